"""Speculative decoding (``--speculative-config``) end to end on the tiny Llama: greedy output token-identical to
the engine without it (batched, prefix cache on, preemption forced; with LoRA adapters), acceptance counted, rows
that must not speculate (penalties, logprobs, structured outputs) unchanged, seeded sampling reproducible, and
what is refused."""
from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.engine.draft_proposer import check_same_tokenizer
from jaxserve.lora import LoRARequest
from jaxserve.sampling_params import BeamSearchParams, StructuredOutputsParams
from support.lora import adapter_names, adapter_path, lora_golden
from support.speculation import make_eagle_head, read_steps
from support.tiny_models import fixture_path, tiny_llm

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# the engines here compile two token buckets (16 and the largest) instead of five: what these tests check does
# not depend on the step sizes, and each bucket is a forward (and its samplers) compiled per engine
BUCKETS = [16]
LLM_ARGS = dict(token_buckets=BUCKETS)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def spec_llm(request):
    # a pool too small for the batch below: the scheduler preempts and recomputes; async scheduling places each
    # step as if the step in flight accepted all its drafts (moved back on the device)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXSERVE_SPEC_ASYNC", "1" if request.param else "0")
        return tiny_llm(speculative_config=NGRAM, num_gpu_blocks_override=70, async_scheduling=request.param,
                        token_buckets=BUCKETS)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    out = [rng.integers(3, 250, size=int(n)).tolist() for n in rng.integers(3, 60, size=14)]
    out += [[5, 6, 7, 8] * 5, list(range(10, 30)) * 2]       # prompts the lookup finds its way in
    return out


def _draft(name, k=3):
    return {"method": "draft_model", "model": fixture_path(name), "num_speculative_tokens": k}


def greedy(m=24, **kw):
    return SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, **kw)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_matches_without_speculation_batched_with_preemption(llm, spec_llm, prompts):
    lengths = [8 + 3 * (i % 7) for i in range(len(prompts))]
    ref = _tokens(llm.generate(prompts, [greedy(m) for m in lengths], use_tqdm=False))
    core = spec_llm.engine.core
    outs = spec_llm.generate(prompts, [greedy(m) for m in lengths], use_tqdm=False)
    assert _tokens(outs) == ref
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    stats = core.stats()
    assert core.scheduler.num_preemptions > 0
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"]
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == stats["spec_decode_num_accepted_tokens"] and per_pos == sorted(per_pos, reverse=True)
    assert core.kv_manager.usage == 0.0
    assert core._lookahead == int(core.config.async_scheduling)
    # the prefix cache took the finished requests' blocks: the same prompts again hit it and match
    spec_llm.generate(prompts[-2:], [greedy(m) for m in lengths[-2:]], use_tqdm=False)
    again = spec_llm.generate(prompts[-2:], [greedy(m) for m in lengths[-2:]], use_tqdm=False)
    assert _tokens(again) == ref[-2:] and all(o.num_cached_tokens > 0 for o in again)


