"""The int4 CUDA GEMV's variants (``kernels/quant_gemv.py`` ``VARIANTS``) side by side, in one process: us per
call and % of the read ceiling at Llama-3.1-8B's projection shapes, each variant first checked against the
default one ("v1") on the same inputs; ``--fp8-splits`` times the fp8 W8A16 GEMV (``fp8_gemv``, channel scales) at
those K splits (0: its default launch) the same way.

    python -m jaxserve.benchmarks.int4_gemv_variants --variants v1,occ3,occ4,v1@2 --m 1,4,16
    python -m jaxserve.benchmarks.int4_gemv_variants --variants none --fp8-splits 0,1,2,4 --m 1,16

A variant may name its K splits after ``@`` (``v1@2``) and the steps a warp loads at once after ``/`` (``v1/8``);
without, the variant's default launch. Timing as
kernel_bench's quant section (``--layers`` distinct weights per program, no L2 repeat), the variants
interleaved over ``--rounds`` rounds and the best round kept. Bytes read: packed weights, scales and zero points.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from .kernel_bench import INT4_GROUP, LLAMA8B_PROJECTIONS, Bench, Sizes, _activations, _layered, call_seconds


def _random_weights(quantize, k: int, n: int, layers: int) -> list:
    """``layers`` random ``[k, n]`` weights in ``quantize``'s storage (an ``online`` quantizer)."""
    import jax
    import jax.numpy as jnp
    quant = jax.jit(quantize)
    return [quant(jax.random.normal(jax.random.key(layer), (k, n), jnp.bfloat16) * 0.02) for layer in range(layers)]


def _int4_weights(k: int, n: int, layers: int) -> list:
    import jax.numpy as jnp

    from jaxserve.quantization import online
    return _random_weights(lambda w: online.quantize_int4(w, INT4_GROUP, jnp.bfloat16), k, n, layers)


def parse_variants(text: str) -> list[tuple[str, int | None, int | None]]:
    """``"v1,occ3@2,v1/8"`` -> ``[("v1", None, None), ("occ3", 2, None), ("v1", None, 8)]``: name, K splits,
    steps a warp loads at once (None: the default launch's); unknown names raise ValueError."""
    from jaxserve.kernels import quant_gemv
    out = []
    for spec in (s.strip() for s in text.split(",") if s.strip() and s.strip() != "none"):
        spec, _, chunk = spec.partition("/")
        name, _, splits = spec.partition("@")
        if name not in quant_gemv.VARIANTS:
            raise ValueError(f"--variants: {name!r} not among {', '.join(quant_gemv.VARIANTS)}")
        if chunk and int(chunk) not in quant_gemv.CHUNKS:
            raise ValueError(f"--variants: chunk {chunk} not among {quant_gemv.CHUNKS}")
        out.append((name, int(splits) if splits else None, int(chunk) if chunk else None))
    return out


def variants_table(b: Bench, variants: list[tuple[str, int | None, int | None]], rounds: int) -> None:
    from jaxserve.kernels import quant_gemv
    from jaxserve.parallel.collectives import kernel_toolchain
    quant_gemv.load(kernel_toolchain())
    labels = [v + (f"@{s}" if s else "") + (f"/{c}" if c else "") for v, s, c in variants]
    b.emit(f"\n## int4 CUDA GEMV variants, {b.S.layers} weights per program, best of {rounds} interleaved rounds; "
           "us per call (% of the read ceiling); err: max |y - y_v1| / max |y_v1|\n"
           f"| shape | M | {' | '.join(labels)} | max err |\n|---|---|{'---|' * len(labels)}---|")

    def gemv(x, w, v="v1", s=None, c=None):
        return quant_gemv.int4_gemv(x, w.packed, w.scales, w.zeros, group_size=w.group_size, splits=s, chunk=c,
                                    variant=v)
    _timed_table(b, labels, _int4_weights, lambda: [_layered(lambda x, w, v=v, s=s, c=c: gemv(x, w, v, s, c))
                                                    for v, s, c in variants],
                 gemv, rounds, lambda w: sum(a.nbytes for a in (w.packed, w.scales, w.zeros)))


