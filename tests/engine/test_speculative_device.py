"""N-gram drafts proposed on the device (``runner.ngram_device``, async scheduling with ``JAXSERVE_SPEC_ASYNC=1``)
on the real SmolLM2 (embedded, float32): greedy output token-identical to the engine without speculation on
prompt-grounded tasks (batched, prefix cache on, preemption forced, stop strings, max_tokens reached inside a
verify step), most drafts accepted, and a request that copies its prompt speculating in consecutive
steps."""
import json
import os

import pytest

from jaxserve import LLM, SamplingParams
from support.speculation import read_steps

pytestmark = pytest.mark.slow      # two SmolLM2 engines (~1 min on 2 cores)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
DATA = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "bench", "data", "spec-grounded.json")
PASSAGE = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
           "Repeat the sentence above exactly:")
ARGS = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128, skip_warmup=True,
            compilation_cache_dir="", use_tqdm_on_load=False)


@pytest.fixture(scope="module")
def engines():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXSERVE_SPEC_ASYNC", "1")
        # a KV pool too small for the batch: the scheduler preempts and recomputes
        spec = LLM(None, speculative_config=NGRAM, async_scheduling=True, num_gpu_blocks_override=24, **ARGS)
    assert spec.engine.core.speculator.on_device
    return LLM(None, **ARGS), spec


@pytest.fixture(scope="module")
def prompts():
    with open(DATA) as f:
        return [c["conversations"][0]["value"] for c in json.load(f)][:4]


def _params(m, **kw):
    return SamplingParams(temperature=0, max_tokens=m, **kw)


def test_greedy_matches_without_speculation(engines, prompts):
    plain, spec = engines
    params = [_params(m) for m in (61, 47, 58, 40)]       # limits inside a verify step's tokens
    want = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    core = spec.engine.core
    before = core.stats()
    got = [o.outputs[0] for o in spec.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    stats = core.stats()
    assert core.scheduler.num_preemptions > 0
    drafted = stats["spec_decode_num_draft_tokens"] - before.get("spec_decode_num_draft_tokens", 0)
    accepted = stats["spec_decode_num_accepted_tokens"] - before.get("spec_decode_num_accepted_tokens", 0)
    assert accepted > 0.5 * drafted > 0
    # stop strings (the front end's) and the prefix cache: the same prompts again
    stop = want[0].text[20:28]
    params = [_params(61, stop=[stop]), _params(30)]
    want = plain.generate(prompts[:2], params, use_tqdm=False)
    got = spec.generate(prompts[:2], params, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert got[0].outputs[0].finish_reason == "stop"
    again = spec.generate(prompts[1:2], params[1:], use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want[1].outputs[0].token_ids and again.num_cached_tokens > 0


def test_a_copying_request_speculates_in_consecutive_steps(engines):
    _, spec = engines
    core = spec.engine.core
    with read_steps(core) as steps:
        out = spec.generate([PASSAGE], _params(64, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    # a request that copies its prompt verifies drafts in consecutive steps (the host-proposed async path
    # verified them every other step at most): a run of steps accepting all K drafts, K + 1 tokens each
    run = longest = 0
    for _, spec_entry in steps:
        run = run + 1 if spec_entry == (3, 3, 3) else 0
        longest = max(longest, run)
    assert longest >= 4
    assert len(out.token_ids) > 1.6 * len(steps)
