"""The int4 kernel's launches, measured: sweeps ``kernels.int4_matmul_pallas.Config`` candidates at Llama-3.1-8B's
projection shapes and writes the fastest per (K, N, M, one live row) to the table the engine reads.

    python -m jaxserve.benchmarks.int4_launches --m 1,4,16 --write kernels/int4_launches.json   # on the GPU it serves
    python -m jaxserve.benchmarks.int4_launches --m 1 --configs 4                               # a short sweep, printed

Each candidate is checked against the reference before it is timed; a launch Triton cannot compile is skipped,
and said. Timing as kernel_bench's quant section (``--layers`` distinct weights per program).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import numpy as np

from .kernel_bench import INT4_GROUP, SMOKE, Bench, Sizes, _activations, _layered, _per_matmul_us, _weights


def _tune_configs(m: int, k: int, n: int) -> list:
    """The int4 kernel's launches worth trying at this size, the likeliest first: the gemv kernel (64-row
    steps give a thread 8 columns), the fma kernel at one row and the dot kernel from two, each with the
    split-K heuristic's choice and twice / half of it."""
    from jaxserve.kernels import int4_matmul_pallas as k4
    R = dataclasses.replace

    def splits(c):
        tiles = n // c.block_n * (1 if c.method != "dot" else -(-m // 16))
        auto = k4._split_k(k // k4.step_rows(c, INT4_GROUP), tiles, c.num_warps, c.unroll,
                           k4.GEMV_MIN_STEPS if c.method == "gemv" else 1)
        return [R(c, split_k=auto * 2), R(c, split_k=max(1, auto // 2))]

    gemv = k4.Config("gemv", block_n=256, block_k=64, num_warps=1)
    fma = k4.Config("fma", block_n=128, num_warps=1)
    dot = k4.Config("dot", block_n=128, num_warps=8, num_stages=3)
    gemvs = [gemv, R(gemv, block_n=128, block_k=None), R(gemv, block_n=128, block_k=32),
             R(gemv, block_n=512, num_warps=2), *splits(gemv), R(gemv, unroll=2)]
    if m == 1:
        cands = [*gemvs, fma, *splits(fma), dot]
    elif m <= k4.GEMV_MAX_ROWS:
        cands = [gemvs[0], dot, *gemvs[1:], R(dot, block_n=64, num_warps=4), *splits(dot), R(dot, unroll=2)]
    else:
        cands = [dot, R(dot, block_n=64, num_warps=4), R(dot, block_n=256), R(dot, unroll=2), R(dot, num_stages=2),
                 *splits(dot), R(dot, num_warps=4)]
    out = []
    for c in cands:
        fits = (c.split_k is None or (k // k4.step_rows(c, INT4_GROUP)) % c.split_k == 0) and n % c.block_n == 0
        if fits and c not in out:
            out.append(c)
    return out


def tune(b: Bench, ms: list[int], max_configs: int) -> list[dict]:
    """Times the int4 kernel's launches (``_tune_configs``; the gemv ones also with one live row, the engine's
    batch 1 in a bucket of more rows), each checked against the reference first; returns the best per (shape,
    M, live rows) as ``int4_launches.json`` entries."""
    import jax
    import jax.numpy as jnp

    from jaxserve.kernels import int4_matmul_pallas as k4
    S = b.S
    b.emit("\n## int4 launch sweep\n| shape | M | live rows | us | speed-up over bf16 | launch |\n|---|---|---|---|---|---|")
    best = []
    for name, k, n in S.projections:
        w = _weights(k, n, S.layers)
        packed = [(q.packed, q.scales, q.zeros) for q in w["int4"]]
        for m in ms:
            xs = _activations(m, k, S.layers)
            t_bf16 = _per_matmul_us(_layered(lambda x, w: x @ w), (xs, w["bf16"]), S.layers)
            want = np.asarray(k4.int4_matmul_reference(xs[0], *packed[0], INT4_GROUP), np.float32)
            found = {None: [], 1: []}
            for cfg in _tune_configs(m, k, n)[:max_configs]:
                for live in ([None, 1] if cfg.method == "gemv" and m > 1 else [None]):
                    lv = None if live is None else jnp.int32(live)
                    fn = _layered(lambda x, p, c=cfg, lv=lv: k4.int4_matmul(
                        x, *p, group_size=INT4_GROUP, config=c, live_rows=lv, interpret=S.interpret))
                    try:
                        got = np.asarray(fn(xs, packed)[0], np.float32)
                        us = _per_matmul_us(fn, (xs, packed), S.layers)
                    except Exception as e:  # noqa: BLE001  (a launch Triton cannot compile is skipped, and said)
                        b.emit(f"| {name} | {m} | {live or m} | skip | | {cfg}: {type(e).__name__} |")
                        continue
                    rows = live or m
                    err = np.abs(got[:rows] - want[:rows]).max() / (np.abs(want).max() + 1e-9)
                    if err > 0.02 or (rows < m and np.abs(got[rows:]).max() > 0):
                        b.emit(f"| {name} | {m} | {rows} | MISMATCH {err:.3g} | | {cfg} |")
                        continue
                    found[live].append((us, cfg))
                    b.emit(f"| {name} | {m} | {rows} | {us:.1f} | {t_bf16 / us:.2f}x | {cfg} |")
            if m > 1:       # a launch without the live-row loop costs its all-rows time at one live row too
                found[1] += [r for r in found[None] if r[1].method != "gemv"]
            for live, rs in found.items():
                if rs and (live is None or m > 1):
                    us, cfg = min(rs, key=lambda r: r[0])
                    b.emit(f"| **{name}** | **{m}** | **{live or m}** | **{us:.1f}** | **{t_bf16 / us:.2f}x** | best |")
                    best.append({"key": k4.launch_key(k, n, m, live == 1), "us": round(us, 2),
                                 "config": dataclasses.asdict(cfg)})
        del w
    return best


def write_launches(path: str, entries: list[dict]) -> None:
    """The tuned launches the engine reads (``kernels.int4_matmul_pallas.LAUNCHES_FILE``), merged into the
    file's entries for other shapes."""
    import jax
    file = pathlib.Path(path)
    old = json.loads(file.read_text())["launches"] if file.exists() else []
    keys = {e["key"] for e in entries}
    doc = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "group_size": INT4_GROUP,
           "launches": sorted([e for e in old if e["key"] not in keys] + entries, key=lambda e: e["key"])}
    file.write_text(json.dumps(doc, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxserve.benchmarks.int4_launches", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,4,16", help="token counts to tune")
    ap.add_argument("--configs", type=int, default=12, help="launches tried per shape and M")
    ap.add_argument("--write", default=None, metavar="FILE", help="merge the best launches into FILE "
                                                                   "(the engine reads kernels/int4_launches.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (the kernel interpreted)")
    ap.add_argument("--hardware", default="auto")
    a = ap.parse_args(argv)
    b = Bench(SMOKE if a.smoke else Sizes(), a.hardware)
    best = tune(b, [int(v) for v in a.m.split(",")], a.configs)
    if a.write:
        write_launches(a.write, best)
        b.emit(f"wrote {len(best)} launches to {a.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
