"""Tensor parallelism on 4 fake CPU devices: TP=2/4 greedy output identical to TP=1 (model forward, the
offline API and the async engine the server drives), the real SmolLM2 at TP=3 equal to transformers' greedy
ids, and the collectives XLA inserts (one all-reduce after attention and one after the MLP per layer, no
all-gather of weights).

Fake devices need ``XLA_FLAGS`` before JAX starts, and conftest has already started it with one device, so the
checks run once in a subprocess (this file run as a script) that prints its findings as JSON; the tests below
assert on them. One subprocess per group of checks (model, engine, SmolLM2): every mesh compiles once.
"""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

import support
from support.fake_devices import fake_device_report

NUM_DEVICES = 4
MAX_NEW_TOKENS = 6


# ------------------------------------------------------------------------------------------ the subprocess
def _collectives(hlo: str) -> dict:
    """Result shapes of the all-reduce / all-gather instructions of a compiled HLO module."""
    out = {"all-reduce": [], "all-gather": []}
    for m in re.finditer(r"= (\(?[a-z0-9]+\[[0-9,]*\][^ ]*) (all-reduce|all-gather)(?:-start)?\(", hlo):
        out[m.group(2)].append(m.group(1))
    return out


def _worker() -> dict:
    import jax

    from jaxserve import parallel
    from support.tp_greedy import GreedyDecoder, random_params, tiny_config

    assert jax.device_count() == NUM_DEVICES, jax.devices()
    report = {}
    cases = {"8q4kv": tiny_config(8, 4), "8q2kv": tiny_config(8, 2, tie_word_embeddings=False),
             "9q3kv": tiny_config(9, 3, intermediate_size=96, vocab_size=252)}
    for name, cfg in cases.items():
        params = random_params(cfg, seed=1)
        for tp in (1, 2, 3, 4):
            try:
                parallel.check_tp_compatible(cfg, tp)
            except ValueError as e:
                report[f"{name}/tp{tp}"] = {"error": str(e)}
                continue
            mesh = None if tp == 1 else parallel.make_mesh(tp)
            dec = GreedyDecoder(cfg, params, mesh, max_new_tokens=MAX_NEW_TOKENS)
            tokens, logits = dec.generate()
            entry = {"tokens": tokens, "logits": logits.tolist()}
            if mesh is not None:
                entry["cache_spec"] = str(dec.kv_caches[0][0].sharding.spec)
                entry["q_spec"] = str(dec.params["layers"][0]["q"].sharding.spec)
                entry["k_spec"] = str(dec.params["layers"][0]["k"].sharding.spec)
                entry["collectives"] = _collectives(_step_hlo(dec))
                entry["weight_shapes"] = sorted({str(list(x.shape)) for x in jax.tree.leaves(params)})
            report[f"{name}/tp{tp}"] = entry
    report["pallas"] = _pallas_under_shard_map()
    report["custom_all_reduce"] = _custom_all_reduce_wiring(cases)
    try:
        parallel.make_mesh(NUM_DEVICES + 1)
    except ValueError as e:
        report["too_many"] = str(e)
    return report