def test_stop_ids_and_min_tokens_see_accepted_tokens_only(llm, spec_llm, prompts):
    p = prompts[-1]
    plain = _tokens(llm.generate([p], greedy(30), use_tqdm=False))[0]
    stop = plain[12]
    for params in (greedy(30, stop_token_ids=[stop]), greedy(30, stop_token_ids=[stop], min_tokens=14)):
        want = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
        got = spec_llm.generate([p], params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"


def test_rows_that_do_not_speculate_are_unchanged(llm, spec_llm, prompts):
    p = prompts[-2]
    params = [greedy(16, presence_penalty=0.5, frequency_penalty=0.3), greedy(16, logprobs=2), greedy(16),
              SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[ab]{8}"))]
    want = llm.generate([p] * 4, params, use_tqdm=False)
    got = spec_llm.generate([p] * 4, params, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    # the constrained row shared a step with drafts: the masked rejection sampler ran
    assert any(k[0] == "spec-sample" and k[3] for k in spec_llm.engine.core.runner.variants.keys())
    for a, b in zip(want[1].outputs[0].logprobs, got[1].outputs[0].logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    # a prompt scored (prompt_logprobs) while others speculate
    scored = [greedy(12), greedy(6, prompt_logprobs=1)]
    want, got = (m.generate([p, prompts[0]], scored, use_tqdm=False) for m in (llm, spec_llm))
    assert _tokens(got) == _tokens(want)
    keys = lambda out: [sorted(d) if d else d for d in out.prompt_logprobs]  # noqa: E731
    assert keys(got[1]) == keys(want[1])


def test_beam_search_runs_unchanged(llm, spec_llm, prompts):
    """Beam search's steps ask for logprobs: its rows never speculate, so its beams are the plain engine's."""
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    want, got = (m.beam_search([prompts[-1]], params) for m in (llm, spec_llm))
    assert [b.tokens for b in got[0].sequences] == [b.tokens for b in want[0].sequences]


def test_seeded_sampling_is_reproducible(spec_llm, prompts):
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=20, seed=s, ignore_eos=True) for s in range(4)]
    first = _tokens(spec_llm.generate(prompts[-2:] * 2, params, use_tqdm=False))
    again = _tokens(spec_llm.generate(prompts[-2:] * 2, params, use_tqdm=False))
    assert first == again and len({tuple(t) for t in first}) > 1


def test_a_speculative_step_pads_up_to_a_compiled_bucket(llm, prompts):
    """As a plain step: while its own bucket is not compiled, a speculative step runs in a larger compiled one."""
    spec = tiny_llm(speculative_config=NGRAM, enforce_eager=True)
    variants = spec.engine.core.runner.variants
    largest = variants.shapes.sizes[-1]
    rows = variants.shapes.num_reqs_for(largest)
    variants.compile_now([("forward-spec", largest, variants.spec_width),
                          ("spec-sample", 0, None, False, variants._spec_layout(rows))])
    params = [greedy(12) for _ in prompts[-2:]]
    assert _tokens(spec.generate(prompts[-2:], params, use_tqdm=False)) == \
        _tokens(llm.generate(prompts[-2:], params, use_tqdm=False))
    assert spec.engine.core.stats()["spec_decode_num_drafts"] > 0
    assert {k[1] for k in variants.keys() if k[0] == "forward-spec"} == {largest}


@pytest.mark.parametrize("spec", [pytest.param(NGRAM, marks=pytest.mark.slow), _draft("tiny-llama3"),
                                  pytest.param("eagle", marks=pytest.mark.slow)],     # ~25 s more
                         ids=["ngram", "draft_model", "eagle"])
def test_lora_adapters_are_verified_by_the_target(spec, tmp_path):
    """LoRA with speculation: the draft proposes without adapters (an EAGLE head from the adapted target's
    hidden states), the target verifies with each request's adapter, so greedy output is HF + peft's for every
    adapter (a batch mixing them and the base model)."""
    if spec == "eagle":
        spec = {"method": "eagle", "model": make_eagle_head(tmp_path / "head"), "num_speculative_tokens": 3}
    g = lora_golden()
    prompts, loras, want = [], [], []
    for j, p in enumerate(g["prompts"]):
        for i, name in enumerate([None, *adapter_names()]):
            prompts.append({"prompt_token_ids": p})
            loras.append(None if name is None else LoRARequest(name, i, adapter_path(name)))
            want.append(g["base"][j] if name is None else g["adapters"][name][j])
    llm = tiny_llm(speculative_config=spec, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2,
                   token_buckets=BUCKETS)
    outs = llm.generate(prompts, greedy(g["max_tokens"]), use_tqdm=False, lora_request=loras)
    assert _tokens(outs) == want
    stats = llm.engine.core.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_unsupported_combinations_are_refused():
    with pytest.raises(ValueError, match="num-scheduler-steps"):
        tiny_llm(speculative_config=NGRAM, num_scheduler_steps=4)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        tiny_llm(speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="unknown keys"):
        tiny_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3})


