"""The MoE grouped GEMM on one GPU: ``jax.lax.ragged_dot`` vs the Pallas Triton kernel vs a gather of the
selected experts' weights (kernels/ragged_dot.py), at decode and prefill token counts, in one run.

    python benchmarks/diagnostics/moe_gemm.py            # the H200 run (a few minutes), prints one table
    python benchmarks/diagnostics/moe_gemm.py --smoke    # tiny sizes on CPU (Pallas in interpret mode)

The run ends with a model check: the tiny Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints (tests/fixtures/models)
through the engine with each implementation (``JAXSERVE_MOE_GROUPED_GEMM``, one subprocess each), float32,
against HF transformers' greedy ids: the kernels inside the whole model, on this device.

Shapes: the gate/up GEMM of one MoE layer, ``[T * top_k, hidden] x [E, hidden, 2 * intermediate]``, of
Qwen3-30B-A3B (128 experts, top-8, hidden 2048, intermediate 768) and Mixtral-8x7B (8 experts, top-2, hidden
4096, intermediate 14336), bf16, T = 1, 16, 256, 8192 tokens routed uniformly at random.

Timing: one jitted chain of ``n_iter`` calls, each with its own routing (a pool of 16 group-size vectors, so
consecutive calls read different experts and L2 does not serve repeats) and its input scaled by the previous
output (nothing hoisted); median of ``reps`` runs over n_iter. Bytes = the distinct experts' weights a call
needs + its input and output; % BW against configs/hardware/h200.yaml's read bandwidth; % FLOP against its bf16
peak. Each implementation is first checked against ``grouped_matmul_reference`` on a small routing; one that
fails to lower or to match prints why and the table goes on.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # as a script
if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import roofline  # noqa: E402
from benchmarks.diagnostics.timing import chain_seconds  # noqa: E402
from jaxserve.kernels import ragged_dot  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}   # E, top_k, hidden, inter
SMOKE_SHAPES = {"tiny": (8, 2, 64, 32)}
POOL = 16
GATHER_MAX_BYTES = 8 << 30          # the gather copies each row's [hidden, n] matrix: skip it past this


def routings(rng, tokens, experts, top_k, n):
    """``n`` group-size vectors of ``tokens`` routed to ``top_k`` distinct random experts each."""
    out = []
    for _ in range(n):
        ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
        out.append(np.bincount(ids.reshape(-1), minlength=experts).astype(np.int32))
    return np.stack(out)


def chained(impl, n_iter):
    def run(lhs, rhs, pool):
        def body(i, carry):
            x, acc = carry
            out = ragged_dot.grouped_matmul(x, rhs, pool[i % POOL], impl)
            acc = acc + out[0, 0].astype(jnp.float32)
            return x * (1 + acc * 1e-30).astype(x.dtype), acc
        return jax.lax.fori_loop(0, n_iter, body, (lhs, jnp.float32(0)))[1]
    return jax.jit(run)


def check(impl, rhs, rng, top_k) -> str | None:
    experts, hidden, _ = rhs.shape
    sizes = jnp.asarray(routings(rng, 8, experts, top_k, 1)[0])
    m = int(sizes.sum()) + 3                               # 3 rows past the groups: must come out zero
    lhs = jnp.asarray(rng.standard_normal((m, hidden)) * 0.1, rhs.dtype)
    want = np.asarray(ragged_dot.grouped_matmul_reference(lhs, rhs, sizes), np.float32)
    got = np.asarray(jax.jit(lambda a, b, s: ragged_dot.grouped_matmul(a, b, s, impl))(lhs, rhs, sizes), np.float32)
    err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-9))
    return None if err < 2e-2 else f"mismatch vs reference: max rel err {err:.3g}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tokens", default=None, help="comma list of token counts (default 1,16,256,8192)")
    ap.add_argument("--n-iter", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-models", action="store_true", help="only the GEMM table")
    ap.add_argument("--model-check", action="store_true", help=argparse.SUPPRESS)   # the per-impl subprocess
    args = ap.parse_args(argv)
    if args.model_check:
        model_check()
        return 0
    smoke = args.smoke
    shapes = SMOKE_SHAPES if smoke else SHAPES
    token_counts = [int(t) for t in (args.tokens or ("1,16" if smoke else "1,16,256,8192")).split(",")]
    n_iter = args.n_iter or (2 if smoke else 20)
    hw = roofline.load_hardware("h200")[0]
    read_bw, peak = hw.read_bandwidth, hw.peak_flops["bfloat16"]
    dtype = jnp.float32 if smoke else jnp.bfloat16
    rng = np.random.default_rng(0)
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  n_iter {n_iter}  reps {args.reps}", flush=True)
    rows = []
    for name, (experts, top_k, hidden, inter) in shapes.items():
        n = 2 * inter
        rhs = jnp.asarray(rng.standard_normal((experts, hidden, n), np.float32) * 0.02, dtype)
        broken = {}
        for impl in ragged_dot.IMPLEMENTATIONS:
            try:
                broken[impl] = check(impl, rhs, rng, top_k)
            except Exception as e:  # noqa: BLE001  (a lowering failure is a finding, not the end of the run)
                broken[impl] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                traceback.print_exc(limit=2)
        for tokens in token_counts:
            m = tokens * top_k
            pool_np = routings(rng, tokens, experts, top_k, POOL)
            touched = float(np.mean([(p > 0).sum() for p in pool_np]))
            nbytes = touched * hidden * n * rhs.dtype.itemsize + m * (hidden + n) * rhs.dtype.itemsize
            flops = 2.0 * m * hidden * n
            lhs = jnp.asarray(rng.standard_normal((m, hidden)) * 0.1, dtype)
            pool = jnp.asarray(pool_np)
            for impl in ragged_dot.IMPLEMENTATIONS:
                row = {"shape": name, "tokens": tokens, "impl": impl}
                if broken[impl]:
                    row["note"] = broken[impl]
                elif impl == "gather" and m * hidden * n * rhs.dtype.itemsize > GATHER_MAX_BYTES:
                    row["note"] = "skipped: the gathered weights would not fit"
                else:
                    try:
                        s = chain_seconds(chained(impl, n_iter), lhs, rhs, pool, n_iter=n_iter, reps=args.reps)
                        row |= {"us": s * 1e6, "tbs": nbytes / s / 1e12, "bw": 100 * nbytes / s / read_bw,
                                "tflops": flops / s / 1e12, "fl": 100 * flops / s / peak}
                    except Exception as e:  # noqa: BLE001
                        row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                rows.append(row)
                print(_fmt(row), flush=True)
    print("\n| shape | tokens | impl | µs | TB/s | % read BW | TFLOP/s | % bf16 peak | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(_fmt(r))
    if not args.skip_models:
        run_model_checks()
    return 0


MOE_FIXTURES = ("tiny-mixtral", "tiny-qwen2moe", "tiny-qwen3moe")


def model_check() -> None:
    """(In a subprocess whose JAXSERVE_MOE_GROUPED_GEMM picks the implementation.) One line per fixture."""
    import json

    from jaxserve import LLM, SamplingParams

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name in MOE_FIXTURES:
        path = os.path.join(root, "tests", "fixtures", "models", name)
        with open(os.path.join(path, "golden.json")) as f:
            golden = json.load(f)
        llm = LLM(path, dtype="float32", max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4,
                  compilation_cache_dir="", use_tqdm_on_load=False, gpu_memory_utilization=0.05)
        outs = llm.generate([golden["prompt_ids"]] * 3, SamplingParams(temperature=0, ignore_eos=True,
                            max_tokens=len(golden["greedy_ids"])), use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        diff = next((i for i, (a, b) in enumerate(zip(got[0], golden["greedy_ids"])) if a != b), None)
        print(f"{name}: {'matches HF' if diff is None else f'differs from HF at token {diff}'}, "
              f"copies equal: {all(g == got[0] for g in got)}", flush=True)


def run_model_checks() -> None:
    import subprocess

    print("\nmodel check (tiny MoE checkpoints, float32, greedy ids vs HF):", flush=True)
    for impl in ragged_dot.IMPLEMENTATIONS:
        env = dict(os.environ, JAXSERVE_MOE_GROUPED_GEMM=impl)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--model-check"], env=env,
                              capture_output=True, text=True, timeout=900)
        lines = proc.stdout.strip().splitlines() if proc.returncode == 0 else [
            f"failed (rc {proc.returncode}): {(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}"]
        for line in lines:
            print(f"  {impl}: {line}", flush=True)


def _fmt(r) -> str:
    if "us" in r:
        return (f"| {r['shape']} | {r['tokens']} | {r['impl']} | {r['us']:.1f} | {r['tbs']:.2f} | {r['bw']:.0f} | "
                f"{r['tflops']:.1f} | {r['fl']:.1f} | |")
    return f"| {r['shape']} | {r['tokens']} | {r['impl']} | | | | | | {r.get('note', '')} |"


if __name__ == "__main__":
    sys.exit(main())
