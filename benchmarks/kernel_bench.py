"""The kernel microbenchmark: the device figures the kernels are judged by, on one device.

    python -m jaxserve.benchmarks.kernel_bench [--only attention,quant] [--smoke: tiny, on CPU, interpreted]
    jaxserve bench --config h200-kernels                              # the same as a config (``kernels.args``)

Sections (``--only``: bandwidth, attention, quant, mla, moe) and what each measures: benchmarks/README.md's table.
Timing (benchmarks/README.md): device-waited, compiles left out, chained calls with rotating inputs (no L2 repeat).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time

import numpy as np

from . import roofline

SECTIONS = ("bandwidth", "attention", "quant", "moe", "mla")
LLAMA8B_PROJECTIONS = (("gate_up", 4096, 28672), ("down", 14336, 4096), ("qkv", 4096, 6144), ("q/o", 4096, 4096),
                       ("k/v", 4096, 1024))      # qkv: q, k and v fused, as a quantized model loads them
INT4_GROUP = 128


@dataclasses.dataclass(frozen=True)
class Sizes:
    gib: float = 4.0                               # bandwidth: far past the L2
    heads: tuple = (32, 8, 128, 16)                # attention: q heads, kv heads, head dim, block size
    decode_b: tuple = (1, 8, 64, 256)
    decode_ctx: tuple = (512, 2048, 8192, 32768)
    max_kv_gib: float = 40.0                       # sweep points whose K+V exceed this are skipped
    fp8_cases: tuple = ((8, 32768), (64, 8192))
    prefill: tuple = (8, 2048)                     # requests x tokens, causal, nothing cached
    pool_bytes: int = 1 << 30                      # decode caches are drawn from at least this much memory
    projections: tuple = LLAMA8B_PROJECTIONS
    quant_m: tuple = (1, 4, 16)
    layers: int = 32
    moe_shapes: tuple = (("qwen3-30b-a3b", 128, 8, 2048, 768), ("mixtral-8x7b", 8, 2, 4096, 14336))
    moe_tokens: tuple = (1, 4, 16, 256, 8192)
    mla_shape: tuple = (512, 64, 16)               # MLA: kv_lora_rank, rope dim, block size (DeepSeek V2/V3)
    mla_batch: tuple = (64, 4096)                  # requests x context
    mla_heads: tuple = (16, 128)
    mla_sweep: bool = True                         # MLA: also sweep the launch options (bf16 cache)
    mla_backends: tuple = ("triton",)              # MLA: triton (mla_decode_pallas), mgpu (mla_decode_mgpu)
    n_iter: int = 16
    reps: int = 5
    interpret: bool = False


SMOKE = Sizes(gib=0.01, heads=(4, 2, 64, 16), decode_b=(2,), decode_ctx=(64,), fp8_cases=((2, 64),),
              prefill=(2, 32), pool_bytes=1 << 20, projections=(("tiny", 256, 256),), quant_m=(1, 4), layers=2,
              moe_shapes=(("tiny", 8, 2, 64, 32),), moe_tokens=(1, 4), mla_shape=(32, 16, 8), mla_batch=(2, 40),
              mla_heads=(4,), n_iter=2, reps=1, interpret=True)


class Bench:
    """The sizes, the device's ceilings, and what the sections print and summarise."""

    def __init__(self, sizes: Sizes, hardware: str, out=None):
        import jax
        dev = jax.devices()[0]
        self.S, self.out, self.rows = sizes, out, []
        self.hw = roofline.resolve_hardware(hardware, dev.device_kind, dev.platform)
        self.read_bw, self.peak = self.hw.read_bandwidth, self.hw.flops("bfloat16")
        self.emit(f"# kernel_bench: {dev.device_kind}, jax {jax.__version__}; ceilings from "
                  f"configs/hardware/{self.hw.source_file}: read {self.read_bw / 1e12:.3g} TB/s, "
                  f"bf16 {self.peak / 1e12:.4g} TFLOP/s")

    def emit(self, line: str = "") -> None:
        print(line, flush=True)
        if self.out:
            self.out.write(line + "\n")
            self.out.flush()

    def read_pct(self, bytes_per_s: float) -> float:
        return roofline.percent(bytes_per_s, self.read_bw, "kernel read rate")