def test_draft_model_set_to_the_target_accepts_every_token(llm, prompts):
    """The mechanism's ceiling: the draft is the target itself, so every draft is accepted (a prompt longer than
    the draft's token budget catches up over several rounds)."""
    params = [greedy(12 + i) for i in range(6)]
    ref = _tokens(llm.generate(prompts[:6], params, use_tqdm=False))
    spec = tiny_llm(speculative_config=_draft("tiny-llama3"), max_num_batched_tokens=32, token_buckets=BUCKETS)
    assert _tokens(spec.generate(prompts[:6], params, use_tqdm=False)) == ref
    stats = spec.engine.core.stats()
    assert stats["spec_decode_num_draft_tokens"] > 20
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]


@pytest.mark.slow    # ~30 s; the draft-model path with preemption is also in test_draft_model_* and the LoRA test
def test_another_draft_model_keeps_greedy_output_with_preemption(llm, prompts):
    lengths = [8 + 3 * (i % 7) for i in range(len(prompts))]
    ref = _tokens(llm.generate(prompts, [greedy(m) for m in lengths], use_tqdm=False))
    spec = tiny_llm(speculative_config=_draft("tiny-llama-tied", k=2), num_gpu_blocks_override=70)
    assert _tokens(spec.generate(prompts, [greedy(m) for m in lengths], use_tqdm=False)) == ref
    assert spec.engine.core.scheduler.num_preemptions > 0


def test_a_draft_with_another_vocabulary_is_refused():
    class Model:
        def __init__(self, vocab, tokens):
            self.config = SimpleNamespace(vocab_size=vocab)
            self.tokenizer = SimpleNamespace(get_vocab=lambda: tokens)
    check_same_tokenizer(Model(8, {"a": 0}), Model(8, {"a": 0}), "same")
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        check_same_tokenizer(Model(8, {"a": 0}), Model(8, {"b": 0}), "other")


def test_ngram_drafts_come_from_verified_tokens_only():
    # under async scheduling a request whose drafts are in flight takes none: drafts continuing unverified
    # ones are wrong whenever those are rejected (acceptance fell from 84 % to 30 % on real SmolLM2)
    from jaxserve.config_decoding import SpeculativeConfig
    from jaxserve.engine.request import Request
    from jaxserve.engine.speculator import Speculator
    spec = Speculator(SpeculativeConfig.coerce(NGRAM))
    req = Request("r", [5, 6, 7, 8] * 5, greedy(), eos_token_ids=(), arrival_time=0.0, sampling_seed=0)
    req.num_computed_tokens = len(req.prompt_token_ids) - 1
    spec.propose([req])
    assert req.spec_token_ids == [5, 6, 7]
    req.output_token_ids += [5, 6, 7]          # the drafts, standing where they would be accepted
    req._all_token_ids += [5, 6, 7]
    req.num_computed_tokens += 3
    req.num_drafts_in_flight = 3
    spec.propose([req])
    assert req.spec_token_ids is None


def test_device_ngram_speculates_every_step_once_the_text_repeats(llm, spec_llm):
    """Async n-gram proposes on the device from the tokens the step before accepted: once the output repeats,
    every step verifies drafts (the host-proposed path skipped every other step: drafts in flight)."""
    core = spec_llm.engine.core
    if not core.speculator.on_device:
        pytest.skip("synchronous speculation proposes on the host")
    prompt, params = [5, 6, 7, 8] * 5, greedy(64)
    with read_steps(core) as steps:
        got = _tokens(spec_llm.generate([prompt], params, use_tqdm=False))[0]
    assert got == _tokens(llm.generate([prompt], params, use_tqdm=False))[0]
    assert set(got[23:58]) == {168}              # the tiny model's output repeats one token for a while
    # from its second repeat on, every step verifies a draft (the lookup's latest match is the token just
    # before: one draft) and accepts it: two tokens a step
    late = [spec for first, spec in steps if 25 <= first < 56]
    assert len(late) == 16 and all(spec == (3, 1, 1) for spec in late)