def _custom_all_reduce_wiring(cases) -> dict:
    """The row-parallel layers as the custom all-reduce runs them (shard_map: local matmul, then the kernel),
    with the CUDA kernel stood in for by a psum that records what it was given (the kernel itself needs two
    GPUs). Greedy tokens and logits against TP=1, the HLO's all-reduces, and which sizes went to the kernel."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxserve import parallel
    from jaxserve.kernels import custom_allreduce as car
    from jaxserve.parallel import collectives
    from support.tp_greedy import GreedyDecoder, random_params

    from jaxserve.models import llama

    calls, fused_calls = [], []

    def stand_in(x, blocks=None):
        calls.append(list(x.shape))
        return lax.psum(x, "tp")

    def fused_stand_in(x, residual, weight, eps, blocks=None):
        fused_calls.append(list(x.shape))
        s = residual + lax.psum(x, "tp")
        return s, llama.rms_norm(s, weight, eps)

    out = {"why_not_cpu": parallel.enable_custom_all_reduce(parallel.make_mesh(2)),
           "why_not_disabled": parallel.enable_custom_all_reduce(parallel.make_mesh(2), disable=True),
           "why_not_tp1": parallel.enable_custom_all_reduce(None)}
    real, real_fused = car.all_reduce, car.all_reduce_add_rms_norm
    car.all_reduce, car.all_reduce_add_rms_norm, collectives._enabled = stand_in, fused_stand_in, True
    try:
        for fuse in (False, True):
            collectives._fuse_norm = fuse
            for name, tp in [("8q4kv", 2), ("8q2kv", 4)]:
                cfg = cases[name]
                mesh = parallel.make_mesh(tp)
                dec = GreedyDecoder(cfg, random_params(cfg, seed=1), mesh, max_new_tokens=MAX_NEW_TOKENS)
                calls.clear()
                fused_calls.clear()
                tokens, logits = dec.generate()
                hlo = _step_hlo(dec)
                out[f"{name}/tp{tp}" + ("/fused" if fuse else "")] = {
                    "tokens": tokens, "logits": logits.tolist(), "calls": list(calls),
                    "fused_calls": list(fused_calls), "collectives": _collectives(hlo)}
        collectives._fuse_norm = False
        # a step too large for the kernel's buffers keeps psum inside the same shard_map
        mesh = parallel.make_mesh(2)
        rng = np.random.default_rng(0)
        for rows in (4, car.DEFAULT_SLOT_BYTES // (4 * 64) + 1):   # f32 [rows, 64]: fits / one row past 1 MiB
            x = jnp.asarray(rng.standard_normal((rows, 128)), jnp.float32)
            w = jnp.asarray(rng.standard_normal((128, 64)), jnp.float32)
            xs, ws = jax.device_put(x, NamedSharding(mesh, P(None, "tp"))), jax.device_put(w, NamedSharding(mesh, P("tp")))
            calls.clear()
            got = jax.jit(parallel.bind_mesh(parallel.row_parallel_matmul, mesh))(xs, ws)
            out[f"matmul rows={rows}"] = {"calls": list(calls), "err": float(jnp.abs(got - x @ w).max()),
                                         "spec": str(got.sharding.spec)}
            # the fused form: the same split, and the plain ops when the step is past the kernel's buffers
            collectives._fuse_norm = True
            res = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
            nw = jnp.asarray(rng.uniform(0.5, 1.5, 64), jnp.float32)
            calls.clear()
            fused_calls.clear()
            s_got, h_got = jax.jit(parallel.bind_mesh(
                lambda a, b, r, n: parallel.row_parallel_matmul_add_rms_norm(a, b, r, n, 1e-5, llama.rms_norm),
                mesh))(xs, ws, res, nw)
            s_want = res + x @ w
            out[f"fused rows={rows}"] = {
                "calls": list(calls), "fused_calls": list(fused_calls),
                "err_sum": float(jnp.abs(s_got - s_want).max()),
                "err_norm": float(jnp.abs(h_got - llama.rms_norm(s_want, nw, 1e-5)).max()),
                "spec": [str(s_got.sharding.spec), str(h_got.sharding.spec)]}
            collectives._fuse_norm = False
    finally:
        car.all_reduce, car.all_reduce_add_rms_norm = real, real_fused
        collectives._enabled = collectives._fuse_norm = False
    return out


def _pallas_under_shard_map() -> dict:
    """The Pallas kernels (the GPU default; interpret mode here) inside the shard_map, against the reference:
    kv heads split (8q/4kv, tp=2: the fused write + attention per device) and replicated (8q/2kv, tp=4: every
    device writes every head, then ``paged_attention`` slices one kv head per device). Each interpreted kernel
    compiles for seconds, so only the layer's own call (``write_kv_and_attend``) is checked."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxserve import parallel
    from support import synthetic
    from jaxserve.kernels import ops
    from jaxserve.parallel import attention as tp_attention

    rng, out = np.random.default_rng(0), {}
    for hq, kvh, tp in [(8, 4, 2), (8, 2, 4)]:
        q, k, v, md = synthetic.make_batch(rng, [1, 3, 1], [10, 3, 20], block_size=16, num_q_heads=hq,
                                           num_kv_heads=kvh, head_dim=64, dtype=jnp.float32)
        mesh = parallel.make_mesh(tp)
        # the layer's write + attention (q, k, v packed per device; replicated kv heads: write, then attend)
        new_k, new_v = (jnp.asarray(rng.standard_normal((q.shape[0], kvh, 64)), jnp.float32) for _ in range(2))
        want = ops.write_kv_and_attend(q, new_k, new_v, k, v, md, sm_scale=0.125)
        fn = jax.jit(parallel.bind_mesh(lambda *a: tp_attention.write_kv_and_attend(
            *a, sm_scale=0.125, backend="pallas", interpret=True), mesh))
        got = fn(*jax.device_put((q, new_k, new_v, k, v, md), NamedSharding(mesh, P())))
        n_real = int(md.query_start_loc[int(md.num_seqs)])
        out[f"write+attend {hq}q{kvh}kv/tp{tp}"] = max(
            float(jnp.abs(got[0][:n_real] - want[0][:n_real]).max()),
            *(float(jnp.abs(g[1:] - w[1:]).max()) for g, w in zip(got[1:], want[1:])))   # block 0: padding
        # an fp8 cache with per-head scales: each device gets its kv heads' scales (replicated heads: its one)
        scale = jnp.linspace(0.5, 2.0, kvh).astype(jnp.float32)
        k8, v8 = synthetic.quantize_caches(k, v, jnp.float8_e4m3fn, scale, scale)
        fp8 = dict(k_scale=scale, v_scale=scale)
        for backend in ("reference", "pallas"):
            extra = dict(interpret=True) if backend == "pallas" else {}
            want = ops.write_kv_and_attend(q, new_k, new_v, k8, v8, md, sm_scale=0.125, **fp8)
            fn = jax.jit(parallel.bind_mesh(lambda *a: tp_attention.write_kv_and_attend(
                *a, sm_scale=0.125, backend=backend, **fp8, **extra), mesh))
            got = fn(*jax.device_put((q, new_k, new_v, k8, v8, md), NamedSharding(mesh, P())))
            err = float(jnp.abs(got[0][:n_real] - want[0][:n_real]).max() / jnp.abs(want[0][:n_real]).max())
            same = all(bool(jnp.array_equal(g[1:].astype(jnp.float32), w[1:].astype(jnp.float32)))
                       for g, w in zip(got[1:], want[1:]))
            out[f"fp8 per-head scales {backend} {hq}q{kvh}kv/tp{tp}"] = err if same else float("inf")
    return out


