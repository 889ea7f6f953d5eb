"""The MoE layers' fused rows kernel (``kernels/ragged_dot.py`` ``expert_rows_matmul_fused``) at decode sizes
under several launches side by side, in one process: us per call and % of the read ceiling for the gate/up
(gated) and the down product of real MoE shapes, each launch first checked against the default one on the same
inputs.

    python -m jaxserve.benchmarks.moe_rows_launch --tokens 4 --valid 1
    python -m jaxserve.benchmarks.moe_rows_launch --launches 64/128/4/3,32/128/4/3 --shapes deepseek-v2-lite

A launch is ``BLOCK_N/BLOCK_K/WARPS/STAGES`` (``ragged_dot.rows_launch``: the blocks are bounds, shrunk to divide
the shape). ``--tokens`` is the step's bucket and ``--valid`` how many of them are real requests (the others are
padding, routed to no expert, as the engine pads a batch-1 step to its bucket). Timing: a jitted chain of calls,
each over the next of a pool of random routings (so consecutive calls read other experts, as consecutive layers
do), the launches interleaved over ``--rounds`` rounds and the best round kept. Bytes read: the distinct experts'
weights a call touches.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import numpy as np

from .kernel_bench import Bench, Sizes, _moe_chain, chain_seconds

# name: (experts, top_k, hidden, moe_intermediate)
SHAPES = {"deepseek-v2-lite": (64, 6, 2048, 1408), "qwen3-30b-a3b": (128, 8, 2048, 768),
          "deepseek-v3": (256, 8, 7168, 2048), "tiny": (8, 2, 256, 128)}
MAX_POOL_BYTES = 4 << 30        # experts kept in device memory per product (enough to defeat the L2)
GRID = [f"{n}/{k}/{w}/{s}" for n, k, (w, s) in itertools.product((32, 64, 128), (64, 128, 256), ((4, 3), (8, 4)))]


def parse_launches(text: str) -> list[tuple[int, int, int, int]]:
    """``"64/128/4/3,32/64/8/3"`` -> ``[(64, 128, 4, 3), (32, 64, 8, 3)]``; ``grid``: a standard sweep."""
    from jaxserve.kernels import ragged_dot
    specs = GRID if text == "grid" else [s.strip() for s in text.split(",") if s.strip()]
    return [ragged_dot.parse_rows_launch(spec) for spec in specs]


def _routings(experts: int, top_k: int, tokens: int, valid: int, pool: int, rng) -> np.ndarray:
    """``[pool, tokens * top_k]`` int32 row experts: each valid token's distinct top_k, padding tokens' ``experts``."""
    ids = np.full((pool, tokens, top_k), experts, np.int32)
    for p in range(pool):
        ids[p, :valid] = np.argsort(rng.random((valid, experts)), axis=1)[:, :top_k]
    return ids.reshape(pool, -1)


def products(shape: str, tokens: int, valid: int, pool: int, rng) -> list[tuple]:
    """``(label, lhs, weights, routings, per_lhs, activation, bytes a call reads)`` of the shape's two products."""
    import jax
    import jax.numpy as jnp
    experts, top_k, hidden, inter = SHAPES[shape]
    out = []
    for label, k, n, per, act in (("gate/up", hidden, 2 * inter, top_k, jax.nn.silu), ("down", inter, hidden, 1, None)):
        held = max(top_k, min(experts, MAX_POOL_BYTES // (k * n * 2)))        # experts in memory
        w = jax.random.normal(jax.random.key(0), (held, k, n), jnp.bfloat16) * 0.02
        routings = _routings(held, top_k, tokens, valid, pool, rng)
        rows = tokens * top_k
        lhs = jnp.asarray(rng.standard_normal((rows // per + (per == 1), k)) * 0.1, jnp.bfloat16)
        out.append((f"{shape} {label}", lhs, w, jnp.asarray(routings), per, act, valid * top_k * k * n * 2))
    return out


def launch_table(b: Bench, shapes: list[str], launches: list[tuple], tokens: int, valid: int, rounds: int,
                 n_iter: int = 50, pool: int = 16) -> dict[str, tuple]:
    """Print each product's table; return its fastest launch by label."""
    from jaxserve.kernels import ragged_dot
    rng = np.random.default_rng(0)
    b.emit(f"\n## MoE fused rows kernel, {tokens}-token step ({valid} real), launch BLOCK_N/BLOCK_K/WARPS/STAGES "
           f"(default {'/'.join(map(str, ragged_dot.ROWS_LAUNCH_GATED))} gate/up, "
           f"{'/'.join(map(str, ragged_dot.ROWS_LAUNCH))} down)\n")
    fastest = {}
    for shape in shapes:
        for label, lhs, w, routings, per, act, nbytes in products(shape, tokens, valid, pool, rng):
            def call(x, w, r, launch=None, per=per, act=act):
                return ragged_dot.expert_rows_matmul_fused(x, w, r, tokens, rows_per_lhs_row=per, activation=act,
                                                           launch=launch)
            want = np.asarray(call(lhs, w, routings[0]), np.float32)
            best: dict = {}
            chains: dict = {}
            for _ in range(rounds):
                for launch in launches:
                    if isinstance(best.get(launch), str):
                        continue
                    try:
                        if launch not in chains:
                            got = np.asarray(call(lhs, w, routings[0], launch), np.float32)
                            err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-9))
                            if err > 2e-2:
                                raise AssertionError(f"differs from the default launch by {err:.3g}")
                            chains[launch] = _moe_chain(lambda x, w, r, launch=launch: call(x, w, r, launch),
                                                        n_iter, pool)
                        s = chain_seconds(chains[launch], lhs, w, routings, n_iter=n_iter, reps=5)
                    except Exception as e:  # noqa: BLE001  (a launch that fails to compile is said, not fatal)
                        best[launch] = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
                        continue
                    best[launch] = min(s, best.get(launch, s))
            b.emit(f"### {label}: {nbytes / 1e6:.1f} MB a call\n\n| launch | us | TB/s | % read |\n|---|---|---|---|")
            timed = sorted((v, k) for k, v in best.items() if not isinstance(v, str))
            for s, launch in timed:
                b.emit(f"| {'/'.join(map(str, launch))} | {s * 1e6:.1f} | {nbytes / s / 1e12:.2f} | "
                       f"{b.read_pct(nbytes / s):.0f} |")
            for launch, v in best.items():
                if isinstance(v, str):
                    b.emit(f"| {'/'.join(map(str, launch))} | {v} | | |")
            b.emit()
            if timed:
                fastest[label] = timed[0][1]
    return fastest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxserve.benchmarks.moe_rows_launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="deepseek-v2-lite,qwen3-30b-a3b", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--launches", default="grid", help="BLOCK_N/BLOCK_K/WARPS/STAGES,... or grid")
    ap.add_argument("--tokens", type=int, default=4, help="the step's token bucket (at most 16)")
    ap.add_argument("--valid", type=int, default=1, help="real tokens among them")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--hardware", default="auto")
    a = ap.parse_args(argv)
    from jaxserve.kernels import ragged_dot
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not 1 <= a.valid <= a.tokens <= 16:
        ap.error(f"shapes {unknown} not among {', '.join(SHAPES)}, or not 1 <= valid <= tokens <= 16")
    launches = parse_launches(a.launches)
    for default in (ragged_dot.ROWS_LAUNCH, ragged_dot.ROWS_LAUNCH_GATED):
        if default not in launches:
            launches.insert(0, default)
    fastest = launch_table(Bench(Sizes(), a.hardware), shapes, launches, a.tokens, a.valid, a.rounds)
    for label, launch in fastest.items():
        print(f"fastest {label.replace(' ', ':')} {'/'.join(map(str, launch))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
