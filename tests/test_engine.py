"""The engine end to end on a tiny Llama (float32, CPU): batching, preemption, prefix caching, compilation."""
import os

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

TINY = os.path.join(os.path.dirname(__file__), "fixtures", "models", "tiny-llama3")


def make_llm(**kw):
    opts = dict(dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=64, max_num_seqs=16,
                kv_cache_memory_bytes=1 << 24, compilation_cache_dir="", use_tqdm_on_load=False)
    opts.update(kw)
    return LLM(TINY, **opts)


@pytest.fixture(scope="module")
def llm():
    return make_llm()


@pytest.fixture(scope="module")
def workload():
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 250, size=int(n)).tolist() for n in rng.integers(2, 90, size=36)]
    max_tokens = [int(m) for m in rng.integers(4, 24, size=36)]
    return prompts, max_tokens


def greedy(m):
    return SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)


@pytest.fixture(scope="module")
def single_outputs(llm, workload):
    prompts, max_tokens = workload
    return [llm.generate([p], greedy(m), use_tqdm=False)[0].outputs[0].token_ids
            for p, m in zip(prompts, max_tokens)]


def test_batched_equals_single_with_preemption(workload, single_outputs):
    prompts, max_tokens = workload
    # a pool far too small for 36 requests at once: the scheduler must preempt and recompute
    small = make_llm(num_gpu_blocks_override=80)
    outs = small.generate(prompts, [greedy(m) for m in max_tokens], use_tqdm=False)
    assert small.engine.scheduler.get_stats()["num_preemptions"] > 0
    for o, ref, m in zip(outs, single_outputs, max_tokens):
        assert len(o.outputs[0].token_ids) == m
        assert o.outputs[0].token_ids == ref
        assert o.outputs[0].finish_reason == "length"
    assert small.engine.kv_manager.usage == 0.0


def test_prefix_caching_on_off_identical(llm, workload, single_outputs):
    prompts, max_tokens = workload
    system = list(range(3, 43))                        # 40 shared tokens = 10 full blocks of 4
    shared = [system + p[:10] for p in prompts[:6]]
    off = make_llm(enable_prefix_caching=False)
    a = off.generate(shared, greedy(8), use_tqdm=False)
    first = llm.generate([shared[0]], greedy(8), use_tqdm=False)[0]
    rest = llm.generate(shared[1:], greedy(8), use_tqdm=False)
    b = [first] + rest
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    # the later requests found the system prompt's full blocks in the cache
    assert all(o.num_cached_tokens >= 40 for o in rest)
    assert all(o.num_cached_tokens == 0 for o in a)


def test_no_recompilation_after_warmup(llm, workload):
    runner = llm.engine.runner
    before = runner.compiled_variants()
    prompts, _ = workload
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=6, seed=s, logprobs=lp,
                             presence_penalty=pp, repetition_penalty=rp, ignore_eos=True)
              for t, p, k, s, lp, pp, rp in [(0, 1, 0, None, None, 0, 1), (0.8, 0.9, 5, 1, 2, 0.5, 1.2),
                                             (1.2, 1, 0, None, None, 0, 1), (0.5, 0.5, 40, 7, None, 0, 1.1)]]
    for i in range(4):
        llm.generate(prompts[i * 4:(i + 1) * 4 + i], params[i], use_tqdm=False)
    assert runner.compiled_variants() == before