FIXTURES = os.path.join(support.FIXTURES, "models")
ENGINE_PROMPTS = [[5, 17, 99, 3, 42, 7, 250], [1, 2, 3], list(range(30, 70)), [200, 11, 11, 11, 64, 9]]
# tiny-llama3 has 4 q / 2 kv heads: tp=4 exercises replicated kv heads; tiny-qwen2 adds q/k/v biases
ENGINE_CASES = [("tiny-llama3", 1), ("tiny-llama3", 2), ("tiny-llama3", 4), ("tiny-qwen2", 1), ("tiny-qwen2", 2)]


def _engine_worker() -> dict:
    """Greedy tokens through the offline API (scheduler, runner, sampler) at each tensor_parallel_size."""
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams
    from support.executable_memo import install

    # the async and the multi-step engines compile programs the tp=2 engine already compiled: the in-process
    # memo serves them (not a persistent cache: XLA:CPU can crash loading one back)
    install()
    report = {}
    for model, tp in ENGINE_CASES:
        llm = LLM(os.path.join(FIXTURES, model), tensor_parallel_size=tp, dtype="float32", max_model_len=128,
                  max_num_batched_tokens=64, max_num_seqs=4, kv_cache_memory_bytes=1 << 22, skip_warmup=True,
                  compilation_cache_dir="", use_tqdm_on_load=False)
        outs = llm.generate(ENGINE_PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS,
                                                           ignore_eos=True), use_tqdm=False)
        report[f"{model}/tp{tp}"] = [list(o.outputs[0].token_ids) for o in outs]
        k = llm.engine.core.model.params["layers"][0]["k"]
        report[f"{model}/tp{tp}/k_spec"] = str(getattr(k.sharding, "spec", None))
        del llm
    report["async/tp2"] = _async_engine_tokens("tiny-llama3", 2)
    report["multistep/tp2"] = _multistep_warm_engine("tiny-llama3", 2)
    return report


