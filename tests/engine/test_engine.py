"""The engine end to end on a tiny Llama (float32, CPU): batching, preemption, prefix caching, compilation."""
import os

import numpy as np
import pytest

from jaxserve import SamplingParams
from support import FIXTURES
from support.goldens import load_golden
from support.tiny_models import tiny_llm as make_llm

TINY = os.path.join(FIXTURES, "models", "tiny-llama3")


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
    assert small.engine.core.scheduler.get_stats()["num_preemptions"] > 0
    for o, ref, m in zip(outs, single_outputs, max_tokens):
        assert len(o.outputs[0].token_ids) == m
        assert o.outputs[0].token_ids == ref
        assert o.outputs[0].finish_reason == "length"
    assert small.engine.core.kv_manager.usage == 0.0


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


def only_planned_or_asked_for(runner) -> bool:
    """Every executable is a planned one, one a step needed first, or that sampler variant for another
    request count (compiled in the background after its first use)."""
    planned = {k for ks in runner.variants.planned() for k in ks}
    asked = set(runner.variants.on_first_use)
    modes = {k[1:4] for k in asked if k[0] == "sample"}
    return all(k in planned or k in asked or (k[0] == "sample" and k[1:4] in modes) for k in runner.variants.keys())


def test_no_recompilation_after_warmup(llm, workload):
    """Once the planned variants are compiled, a workload compiles only the sampler variants its requests
    ask for (logprobs, penalties: on first use, then for every request count), and running it again
    compiles nothing: every step runs an executable compiled ahead, never jit's own."""
    runner = llm.engine.core.runner
    assert runner.wait_compiled(timeout=600)
    planned = runner.compiled_variants()
    assert planned == sum(len(k) for k in runner.variants.planned())
    prompts, _ = workload
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, max_tokens=6, seed=s, logprobs=lp,
                             presence_penalty=pp, repetition_penalty=rp, ignore_eos=True)
              for t, p, k, s, lp, pp, rp in [(0, 1, 0, None, None, 0, 1), (0.8, 0.9, 5, 1, 2, 0.5, 1.2),
                                             (1.2, 1, 0, None, None, 0, 1), (0.5, 0.5, 40, 7, None, 0, 1.1)]]

    def run():
        for i in range(4):
            llm.generate(prompts[i * 4:(i + 1) * 4 + i], params[i], use_tqdm=False)
        assert runner.wait_compiled(timeout=600)
        return runner.compiled_variants()
    after = run()
    lazy = runner.variants.on_first_use
    assert lazy and all(k[0] == "sample" for k in lazy)          # only the samplers these requests need
    assert only_planned_or_asked_for(runner)
    assert run() == after
    assert runner.variants.forward._cache_size() == 0 and \
        all(f._cache_size() == 0 for f in runner.variants.samplers.values())


def test_decode_only_variants_cover_every_uniform_decode_step(llm, workload, single_outputs):
    """Under the Pallas backends the runner compiles a decode-only variant of each bucket a uniform decode
    step can land in and marks such steps (the attention then runs its decode launch alone). Here with the
    reference backend, which ignores the flag: warm-up covers every step of a batched workload (no compile
    after it), and the tokens are unchanged."""
    runner = llm.engine.core.runner
    runner.shapes.uniform_decode = True
    marks = []

    def prepare(*a, _prepare=runner.prepare, **kw):
        out = _prepare(*a, **kw)
        marks.append(out[4].decode_only)
        return out
    runner.prepare = prepare
    try:
        runner.warmup(progress=False)
        assert runner.wait_compiled(timeout=600)
        before = runner.compiled_variants()
        prompts, max_tokens = workload
        outs = llm.generate(prompts[:12], [greedy(m) for m in max_tokens[:12]], use_tqdm=False)
        assert runner.compiled_variants() == before
        assert any(marks) and not all(marks)           # both kinds of step ran
        assert [o.outputs[0].token_ids for o in outs] == single_outputs[:12]
        cap = runner.bucket_for(min(runner.max_num_seqs, runner.max_num_tokens))
        forwards = [k for k in runner.variants.keys() if k[0] == "forward"]
        assert len(forwards) == len(runner.buckets) + len([b for b in runner.buckets if b <= cap])
    finally:
        runner.shapes.uniform_decode = False
        del runner.prepare