def call_seconds(fn, *args, calls: int = 1, repeats: int) -> list[float]:
    """Seconds per call of ``fn``, one figure per repeat of ``calls`` calls dispatched back to back (launch gaps
    hide behind the previous call), blocked on the last; the first call (its compile) untimed."""
    import jax
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            y = fn(*args)
        jax.block_until_ready(y)
        out.append((time.perf_counter() - t) / calls)
    return out


def chain_seconds(fn, *args, n_iter: int, reps: int) -> float:
    """Seconds per step of ``fn``, a jitted chain of ``n_iter`` dependent steps: the median of ``reps`` calls."""
    return statistics.median(call_seconds(fn, *args, repeats=reps)) / n_iter


def rotating_tables(S: Sizes, B: int, pages: int, page_bytes: int):
    """(block tables [n_rot, B, pages], pool pages): B requests' pages drawn at random from a pool of at least
    ``S.pool_bytes`` (page 0 left out), a few tables in rotation."""
    import jax.numpy as jnp
    pool = max(B * pages, S.pool_bytes // page_bytes) + 1
    rng = np.random.default_rng(0)
    return jnp.asarray(np.stack([rng.choice(pool - 1, B * pages, replace=False).reshape(B, pages) + 1
                                 for _ in range(max(1, min(S.n_iter, pool // (B * pages))))]), jnp.int32), pool


def decode_metadata(table, seq_lens):
    """The decode-only launch's metadata: one new token for each of ``seq_lens``' requests."""
    import jax.numpy as jnp

    from jaxserve.kernels.metadata import AttentionMetadata
    B = seq_lens.shape[0]
    return AttentionMetadata(slot_mapping=jnp.zeros((B,), jnp.int32), block_tables=table, seq_lens=seq_lens,
                             query_start_loc=jnp.arange(B + 1, dtype=jnp.int32), num_seqs=jnp.int32(B),
                             decode_only=True)


# ------------------------------------------------------------------------------------------------ bandwidth
def bandwidth(b: Bench) -> None:
    import jax
    import jax.numpy as jnp
    cols = 8192
    x = jnp.ones((max(int(b.S.gib * 2 ** 30) // (2 * cols), 1), cols), jnp.bfloat16)
    kernels = {"read (sum along rows)": (lambda a: jnp.sum(a, axis=1, dtype=jnp.float32), 1),
               "read (sum along columns)": (lambda a: jnp.sum(a, axis=0, dtype=jnp.float32), 1),
               "copy (-x)": (lambda a: -a, 2)}        # an elementwise kernel XLA cannot elide: read + write
    b.emit(f"\n## bandwidth: {x.nbytes / 2 ** 30:.2f} GiB bf16, 40 calls x 7 repeats\n"
           "| kernel | us per call | TB/s median | min | max |\n|---|---|---|---|---|")
    median = {}
    for name, (fn, passes) in kernels.items():
        per_call = call_seconds(jax.jit(fn), x, calls=40, repeats=7)
        tbps = [passes * x.nbytes / t / 1e12 for t in per_call]
        median[name] = statistics.median(tbps)
        b.emit(f"| {name} | {statistics.median(per_call) * 1e6:.1f} | {median[name]:.3f} | {min(tbps):.3f} | "
               f"{max(tbps):.3f} |")
    read, copy = max(v for k, v in median.items() if k.startswith("read")), median["copy (-x)"]
    b.emit(f"read_bandwidth: {read:.3g}e12     # bytes/s: read-only streaming sum (best layout, median)\n"
           f"copy_bandwidth: {copy:.3g}e12     # bytes/s: read + write bytes of a device copy (median)")
    b.rows.append(("HBM read / copy", f"{read:.2f} / {copy:.2f} TB/s"))


# ------------------------------------------------------------------------------------------------ attention
def attention(b: Bench) -> None:
    import jax.numpy as jnp
    S = b.S
    hq, kvh, d, _ = S.heads
    b.emit(f"\n## paged decode, {hq}q/{kvh}kv d={d}: ours (the engine's decode-only launch) vs the stock Pallas "
           f"kernel, TB/s of K+V read\n| B | ctx | ours us | ours TB/s | ours % read | stock us | stock TB/s | "
           f"ours / stock |\n|---|---|---|---|---|---|---|---|")
    for B in S.decode_b:
        for ctx in S.decode_ctx:
            if _kv_bytes(S, B * ctx, 2) > S.max_kv_gib * 2 ** 30:
                continue
            t1, r1 = _time_decode(S, B, ctx, "ours")
            t2, r2 = _time_decode(S, B, ctx, "stock")
            b.emit(f"| {B} | {ctx} | {t1 * 1e6:.1f} | {r1 / 1e12:.2f} | {b.read_pct(r1):.0f} | {t2 * 1e6:.1f} | "
                   f"{r2 / 1e12:.2f} | {r1 / r2:.2f}x |")
            if (B, ctx) in ((64, 2048), (S.decode_b[-1], S.decode_ctx[-1])):
                b.rows.append((f"paged decode B={B} ctx={ctx}", f"{t1 * 1e6:.1f} us, {r1 / 1e12:.2f} TB/s "
                               f"({b.read_pct(r1):.0f} % of read; stock {r2 / 1e12:.2f} TB/s)"))
    b.emit("\n| fp8 cache: B | ctx | bf16 us | fp8 us | fp8 / bf16 time |\n|---|---|---|---|---|")
    for B, ctx in S.fp8_cases:
        t16, _ = _time_decode(S, B, ctx, "ours")
        t8, _ = _time_decode(S, B, ctx, "ours", cache_dtype=jnp.float8_e4m3fn)
        b.emit(f"| {B} | {ctx} | {t16 * 1e6:.1f} | {t8 * 1e6:.1f} | {t8 / t16:.2f} |")
        b.rows.append((f"fp8 KV decode B={B} ctx={ctx}", f"{t8 * 1e6:.1f} us, {t8 / t16:.2f}x bf16's time"))
    n, L = S.prefill
    b.emit(f"\n## causal prefill {n} x {L}, {hq}q/{kvh}kv d={d} bf16\n| kernel | ms | TFLOP/s | % bf16 peak |\n"
           "|---|---|---|---|")
    flops = 4 * hq * d * n * L * (L + 1) // 2
    for name, t in _time_prefill(S, n, L).items():
        b.emit(f"| {name} | {t * 1e3:.3f} | {flops / t / 1e12:.0f} | {100 * flops / t / b.peak:.0f} |")
        b.rows.append((f"prefill {n}x{L} causal: {name}", f"{t * 1e3:.3f} ms, {flops / t / 1e12:.0f} TFLOP/s"))


def _kv_bytes(S: Sizes, tokens: int, itemsize: int) -> int:
    return tokens * S.heads[1] * S.heads[2] * 2 * itemsize


def chain(step, n_iter: int):
    """jit(q, k, v, tables, *rest) -> q after n_iter steps, step i reading block table i % len(tables)."""
    import jax

    def run(q, k, v, tables, *rest):
        for i in range(n_iter):
            q = step(q, k, v, tables[i % len(tables)], *rest)
        return q
    return jax.jit(run)


def _time_decode(S: Sizes, B: int, ctx: int, which: str, cache_dtype=None) -> tuple[float, float]:
    """(seconds, bytes/s of K+V read) of one decode step: B requests at context ``ctx`` (``rotating_tables``)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import paged_attention as stock

    from jaxserve.kernels import ops
    hq, kvh, d, bs = S.heads
    dtype = jnp.dtype(cache_dtype or jnp.bfloat16)
    pages = -(-ctx // bs)
    tables, pool = rotating_tables(S, B, pages, bs * kvh * d * 2 * dtype.itemsize)
    k_shape, v_shape = ops.kv_cache_shapes(pool, bs, kvh, d, dtype)
    key = jax.random.key(0)
    k = jax.random.normal(key, k_shape, jnp.bfloat16).astype(dtype)
    v = jax.random.normal(jax.random.fold_in(key, 1), v_shape if which == "ours" else k_shape,
                          jnp.bfloat16).astype(dtype)
    q = jax.random.normal(jax.random.fold_in(key, 2), (B, hq, d), jnp.bfloat16)
    seq_lens = jnp.full((B,), ctx, jnp.int32)
    scale = jnp.float32(0.5) if cache_dtype is not None else None
    if which == "stock":                   # its layout: [kv_heads, pages, block, d]
        k, v = jnp.swapaxes(k, 0, 1), jnp.swapaxes(v, 0, 1)

        def step(q, k, v, table, seq_lens):
            return stock.paged_attention(q, k, v, table, seq_lens, k_splits=math.gcd(16, pages),
                                         interpret=S.interpret)
    else:
        def step(q, k, v, table, seq_lens):
            return ops.paged_attention(q, k, v, decode_metadata(table, seq_lens), sm_scale=d ** -0.5,
                                       backend="pallas", k_scale=scale, v_scale=scale, interpret=S.interpret)
    t = chain_seconds(chain(step, S.n_iter), q, k, v, tables, seq_lens, n_iter=S.n_iter, reps=S.reps)
    return t, _kv_bytes(S, B * ctx, dtype.itemsize) / t


def _time_prefill(S: Sizes, n: int, L: int) -> dict[str, float]:
    """Seconds of causal attention over ``n`` prompts of ``L`` tokens: ours on the paged cache (the engine's
    backend, and the Triton kernel alone), and dense kernels on [n, L, heads, d]."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxserve.kernels import ops
    from jaxserve.kernels.metadata import AttentionMetadata
    hq, kvh, d, bs = S.heads
    pages = -(-L // bs)
    key = jax.random.key(3)
    k_shape, v_shape = ops.kv_cache_shapes(n * pages + 1, bs, kvh, d, jnp.bfloat16)
    k = jax.random.normal(key, k_shape, jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 1), v_shape, jnp.bfloat16)
    q = jax.random.normal(jax.random.fold_in(key, 2), (n * L, hq, d), jnp.bfloat16)
    tables = jnp.arange(1, n * pages + 1, dtype=jnp.int32).reshape(n, pages)
    pos = jnp.arange(L, dtype=jnp.int32)
    md = AttentionMetadata(slot_mapping=(tables[:, pos // bs] * bs + pos % bs).reshape(-1), block_tables=tables,
                           seq_lens=jnp.full((n,), L, jnp.int32), num_seqs=jnp.int32(n),
                           query_start_loc=jnp.arange(0, n * L + 1, L, dtype=jnp.int32))
    out = {}
    backends = {"ours (pallas)": "pallas", "ours (pallas-triton)": "pallas-triton"}
    for name, backend in backends.items():
        fn = chain(lambda q, k, v, _, md, be=backend: ops.paged_attention(
            q, k, v, md, sm_scale=d ** -0.5, backend=be, interpret=S.interpret), S.n_iter)
        out[name] = chain_seconds(fn, q, k, v, [None], md, n_iter=S.n_iter, reps=S.reps)
    dense = {"xla (dot_product_attention)": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)}
    if not S.interpret:
        dense = {"cuDNN": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                        implementation="cudnn"),
                 "Mosaic GPU FA3 (fp16)": _mgpu_fa3}
    qd = q.reshape(n, L, hq, d)
    kd, vd = (jax.random.normal(jax.random.fold_in(key, i), (n, L, kvh, d), jnp.bfloat16) for i in (4, 5))
    for name, f in dense.items():
        fn = jax.jit(lambda q, k, v, f=f: functools.reduce(lambda acc, _: f(acc, k, v), range(S.n_iter), q))
        try:
            out[name] = chain_seconds(fn, qd, kd, vd, n_iter=S.n_iter, reps=S.reps)
        except Exception as e:  # noqa: BLE001  (a comparison that does not lower here is skipped, and said)
            print(f"{name}: skipped ({type(e).__name__}: {str(e)[:200]})", flush=True)
    return out


def _mgpu_fa3(q, k, v):
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import attention_mgpu
    cfg = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    f16 = [a.astype(jnp.float16) for a in (q, k, v)]
    return attention_mgpu.attention(*f16, cfg).astype(q.dtype)


# ---------------------------------------------------------------------------------------------------- quant
def _layered(matmul):
    """One program: each layer's activation times its own weight (nothing shared between layers, as in the
    model), so L2 serves no repeat and one dispatch covers ``layers`` matmuls."""
    import jax
    return jax.jit(lambda xs, ws: [matmul(x, w) for x, w in zip(xs, ws)])


def _per_matmul_us(fn, args, layers: int) -> float:
    return min(call_seconds(fn, *args, calls=10, repeats=3)) / layers * 1e6


def _activations(m: int, k: int, layers: int) -> list:
    import jax
    import jax.numpy as jnp
    return [jax.random.normal(jax.random.key(1000 + i), (m, k), jnp.bfloat16) for i in range(layers)]


def _weights(k: int, n: int, layers: int) -> dict[str, list]:
    """Per layer, the bf16 weight ``[k, n]`` and its int4 and fp8 forms."""
    import jax
    import jax.numpy as jnp

    from jaxserve.quantization import online
    quant4 = jax.jit(lambda w: online.quantize_int4(w, INT4_GROUP, jnp.bfloat16))
    out = {"bf16": [], "int4": [], "fp8": []}
    for layer in range(layers):
        w = jax.random.normal(jax.random.key(layer), (k, n), jnp.bfloat16) * 0.02
        out["bf16"].append(w)
        out["int4"].append(quant4(w))
        out["fp8"].append(online.quantize_fp8_per_channel(w))
    return out


def quant(b: Bench) -> None:
    import jax
    import jax.numpy as jnp

    from jaxserve.quantization import weights as qw
    S = b.S

    def fp8_w8a16(x, w):            # the weight converted inside XLA's GEMM, the channel scale on the result
        y = jax.lax.dot_general(x, w.weight.astype(x.dtype), (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        return (y * w.scale).astype(x.dtype)

    paths = {"bf16": _layered(lambda x, w: x @ w), "int4": _layered(qw.matmul), "fp8 W8A8": _layered(qw.matmul),
             "fp8 W8A16": _layered(fp8_w8a16)}
    b.emit(f"\n## quantized matmuls (the engine's paths), {S.layers} weights per program; us per matmul, GB/s of "
           "weight read (% of the read ceiling), speed-up over bf16\n"
           "| shape | M | bf16 us | int4 us | int4 GB/s (%) | fp8 W8A8 us | fp8 GB/s (%) | fp8 W8A16 us | "
           "int4 / W8A8 / W8A16 speed-up |\n|---|---|---|---|---|---|---|---|---|")
    for name, k, n in S.projections:
        w = _weights(k, n, S.layers)
        nbytes = {"int4": sum(a.nbytes for a in (w["int4"][0].packed, w["int4"][0].scales, w["int4"][0].zeros)),
                  "fp8": w["fp8"][0].weight.nbytes + w["fp8"][0].scale.nbytes}
        for m in S.quant_m:
            xs = _activations(m, k, S.layers)
            t = {p: _per_matmul_us(fn, (xs, w[p.split()[0]]), S.layers) for p, fn in paths.items()}
            r4, r8 = nbytes["int4"] / t["int4"] / 1e3, nbytes["fp8"] / t["fp8 W8A8"] / 1e3
            b.emit(f"| {name} {k}x{n} | {m} | {t['bf16']:.1f} | {t['int4']:.1f} | {r4:.0f} "
                   f"({b.read_pct(r4 * 1e9):.0f}) | {t['fp8 W8A8']:.1f} | {r8:.0f} ({b.read_pct(r8 * 1e9):.0f}) | "
                   f"{t['fp8 W8A16']:.1f} | {t['bf16'] / t['int4']:.2f}x / {t['bf16'] / t['fp8 W8A8']:.2f}x / "
                   f"{t['bf16'] / t['fp8 W8A16']:.2f}x |")
            if name == S.projections[0][0]:
                b.rows.append((f"{name} {k}x{n} M={m}: int4 / fp8 W8A8 / W8A16 vs bf16",
                               f"{t['bf16'] / t['int4']:.2f}x / {t['bf16'] / t['fp8 W8A8']:.2f}x / "
                               f"{t['bf16'] / t['fp8 W8A16']:.2f}x (int4 {r4:.0f} GB/s)"))
        del w


# ------------------------------------------------------------------------------------------------------ moe
def moe(b: Bench) -> None:
    import jax
    import jax.numpy as jnp

    from jaxserve.kernels import ragged_dot
    S = b.S
    rows_max = 16                          # the rows kernel's decode sizes (models/layers/moe.py's rows path)
    pool_n = 16                            # routings in rotation, so consecutive calls read different experts
    dtype = jnp.float32 if S.interpret else jnp.bfloat16
    b.emit("\n## MoE grouped GEMM (gate/up of one layer), tokens routed uniformly at random\n"
           "| shape | tokens | impl | us | TB/s | % read | TFLOP/s | % bf16 peak |\n|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name, experts, top_k, hidden, inter in S.moe_shapes:
        n = 2 * inter
        w = (jax.random.normal(jax.random.key(0), (experts, hidden, n), jnp.float32) * 0.02).astype(dtype)
        for tokens in S.moe_tokens:
            m = tokens * top_k
            ids = np.stack([np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k] for _ in range(pool_n)])
            sizes = np.stack([np.bincount(r.reshape(-1), minlength=experts) for r in ids]).astype(np.int32)
            touched = float(np.mean([(s > 0).sum() for s in sizes]))
            nbytes = (touched * hidden * n + m * (hidden + n)) * w.dtype.itemsize
            flops = 2.0 * m * hidden * n
            x = jnp.asarray(rng.standard_normal((m, hidden)) * 0.1, dtype)
            calls = {impl: (lambda x, w, s, impl=impl: ragged_dot.grouped_matmul(x, w, s, impl), jnp.asarray(sizes))
                     for impl in ragged_dot.IMPLEMENTATIONS
                     if impl != "gather" or m * hidden * n * w.dtype.itemsize <= 8 << 30}
            if tokens <= rows_max:      # each expert gets at most one row per token, rows in token order
                calls["rows"] = (lambda x, w, r: ragged_dot.expert_rows_matmul(x, w, r.reshape(-1), r.shape[0]),
                                 jnp.asarray(ids, jnp.int32))
            for impl, (call, routing) in calls.items():
                try:
                    s = chain_seconds(_moe_chain(call, S.n_iter, pool_n), x, w, routing, n_iter=S.n_iter, reps=S.reps)
                except Exception as e:  # noqa: BLE001  (an implementation that does not lower is said, not fatal)
                    b.emit(f"| {name} | {tokens} | {impl} | {type(e).__name__}: {str(e).splitlines()[0][:120]} |")
                    continue
                b.emit(f"| {name} | {tokens} | {impl} | {s * 1e6:.1f} | {nbytes / s / 1e12:.2f} | "
                       f"{b.read_pct(nbytes / s):.0f} | {flops / s / 1e12:.1f} | {100 * flops / s / b.peak:.1f} |")
                if tokens in (1, S.moe_tokens[-1]) and impl in ("rows", "pallas"):
                    b.rows.append((f"MoE GEMM {name} {tokens} tokens: {impl}", f"{s * 1e6:.1f} us"))


def _moe_chain(call, n_iter: int, pool_n: int):
    """n_iter calls, each with the next routing of the pool and its input scaled by the previous output."""
    import jax
    import jax.numpy as jnp

    def run(x, w, pool):
        def body(i, carry):
            x, acc = carry
            acc = acc + call(x, w, pool[i % pool_n])[0, 0].astype(jnp.float32)
            return x * (1 + acc * 1e-30).astype(x.dtype), acc
        return jax.lax.fori_loop(0, n_iter, body, (x, jnp.float32(0)))[1]
    return jax.jit(run)


# ------------------------------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m jaxserve.benchmarks.kernel_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, Pallas kernels interpreted")
    ap.add_argument("--hardware", default="auto", help="ceilings from configs/hardware (auto: the device's kind)")
    ap.add_argument("--m", default=None, help="quant: token counts (default 1,4,16)")
    ap.add_argument("--tokens", default=None, help="moe: token counts (default 1,4,16,256,8192)")
    ap.add_argument("--out", default=None, help="also write the output to this file as it goes")
    ap.add_argument("--no-sweep", action="store_true",
                    help="mla: time the Triton kernel's default launch only (the mgpu backend's short sweep runs)")
    ap.add_argument("--mla-backend", default="triton", help="mla: comma list of triton, mgpu (the Mosaic GPU kernel)")
    return ap


def run_sections(a: argparse.Namespace) -> tuple[int, list[tuple[str, str]]]:
    """(exit code, summary rows) of the sections ``a`` names."""
    sections = [s for s in a.only.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"--only: {', '.join(unknown)} not among {', '.join(SECTIONS)}")
    if a.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sizes = SMOKE if a.smoke else Sizes()
    sizes = dataclasses.replace(sizes, quant_m=tuple(int(v) for v in (a.m or "").split(",") if v) or sizes.quant_m,
                                moe_tokens=tuple(int(v) for v in (a.tokens or "").split(",") if v) or sizes.moe_tokens,
                                mla_sweep=sizes.mla_sweep and not a.no_sweep,
                                mla_backends=tuple(v for v in a.mla_backend.split(",") if v))
    bad = sorted(set(sizes.mla_backends) - {"triton", "mgpu"})
    if bad:
        raise ValueError(f"--mla-backend: {', '.join(bad)} not among triton, mgpu")
    out = open(a.out, "w") if a.out else None
    b = Bench(sizes, a.hardware, out)
    failed = []
    for name in sections:
        try:
            if name == "mla":
                from .mla_kernel_bench import mla
                mla(b)
            else:
                {"bandwidth": bandwidth, "attention": attention, "quant": quant, "moe": moe}[name](b)
        except Exception as e:  # noqa: BLE001  (one section failing leaves the others' figures)
            import traceback
            traceback.print_exc()
            failed.append(name)
            b.rows.append((name, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"))
    b.emit("\n## summary\n| what | result |\n|---|---|")
    for what, res in b.rows:
        b.emit(f"| {what} | {res} |")
    if out:
        out.close()
    return (1 if failed else 0), b.rows


def run_kernels(run) -> None:
    """The ``kernels`` mode of ``jaxserve bench``: these sections in-process with the config's ``kernels.args``
    (ceilings from its ``hardware``); the output is kept as kernels_output.txt, the summary goes in the report."""
    from .report import Table
    args = [str(a) for a in run.cfg["kernels"]["args"]]
    a = build_parser().parse_args(["--hardware", str(run.cfg["hardware"]), *args,
                                   "--out", str(run.out_dir / "kernels_output.txt")])
    rc, rows = run_sections(a)
    run.result |= {"exit_code": rc, "summary": rows}
    run.tables.append(Table("kernel_bench summary", ["what", "result"], [list(r) for r in rows]))
    run.notes.append("the full output: kernels_output.txt")
    if rc:
        raise RuntimeError(f"a kernel_bench section failed; see {run.out_dir}/kernels_output.txt")


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    try:
        return run_sections(ap.parse_args(argv))[0]
    except ValueError as e:
        ap.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