def _multistep_warm_engine(model: str, tp: int) -> dict:
    """num_scheduler_steps=4 with the warm-up on: the greedy tokens, and the compiled variants after the
    warm-up and after a workload (under a mesh, a step fed what the previous one returned must hit the
    executable the warm-up compiled)."""
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    llm = LLM(os.path.join(FIXTURES, model), tensor_parallel_size=tp, dtype="float32", max_model_len=128,
              max_num_batched_tokens=64, max_num_seqs=4, token_buckets=[16, 64], kv_cache_memory_bytes=1 << 22,
              num_scheduler_steps=4, skip_warmup=False, compilation_cache_dir="", use_tqdm_on_load=False)
    runner, sched = llm.engine.core.runner, llm.engine.core.scheduler
    num_steps, schedule = [], sched.schedule

    def recording_schedule():
        out = schedule()
        num_steps.append(out.num_steps)
        return out
    sched.schedule = recording_schedule
    runner.wait_compiled()
    before = runner.compiled_variants()
    outs = llm.generate(ENGINE_PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    after_greedy = runner.compiled_variants()
    mixed = [SamplingParams(temperature=0.8, top_p=0.9, top_k=5, max_tokens=MAX_NEW_TOKENS, seed=3, ignore_eos=True),
             SamplingParams(temperature=0.7, max_tokens=MAX_NEW_TOKENS, repetition_penalty=1.2, ignore_eos=True),
             SamplingParams(temperature=0.5, max_tokens=MAX_NEW_TOKENS, logprobs=2, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)]
    llm.generate(ENGINE_PROMPTS, mixed, use_tqdm=False)      # compiles the sampler variants it first needs
    runner.wait_compiled()
    after_mixed = runner.compiled_variants()
    llm.generate(ENGINE_PROMPTS, mixed, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "variants": [before, after_greedy, after_mixed,
                                                                                 runner.compiled_variants()],
            "num_steps": num_steps, "kv_usage": llm.engine.core.kv_manager.usage}


def _async_engine_tokens(model: str, tp: int) -> list[list[int]]:
    """The server's path: AsyncLLMEngine (background loop thread), concurrent requests."""
    import asyncio

    from jaxserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from jaxserve.engine.async_engine import AsyncLLMEngine
    from jaxserve.sampling_params import SamplingParams

    config = EngineConfig(model=os.path.join(FIXTURES, model), dtype="float32", max_model_len=128,
                          skip_warmup=True, compilation_cache_dir="",
                          cache=CacheConfig(kv_cache_memory_bytes=1 << 22),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                          parallel=ParallelConfig(tensor_parallel_size=tp))
    engine = AsyncLLMEngine(config, progress=False)

    async def one(i, prompt):
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
        last = None
        async for out in engine.generate(prompt, sp, request_id=f"r{i}"):
            last = out
        return list(last.outputs[0].token_ids)

    async def all_prompts():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(ENGINE_PROMPTS)))

    try:
        return asyncio.run(all_prompts())
    finally:
        engine.shutdown(drain_timeout=1.0)


def _smollm2_worker() -> dict:
    """The real SmolLM2 (9 q / 3 kv heads) at tp=3 against transformers' greedy ids, and tp=2's error."""
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    golden = json.load(open(os.path.join(FIXTURES, "smollm2_golden.json")))["cases"][:3]
    kw = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=128, max_num_seqs=4,
              kv_cache_memory_bytes=1 << 26, skip_warmup=True, compilation_cache_dir="", use_tqdm_on_load=False)
    report = {}
    try:
        LLM(None, tensor_parallel_size=2, **kw)
    except ValueError as e:
        report["tp2_error"] = str(e)
    llm = LLM(None, tensor_parallel_size=3, **kw)
    outs = llm.generate([c["prompt_ids"] for c in golden],
                        [SamplingParams(temperature=0.0, max_tokens=len(c["greedy_ids"])) for c in golden],
                        use_tqdm=False)
    report["tp3"] = [list(o.outputs[0].token_ids) for o in outs]
    report["golden"] = [c["greedy_ids"] for c in golden]
    return report


def _step_hlo(dec) -> str:
    """The decoder's compiled step (for its next inputs), as HLO text."""
    from support.tiny_models import shard_step_inputs
    ints, layout = dec.build_inputs()
    lowered = dec._step.lower(dec.params, dec.kv_caches, shard_step_inputs(dec.mesh, ints), dec.no_prev, layout=layout)
    return lowered.compile().as_text()


# ---------------------------------------------------------------------------------------------- the tests
def _run_worker(*args: str) -> dict:
    return fake_device_report([__file__, *args], NUM_DEVICES, timeout=600)


@pytest.fixture(scope="module")
def report():
    return _run_worker()


@pytest.fixture(scope="module")
def engine_report():
    return _run_worker("engine")