def test_abort_frees_everything(llm, workload):
    eng = llm.engine
    prompts, _ = workload
    for i, p in enumerate(prompts[:10]):
        eng.add_request(f"abort-{i}", p, greedy(50))
    for _ in range(3):
        eng.step()
    assert eng.core.kv_manager.usage > 0
    eng.abort_request([f"abort-{i}" for i in range(10)])
    assert not eng.has_unfinished_requests()
    assert eng.core.kv_manager.usage == 0.0


def test_delta_and_cumulative_outputs_add_up_to_the_final_one(llm, workload, single_outputs):
    """Streams read while the next step is in flight: no placeholder ever shows, nothing is sent twice."""
    from jaxserve.sampling_params import RequestOutputKind
    from jaxserve.errors import InvalidRequestError
    prompts, max_tokens = workload
    eng = llm.engine
    kinds = (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE)
    for i, kind in enumerate(kinds):
        eng.add_request(f"stream-{i}", prompts[i], SamplingParams(temperature=0, max_tokens=max_tokens[i],
                                                                   ignore_eos=True, logprobs=1, output_kind=kind))
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("stream-0", prompts[0], greedy(3))
    seen = {f"stream-{i}": [] for i in range(len(kinds))}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out.outputs[0])
    delta, cumulative = seen["stream-0"], seen["stream-1"]
    assert [t for o in delta for t in o.token_ids] == single_outputs[0]
    assert sum(len(o.logprobs) for o in delta) == len(single_outputs[0])
    assert [o.token_ids for o in cumulative] == [single_outputs[1][:len(o.token_ids)] for o in cumulative]
    assert cumulative[-1].token_ids == single_outputs[1] and len(cumulative[-1].logprobs) == max_tokens[1]
    assert delta[-1].finish_reason == cumulative[-1].finish_reason == "length"
    assert [o.finish_reason for o in delta[:-1] + cumulative[:-1]] == [None] * (len(delta) + len(cumulative) - 2)


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
    assert llm.engine.core.kv_manager.usage == 0.0 and sync.engine.core.kv_manager.usage == 0.0


def test_prompt_logprobs_match_hf_logits(llm):
    """prompt_logprobs (an extra prefill) = log_softmax of HF's float32 logits at each prompt position."""
    prompt = load_golden(os.path.join(TINY, "golden.json"))["prompt_ids"]
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


# ----------------------------------------------------------------------------- multi-step decoding
MULTI_WARM = {}         # the multi-step engine's compiled variants right after its warm-up


@pytest.fixture(scope="module")
def multi():
    m = make_llm(num_scheduler_steps=4)
    assert m.engine.core.runner.wait_compiled(timeout=600)
    MULTI_WARM["variants"] = m.engine.core.runner.compiled_variants()
    return m


class StepCounts:
    """Records each scheduled step's num_steps (the scheduler's output) while in a `with` block."""

    def __init__(self, llm):
        self.sched, self.num_steps = llm.engine.core.scheduler, []

    def __enter__(self):
        orig = self.sched.schedule

        def schedule():
            out = orig()
            if not out.is_empty:
                self.num_steps.append(out.num_steps)
            return out
        self.sched.schedule = schedule
        return self

    def __exit__(self, *exc):
        del self.sched.schedule

    @property
    def multi(self) -> int:
        return sum(n > 1 for n in self.num_steps)


