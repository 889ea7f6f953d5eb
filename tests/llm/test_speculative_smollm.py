"""n-gram speculation on the real SmolLM2 (the embedded model, float32): greedy output token-identical to the
engine without it, on a prompt the lookup finds its way in (drafts accepted) and a free-form one, batched."""
import pytest

from jaxserve import LLM, SamplingParams

PASSAGE = ("The Amazon rainforest covers much of the Amazon basin of South America. This basin encompasses seven "
           "million square kilometres, of which five and a half million are covered by the rainforest.")
PROMPTS = [f"Passage: {PASSAGE}\nRewrite the passage above word for word:\n", "Write a short poem about the sea.\n"]
OPTS = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, use_tqdm_on_load=False)


@pytest.mark.slow    # two SmolLM2 engines compiled from scratch: minutes on two cores
def test_greedy_is_token_identical_and_drafts_are_accepted():
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = LLM(**OPTS)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    plain.shutdown()
    spec = LLM(**OPTS, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                           "prompt_lookup_max": 4})
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    stats = spec.engine.core.stats()
    spec.shutdown()
    assert got == want
    assert stats["spec_decode_num_accepted_tokens"] > 10