@pytest.mark.slow     # ~27 s; the tiny models at TP=2 in make test
def test_smollm2_tp3_matches_transformers():
    report = _run_worker("smollm2")
    assert report["tp3"] == report["golden"]
    assert "9 attention heads are not divisible by tensor_parallel_size=2" in report["tp2_error"]
    assert "sizes that work: [1, 3]" in report["tp2_error"]


@pytest.mark.parametrize("model,tp", [c for c in ENGINE_CASES if c[1] > 1])
def test_engine_greedy_matches_single_device(engine_report, model, tp):
    base = engine_report[f"{model}/tp1"]
    assert [len(t) for t in base] == [MAX_NEW_TOKENS] * len(ENGINE_PROMPTS)
    assert engine_report[f"{model}/tp{tp}"] == base


def test_async_engine_tp2_matches_single_device(engine_report):
    assert engine_report["async/tp2"] == engine_report["tiny-llama3/tp1"]


def test_multi_step_tp2_matches_single_device_without_recompiling(engine_report):
    r = engine_report["multistep/tp2"]
    assert r["tokens"] == engine_report["tiny-llama3/tp1"]
    assert 4 in r["num_steps"]                       # the greedy batch ran multi-step dispatches
    before, after_greedy, after_mixed, again = r["variants"]
    assert before > 0 and before == after_greedy and after_mixed == again, r["variants"]
    assert r["kv_usage"] == 0.0


def test_loader_keeps_kv_heads_whole(engine_report):
    # tiny-llama3 has 2 kv heads: split over tp=2, replicated (whole heads) at tp=4
    assert engine_report["tiny-llama3/tp2/k_spec"] == "P(None, 'tp')"
    assert engine_report["tiny-llama3/tp4/k_spec"] == "P()"


@pytest.mark.parametrize("case,tp", [("8q4kv", 2), ("8q4kv", 4), ("8q2kv", 2), ("8q2kv", 4), ("9q3kv", 3)])
def test_tp_greedy_matches_single_device(report, case, tp):
    import numpy as np
    base, sharded = report[f"{case}/tp1"], report[f"{case}/tp{tp}"]
    assert sharded["tokens"] == base["tokens"]
    assert len(base["tokens"][0]) == MAX_NEW_TOKENS
    # float32: only the order of the partial sums differs
    np.testing.assert_allclose(np.array(sharded["logits"]), np.array(base["logits"]), atol=2e-5, rtol=1e-4)


def test_weights_and_cache_are_sharded(report):
    # (jax prints specs without trailing Nones)
    assert report["8q4kv/tp4"]["q_spec"] == "P(None, 'tp')"
    assert report["8q4kv/tp4"]["cache_spec"] == "P(None, 'tp')"          # [blocks, kv_heads, block, d]
    # 2 kv heads over 4 devices: k/v projections and the cache are replicated, not cut mid-head
    assert report["8q2kv/tp4"]["k_spec"] == "P()"
    assert report["8q2kv/tp4"]["cache_spec"] == "P()"
    assert report["8q2kv/tp2"]["cache_spec"] == "P(None, 'tp')"
    assert report["8q2kv/tp2"]["k_spec"] == "P(None, 'tp')"


@pytest.mark.parametrize("case,tp", [("8q4kv", 2), ("8q4kv", 4), ("8q2kv", 4), ("9q3kv", 3)])
def test_hlo_collectives(report, case, tp):
    entry = report[f"{case}/tp{tp}"]
    num_layers = 2
    reduces, gathers = entry["collectives"]["all-reduce"], entry["collectives"]["all-gather"]
    # one after attention (o) and one after the MLP (down) per layer, one for the vocab-parallel embedding
    assert len(reduces) == 2 * num_layers + 1, reduces
    # the only all-gather: the [R, vocab] logits for the sampler; never a weight
    assert all(g.startswith("f32[3,") for g in gathers), gathers
    assert len(gathers) <= 1, gathers


def test_custom_all_reduce_is_off_where_it_cannot_run(report):
    car = report["custom_all_reduce"]
    assert "needs NVIDIA GPUs" in car["why_not_cpu"]
    assert car["why_not_disabled"] == "--disable-custom-all-reduce"
    assert car["why_not_tp1"] == "no tensor parallelism"