def test_multi_step_greedy_matches_single_step(llm, multi, workload, single_outputs):
    prompts, max_tokens = workload
    params = [greedy(m) for m in max_tokens]
    counts = []
    for eng in (llm, multi):
        stats = eng.engine.core.runner.stats
        steps0 = stats.steps
        with StepCounts(eng) as rec:
            outs = eng.generate(prompts, params, use_tqdm=False)
        counts.append(stats.steps - steps0)
        assert eng.engine.core.kv_manager.usage == 0.0
        for o, ref, m in zip(outs, single_outputs, max_tokens):
            assert o.outputs[0].token_ids == ref and len(ref) == m
            assert o.outputs[0].finish_reason == "length"
    single, multi_steps = counts
    assert rec.multi > 0 and max(rec.num_steps) == 4
    # (most of this workload's steps mix prefill chunks with decodes: those run one step)
    assert multi_steps < single and multi_steps < sum(max_tokens), counts
    # a lone request: prefill, then one dispatch per 4 tokens
    steps0 = multi.engine.core.runner.stats.steps
    out = multi.generate([prompts[0]], greedy(17), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == llm.generate([prompts[0]], greedy(17), use_tqdm=False)[0].outputs[0].token_ids
    assert multi.engine.core.runner.stats.steps - steps0 == 1 + 4


def test_multi_step_early_stops_match_single_step(llm, multi, workload, single_outputs):
    """Stop ids and stop strings met inside a 4-step loop: the tokens computed after them are dropped."""
    prompts, max_tokens = workload
    n = 12
    # a stop id at output 1..5: after the prefill's token, inside the first loop or at the second's start
    stops = [ref[min(i % 5 + 1, len(ref) - 1)] for i, ref in enumerate(single_outputs[:n])]
    params = [SamplingParams(temperature=0, max_tokens=m, stop_token_ids=[s]) for m, s in zip(max_tokens, stops)]
    with StepCounts(multi) as rec:
        a = multi.generate(prompts[:n], params, use_tqdm=False)
    assert rec.multi > 0
    b = llm.generate(prompts[:n], params, use_tqdm=False)
    stopped = 0
    for x, y in zip(a, b):
        x, y = x.outputs[0], y.outputs[0]
        assert (x.token_ids, x.finish_reason, x.stop_reason, x.text) == (y.token_ids, y.finish_reason,
                                                                            y.stop_reason, y.text)
        stopped += x.finish_reason == "stop"
    for x, ref, stop in zip(a, single_outputs, stops):
        if x.outputs[0].stop_reason == stop:
            assert x.outputs[0].token_ids == ref[:ref.index(stop) + 1]
    assert stopped >= n // 2
    assert multi.engine.core.kv_manager.usage == 0.0

    # stop strings: text taken from the middle of each single-step output
    full = llm.generate(prompts[:n], [greedy(m) for m in max_tokens[:n]], use_tqdm=False)
    texts = [o.outputs[0].text for o in full]
    cases = [(p, m, t[len(t) // 3:len(t) // 3 + 3]) for p, m, t in zip(prompts, max_tokens, texts)
             if len(t[len(t) // 3:len(t) // 3 + 3].strip()) == 3]
    assert len(cases) >= 4
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, stop=[s]) for _, m, s in cases]
    a = multi.generate([c[0] for c in cases], sps, use_tqdm=False)
    b = llm.generate([c[0] for c in cases], sps, use_tqdm=False)
    for x, y, (_, m, s) in zip(a, b, cases):
        x, y = x.outputs[0], y.outputs[0]
        assert (x.text, x.token_ids, x.finish_reason, x.stop_reason) == (y.text, y.token_ids, y.finish_reason,
                                                                            y.stop_reason)
        assert x.finish_reason == "stop" and x.stop_reason == s and s not in x.text and len(x.token_ids) < m
    assert multi.engine.core.kv_manager.usage == 0.0


def test_multi_step_seeded_sampling_matches_single_step(llm, multi, workload):
    prompts, max_tokens = workload
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=m, seed=100 + i, ignore_eos=True)
              for i, m in enumerate(max_tokens[:12])]
    with StepCounts(multi) as rec:
        a = multi.generate(prompts[:12], params, use_tqdm=False)
    assert rec.multi > 0
    b = llm.generate(prompts[:12], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    # and not greedy in disguise
    g = llm.generate(prompts[:12], [greedy(m) for m in max_tokens[:12]], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in g]


def test_multi_step_no_recompilation_after_warmup(multi, workload):
    runner = multi.engine.core.runner
    # since the warm-up (in the tests before this one too) only the variants some request first needed
    assert runner.wait_compiled(timeout=600)
    assert runner.compiled_variants() >= MULTI_WARM["variants"] and only_planned_or_asked_for(runner)
    prompts, _ = workload
    mixed = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
             SamplingParams(temperature=0.8, top_p=0.9, top_k=5, max_tokens=9, ignore_eos=True),
             SamplingParams(temperature=1.0, max_tokens=9, seed=5, ignore_eos=True),
             SamplingParams(temperature=0.7, max_tokens=9, presence_penalty=0.5, repetition_penalty=1.2,
                            ignore_eos=True),
             SamplingParams(temperature=0.5, max_tokens=9, logprobs=2, ignore_eos=True)]
    with StepCounts(multi) as rec:
        for sp in mixed:                             # each kind alone: the greedy/random ones run multi-step
            multi.generate(prompts[:3], sp, use_tqdm=False)
        multi.generate(prompts[3:3 + len(mixed)], mixed, use_tqdm=False)       # all in one batch
        multi.generate(prompts[10:26], mixed[:3] * 5 + mixed[:1], use_tqdm=False)  # 16 rows: the full batch
    assert rec.multi >= 3
    assert runner.wait_compiled(timeout=600)
    before = runner.compiled_variants()
    for sp in mixed:                                 # the same again: everything it needs exists now
        multi.generate(prompts[:3], sp, use_tqdm=False)
    multi.generate(prompts[3:3 + len(mixed)], mixed, use_tqdm=False)
    assert runner.compiled_variants() == before


def test_multi_step_prefix_caching_stays_correct(llm, multi):
    p = np.random.default_rng(7).integers(1, 250, size=30).tolist()     # a prompt no other test uses
    first = multi.generate([p], greedy(21), use_tqdm=False)[0].outputs[0].token_ids
    assert first == llm.generate([p], greedy(21), use_tqdm=False)[0].outputs[0].token_ids
    follow = p + list(first) + [17, 3, 99]
    with StepCounts(multi) as rec:
        out = multi.generate([follow], greedy(12), use_tqdm=False)[0]
    assert rec.multi > 0
    # The first request ran a prefill then five 4-step loops; each loop enters the blocks up to its first
    # position into the cache (its later tokens are placeholders then), so every full block but those of
    # the last loop's tokens is a hit. Caching blocks with placeholders would lose the hits after them.
    assert out.num_cached_tokens >= (len(p) + len(first) - 4) // 4 * 4 > len(p)
    assert out.outputs[0].token_ids == llm.generate([follow], greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    assert multi.engine.core.kv_manager.usage == 0.0


def test_request_preempted_while_its_stop_token_is_in_flight_finishes(llm, workload, single_outputs):
    """Async scheduling: step N samples a request's stop token; before N is read, step N+1's schedule()
    preempts the request (short of blocks). Reading N must finish it and take it out of the waiting queue,
    not leave it there to be re-admitted and run on to max_tokens unseen."""
    from jaxserve.engine.request import RequestStatus
    from jaxserve.engine.request import PLACEHOLDER

    prompts, _ = workload
    p, ref = prompts[0], single_outputs[0]
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])      # a token first sampled at output k
    eng, sched = llm.engine, llm.engine.core.scheduler
    assert not eng.has_unfinished_requests()
    eng.add_request("pre-stop", p, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ref[k]]))
    orig = sched.schedule
    preempted = []

    def schedule():
        out = orig()
        req = sched.get_request("pre-stop")
        if (not preempted and req is not None and len(req.output_token_ids) == k + 1
                and req.output_token_ids[-1] == PLACEHOLDER):     # the step in flight samples output k
            out.scheduled = [e for e in out.scheduled if e.request is not req]
            sched.running.remove(req)
            sched._preempt(req)
            preempted.append(req)
        return out

    sched.schedule = schedule
    try:
        final = None
        for _ in range(100):
            for o in eng.step():
                if o.finished:
                    final = o
            if final is not None:
                break
    finally:
        del sched.schedule
    assert preempted and final is not None
    assert final.outputs[0].token_ids == ref[:k + 1] and final.outputs[0].finish_reason == "stop"
    assert preempted[0].status == RequestStatus.FINISHED_STOPPED
    assert sched.get_request("pre-stop") is None and not eng.has_unfinished_requests()
    assert eng.core.kv_manager.usage == 0.0


