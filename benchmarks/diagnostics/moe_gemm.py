"""The MoE grouped GEMM on one GPU: ``jax.lax.ragged_dot`` vs the Pallas Triton kernel vs a gather of the
selected experts' weights (kernels/ragged_dot.py), at decode and prefill token counts, in one run.

    python benchmarks/diagnostics/moe_gemm.py            # the H200 run (a few minutes), prints one table
    python benchmarks/diagnostics/moe_gemm.py --smoke    # tiny sizes on CPU (Pallas in interpret mode)
    python benchmarks/diagnostics/moe_gemm.py --decode --skip-models   # T = 1, 4, 16, 64, 256, + rows / layer
    python benchmarks/diagnostics/moe_gemm.py --tune --skip-models     # the fused kernels' blocks (~3 minutes)

``--decode``: decode token counts, and more rows per count: ``rows`` (``expert_rows_matmul``, the sort-free
decode kernel, tokens in token order, at most 16 tokens), the whole routed-expert part of one MoE layer
(``moe.routed_experts``: both GEMMs, the activation, the combine, and for ``layer:pallas`` the sort, group
count, tile plan and scatter back) on the sorted path and, up to 16 tokens, the rows path and the fused
decode kernels (``layer:fused``, ``kernels/fused_moe.py``: two launches for the whole routed part), and the
fused kernels alone at a few block shapes: the layer rows show what the sort and the launches around the
GEMMs cost. A block shape is named ``fused[bi,bh,s]`` or ``fused[bi,bh,s,bk,st]`` (positional) or by keys,
``fused[bi=32,dk=128,w=8]`` (the others at ``fused_moe.GPU_BLOCKS``): ``bi`` gate/up's intermediate columns per
program, ``bh`` down's output columns per program, ``s`` down's splits of the intermediate, ``bk`` / ``dk``
gate/up's / down's rows per loop step, ``st`` the pipeline depth, ``w`` warps per program. What the brackets of a
keyed name hold is a ``JAXSERVE_MOE_FUSED_BLOCKS`` value: the engine's MoE layers run those blocks.

``--tune`` (the decode rows at 1, 4, 16 tokens unless --tokens): per shape and token count, ``layer:rows``,
``layer:fused`` and a coordinate search over the fused kernels' blocks from ``GPU_BLOCKS`` (``TUNE_AXES``:
each key's values in turn, keeping the fastest that matches ``fused_moe_reference``; settings that resolve to
the same kernels run once), a ``tune:`` line with the best setting against both layers as each count
finishes, then per shape each count's winner timed at the other counts and the one best summed over them (a
candidate for that shape's default).

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
import re
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
from jaxserve.kernels import fused_moe, ragged_dot  # noqa: E402
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


# the fused kernels' shapes tried beside the default (fused_moe.GPU_BLOCKS): (block_i, block_h, splits[,
# block_k, num_stages])
FUSED_BLOCKS = ((16, 64, 4), (64, 64, 4), (32, 32, 4), (32, 128, 8), (32, 64, 4, 256, 3), (32, 64, 4, 128, 4))
DECODE_ROWS = ("rows", "layer:pallas", "layer:rows", "layer:fused") + tuple(
    f"fused[{','.join(map(str, b))}]" for b in FUSED_BLOCKS)           # --decode's extra rows
ROWS_MAX_TOKENS = moe.ROWS_PATH_MAX_TOKENS
# a fused row's positional order (fused[bi,bh,s(,bk,st)]); by keys, fused_moe.BLOCK_KEYS (fused[bi=..,dk=..])
FUSED_POSITIONAL = ("block_i", "block_h", "splits", "block_k", "num_stages")
# --tune's coordinate search, in this order: gate/up's blocks, down's, then the compiler settings both share
TUNE_AXES = (("block_i", (16, 32, 64, 128)), ("block_k", (64, 128, 256)), ("block_h", (32, 64, 128, 256)),
             ("splits", (1, 2, 4, 8)), ("down_block_k", (64, 128)), ("num_stages", (2, 3, 4)),
             ("num_warps", (4, 8)))


def fused_blocks(impl: str) -> dict[str, int]:
    """The ``fused_moe`` block arguments a ``fused[...]`` row names (see the docstring); ValueError says why
    a name is not one."""
    m = re.fullmatch(r"fused\[([^\]]*)\]", impl)
    parts = [p.strip() for p in m.group(1).split(",")] if m else []
    if not parts or not all(parts):
        raise ValueError(f"{impl!r}: expected fused[bi,bh,s(,bk,st)] or fused[key=value,...]")
    named = ["=" in p for p in parts]
    if any(named) and not all(named):
        raise ValueError(f"{impl!r}: all values positional or all key=value, not both")
    if all(named):
        try:
            return fused_moe.parse_blocks(m.group(1))
        except ValueError as e:
            raise ValueError(f"{impl!r}: {e}") from None
    if not 3 <= len(parts) <= len(FUSED_POSITIONAL):
        raise ValueError(f"{impl!r}: 3 to {len(FUSED_POSITIONAL)} positional values (bi,bh,s(,bk,st))")
    if not all(v.isdigit() and int(v) > 0 for v in parts):
        raise ValueError(f"{impl!r}: every value a positive integer")
    return {key: int(v) for key, v in zip(FUSED_POSITIONAL, parts)}


def fused_name(blocks: dict[str, int]) -> str:
    """The ``fused[key=value,...]`` row of these blocks, every key spelled out (``fused_blocks``' inverse)."""
    short = {full: key for key, full in fused_moe.BLOCK_KEYS.items()}
    return "fused[" + ",".join(f"{short[k]}={blocks[k]}" for k in fused_moe.GPU_BLOCKS) + "]"


def _decode_row(impl) -> bool:
    """Whether ``impl`` is one of --decode's rows (its inputs in token order, from ``decode_inputs``)."""
    return impl == "rows" or impl.startswith(("layer:", "fused["))


def one_call(impl):
    """``f(x, rhs, routing) -> out`` of one implementation; ``rhs`` and ``routing`` as ``decode_inputs`` makes
    them for the ``DECODE_ROWS`` (the routing's ``ids [T, k]`` in token order), the sorted rows'
    ``[E, hidden, n]`` and group sizes otherwise."""
    if impl == "rows":      # each expert gets at most one row per token
        return lambda x, rhs, ids: ragged_dot.expert_rows_matmul(x, rhs, ids.reshape(-1), ids.shape[0])
    if impl.startswith("fused["):
        blocks = fused_blocks(impl)

        def fused(x, rhs, routing):
            (gate_up, down), (ids, weights) = rhs, routing
            return fused_moe.fused_moe(x, ids, weights, gate_up, down, jax.nn.silu, **blocks).astype(x.dtype)
        return fused
    if impl.startswith("layer:"):
        def layer(x, rhs, routing):
            (gate_up, down), (ids, weights) = rhs, routing
            decode = impl in ("layer:rows", "layer:fused")
            spec = moe.MoESpec(num_experts=gate_up.shape[0], top_k=ids.shape[1], intermediate_size=down.shape[1],
                               renormalize=True, layers=(True,), grouped_gemm="pallas",
                               rows_path_max_tokens=ROWS_MAX_TOKENS if decode else 0,
                               decode_kernel=impl.split(":")[1] if decode else "fused")
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
    if impl.startswith(("layer:", "fused")):
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
    ap.add_argument("--tune", action="store_true", help="search the fused kernels' blocks at T = 1, 4, 16 (unless "
                    "--tokens) against layer:rows / layer:fused (see the docstring)")
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
    default_tokens = "1,4,16" if args.tune else "1,4,16,64,256" if args.decode else "1,16,256,8192"
    token_counts = [int(t) for t in (args.tokens or ("1,16" if smoke else default_tokens)).split(",")]
    if args.tune and (args.impls or max(token_counts) > ROWS_MAX_TOKENS):
        ap.error(f"--tune: times its own rows (no --impls), at most {ROWS_MAX_TOKENS} tokens")
    impls = ("layer:rows", "layer:fused") if args.tune else \
        ragged_dot.IMPLEMENTATIONS + (DECODE_ROWS if args.decode else ())
    if args.impls:      # fused[...] names hold commas: split on the commas outside brackets
        wanted = re.findall(r"[^,\[]+(?:\[[^\]]*\])?", args.impls)
        unknown = [w for w in wanted if w not in impls and not _is_fused(w)]
        if unknown:
            ap.error(f"--impls: {', '.join(unknown)} not among {', '.join(impls)} (with --decode) nor a "
                     "fused[...] row (see the docstring)")
        impls = tuple(wanted)
    n_iter = args.n_iter or (2 if smoke else 20)
    hw = roofline.load_hardware("h200")[0]
    dtype = jnp.float32 if smoke else jnp.bfloat16
    rng = np.random.default_rng(0)
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}  n_iter {n_iter}  reps {args.reps}", flush=True)
    rows, tuned = [], []
    if args.tune:       # the summary rows print as they come, "tune: " first (a run cut short keeps them)
        print("\n".join(f"tune: {line}" for line in TUNE_HEADER.splitlines()), flush=True)
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
        timers = {tokens: Timer(name, tokens, experts_w, top_k, rng, dtype, hw, broken, n_iter, args.reps, rows)
                  for tokens in token_counts}
        for timer in timers.values():
            for impl in impls:
                timer(impl)
            if args.tune:
                tuned.append(tune(timer, hidden, inter))
        if args.tune:
            tuned.append(best_across(timers, hidden, inter))
    print("\n| shape | tokens | impl | µs | TB/s | % read BW | TFLOP/s | % bf16 peak | note |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(_fmt(r))
    if tuned:
        print("\n" + TUNE_HEADER)
        for line in tuned:
            print(line)
    if not args.skip_models:
        run_model_checks()
    return 0


def _is_fused(impl: str) -> bool:
    try:
        fused_blocks(impl)
        return True
    except ValueError:
        return False


class Timer:
    """``timer(impl) -> row``: one implementation at one shape and token count (printed and kept in
    ``rows``); each row is timed once, a repeat returns the first row."""

    def __init__(self, shape, tokens, experts_w, top_k, rng, dtype, hw, broken, n_iter, reps, rows):
        self.shape, self.tokens, self.experts_w, self.rng, self.dtype = shape, tokens, experts_w, rng, dtype
        self.hw, self.broken, self.n_iter, self.reps, self.rows = hw, broken, n_iter, reps, rows
        experts, hidden, n = experts_w.shape
        m = tokens * top_k
        self.ids = routed_ids(rng, tokens, experts, top_k, POOL)
        pool = group_sizes(self.ids, experts)
        touched = float(np.mean([(p > 0).sum() for p in pool]))
        self.gemm_bytes = (touched * hidden * n + m * (hidden + n)) * experts_w.dtype.itemsize
        self.gemm_flops = 2.0 * m * hidden * n
        self.gather_bytes = m * hidden * n * experts_w.dtype.itemsize
        self.gemm_inputs = (jnp.asarray(rng.standard_normal((m, hidden)) * 0.1, dtype), experts_w, jnp.asarray(pool))
        self.done = {}
        self.best = None          # tune(): the fastest fused row

    def __call__(self, impl: str) -> dict:
        if impl in self.done:
            return self.done[impl]
        tokens = self.tokens
        row = {"shape": self.shape, "tokens": tokens, "impl": impl}
        layer = impl.startswith(("layer:", "fused"))   # both GEMMs: 1.5 x the gate/up weights, FLOPs
        nbytes, flops = (1.5 * self.gemm_bytes, 1.5 * self.gemm_flops) if layer else (self.gemm_bytes, self.gemm_flops)
        if self.broken.get(impl):
            row["note"] = self.broken[impl]
        elif (impl in ("rows", "layer:rows", "layer:fused") or impl.startswith("fused")) and tokens > ROWS_MAX_TOKENS:
            row["note"] = f"the decode kernels run at most {ROWS_MAX_TOKENS} tokens"
        elif impl == "gather" and self.gather_bytes > GATHER_MAX_BYTES:
            row["note"] = "skipped: the gathered weights would not fit"
        else:
            lhs, rhs, pool = decode_inputs(impl, self.rng, self.experts_w, self.ids, self.dtype) \
                if _decode_row(impl) else self.gemm_inputs
            try:
                s = chain_seconds(chained(impl, self.n_iter), lhs, rhs, pool, n_iter=self.n_iter, reps=self.reps)
                read_bw, peak = self.hw.read_bandwidth, self.hw.peak_flops["bfloat16"]
                row |= {"us": s * 1e6, "tbs": nbytes / s / 1e12, "bw": 100 * nbytes / s / read_bw,
                        "tflops": flops / s / 1e12, "fl": 100 * flops / s / peak}
            except Exception as e:  # noqa: BLE001
                row["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        self.rows.append(row)
        self.done[impl] = row
        print(_fmt(row), flush=True)
        return row


    def verify(self, impl: str) -> str | None:
        """A ``fused[...]`` row's kernels against ``fused_moe_reference`` on this count's first routing: why
        not, or None where they agree."""
        experts, hidden, n = self.experts_w.shape
        _, (gate_up, down), _ = decode_inputs(impl, self.rng, self.experts_w, self.ids, self.dtype)
        ids = jnp.asarray(self.ids[0])
        h = jnp.asarray(self.rng.standard_normal((self.tokens, hidden)) * 0.1, self.dtype)
        weights = jnp.asarray(self.rng.random(ids.shape), jnp.float32)
        want = np.asarray(fused_moe.fused_moe_reference(h, ids, weights, gate_up, down, jax.nn.silu), np.float32)
        try:
            got = np.asarray(fused_moe.fused_moe(h, ids, weights, gate_up, down, jax.nn.silu, **fused_blocks(impl)),
                             np.float32)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-9))
        return None if err < 2e-2 else f"mismatch vs fused_moe_reference: max rel err {err:.3g}"


