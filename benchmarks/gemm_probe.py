"""The weight-streaming GEMMs of a Llama-3.1-8B decode step, per GPU at TP=1 and TP=2, under XLA flag sets.

    python benchmarks/gemm_probe.py [--tp 1 2] [--tokens 1 16] [--flags default no-triton-gemm ...] [--smoke]

Why: at TP=2 a batch-1 token spends 2.17 ms per GPU in GEMMs over 8 GB of weights (3.7 TB/s), where TP=1
streams its 16 GB at 4.2 TB/s (H200, 2026-11-30, step_diag --profile). The TP=2 target (1.75x TP=1) needs
about 1 ms less kernel time per GPU; this probe asks how much of it GEMM choices alone can give.

Each flag set runs in a child process (XLA reads XLA_FLAGS once). Per TP degree and token count it times
(a) the 32 layers' four GEMMs (qkv, o, gate_up, down) as one dependent chain on distinct weights, as the
forward runs them, and (b) each GEMM kind alone over its 32 weights; bytes are weight bytes, against the
4.3 TB/s copy ceiling. No attention, norms or collectives: the GEMMs' share of the step only.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CEIL_TBS = 4.3
HIDDEN, Q_OUT, KV_OUT, INTER, LAYERS = 4096, 4096, 1024, 14336, 32      # Llama-3.1-8B
FLAG_SETS = {
    "default": "",
    "no-triton-gemm": "--xla_gpu_enable_triton_gemm=false",
    "cublaslt": "--xla_gpu_enable_cublaslt=true",
    "autotune-0": "--xla_gpu_autotune_level=0",
    "exhaustive-tiling": "--xla_gpu_exhaustive_tiling_search=true",   # every Triton tiling the autotuner knows
}


def shapes(tp: int, scale: int = 1) -> dict[str, tuple[int, int]]:
    """(in, out) of each GEMM kind on one GPU: column-parallel qkv and gate_up, row-parallel o and down."""
    h, i = HIDDEN // scale, INTER // scale
    return {"qkv": (h, (Q_OUT + 2 * KV_OUT) // scale // tp), "o": (Q_OUT // scale // tp, h),
            "gate_up": (h, 2 * i // tp), "down": (i // tp, h)}


def child(a) -> list[dict]:
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.kernels_bench import timed

    scale, layers = (16, 4) if a.smoke else (1, LAYERS)
    rows = []
    for tp in a.tp:
        sh = shapes(tp, scale)
        key = jax.random.key(0)
        w = {k: [jax.random.normal(jax.random.fold_in(key, 100 * n + j), s, jnp.bfloat16) * 0.01
                 for j in range(layers)] for n, (k, s) in enumerate(sh.items())}
        wbytes = {k: sum(x.size * 2 for x in v) for k, v in w.items()}

        def chain(x, w):
            for j in range(layers):
                y = x @ w["qkv"][j]
                x = x + (y[:, :sh["o"][0]] @ w["o"][j])
                g = x @ w["gate_up"][j]
                x = x + (g[:, :sh["down"][0]] @ w["down"][j])
            return x

        def alone(kind):
            def f(x, ws):
                acc = jnp.zeros((x.shape[0], sh[kind][1]), jnp.float32)
                for m in ws:       # independent GEMMs, launched in order on one stream
                    acc = acc + (x[:, :sh[kind][0]] @ m).astype(jnp.float32)
                return acc
            return f

        for m in a.tokens:
            x = jax.random.normal(key, (m, sh["qkv"][0]), jnp.bfloat16)
            row = {"tp": tp, "tokens": m}
            t = timed(jax.jit(chain), x, w, n_iter=1, reps=a.reps)
            row["chain_ms"] = t * 1e3
            row["chain_tbs"] = sum(wbytes.values()) / t / 1e12
            for kind in sh:
                xin = jax.random.normal(key, (m, max(s[0] for s in sh.values())), jnp.bfloat16)
                tk = timed(jax.jit(alone(kind)), xin, w[kind], n_iter=1, reps=a.reps)
                row[f"{kind}_us"] = tk * 1e6 / layers
                row[f"{kind}_tbs"] = wbytes[kind] / tk / 1e12
            rows.append(row)
        del w
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP degrees whose per-GPU shapes to time")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    p.add_argument("--flags", nargs="+", default=list(FLAG_SETS), choices=list(FLAG_SETS))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="CPU: 1/16 of the shapes, 4 layers")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-timeout", type=int, default=300)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a)))
        return 0
    print("| flags | TP | tokens | 4 GEMMs x layers, ms | TB/s | qkv us (TB/s) | o us (TB/s) | gate_up us (TB/s) "
          "| down us (TB/s) |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    rc = 0
    for fs in a.flags:
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + FLAG_SETS[fs]).strip())
        if a.smoke:
            env["JAX_PLATFORMS"] = "cpu"
        args = [sys.executable, os.path.abspath(__file__), "--child", "--reps", str(a.reps),
                "--tp", *map(str, a.tp), "--tokens", *map(str, a.tokens)] + (["--smoke"] if a.smoke else [])
        try:
            proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=a.child_timeout)
        except subprocess.TimeoutExpired:
            print(f"| {fs} | timeout after {a.child_timeout} s |", flush=True)
            rc = 1
            continue
        if proc.returncode != 0:
            print(f"| {fs} | failed: {proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else proc.returncode} |")
            rc = 1
            continue
        for r in json.loads(proc.stdout.strip().splitlines()[-1]):
            cells = " | ".join(f"{r[k + '_us']:.1f} ({r[k + '_tbs']:.2f})" for k in ("qkv", "o", "gate_up", "down"))
            print(f"| {fs} | {r['tp']} | {r['tokens']} | {r['chain_ms']:.3f} | {r['chain_tbs']:.2f} | {cells} |",
                  flush=True)
    print(f"(TB/s: weight bytes per second; copy ceiling {CEIL_TBS} TB/s)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