def test_stop_string_on_the_last_allowed_token_reports_stop(llm, multi, workload):
    """vLLM v1: a stop string completed by the token that also reaches max_tokens finishes as "stop"."""
    prompts, max_tokens = workload
    cases = []
    for p, m in zip(prompts[:12], max_tokens[:12]):
        text = llm.generate([p], greedy(m), use_tqdm=False)[0].outputs[0].text
        stop = text[-2:]
        if len(stop.strip()) == 2 and text.find(stop) == len(text) - 2:     # only at the very end
            cases.append((p, m, stop, text))
    assert len(cases) >= 2
    for eng in (llm, multi):
        for p, m, stop, text in cases:
            out = eng.generate([p], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, stop=[stop]),
                               use_tqdm=False)[0].outputs[0]
            assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, text[:-2])
            assert len(out.token_ids) == m


def test_multi_step_logprobs_match_single_step(llm, multi, workload):
    """Logprobs inside the loop: every token's logprob, rank and top-k equal the single-step engine's."""
    prompts, max_tokens = workload
    params = [SamplingParams(temperature=0, max_tokens=13, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=13, logprobs=1, seed=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)]
    with StepCounts(multi) as rec:
        a = multi.generate(prompts[:3], params, use_tqdm=False)
    assert rec.multi >= 2
    b = llm.generate(prompts[:3], params, use_tqdm=False)
    for x, y, sp in zip(a, b, params):
        x, y = x.outputs[0], y.outputs[0]
        assert x.token_ids == y.token_ids
        if sp.logprobs is None:
            assert x.logprobs is None
            continue
        assert len(x.logprobs) == len(y.logprobs) == 13
        assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)
        for tok, lx, ly in zip(x.token_ids, x.logprobs, y.logprobs):
            assert list(lx) == list(ly) and tok in lx            # same ids: the sampled one and the top-k
            for t in lx:
                assert lx[t].rank == ly[t].rank
                assert lx[t].logprob == pytest.approx(ly[t].logprob, abs=1e-4)