def _us(row: dict) -> float:
    return row.get("us", float("inf"))


def tune(timer: Timer, hidden: int, inter: int) -> str:
    """The coordinate search over ``TUNE_AXES`` from ``GPU_BLOCKS`` at one shape and token count; prints and
    returns its summary row (``timer.best``: the winning row)."""
    current = fused_moe.resolve_blocks(hidden, inter)
    default = best = timer(fused_name(current))       # GPU_BLOCKS: the engine's setting, checked by the tests
    for key, values in TUNE_AXES:
        for value in values:
            row = timer(fused_name(fused_moe.resolve_blocks(hidden, inter, **(current | {key: value}))))
            if _us(row) < _us(best):
                bad = timer.verify(row["impl"])      # a faster setting counts only if it computes the layer
                if bad:
                    row["note"] = bad
                    print(f"tune: {timer.shape}, {timer.tokens} tokens: {row['impl']} not taken: {bad}", flush=True)
                else:
                    best = row
        current = fused_blocks(best["impl"])
    timer.best = best
    line = _tune_row(timer.shape, str(timer.tokens), _us(timer("layer:rows")), _us(timer("layer:fused")),
                     _us(default), _us(best), best["impl"])
    print(f"tune: {line}", flush=True)
    return line


def best_across(timers: dict[int, Timer], hidden: int, inter: int) -> str:
    """Each token count's winner timed at the other counts: the one with the least µs summed over them."""
    winners = list(dict.fromkeys(t.best["impl"] for t in timers.values()))
    total = {w: sum(_us(t(w)) for t in timers.values()) for w in winners}
    best = min(winners, key=total.get)
    default = fused_name(fused_moe.resolve_blocks(hidden, inter))
    sums = [sum(_us(t(impl)) for t in timers.values()) for impl in ("layer:rows", "layer:fused", default)]
    line = _tune_row(next(iter(timers.values())).shape, "sum " + "+".join(map(str, timers)), *sums, total[best], best)
    print(f"tune: {line}", flush=True)
    return line


TUNE_HEADER = ("| shape | tokens | layer:rows µs | layer:fused µs | fused kernels at GPU_BLOCKS µs | best µs | "
               "best / GPU_BLOCKS | layer:fused with best / layer:rows | best setting |\n"
               "|---|---|---|---|---|---|---|---|---|")


def _tune_row(shape, tokens, rows_us, layer_us, default_us, best_us, best) -> str:
    """One summary row; "layer:fused with best" is layer:fused less the kernels' gain (an estimate)."""
    return (f"| {shape} | {tokens} | {rows_us:.1f} | {layer_us:.1f} | {default_us:.1f} | {best_us:.1f} | "
            f"{best_us / default_us:.2f} | {(layer_us - default_us + best_us) / rows_us:.2f} | {best} |")


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
    for impl in ragged_dot.IMPLEMENTATIONS + (moe.ROWS, moe.FUSED):
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