@pytest.mark.parametrize("case,tp", [("8q4kv", 2), ("8q2kv", 4)])
def test_custom_all_reduce_path_matches_single_device(report, case, tp):
    import numpy as np
    base, got = report[f"{case}/tp1"], report["custom_all_reduce"][f"{case}/tp{tp}"]
    assert got["tokens"] == base["tokens"]
    np.testing.assert_allclose(np.array(got["logits"]), np.array(base["logits"]), atol=2e-5, rtol=1e-4)
    # every o and down projection went to the kernel (2 layers), with the step's [tokens, hidden]
    assert len(got["calls"]) == 2 * 2 and all(c[1] == 64 for c in got["calls"]), got["calls"]
    # and XLA added none of its own for them: what is left is the kernel's stand-in and the embedding's
    assert len(got["collectives"]["all-reduce"]) == 2 * 2 + 1


@pytest.mark.parametrize("case,tp", [("8q4kv", 2), ("8q2kv", 4)])
def test_custom_all_reduce_fused_with_add_and_norm_matches_single_device(report, case, tp):
    """With the kernel's add + RMSNorm fusion on, every o / down projection (and the next norm) is one fused
    call, the last one ending in the final norm, and decoding still equals TP=1."""
    import numpy as np
    base, got = report[f"{case}/tp1"], report["custom_all_reduce"][f"{case}/tp{tp}/fused"]
    assert got["tokens"] == base["tokens"]
    np.testing.assert_allclose(np.array(got["logits"]), np.array(base["logits"]), atol=2e-5, rtol=1e-4)
    assert got["calls"] == [] and len(got["fused_calls"]) == 2 * 2, got
    assert all(c[1] == 64 for c in got["fused_calls"]), got["fused_calls"]
    assert len(got["collectives"]["all-reduce"]) == 2 * 2 + 1


def test_custom_all_reduce_fused_form_falls_back_for_large_steps(report):
    car = report["custom_all_reduce"]
    small, large = car["fused rows=4"], car[f"fused rows={(1 << 20) // 256 + 1}"]
    assert small["fused_calls"] == [[4, 64]] and small["calls"] == []
    assert large["fused_calls"] == [] and large["calls"] == []      # plain x @ w: XLA's all-reduce
    for r in (small, large):
        assert r["err_sum"] < 1e-3 and r["err_norm"] < 1e-4, r
        assert r["spec"] == ["P()", "P()"]


def test_custom_all_reduce_leaves_large_steps_to_psum(report):
    car = report["custom_all_reduce"]
    small, large = car["matmul rows=4"], car[f"matmul rows={(1 << 20) // 256 + 1}"]
    assert small["calls"] == [[4, 64]] and large["calls"] == []
    assert small["err"] < 1e-4 and large["err"] < 1e-3
    assert small["spec"] == large["spec"] == "P()"


def test_pallas_kernel_under_shard_map(report):
    exact = {"write+attend 8q4kv/tp2", "write+attend 8q2kv/tp4"}
    fp8 = {f"fp8 per-head scales {b} {c}" for b in ("reference", "pallas") for c in ("8q4kv/tp2", "8q2kv/tp4")}
    assert set(report["pallas"]) == exact | fp8
    assert all(report["pallas"][k] < 1e-5 for k in exact), report["pallas"]
    # fp8: caches equal to the single-device ones (else inf), outputs within 1e-4 of them (f32 queries)
    assert all(report["pallas"][k] < 1e-4 for k in fp8), report["pallas"]


def test_check_tp_compatible_names_every_problem():
    from jaxserve.parallel import check_tp_compatible
    from support.tp_greedy import tiny_config

    cfg = tiny_config(8, 4, vocab_size=250)
    check_tp_compatible(cfg, 2)
    with pytest.raises(ValueError) as e:
        check_tp_compatible(cfg, 4)
    assert str(e.value) == ("cannot shard this model with tensor_parallel_size=4: vocab_size 250 is not "
                            "divisible by 4 (sizes that work: [1, 2])")
    with pytest.raises(ValueError, match="8 attention heads are not divisible by tensor_parallel_size=3; 4 kv "
                                         "heads and tensor_parallel_size=3: one must divide the other"):
        check_tp_compatible(tiny_config(8, 4), 3)


def test_indivisible_heads_error(report):
    err = report["9q3kv/tp2"]["error"]
    assert "9 attention heads are not divisible by tensor_parallel_size=2" in err and "sizes that work" in err
    assert "needs 5 devices, but only 4 cpu device(s)" in report["too_many"]


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "model"
    print(json.dumps({"model": _worker, "engine": _engine_worker, "smollm2": _smollm2_worker}[mode]()))
