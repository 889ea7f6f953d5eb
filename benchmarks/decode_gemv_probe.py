"""The CUDA decode GEMV with fused epilogues (``kernels/decode_gemv.py``) against XLA's GEMMs + small fusions.

    python benchmarks/decode_gemv_probe.py [--tp 1 2] [--tokens 1 4 8] [--ctas-per-sm 2 1 4] [--reps 10] [--smoke]

Per TP degree (Llama-3.1-8B's per-GPU shapes: qkv, o, gate_up, down) and token count:
- **check**: each fused kind (qkv + RoPE on q and k, o + residual, gate_up + silu x up, down + residual) on
  random data against ``decode_gemv.reference`` (float32 products rounded as the kernel rounds): the share of
  output elements that are bit-equal and the largest difference relative to the largest value;
- **layer stack**: 32 layers of the four projections with what the model does around them (RoPE, residual adds,
  RMSNorm, silu x up; no attention: q stands in for its output), as XLA ops and with the kernel, in ms per
  forward; TB/s = weight bytes / time against the 4.3 TB/s copy ceiling;
- **alone**: each kind over its 32 distinct weights, microseconds per call, XLA (GEMM + its epilogue ops) and
  the kernel, for each ``--ctas-per-sm`` (the kernel's split-K target).
``--smoke``: CPU, 1/16 of the shapes, 2 layers, ``reference`` standing in for the kernel (timings mean nothing).
"""
from __future__ import annotations

import argparse
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.kernels_bench import timed  # noqa: E402
from jaxserve.kernels import decode_gemv as dg  # noqa: E402
from jaxserve.models.llama import apply_rope, rms_norm  # noqa: E402

CEIL_TBS = 4.3
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 4096, 32, 8, 128, 14336, 32


def layer_weights(key, tp: int, scale: int, layers: int):
    h, i = HIDDEN // scale, INTER // scale // tp
    nq, nkv = HEADS // tp * HEAD_DIM // scale, KV_HEADS // tp * HEAD_DIM // scale
    shapes = {"q": (h, nq), "k": (h, nkv), "v": (h, nkv), "o": (nq, h), "gate_up": (h, 2, i), "down": (i, h)}
    ws = []
    for j in range(layers):
        ks = jax.random.split(jax.random.fold_in(key, j), len(shapes))
        ws.append({n: jax.random.normal(kk, s, jnp.float32).astype(jnp.bfloat16) * (s[0] ** -0.5)
                   for kk, (n, s) in zip(ks, shapes.items())})
    return ws


def weight_bytes(ws) -> int:
    return sum(w.size * 2 for lw in ws for w in lw.values())


def make_stack(fused: bool, gemv, head_dim: int):
    """jit(x, cos, sin, ws) -> x after the layers: the model's projections and the ops around them."""
    def run(x, cos, sin, ws):
        t = x.shape[0]
        norm = jnp.ones((x.shape[1],), jnp.bfloat16)
        h = rms_norm(x, norm, 1e-5)
        for lw in ws:
            nq = lw["q"].shape[1]
            if fused:
                qkv = gemv(h, [lw["q"], lw["k"], lw["v"]], rope=(cos, sin), rope_mask=0b011, head_dim=head_dim)
                attn = qkv[:, :nq]
                x = gemv(attn, [lw["o"]], residual=x)
                h = rms_norm(x, norm, 1e-5)
                act = gemv(h, [lw["gate_up"]], silu=True)
                x = gemv(act, [lw["down"]], residual=x)
            else:
                q = apply_rope((h @ lw["q"]).reshape(t, -1, head_dim), cos[:, None], sin[:, None])
                k = apply_rope((h @ lw["k"]).reshape(t, -1, head_dim), cos[:, None], sin[:, None])
                v = h @ lw["v"]
                attn = q.reshape(t, nq) + 0 * (k.sum() + v.sum()).astype(q.dtype)  # keep k, v live
                x = x + attn @ lw["o"]
                h = rms_norm(x, norm, 1e-5)
                gu = jnp.einsum("th,hci->tci", h, lw["gate_up"])
                x = x + (jax.nn.silu(gu[:, 0]) * gu[:, 1]) @ lw["down"]
            h = rms_norm(x, norm, 1e-5)
        return x
    return jax.jit(run)


