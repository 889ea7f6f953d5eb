"""Can a Pallas (Triton) weight-streaming GEMM beat XLA's ``x @ W`` on the decode GEMMs of Llama-3.1-8B?

    python benchmarks/gemv_probe.py [--tp 1 2] [--tokens 1 16] [--reps 10] [--smoke]

Why: at TP=2 XLA streams a decode step's weights at 3.7 TB/s per GPU, at TP=1 at 4.2 (gemm_probe.py's
docstring; per GPU at TP=2: qkv 4096x3072, o 2048x4096, gate_up 4096x14336, down 7168x4096). This probe
times ``gemv`` below (column blocks x K splits, f32 accumulation, bf16 out) in a small grid of tile
configurations against XLA's ``x @ W`` on the same data.

Answer (H200, 2026-11-30, benchmarks/results/2026-11-30-h200-seventh-session.md): at M=16, the engine's
smallest token bucket then and so its batch-1 step (8 since the eleventh session, 4 since the twelfth), the best Pallas configuration is 0.88-1.15x XLA's time per
GEMM kind at TP=2 (0.83-0.98x at TP=1): no GEMM choice gives the TP=2 decode the ~1 ms it lacks, and the
engine keeps XLA's GEMMs. XLA picks badly at M=1 for the TP=2 ``o`` GEMM (31.3 us, Pallas 12.8), and the Pallas
kernel is 0.94x XLA over a TP=1 M=16 layer. Caveats: this harness's XLA times differ from gemm_probe's by up to
20 % on the same shapes, and the best of 10 Pallas configurations is set against one XLA measurement.

Per TP degree, token count M and GEMM kind, each candidate runs as gemm_probe's ``alone``: one jit over 32
distinct weights (so they stream from HBM, not L2), each GEMM's bf16 result kept behind an
``optimization_barrier`` (so a split-K kernel's XLA reduction runs as its own kernel, as it would in the
model, instead of fusing into the probe's accumulation). Each Pallas configuration is first checked against
``x @ W`` in f32 (max |err| / max |ref| <= 1e-2) on the first weight; failures and compile errors are
printed and skipped. TB/s = weight bytes / time, against the 4.3 TB/s copy ceiling.
``--smoke``: CPU, interpret mode, 1/16 of the shapes, 2 weights, 2 configurations (its timings mean nothing).
"""
from __future__ import annotations

import argparse
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from benchmarks.gemm_probe import CEIL_TBS, LAYERS, shapes  # noqa: E402
from benchmarks.kernels_bench import timed  # noqa: E402

M_TILE = 16  # rows of every dot: tl.dot needs M >= 16


def _kernel(x_ref, w_ref, o_ref, *, m, block_n, block_k, steps):
    j, s = pl.program_id(0), pl.program_id(1)
    n0 = pl.multiple_of(j * block_n, block_n)
    real = (lax.iota(jnp.int32, M_TILE) < m)[:, None]
    x_ok = None if m == M_TILE else jnp.broadcast_to(real, (M_TILE, block_k))

    def body(i, acc):
        k0 = pl.multiple_of((s * steps + i) * block_k, block_k)
        xb = plgpu.load(x_ref.at[pl.ds(0, M_TILE), pl.ds(k0, block_k)], mask=x_ok,
                        other=None if x_ok is None else 0)
        wb = plgpu.load(w_ref.at[pl.ds(k0, block_k), pl.ds(n0, block_n)])
        return acc + plgpu.dot(xb, wb, allow_tf32=False)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((M_TILE, block_n), jnp.float32))
    idx = (pl.ds(0, M_TILE), pl.ds(n0, block_n))
    if len(o_ref.shape) == 3:                      # split_k > 1: this split's f32 partial
        idx = (s,) + idx
    o_ok = None if m == M_TILE else jnp.broadcast_to(real, (M_TILE, block_n))
    plgpu.store(o_ref.at[idx], acc.astype(o_ref.dtype), mask=o_ok)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "split_k", "num_warps", "num_stages",
                                             "interpret"))
