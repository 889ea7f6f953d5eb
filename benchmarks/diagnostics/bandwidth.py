"""The device's memory ceilings, measured through JAX: read-only streaming and copy (read + write).

    python benchmarks/diagnostics/bandwidth.py                 # one GPU, ~20 s: 4 GiB bf16 arrays
    python benchmarks/diagnostics/bandwidth.py --gib 0.05      # small, e.g. on CPU (checks the script)

A decode step streams the weights and the KV cache and writes almost nothing, so its roofline needs the
read-only ceiling: a jitted sum over a large bf16 array (float32 accumulation; the output is a few MB at most)
in two layouts (reduce along rows and along columns, XLA emits a different reduction kernel for each), the
better layout's median counts. A copy moves every byte twice: ``-x`` (an elementwise kernel XLA cannot elide)
counts read + write bytes. Timing: ``--iters`` calls dispatched back to back, one ``block_until_ready`` after
the last (so launch gaps hide behind the previous call), ``--repeats`` times; the median repeat counts.
Prints both in TB/s and the lines for configs/hardware/<chip>.yaml.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # as a script


def bytes_moved(nbytes: int, kind: str) -> int:
    """Bytes one call moves: a read-only reduction reads the array once; a copy reads and writes it."""
    return {"read": nbytes, "copy": 2 * nbytes}[kind]


def measure(gib: float, iters: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from benchmarks.diagnostics.timing import back_to_back_seconds

    cols = 8192
    rows = max(int(gib * 2 ** 30) // (2 * cols), 1)
    x = jnp.ones((rows, cols), jnp.bfloat16)
    nbytes = x.size * x.dtype.itemsize
    kernels = {
        "read (sum along rows)": (jax.jit(lambda a: jnp.sum(a, axis=1, dtype=jnp.float32)), "read"),
        "read (sum along columns)": (jax.jit(lambda a: jnp.sum(a, axis=0, dtype=jnp.float32)), "read"),
        "copy (-x)": (jax.jit(lambda a: -a), "copy"),
    }
    results = {}
    for name, (fn, kind) in kernels.items():
        per_call = back_to_back_seconds(fn, x, iters=iters, repeats=repeats)
        tbps = [bytes_moved(nbytes, kind) / t / 1e12 for t in per_call]
        results[name] = {"kind": kind, "median_tbps": statistics.median(tbps), "min_tbps": min(tbps),
                         "max_tbps": max(tbps), "us_per_call": statistics.median(per_call) * 1e6}
    read = max(r["median_tbps"] for r in results.values() if r["kind"] == "read")
    copy = results["copy (-x)"]["median_tbps"]
    return {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "array_bytes": nbytes,
            "iters": iters, "repeats": repeats, "kernels": results, "read_tbps": read, "copy_tbps": copy}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="array size in GiB (default 4: far past the 60 MB L2)")
    ap.add_argument("--iters", type=int, default=40, help="calls per timed repeat")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    r = measure(a.gib, a.iters, a.repeats)
    print(f"# bandwidth: {r['device']}, jax {r['jax']}, {r['array_bytes'] / 2 ** 30:.2f} GiB bf16, "
          f"{a.iters} calls x {a.repeats} repeats")
    print("| kernel | us per call | TB/s median | min | max |")
    print("|---|---|---|---|---|")
    for name, k in r["kernels"].items():
        print(f"| {name} | {k['us_per_call']:.1f} | {k['median_tbps']:.3f} | {k['min_tbps']:.3f} | {k['max_tbps']:.3f} |")
    print(f"\nread_bandwidth: {r['read_tbps']:.3g}e12     # bytes/s: read-only streaming sum (best layout, median)")
    print(f"copy_bandwidth: {r['copy_tbps']:.3g}e12     # bytes/s: read + write bytes of a device copy (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
