"""Quantized projection matmuls vs bf16 at Llama-3.1-8B's shapes: the int4 W4A16 Pallas kernel, the int4
dequantize-then-dot path, FP8 W8A8 (XLA's fp8 dot) and the bf16 dot, at decode (M = 1, 4, 16) and prefill
(M = 256, 2048) sizes. Prints one markdown table: microseconds per call, the weight-read rate in TB/s and its
share of the read ceiling (configs/hardware/h200.yaml), and the speed-up over bf16; ``--tune`` first sweeps
the int4 kernel's block_n / split_k / warps / stages at M = 1 (decode) and reports the best per shape.

    python -m benchmarks.diagnostics.quant_matmul_bench [--tune] [--out FILE]
"""
from __future__ import annotations

import argparse
import itertools
import sys

import jax
import jax.numpy as jnp

from benchmarks.diagnostics.timing import back_to_back_seconds
from jaxserve.kernels import int4_matmul_pallas as k4
from jaxserve.quantization import online
from jaxserve.quantization.weights import _fp8_matmul

READ_CEILING = 4.60e12          # configs/hardware/h200.yaml read_bandwidth
# (name, K, N) of one Llama-3.1-8B layer's projections (gate_up fused: N = 2 x 14336)
SHAPES = [("q/o", 4096, 4096), ("k/v", 4096, 1024), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
M_SIZES = (1, 4, 16, 256, 2048)
GROUP = 128


def time_us(fn, *args, iters: int = 50) -> float:
    """Microseconds per call: the best of 5 repeats of ``iters`` back-to-back calls."""
    return min(back_to_back_seconds(fn, *args, iters=iters, repeats=5)) * 1e6


def weights(k: int, n: int):
    w = jax.random.normal(jax.random.key(0), (k, n), jnp.bfloat16) * 0.02
    return w, online.quantize_int4(w, GROUP, jnp.bfloat16), online.quantize_fp8_per_channel(w)


def tune(k: int, n: int, q4) -> dict:
    """The fastest int4 kernel options at M = 1 for this shape (36 compiles)."""
    best = {}
    for m in (1,):
        x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
        results = []
        for bn, split, warps, stages in itertools.product((32, 64, 128), (None, 2, 8), (2, 4), (2, 4)):
            if n % bn or (split and (k // 128) % split):
                continue
            fn = jax.jit(lambda x, p, s, z, bn=bn, split=split, warps=warps, stages=stages: k4.int4_matmul(
                x, p, s, z, group_size=GROUP, block_n=bn, split_k=split, num_warps=warps, num_stages=stages))
            try:
                results.append((time_us(fn, x, q4.packed, q4.scales, q4.zeros, iters=20), bn, split, warps, stages))
            except Exception as e:  # noqa: BLE001  (a config Triton cannot compile is skipped, and said)
                print(f"skip bn={bn} split={split} warps={warps} stages={stages}: {type(e).__name__}", file=sys.stderr)
        best[m] = min(results)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    a = ap.parse_args(argv)
    lines = [f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", ""]
    if a.tune:
        lines += ["| shape | M | best us | block_n | split_k | warps | stages |", "|---|---|---|---|---|---|---|"]
        for name, k, n in SHAPES:
            _, q4, _ = weights(k, n)
            for m, (us, bn, split, warps, stages) in tune(k, n, q4).items():
                lines.append(f"| {name} {k}x{n} | {m} | {us:.1f} | {bn} | {split} | {warps} | {stages} |")
            print("\n".join(lines), flush=True)
        lines.append("")
    lines += ["| shape | M | bf16 us | int4 kernel us | int4 TB/s (% read) | int4 dequant+dot us | fp8 us | "
              "fp8 TB/s (% read) | int4 / fp8 speed-up |", "|---|---|---|---|---|---|---|---|---|"]
    bf16_dot = jax.jit(lambda x, w: x @ w)
    kernel = jax.jit(lambda x, p, s, z: k4.int4_matmul(x, p, s, z, group_size=GROUP))
    dequant = jax.jit(lambda x, p, s, z: k4.int4_matmul_reference(x, p, s, z, GROUP))
    fp8 = jax.jit(lambda x, w: _fp8_matmul(x, w, w.weight.shape[0]))
    for name, k, n in SHAPES:
        w, q4, q8 = weights(k, n)
        int4_bytes = q4.packed.nbytes + q4.scales.nbytes + q4.zeros.nbytes
        fp8_bytes = q8.weight.nbytes + q8.scale.nbytes
        for m in M_SIZES:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            t_bf16 = time_us(bf16_dot, x, w)
            t_k = time_us(kernel, x, q4.packed, q4.scales, q4.zeros)
            t_d = time_us(dequant, x, q4.packed, q4.scales, q4.zeros)
            t_8 = time_us(fp8, x, q8)
            err = float(jnp.max(jnp.abs(kernel(x, q4.packed, q4.scales, q4.zeros).astype(jnp.float32)
                                        - dequant(x, q4.packed, q4.scales, q4.zeros).astype(jnp.float32))))
            rate4, rate8 = int4_bytes / t_k / 1e6, fp8_bytes / t_8 / 1e6
            lines.append(f"| {name} {k}x{n} | {m} | {t_bf16:.1f} | {t_k:.1f} | {rate4:.2f} "
                         f"({100 * rate4 / READ_CEILING * 1e12:.0f} %) | {t_d:.1f} | {t_8:.1f} | {rate8:.2f} "
                         f"({100 * rate8 / READ_CEILING * 1e12:.0f} %) | {t_bf16 / t_k:.2f}x / {t_bf16 / t_8:.2f}x |"
                         + ("" if err < 0.05 else f" MISMATCH {err:.3g}"))
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