def gemv(x, w, *, block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int,
         interpret: bool = False):
    """``x @ w`` in x's dtype (f32 accumulation) for ``x [M, K]``, M <= 16, ``w [K, N]``."""
    m, k = x.shape
    n = w.shape[1]
    assert m <= M_TILE and w.shape[0] == k, (x.shape, w.shape)
    assert n % block_n == 0 and k % (split_k * block_k) == 0, (k, n, block_n, block_k, split_k)
    out_shape = (jax.ShapeDtypeStruct((m, n), x.dtype) if split_k == 1
                 else jax.ShapeDtypeStruct((split_k, m, n), jnp.float32))
    out = pl.pallas_call(
        functools.partial(_kernel, m=m, block_n=block_n, block_k=block_k, steps=k // (split_k * block_k)),
        grid=(n // block_n, split_k), out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="gemv")(x, w)
    return out if split_k == 1 else out.sum(axis=0).astype(x.dtype)


NUM_SMS = 132
TOL = 1e-2
# (block_n, block_k, num_stages); shared memory per stage is (block_k * block_n + 16 * block_k) * 2 bytes,
# <= 216 KiB here. split_k is picked per shape (split_configs).
TILES = [(64, 128, 4), (64, 128, 5), (64, 256, 3), (64, 256, 4), (64, 256, 5),
         (128, 128, 3), (128, 128, 4), (128, 128, 5), (128, 256, 3), (256, 128, 3)]
SMOKE_CONFIGS = [dict(block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=3),
                 dict(block_n=32, block_k=32, split_k=2, num_warps=4, num_stages=3)]


def split_configs(k: int, n: int) -> list[dict]:
    """One config per tile: the smallest split_k in (1, 2, 4, 8) giving >= NUM_SMS programs (else the
    largest that divides), each split at least 2 K-steps."""
    out = []
    for bn, bk, stages in TILES:
        ok = [s for s in (1, 2, 4, 8) if n % bn == 0 and k % (s * bk) == 0 and k // (s * bk) >= 2]
        if ok:
            s = next((s for s in ok if n // bn * s >= NUM_SMS), ok[-1])
            out.append(dict(block_n=bn, block_k=bk, split_k=s, num_warps=4, num_stages=stages))
    return out


def cfg_name(c: dict) -> str:
    return f"bn{c['block_n']} bk{c['block_k']} sk{c['split_k']} w{c['num_warps']} s{c['num_stages']}"


def alone(mm):
    """jit(x, ws) -> (sum of mm(x, w) over ws in f32, mm(x, ws[0])): independent GEMMs in order."""
    def f(x, ws):
        ys = [lax.optimization_barrier(mm(x, w)) for w in ws]
        acc = jnp.zeros(ys[0].shape, jnp.float32)
        for y in ys:
            acc = acc + y.astype(jnp.float32)
        return acc, ys[0]
    return jax.jit(f)


def probe(tp: int, m: int, kind: str, x, ws, a) -> dict:
    """XLA's time and the best passing Pallas configuration's for one GEMM kind; logs every config."""
    k, n = ws[0].shape
    per_call = lambda t: t / len(ws)                                             # noqa: E731
    tbs = lambda t: k * n * 2 / t / 1e12                                          # noqa: E731
    ref = np.asarray(jnp.matmul(x.astype(jnp.float32), ws[0].astype(jnp.float32), precision=lax.Precision.HIGHEST))
    t_xla = per_call(timed(alone(lambda x, w: x @ w), x, ws, n_iter=1, reps=a.reps))
    row = dict(tp=tp, m=m, kind=kind, xla=t_xla, best=None, cfg="-")
    print(f"tp={tp} M={m} {kind} {k}x{n}: XLA {t_xla * 1e6:.1f} us {tbs(t_xla):.2f} TB/s", flush=True)
    for c in SMOKE_CONFIGS if a.smoke else split_configs(k, n):
        try:
            fn = alone(lambda x, w, c=c: gemv(x, w, interpret=a.smoke, **c))
            y0 = np.asarray(fn(x, ws)[1], np.float32)
            err = float(np.abs(y0 - ref).max() / np.abs(ref).max())
            if not err <= TOL:
                print(f"  {cfg_name(c)}: FAIL max rel err {err:.2e}", flush=True)
                continue
            t = per_call(timed(fn, x, ws, n_iter=1, reps=a.reps))
        except Exception as e:                                                    # noqa: BLE001
            print(f"  {cfg_name(c)}: ERROR {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}", flush=True)
            continue
        print(f"  {cfg_name(c)}: {t * 1e6:.1f} us {tbs(t):.2f} TB/s (err {err:.1e})", flush=True)
        if row["best"] is None or t < row["best"]:
            row.update(best=t, cfg=cfg_name(c))
    row["tbs_xla"], row["tbs_best"] = tbs(t_xla), row["best"] and tbs(row["best"])
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP degrees whose per-GPU shapes to time")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16], help="M, at most 16")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="CPU: interpret mode, 1/16 shapes, correctness only")
    a = p.parse_args(argv)
    scale, layers = (16, 2) if a.smoke else (1, LAYERS)
    if a.smoke:
        a.reps = 1
    key = jax.random.key(0)
    rows = []
    for tp in a.tp:
        for n_kind, (kind, (k, n)) in enumerate(shapes(tp, scale).items()):
            ws = [jax.random.normal(jax.random.fold_in(key, 100 * n_kind + j), (k, n), jnp.bfloat16) * 0.01
                  for j in range(layers)]
            for m in a.tokens:
                x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.bfloat16)
                rows.append(probe(tp, m, kind, x, ws, a))
            del ws
    order = {k: i for i, k in enumerate(shapes(1))}
    rows.sort(key=lambda r: (r["tp"], r["m"], order[r["kind"]]))
    print("\n| TP | M | gemm | XLA us (TB/s) | best Pallas us (TB/s) | Pallas / XLA time | best config |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        best = "all failed" if r["best"] is None else f"{r['best'] * 1e6:.1f} ({r['tbs_best']:.2f})"
        ratio = "-" if r["best"] is None else f"{r['best'] / r['xla']:.2f}"
        print(f"| {r['tp']} | {r['m']} | {r['kind']} | {r['xla'] * 1e6:.1f} ({r['tbs_xla']:.2f}) | {best} | {ratio} "
              f"| {r['cfg']} |")
    print(f"(TB/s: weight bytes per second; copy ceiling {CEIL_TBS} TB/s)")
    return 0 if all(r["best"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
