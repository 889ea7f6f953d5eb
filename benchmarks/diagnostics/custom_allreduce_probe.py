"""The CUDA one-shot all-reduce (``kernels/custom_allreduce.py``) against XLA's psum, one process per GPU.

    python benchmarks/diagnostics/custom_allreduce_probe.py --processes 2 [--tokens 1 4 8 16 64 128] [--blocks 0 1 2 4 8 16]
    python benchmarks/diagnostics/custom_allreduce_probe.py --engine llama-3.2-1b [--dtype float32]   # through the engine

Per size (tokens x 4096 bf16 elements per device, the Llama-3.1-8B hidden state of a step of that many tokens):
whether a chain of calls equals psum's chain bit for bit on every rank (with 2 ranks both round one float32
sum once), then us per all-reduce in a jitted chain of ``--chain`` (each result halved so values stay bounded;
the halving is in both). ``--blocks 0`` = the kernel's default CTA count. Run it under ``timeout``: a protocol
error shows as a mismatch or a hang.

``--fused``: the same for ``all_reduce_add_rms_norm`` (the all-reduce + residual add + RMSNorm of a pre-norm
layer): its sum must equal ``residual + psum`` bit for bit, its normalised output is compared with XLA's
``rms_norm`` of that sum (statistics summed in another order: a few bf16 ulps may differ); us per call against
the custom all-reduce followed by XLA's add and norm, and against psum followed by them.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def engine_child(a) -> None:
    """One engine (TP=a.tp, one process per GPU), greedy tokens with their log-probabilities, as JSON."""
    import json

    import numpy as np

    from jaxserve import LLM, SamplingParams

    llm = LLM(a.engine, load_format="dummy", dtype=a.dtype, tensor_parallel_size=a.tp,
              distributed_executor_backend="mp" if a.tp > 1 else "uni", disable_custom_all_reduce=a.xla,
              max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256, use_tqdm_on_load=False,
              kv_cache_memory_bytes=1 << 30)
    rng = np.random.default_rng(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [rng.integers(min(100, vocab // 4), min(30000, vocab), size=n).tolist() for n in (7, 19, 64, 120)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True, logprobs=2),
                        use_tqdm=False)
    rows = [{"ids": o.outputs[0].token_ids,
             "top": [sorted(((lp.logprob, t) for t, lp in pos.items()), reverse=True) for pos in o.outputs[0].logprobs]}
            for o in outs]
    print("RESULT " + json.dumps({"custom": bool(llm.engine.custom_all_reduce), "rows": rows}), flush=True)


def engine_check(a, argv) -> int:
    """TP=1, TP=2 with XLA's all-reduce and TP=2 with the custom one, each in its own process: where the
    greedy tokens first differ from the TP=1 run's, whether that was a near-tie there, and the largest
    log-probability difference of the same token before it."""
    import json
    runs = {}
    for name, extra in (("tp1", ["--tp", "1"]), ("tp2 xla", ["--tp", "2", "--xla"]), ("tp2 custom", ["--tp", "2"])):
        proc = subprocess.run([sys.executable, __file__, *argv, "--engine-child", *extra], capture_output=True,
                              text=True, timeout=400)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if not line:
            print(f"{name}: failed ({proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            return 1
        runs[name] = json.loads(line[-1][len("RESULT "):])
    base = runs["tp1"]["rows"]
    print("| run | all-reduce | first differing token vs TP=1 (per prompt) | TP=1's top-2 gap there | "
          "max logprob diff before it |\n|---|---|---|---|---|")
    for name, r in runs.items():
        firsts, gaps, worst = [], [], 0.0
        for got, ref in zip(r["rows"], base):
            i = next((k for k, (x, y) in enumerate(zip(got["ids"], ref["ids"])) if x != y), None)
            firsts.append(i)
            gaps.append(None if i is None else round(ref["top"][i][0][0] - ref["top"][i][1][0], 4))
            for k in range(len(ref["ids"]) if i is None else i):
                worst = max(worst, abs(got["top"][k][0][0] - ref["top"][k][0][0]))
        print(f"| {name} | {'custom' if r['custom'] else 'xla'} | {firsts} | {gaps} | {worst:.2g} |", flush=True)
    same = runs["tp2 xla"]["rows"] == runs["tp2 custom"]["rows"]
    print(f"TP=2 custom == TP=2 xla (tokens and logprobs): {same}", flush=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--pid", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=12361)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 64, 128])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--blocks", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16])
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--fused", action="store_true", help="check and time all_reduce_add_rms_norm instead")
    ap.add_argument("--engine", default=None, help="configs/models name: compare greedy decoding through the "
                    "engine at TP=1, TP=2 (XLA's all-reduce) and TP=2 (custom) instead")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--xla", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.engine_child:
        engine_child(a)
        return 0
    if a.engine:
        return engine_check(a, argv)
    if a.pid is None:                      # spawn one child per GPU, each with one device
        procs = [subprocess.Popen([sys.executable, __file__, *argv, "--pid", str(i)]) for i in range(a.processes)]
        return max(p.wait() for p in procs)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxserve.kernels import custom_allreduce as car

    jax.distributed.initialize(f"127.0.0.1:{a.port}", num_processes=a.processes, process_id=a.pid,
                               local_device_ids=[a.pid])
    say = print if jax.process_index() == 0 else (lambda *_, **__: None)
    mesh = jax.make_mesh((jax.device_count(),), ("tp",))
    d = mesh.shape["tp"]
    t0 = time.perf_counter()
    from jaxserve.parallel.collectives import kernel_toolchain
    car.setup(jax.local_devices()[0], jax.process_index(), d, car.distributed_exchange(jax.process_index(), d),
              kernel_toolchain())
    say(f"# custom_allreduce_probe: jax {jax.__version__}, {d} x {jax.devices()[0].device_kind}, "
        f"{jax.process_count()} processes; build + setup {time.perf_counter() - t0:.1f} s", flush=True)

    def build(which, blocks, chain):
        def step(x):
            return lax.psum(x, "tp") if which == "psum" else car.all_reduce(x, blocks=blocks or None)

        def body(x):
            for _ in range(chain):
                x = (step(x).astype(jnp.float32) * 0.5).astype(x.dtype)
            return x
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))

    def same(got, want) -> bool:
        ok = all(np.array_equal(np.asarray(g.data, np.float32), np.asarray(w.data, np.float32))
                 for g, w in zip(got.addressable_shards, want.addressable_shards))
        return bool(multihost_utils.process_allgather(np.array(ok)).all())

    if a.fused:
        return fused_check(a, mesh, d, say)
    say("| tokens | KiB per device | kernel | blocks | chain equals psum | us per all-reduce |\n|---|---|---|---|---|---|",
        flush=True)
    failures = 0
    for t in a.tokens:
        n = t * a.hidden
        host = np.random.default_rng(t).standard_normal(d * n).astype(jnp.bfloat16)   # same in every process
        x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("tp")), lambda idx: host[idx])
        want = build("psum", 0, 5)(x)
        for which, blocks in [("psum", 0)] + [("custom", b) for b in a.blocks]:
            eq = "-"
            if which == "custom":
                eq = same(build(which, blocks, 5)(x), want)
                failures += not eq
            f = build(which, blocks, a.chain)
            y = f(x).block_until_ready()
            t1 = time.perf_counter()
            for _ in range(a.reps):
                y = f(y)
            y.block_until_ready()
            us = (time.perf_counter() - t1) / (a.reps * a.chain) * 1e6
            label = blocks or (f"default ({car.default_blocks(n * 2)})" if which == "custom" else "-")
            say(f"| {t} | {n * 2 / 1024:.0f} | {which} | {label} | {eq} | {us:.1f} |", flush=True)
    say(f"mismatches: {failures}", flush=True)
    return 1 if failures else 0


def fused_check(a, mesh, d, say) -> int:
    """``--fused``: all_reduce_add_rms_norm against psum + XLA's add + norm."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxserve.kernels import custom_allreduce as car
    from jaxserve.models.llama import rms_norm

    eps, hid = 1e-5, a.hidden
    say("| tokens | variant | sum equals | normed: elements differing (max abs diff) | us per call |\n"
        "|---|---|---|---|---|", flush=True)

    def step(which, xs, res, w):
        if which == "fused":
            return car.all_reduce_add_rms_norm(xs, res, w, eps)
        s = res + (car.all_reduce(xs) if which == "custom+xla" else lax.psum(xs, "tp"))
        return s, rms_norm(s, w, eps)

    def build(which, chain):
        def body(x, res, w):
            xs = x.reshape(-1, hid)
            for _ in range(chain):
                res, h = step(which, xs, res, w)
                xs = (h.astype(jnp.float32) * 0.5).astype(h.dtype)
            return res, h
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P(), P()),
                                     check_vma=False))

    failures = 0
    for t in a.tokens:
        n = t * hid
        rng = np.random.default_rng(t)                   # same in every process
        host = rng.standard_normal(d * n).astype(jnp.bfloat16)
        res_h = rng.standard_normal((t, hid)).astype(jnp.bfloat16)
        w_h = rng.uniform(0.5, 1.5, hid).astype(jnp.bfloat16)
        x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("tp")), lambda idx: host[idx])
        rep = NamedSharding(mesh, P())
        res = jax.make_array_from_callback(res_h.shape, rep, lambda idx: res_h[idx])
        w = jax.make_array_from_callback(w_h.shape, rep, lambda idx: w_h[idx])
        got_s, got_h = (np.asarray(o.addressable_shards[0].data, np.float32) for o in build("fused", 1)(x, res, w))
        want_s, want_h = (np.asarray(o.addressable_shards[0].data, np.float32)
                          for o in build("psum+xla", 1)(x, res, w))
        same_s = bool(np.array_equal(got_s, want_s))
        diff = np.abs(got_h - want_h)
        ok = same_s and float(diff.max()) <= 0.02 * float(np.abs(want_h).max())
        failures += not ok
        for which in ("fused", "custom+xla", "psum+xla"):
            f = build(which, a.chain)
            out = f(x, res, w)
            jax.block_until_ready(out)
            t1 = time.perf_counter()
            for _ in range(a.reps):
                out = f(x, res, w)
            jax.block_until_ready(out)
            us = (time.perf_counter() - t1) / (a.reps * a.chain) * 1e6
            check = (f"{same_s} | {int((diff > 0).sum())} of {diff.size} ({float(diff.max()):.3g})"
                     if which == "fused" else "- | -")
            say(f"| {t} | {which} | {check} | {us:.1f} |", flush=True)
    say(f"fused mismatches: {failures}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
