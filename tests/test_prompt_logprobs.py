"""prompt_logprobs through the scheduler: scored chunk by chunk as the prompt prefills, sharing the step's
budget with other requests' decodes, counted in running/waiting, abortable between chunks."""
import functools

import numpy as np
import pytest

from jaxserve import SamplingParams
from tiny_models import tiny_llm

make_llm = functools.partial(tiny_llm, max_num_batched_tokens=16, max_num_seqs=8)


@pytest.fixture(scope="module")
def llm():
    return make_llm()


PROMPT = np.random.default_rng(3).integers(1, 250, size=150).tolist()


def scored(llm, prompt, k=2):
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k), use_tqdm=False)
    return out[0].prompt_logprobs


def test_chunked_scoring_equals_one_chunk(llm):
    """150 prompt tokens scored in chunks of at most 16 (after a request that leaves half the prompt in the
    prefix cache: scoring takes no hits) equal one engine scoring them in one chunk."""
    llm.generate([PROMPT[:80]], SamplingParams(max_tokens=1), use_tqdm=False)
    chunked = scored(llm, PROMPT)
    whole = scored(make_llm(max_num_batched_tokens=256), PROMPT)
    assert len(chunked) == len(whole) == len(PROMPT) and chunked[0] is None and whole[0] is None
    for i in range(1, len(PROMPT)):
        assert set(chunked[i]) == set(whole[i]) and PROMPT[i] in chunked[i]
        for tok, lp in chunked[i].items():
            assert lp.logprob == pytest.approx(whole[i][tok].logprob, abs=1e-4)
            assert lp.rank == whole[i][tok].rank


def test_scoring_shares_the_step_and_is_counted_and_abortable(llm):
    """While a long prompt is scored, a decoding request gets a token every step; the scoring request is
    running (not invisible) and an abort mid-prompt frees it."""
    engine = llm.engine
    engine.add_request("decode", [5, 6, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.add_request("score", PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    assert engine.scheduler.num_scoring == 1
    score = engine.scheduler.get_request("score")
    decoded = []
    for _ in range(4):
        outs = engine.step()
        decoded += [o for o in outs if o.request_id == "decode"]
    assert 0 < score.num_computed_tokens < len(PROMPT)           # still prefilling, chunk by chunk
    assert 0 < score.num_prompt_positions_scored <= score.num_computed_tokens
    assert len(decoded) >= 3                                      # the decode was not stalled
    assert engine.scheduler.get_stats()["num_running"] == 2
    engine.abort_request("score")
    assert engine.scheduler.num_scoring == 0 and engine.scheduler.get_request("score") is None
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv_manager.usage == 0.0