def kind_call(kind: str, gemv, head_dim: int, cos, sin):
    """(x, residual, w) -> output of one fused kind through ``gemv`` (kernel or reference)."""
    def f(x, res, w):
        if kind == "qkv":
            return gemv(x, w, rope=(cos, sin), rope_mask=0b011, head_dim=head_dim)
        if kind == "gate_up":
            return gemv(x, w, silu=True)
        return gemv(x, w, residual=res)
    return f


def xla_call(kind: str, head_dim: int, cos, sin):
    def f(x, res, w):
        t = x.shape[0]
        if kind == "qkv":
            q = apply_rope((x @ w[0]).reshape(t, -1, head_dim), cos[:, None], sin[:, None]).reshape(t, -1)
            k = apply_rope((x @ w[1]).reshape(t, -1, head_dim), cos[:, None], sin[:, None]).reshape(t, -1)
            return jnp.concatenate([q, k, x @ w[2]], axis=1)
        if kind == "gate_up":
            gu = jnp.einsum("th,hci->tci", x, w[0])
            return jax.nn.silu(gu[:, 0]) * gu[:, 1]
        return res + x @ w[0]
    return f


def kind_weights(kind: str, lw) -> list:
    return {"qkv": [lw["q"], lw["k"], lw["v"]], "o": [lw["o"]], "gate_up": [lw["gate_up"]], "down": [lw["down"]]}[kind]


def kind_io(kind: str, lw) -> tuple[int, int]:
    w = kind_weights(kind, lw)
    k = w[0].shape[0]
    n = w[0].shape[2] if kind == "gate_up" else sum(m.shape[1] for m in w)
    return k, n