def test_fp8_kv_cache_tracks_the_full_precision_cache(llm, workload):
    """``kv_cache_dtype="fp8"``: the runner keeps e4m3 caches in the kernels' layout (V pages transposed,
    ``ops.kv_cache_shapes``), and what it serves stays near the float32 cache's: the first generated token's
    log-probability over prompts of 2-89 tokens (the attention reads every prompt token back from the cache)."""
    import jax.numpy as jnp
    from jaxserve.kernels import ops
    fp8 = make_llm(kv_cache_dtype="fp8")
    runner = fp8.engine.core.runner
    k, v = runner.kv_caches[0]
    cfg = runner.cfg
    assert k.dtype == v.dtype == jnp.float8_e4m3fn
    assert (k.shape, v.shape) == ops.kv_cache_shapes(runner.num_blocks, 4, cfg.num_kv_heads, cfg.head_dim, k.dtype)
    assert v.shape[2:] == (cfg.head_dim, 4)
    prompts, _ = workload
    sp = SamplingParams(temperature=0, max_tokens=1, logprobs=3, ignore_eos=True)
    want = llm.generate(prompts[:16], sp, use_tqdm=False)
    got = fp8.generate(prompts[:16], sp, use_tqdm=False)
    diffs, same = [], 0
    for g, w in zip(got, want):
        wt, gt = w.outputs[0].token_ids[0], g.outputs[0].token_ids[0]
        same += wt == gt
        lp = g.outputs[0].logprobs[0]
        if wt in lp:
            diffs.append(abs(lp[wt].logprob - w.outputs[0].logprobs[0][wt].logprob))
    # measured: 14/16 same, |diff| median 0.069, max 0.133 (e4m3 keeps 3 mantissa bits, and this random tiny
    # model's next-token distributions are flat); V stored one slot off in its page: 0/16 same
    assert same >= 13 and len(diffs) >= 14 and np.median(diffs) < 0.1 and max(diffs) < 0.3, (same, diffs)
