"""The MoE grouped GEMM on one GPU: ``jax.lax.ragged_dot`` vs the Pallas Triton kernel vs a gather of the
selected experts' weights (kernels/ragged_dot.py), at decode and prefill token counts, in one run.

    python benchmarks/diagnostics/moe_gemm.py            # the H200 run (a few minutes), prints one table
    python benchmarks/diagnostics/moe_gemm.py --smoke    # tiny sizes on CPU (Pallas in interpret mode)
    python benchmarks/diagnostics/moe_gemm.py --decode --skip-models   # T = 1, 4, 16, 64, 256, + rows / layer

``--decode``: decode token counts, and three more rows per count: ``rows`` (``expert_rows_matmul``, the
sort-free decode kernel, tokens in token order, at most 16 tokens) and the whole routed-expert part of one MoE
layer (``moe.routed_experts``: both GEMMs, the activation, the combine, and for ``layer:pallas`` the sort,
group count, tile plan and scatter back) on the sorted path and, up to 16 tokens, the rows path: the
layer rows show what the sort costs. ``--impls`` and ``--shapes`` pick the rows and shapes to time.

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
import functools
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
from jaxserve.models.layers import moe  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}   # E, top_k, hidden, inter
SMOKE_SHAPES = {"tiny": (8, 2, 64, 32)}
POOL = 16
GATHER_MAX_BYTES = 8 << 30          # the gather copies each row's [hidden, n] matrix: skip it past this


def routed_ids(rng, tokens, experts, top_k, n):
    """``n`` routings ``[n, tokens, top_k]``: each token to ``top_k`` distinct random experts."""
    return np.stack([np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k] for _ in range(n)]).astype(np.int32)


def group_sizes(ids, experts):
    return np.stack([np.bincount(r.reshape(-1), minlength=experts) for r in ids]).astype(np.int32)


def routings(rng, tokens, experts, top_k, n):
    """``n`` group-size vectors of ``tokens`` routed to ``top_k`` distinct random experts each."""
    return group_sizes(routed_ids(rng, tokens, experts, top_k, n), experts)


DECODE_ROWS = ("rows", "layer:pallas", "layer:rows")     # --decode's extra rows
ROWS_MAX_TOKENS = moe.ROWS_PATH_MAX_TOKENS


def one_call(impl):
    """``f(x, rhs, routing) -> out`` of one implementation; ``rhs`` and ``routing`` as ``decode_inputs`` makes
    them for the ``DECODE_ROWS`` (the routing's ``ids [T, k]`` in token order), the sorted rows'
    ``[E, hidden, n]`` and group sizes otherwise."""
    if impl == "rows":      # each expert gets at most one row per token
        return lambda x, rhs, ids: ragged_dot.expert_rows_matmul(x, rhs, ids.reshape(-1), ids.shape[0])
    if impl.startswith("layer:"):
        def layer(x, rhs, routing):
            (gate_up, down), (ids, weights) = rhs, routing
            spec = moe.MoESpec(num_experts=gate_up.shape[0], top_k=ids.shape[1], intermediate_size=down.shape[1],
                               renormalize=True, layers=(True,), grouped_gemm="pallas",
                               rows_path_max_tokens=ROWS_MAX_TOKENS if impl == "layer:rows" else 0)
            return moe.routed_experts(x, ids, weights, gate_up, down, spec, jax.nn.silu)
        return layer
    return lambda x, rhs, sizes: ragged_dot.grouped_matmul(x, rhs, sizes, impl)


def decode_inputs(impl, rng, rhs, ids, dtype):
    """(lhs, rhs, routing pool) of a ``DECODE_ROWS`` implementation for the routings ``ids [POOL, T, k]``."""
    _, tokens, top_k = ids.shape
    experts, hidden, n = rhs.shape
    if impl == "rows":       # the (token, slot) rows in token order, each naming its expert
        return jnp.asarray(rng.standard_normal((tokens * top_k, hidden)) * 0.1, dtype), rhs, jnp.asarray(ids)
    down = _down_weights(experts, n // 2, hidden, dtype)
    weights = jnp.asarray(rng.random(ids.shape), jnp.float32)
    return (jnp.asarray(rng.standard_normal((tokens, hidden)) * 0.1, dtype),
            (rhs.reshape(experts, hidden, 2, n // 2), down), (jnp.asarray(ids), weights))


@functools.lru_cache(maxsize=1)
def _down_weights(experts, inter, hidden, dtype):
    """The layer rows' down projections, made once per shape on the device (a host copy would take seconds)."""
    return (jax.random.normal(jax.random.key(1), (experts, inter, hidden), jnp.float32) * 0.02).astype(dtype)


def chained(impl, n_iter):
    call = one_call(impl)

    def run(lhs, rhs, pool):
        def body(i, carry):
            x, acc = carry
            out = call(x, rhs, jax.tree.map(lambda p: p[i % POOL], pool))
            acc = acc + out[0, 0].astype(jnp.float32)
            return x * (1 + acc * 1e-30).astype(x.dtype), acc
        return jax.lax.fori_loop(0, n_iter, body, (lhs, jnp.float32(0)))[1]
    return jax.jit(run)


def check(impl, rhs, rng, top_k) -> str | None:
    """The implementation against the reference on 8 tokens; the whole-layer rows are tested on CPU instead
    (tests/test_moe_layer.py)."""
    if impl.startswith("layer:"):
        return None
    experts, hidden, _ = rhs.shape
    sizes = jnp.asarray(routings(rng, 8, experts, top_k, 1)[0])
    m = int(sizes.sum()) + 3                               # 3 rows past the groups: must come out zero
    lhs = jnp.asarray(rng.standard_normal((m, hidden)) * 0.1, rhs.dtype)
    want = np.asarray(ragged_dot.grouped_matmul_reference(lhs, rhs, sizes), np.float32)
    routing = sizes
    if impl == "rows":     # 8 tokens in token order, the last one's rows unowned (padding): reference on them sorted
        ids = routed_ids(rng, 8, experts, top_k, 1)[0]
        ids[-1] = experts
        order = np.argsort(ids.reshape(-1), kind="stable")
        lhs = jnp.asarray(rng.standard_normal((8 * top_k, hidden)) * 0.1, rhs.dtype)
        sizes = jnp.asarray(np.bincount(ids.reshape(-1), minlength=experts + 1)[:experts])
        want = np.empty((8 * top_k, rhs.shape[2]), np.float32)
        want[order] = np.asarray(ragged_dot.grouped_matmul_reference(lhs[order], rhs, sizes), np.float32)
        routing = jnp.asarray(ids)
    got = np.asarray(jax.jit(one_call(impl))(lhs, rhs, routing), np.float32)
    err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-9))
    return None if err < 2e-2 else f"mismatch vs reference: max rel err {err:.3g}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tokens", default=None, help="comma list of token counts (default 1,16,256,8192)")
    ap.add_argument("--n-iter", type=int, default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-models", action="store_true", help="only the GEMM table")
    ap.add_argument("--decode", action="store_true", help="T = 1, 4, 16, 64, 256 (unless --tokens) and the rows "
                                                           "kernel and whole-layer rows (see the docstring)")
    ap.add_argument("--impls", default=None, help="comma list of the implementations / rows to time (default all)")
    ap.add_argument("--shapes", default=None, help=f"comma list of {', '.join(SHAPES)} (default both)")
    ap.add_argument("--model-check", action="store_true", help=argparse.SUPPRESS)   # the per-impl subprocess
    args = ap.parse_args(argv)
    if args.model_check:
        model_check()
        return 0
    smoke = args.smoke
    names = args.shapes.split(",") if args.shapes else list(SHAPES)
    if not smoke and set(names) - set(SHAPES):
        ap.error(f"--shapes: {', '.join(sorted(set(names) - set(SHAPES)))} not among {', '.join(SHAPES)}")
    shapes = SMOKE_SHAPES if smoke else {n: SHAPES[n] for n in names}
    default_tokens = "1,4,16,64,256" if args.decode else "1,16,256,8192"
    token_counts = [int(t) for t in (args.tokens or ("1,16" if smoke else default_tokens)).split(",")]
    impls = ragged_dot.IMPLEMENTATIONS + (DECODE_ROWS if args.decode else ())
    if args.impls:
        wanted = args.impls.split(",")
        unknown = [w for w in wanted if w not in impls]
        if unknown:
            ap.error(f"--impls: {', '.join(unknown)} not among {', '.join(impls)}"
                     + ("" if args.decode else f" (--decode adds {', '.join(DECODE_ROWS)})"))
        impls = tuple(wanted)
    n_iter = args.n_iter or (2 if smoke else 20)
    hw = roofline.load_hardware("h200")[0]
    read_bw, peak = hw.read_bandwidth, hw.peak_flops["bfloat16"]
    dtype = jnp.float32 if smoke else jnp.bfloat16
    rng = np.random.default_rng(0)
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  n_iter {n_iter}  reps {args.reps}", flush=True)
    rows = []
    for name, (experts, top_k, hidden, inter) in shapes.items():
        n = 2 * inter
        experts_w = (jax.random.normal(jax.random.key(0), (experts, hidden, n), jnp.float32) * 0.02).astype(dtype)
        broken = {}
        for impl in impls:
            try:
                broken[impl] = check(impl, experts_w, rng, top_k)
            except Exception as e:  # noqa: BLE001  (a lowering failure is a finding, not the end of the run)
                broken[impl] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                traceback.print_exc(limit=2)
        for tokens in token_counts:
            m = tokens * top_k
            ids_np = routed_ids(rng, tokens, experts, top_k, POOL)
            pool_np = group_sizes(ids_np, experts)
            touched = float(np.mean([(p > 0).sum() for p in pool_np]))
            gemm_bytes = (touched * hidden * n + m * (hidden + n)) * experts_w.dtype.itemsize
            gemm_flops = 2.0 * m * hidden * n
            gemm_inputs = (jnp.asarray(rng.standard_normal((m, hidden)) * 0.1, dtype), experts_w, jnp.asarray(pool_np))
            for impl in impls:
                row = {"shape": name, "tokens": tokens, "impl": impl}
                layer = impl.startswith("layer:")      # both GEMMs: 1.5 x the gate/up weights and FLOPs
                nbytes, flops = (1.5 * gemm_bytes, 1.5 * gemm_flops) if layer else (gemm_bytes, gemm_flops)
                lhs, rhs, pool = decode_inputs(impl, rng, experts_w, ids_np, dtype) if impl in DECODE_ROWS \
                    else gemm_inputs
                if broken[impl]:
                    row["note"] = broken[impl]
                elif impl in ("rows", "layer:rows") and tokens > ROWS_MAX_TOKENS:
                    row["note"] = f"the rows path runs at most {ROWS_MAX_TOKENS} tokens"
                elif impl == "gather" and m * hidden * n * experts_w.dtype.itemsize > GATHER_MAX_BYTES:
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
    for impl in ragged_dot.IMPLEMENTATIONS + (moe.ROWS,):
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
                f"{r['tflops']:.1f} | {r['fl']:.1f} | {r.get('note', '')} |")
    return f"| {r['shape']} | {r['tokens']} | {r['impl']} | | | | | | {r.get('note', '')} |"


if __name__ == "__main__":
    sys.exit(main())