def alone(call, ws, kind):
    """jit(x, res) -> sum of the 32 independent calls (one per layer's weight), launched in order."""
    def f(x, res, ws):
        acc = None
        for lw in ws:
            y = call(x, res, kind_weights(kind, lw)).astype(jnp.float32)
            acc = y if acc is None else acc + y
        return acc
    return jax.jit(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--ctas-per-sm", type=float, nargs="+", default=[2.0, 1.0, 4.0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    scale, layers = (16, 2) if a.smoke else (1, LAYERS)
    head_dim = HEAD_DIM // scale
    if a.smoke:
        gemv = dg.reference
    else:
        why = dg.enable()
        if why:
            print(f"decode GEMV unavailable: {why}")
            return 1
        gemv = dg.gemv
    dev = jax.devices()[0]
    print(f"# decode_gemv_probe: jax {jax.__version__}, {dev.device_kind}, {'smoke' if a.smoke else 'kernel'}")
    key = jax.random.key(0)
    rc = 0
    for tp in a.tp:
        ws = layer_weights(key, tp, scale, layers)
        wb = weight_bytes(ws)
        for t in a.tokens:
            ks = jax.random.split(jax.random.fold_in(key, 1000 + t), 4)
            pos = jnp.arange(100, 100 + t)
            inv = 1.0 / (500000.0 ** (np.arange(0, head_dim, 2) / head_dim))
            ang = pos[:, None].astype(jnp.float32) * inv[None, :]
            ang = jnp.concatenate([ang, ang], axis=-1)
            cos, sin = jnp.cos(ang).astype(jnp.bfloat16), jnp.sin(ang).astype(jnp.bfloat16)
            # check each fused kind against the reference
            cells = []
            for kind in ("qkv", "o", "gate_up", "down"):
                k, n = kind_io(kind, ws[0])
                x = jax.random.normal(ks[0], (t, k), jnp.float32).astype(jnp.bfloat16)
                res = jax.random.normal(ks[1], (t, n), jnp.float32).astype(jnp.bfloat16)
                args = (x, res, kind_weights(kind, ws[0]))
                got = np.asarray(jax.jit(kind_call(kind, gemv, head_dim, cos, sin))(*args).astype(jnp.float32))
                ref = np.asarray(jax.jit(kind_call(kind, dg.reference, head_dim, cos, sin))(*args).astype(jnp.float32))
                xla = np.asarray(jax.jit(xla_call(kind, head_dim, cos, sin))(*args).astype(jnp.float32))
                rel = float(np.max(np.abs(got - ref)) / max(1e-30, np.max(np.abs(ref))))
                rel_xla = float(np.max(np.abs(got - xla)) / max(1e-30, np.max(np.abs(xla))))
                ok = got.shape == ref.shape and rel <= 1e-2
                rc |= 0 if ok else 1
                cells.append(f"{kind} {'ok' if ok else 'FAIL'} eq {np.mean(got == ref):.3f} rel {rel:.1e} "
                             f"(vs XLA ops {rel_xla:.1e})")
            print(f"## TP={tp} T={t}: " + "; ".join(cells), flush=True)
            # layer stacks
            x = jax.random.normal(ks[2], (t, HIDDEN // scale), jnp.float32).astype(jnp.bfloat16)
            t_xla = timed(make_stack(False, gemv, head_dim), x, cos, sin, ws, n_iter=1, reps=a.reps)
            row = [f"| {tp} | {t} | XLA | {t_xla * 1e3:.3f} | {wb / t_xla / 1e12:.2f} |"]
            for c in a.ctas_per_sm:
                dg._ctas_per_sm = c
                tc = timed(make_stack(True, gemv, head_dim), x, cos, sin, ws, n_iter=1, reps=a.reps)
                row.append(f"| {tp} | {t} | kernel, {c:g} CTA/SM | {tc * 1e3:.3f} | {wb / tc / 1e12:.2f} |")
            dg._ctas_per_sm = a.ctas_per_sm[0]
            print("| TP | T | layer stack | ms | TB/s |\n|---|---|---|---|---|\n" + "\n".join(row), flush=True)
            # each kind alone
            print("| kind | XLA us (TB/s) | " + " | ".join(f"kernel {c:g} CTA/SM us (TB/s)" for c in a.ctas_per_sm)
                  + " |\n|---|" + "---|" * (1 + len(a.ctas_per_sm)))
            for kind in ("qkv", "o", "gate_up", "down"):
                k, n = kind_io(kind, ws[0])
                xk = jax.random.normal(ks[3], (t, k), jnp.float32).astype(jnp.bfloat16)
                res = jnp.zeros((t, n), jnp.bfloat16)
                kb = sum(m.size * 2 for lw in ws for m in kind_weights(kind, lw))
                tx = timed(alone(xla_call(kind, head_dim, cos, sin), ws, kind), xk, res, ws, n_iter=1, reps=a.reps)
                cells = [f"{tx * 1e6 / layers:.1f} ({kb / tx / 1e12:.2f})"]
                for c in a.ctas_per_sm:
                    dg._ctas_per_sm = c
                    tk = timed(alone(kind_call(kind, gemv, head_dim, cos, sin), ws, kind), xk, res, ws, n_iter=1,
                               reps=a.reps)
                    cells.append(f"{tk * 1e6 / layers:.1f} ({kb / tk / 1e12:.2f})")
                dg._ctas_per_sm = a.ctas_per_sm[0]
                print(f"| {kind} | " + " | ".join(cells) + " |", flush=True)
        del ws
    print(f"(TB/s: weight bytes per second; copy ceiling {CEIL_TBS} TB/s)")
    print("decode_gemv_probe: " + ("PASS" if rc == 0 else "FAIL"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