def _timed_table(b: Bench, labels: list[str], weights, make_fns, ref_fn, rounds: int, nbytes_of) -> None:
    """One row per shape and M: each of ``make_fns(ws)``'s programs timed interleaved over ``rounds`` rounds
    (best kept), us per call and % of the read ceiling, and the largest difference from ``ref_fn``."""
    import jax
    S = b.S
    for name, k, n in S.projections:
        ws = weights(k, n, S.layers)
        nbytes = nbytes_of(ws[0])
        for m in S.quant_m:
            xs = _activations(m, k, S.layers)
            fns = make_fns()
            ref = np.asarray(ref_fn(xs[0], ws[0]), np.float32)
            err = max(float(np.max(np.abs(np.asarray(f(xs[:1], ws[:1])[0], np.float32) - ref)))
                      for f in fns) / max(float(np.max(np.abs(ref))), 1e-30)
            best = [float("inf")] * len(fns)
            for _ in range(rounds):
                for i, f in enumerate(fns):
                    best[i] = min(best[i], min(call_seconds(f, xs, ws, calls=10, repeats=1)) / S.layers * 1e6)
            cells = [f"{us:.1f} ({b.read_pct(nbytes / us * 1e6):.0f})" for us in best]
            b.emit(f"| {name} {k}x{n} | {m} | {' | '.join(cells)} | {err:.1e} |")
            b.rows.append((f"{name} {k}x{n} M={m}", ", ".join(f"{lab} {us:.1f} us" for lab, us in zip(labels, best))))
            jax.clear_caches()
        del ws


def fp8_table(b: Bench, splits: list[int], rounds: int) -> None:
    """The fp8 W8A16 GEMV (channel scales) at each of ``splits`` (0: ``default_fp8_splits``)."""
    from jaxserve.kernels import quant_gemv
    from jaxserve.parallel.collectives import kernel_toolchain
    from jaxserve.quantization import online
    quant_gemv.load(kernel_toolchain())
    labels = [f"fp8@{s}" if s else "fp8" for s in splits]
    b.emit(f"\n## fp8 W8A16 CUDA GEMV by K splits, {b.S.layers} weights per program, best of {rounds} interleaved "
           "rounds; us per call (% of the read ceiling); err: max |y - y_default| / max |y_default|\n"
           f"| shape | M | {' | '.join(labels)} | max err |\n|---|---|{'---|' * len(labels)}---|")
    def weights(k, n, layers):
        return _random_weights(online.quantize_fp8_per_channel, k, n, layers)

    def gemv(x, w, s=None):
        return quant_gemv.fp8_gemv(x, w.weight, w.scale, splits=s or None)
    _timed_table(b, labels, weights, lambda: [_layered(lambda x, w, s=s: gemv(x, w, s)) for s in splits],
                 gemv, rounds, lambda w: w.weight.nbytes + w.scale.nbytes)


def main(argv: list[str] | None = None) -> int:
    from jaxserve.kernels import quant_gemv
    ap = argparse.ArgumentParser(prog="python -m jaxserve.benchmarks.int4_gemv_variants", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(quant_gemv.VARIANTS), help="comma list, NAME or NAME@SPLITS")
    ap.add_argument("--m", default="1,4,16", help="token counts")
    ap.add_argument("--layers", type=int, default=Sizes.layers, help="distinct weights per program")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fp8-splits", default="", help="comma list of K splits for the fp8 GEMV table (0: default)")
    ap.add_argument("--hardware", default="auto", help="ceilings from configs/hardware (auto: the device's kind)")
    ap.add_argument("--shapes", default=None, help="comma list of projection names (default all: "
                                                   f"{', '.join(p[0] for p in LLAMA8B_PROJECTIONS)})")
    a = ap.parse_args(argv)
    try:
        variants = parse_variants(a.variants)
    except ValueError as e:
        ap.error(str(e))
    shapes = tuple(p for p in LLAMA8B_PROJECTIONS if a.shapes is None or p[0] in a.shapes.split(","))
    sizes = dataclasses.replace(Sizes(), projections=shapes, layers=a.layers,
                                quant_m=tuple(int(v) for v in a.m.split(",") if v))
    b = Bench(sizes, a.hardware)
    if variants:
        variants_table(b, variants, a.rounds)
    if a.fp8_splits:
        fp8_table(b, [int(v) for v in a.fp8_splits.split(",") if v], a.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