def test_decode_only_variants_cover_every_uniform_decode_step(llm, workload, single_outputs):
    """Under the Pallas backends the runner compiles a decode-only variant of each bucket a uniform decode
    step can land in and marks such steps (the attention then runs its decode launch alone). Here with the
    reference backend, which ignores the flag: warm-up covers every step of a batched workload (no compile
    after it), and the tokens are unchanged."""
    runner = llm.engine.runner
    runner.uniform_decode = True
    marks = []

    def prepare(*a, _prepare=runner.prepare, **kw):
        out = _prepare(*a, **kw)
        marks.append(out[4].decode_only)
        return out
    runner.prepare = prepare
    try:
        runner.warmup(progress=False)
        before = runner.compiled_variants()
        prompts, max_tokens = workload
        outs = llm.generate(prompts[:12], [greedy(m) for m in max_tokens[:12]], use_tqdm=False)
        assert runner.compiled_variants() == before
        assert any(marks) and not all(marks)           # both kinds of step ran
        assert [o.outputs[0].token_ids for o in outs] == single_outputs[:12]
        cap = runner.bucket_for(min(runner.max_num_seqs, runner.max_num_tokens))
        assert runner._forward._cache_size() == len(runner.buckets) + len([b for b in runner.buckets if b <= cap])
    finally:
        runner.uniform_decode = False
        del runner.prepare


def test_abort_frees_everything(llm, workload):
    eng = llm.engine
    prompts, _ = workload
    for i, p in enumerate(prompts[:10]):
        eng.add_request(f"abort-{i}", p, greedy(50))
    for _ in range(3):
        eng.step()
    assert eng.kv_manager.usage > 0
    eng.abort_request([f"abort-{i}" for i in range(10)])
    assert not eng.has_unfinished_requests()
    assert eng.kv_manager.usage == 0.0


def test_seeded_sampling_reproducible_across_batches(llm, workload):
    prompts, _ = workload
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[0]], sp, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(prompts[:8], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == crowd


def test_n_completions_and_logprobs(llm, workload):
    prompts, _ = workload
    out = llm.generate([prompts[1]], SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=3, logprobs=2,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    for o in out.outputs:
        assert len(o.token_ids) == 5 and len(o.logprobs) == 5
        for tok, lp in zip(o.token_ids, o.logprobs):
            assert tok in lp and lp[tok].logprob <= 0
        assert o.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)),
                                                     abs=1e-3)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_stats_report_host_and_device_time(llm):
    s = llm.engine.stats()
    assert s["steps"] > 0 and s["host_ms_per_step"] > 0 and s["device_ms_per_step"] > 0


def test_async_and_sync_scheduling_agree_on_early_stops(llm, workload, single_outputs):
    """Async scheduling computes one token past a stop it has not seen yet: that token must be dropped."""
    prompts, max_tokens = workload
    sync = make_llm(async_scheduling=False)
    stops = [ref[min(2, len(ref) - 1)] for ref in single_outputs[:12]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, stop_token_ids=[stop])
              for m, stop in zip(max_tokens, stops)]
    a = llm.generate(prompts[:12], params, use_tqdm=False)
    b = sync.generate(prompts[:12], params, use_tqdm=False)
    for x, y, ref, stop in zip(a, b, single_outputs, stops):
        expected = ref[:ref.index(stop) + 1]
        assert x.outputs[0].token_ids == y.outputs[0].token_ids == expected
        assert x.outputs[0].finish_reason == "stop" and x.outputs[0].stop_reason == stop
    assert llm.engine.kv_manager.usage == 0.0 and sync.engine.kv_manager.usage == 0.0


def test_prompt_logprobs_match_hf_logits(llm):
    """prompt_logprobs (an extra prefill) = log_softmax of HF's float32 logits at each prompt position."""
    import json
    with open(os.path.join(TINY, "golden.json")) as f:
        prompt = json.load(f)["prompt_ids"]
    hf = np.load(os.path.join(TINY, "logits.npy"))
    ref = hf - np.log(np.exp(hf - hf.max(1, keepdims=True)).sum(1, keepdims=True)) - hf.max(1, keepdims=True)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        entry = plp[i]
        tok = prompt[i]
        assert entry[tok].logprob == pytest.approx(ref[i - 1, tok], abs=1e-4)
        assert entry[tok].rank == int((ref[i - 1] >= ref[i - 1, tok]).sum())
        top = np.argsort(-ref[i - 1])[:3]
        for t in top:
            assert entry[int(t)].logprob == pytest.approx(ref[i - 1, t], abs=1e-4)
