"""``kernel_bench``'s ``mla`` section: the paged MLA decode kernel (``kernels/mla_decode_pallas.py``) at DeepSeek's
latent shape, its default launch then its launch sweep (benchmarks/README.md's kernel table); with
``--mla-backend triton,mgpu`` also the Mosaic GPU kernel (``kernels/mla_decode_mgpu.py``, bf16 cache only), its
default launch then its own sweep (heads a program, keys a step, ring slots, splits)."""
from __future__ import annotations

import itertools

from .kernel_bench import Bench, chain, chain_seconds, decode_metadata, rotating_tables


def _launches(heads: int, width: int, quick: bool) -> list[dict]:
    """The launches swept at ``heads`` (bf16 rows ``width`` wide): heads a program, keys a step, warps, stages
    (where the tiles fit in shared memory), then split counts."""
    from jaxserve.kernels.device_info import SHARED_MEMORY
    if quick:
        return [dict(block_k=16, num_stages=2), dict(num_splits=2)]
    block_hs = [bh for bh in (16, 32, 64) if bh <= max(16, heads)]
    out = []
    for bh, bk, warps, stages in itertools.product(block_hs, (16, 32, 64), (2, 4, 8), (2, 3, 4)):
        if warps * 8 < bh or warps * 8 > 2 * bh:
            continue              # 4 to 8 heads a warp: the [bh, R] f32 accumulator (64 heads at 4 warps spill)
        if 2 * width * (stages * bk + bh) > SHARED_MEMORY:
            continue
        out.append(dict(block_h=bh, block_k=bk, num_warps=warps, num_stages=stages))
    return out + [dict(num_splits=s) for s in (1, 2, 4, 8)]


def _mgpu_launches(heads: int, quick: bool, fits) -> list[dict]:
    """The Mosaic GPU kernel's launches swept at ``heads``: heads a program, keys a step and ring slots where
    ``fits(launch)`` (its ``supported``), then split counts."""
    if quick:
        return [dict(num_splits=2)]
    out = [dict(block_h=bh, block_kv=bk, stages=st)
           for bh, bk, st in itertools.product((8, 16, 32), (64, 128), (1, 2, 3)) if heads % bh == 0]
    return [launch for launch in out if fits(launch)] + [dict(num_splits=s) for s in (1, 2, 4, 8)]


def _label(launch: dict) -> str:
    return ", ".join(f"{k.replace('num_', '')}={v}" for k, v in launch.items()) or "default"


def _timer(S, B: int, ctx: int, heads: int, cache_dtype, backend: str = "triton"):
    """launch options -> seconds a decode step of B requests at ``ctx`` (random pages, rotating tables), and
    launch options -> whether the backend takes them at this shape."""
    import jax
    import jax.numpy as jnp

    from jaxserve.kernels import mla_decode_mgpu, mla_decode_pallas
    mla_paged_attention = (mla_decode_mgpu if backend == "mgpu" else mla_decode_pallas).mla_paged_attention
    R, P, bs = S.mla_shape
    dtype = jnp.dtype(cache_dtype)
    tables, pool = rotating_tables(S, B, -(-ctx // bs), bs * (R + P) * dtype.itemsize)
    key = jax.random.key(0)
    latent = jax.random.normal(key, (pool, bs, R + P), jnp.bfloat16).astype(dtype)
    q_dtype = jnp.float32 if S.interpret and backend == "triton" else jnp.bfloat16
    qn = jax.random.normal(jax.random.fold_in(key, 1), (B, heads, R), q_dtype)
    qr = jax.random.normal(jax.random.fold_in(key, 2), (B, heads, P), q_dtype)
    seq_lens = jnp.full((B,), ctx, jnp.int32)
    scale = jnp.float32(0.5) if dtype.itemsize == 1 else None

    def seconds(launch: dict) -> float:          # each call's output is the next call's query
        fn = chain(lambda qn, qr, latent, table, seq_lens: mla_paged_attention(
            qn, qr, latent, decode_metadata(table, seq_lens), sm_scale=(R + P) ** -0.5, kv_scale=scale,
            interpret=S.interpret, **launch), S.n_iter)
        return chain_seconds(fn, qn, qr, latent, tables, seq_lens, n_iter=S.n_iter, reps=S.reps)

    def fits(launch: dict) -> bool:
        if backend == "triton":
            return True
        return mla_decode_mgpu.supported(qn, qr, latent, kv_scale=scale, **launch)
    return seconds, fits


def mla(b: Bench) -> None:
    import jax.numpy as jnp
    S = b.S
    R, P, bs = S.mla_shape
    B, ctx = S.mla_batch
    b.emit(f"\n## paged MLA decode (absorbed; latent R={R} + P={P}, block {bs}), B={B} ctx={ctx}: the default "
           f"launch, then the launch sweep (bf16 cache); backends {', '.join(S.mla_backends)}\n"
           "| heads | cache | launch | us | GB/s | % read | TFLOP/s | % roofline |\n|---|---|---|---|---|---|---|---|")
    for heads in S.mla_heads:
        for cache in ("bfloat16", "float8_e4m3fn"):
            for backend in S.mla_backends:
                _time_backend(b, heads, cache, backend)


def _time_backend(b: Bench, heads: int, cache: str, backend: str) -> None:
    """The rows of one (heads, cache, backend): its default launch, then its sweep (bf16)."""
    import jax.numpy as jnp
    S = b.S
    R, P, bs = S.mla_shape
    B, ctx = S.mla_batch
    nbytes = B * ctx * (R + P) * jnp.dtype(cache).itemsize
    flops = 2.0 * B * ctx * heads * (2 * R + P)
    bound = max(nbytes / b.read_bw, flops / b.peak)
    seconds, fits = _timer(S, B, ctx, heads, cache, backend)
    what = f"MLA decode B={B} ctx={ctx} H={heads} {cache}" + ("" if backend == "triton" else f" ({backend})")
    prefix = "" if backend == "triton" else f"{backend}: "
    if not fits({}):
        b.emit(f"| {heads} | {cache} | {prefix}not supported at this shape or cache |")
        b.rows.append((what, "not supported at this shape or cache (the Triton kernel runs it)"))
        return
    if backend == "triton":
        launches = [{}] + (_launches(heads, R + P, S.interpret) if S.mla_sweep and cache == "bfloat16" else [])
    else:                                    # a short sweep, run with --no-sweep too
        launches = [{}] + _mgpu_launches(heads, S.interpret, fits)
    timed = []
    for launch in launches:
        label = prefix + _label(launch)
        try:
            t = seconds(launch)
        except Exception as e:  # noqa: BLE001  (a launch that does not compile is said, not fatal)
            b.emit(f"| {heads} | {cache} | {label} | {type(e).__name__}: "
                   f"{str(e).splitlines()[0][:120] if str(e) else ''} |")
            continue
        timed.append((t, launch))
        b.emit(f"| {heads} | {cache} | {label} | {t * 1e6:.1f} | {nbytes / t / 1e9:.0f} | "
               f"{b.read_pct(nbytes / t):.0f} | {flops / t / 1e12:.0f} | {100 * bound / t:.0f} |")
    if not timed:
        b.rows.append((what, "FAILED: no launch compiled"))
        return
    t0 = next((t for t, launch in timed if not launch), None)
    t_best, best = min(timed, key=lambda x: x[0])
    res = (f"default {t0 * 1e6:.1f} us, {nbytes / t0 / 1e9:.0f} GB/s ({b.read_pct(nbytes / t0):.0f} % of "
           f"read, {100 * bound / t0:.0f} % of roofline)" if t0 else "default FAILED")
    if best:
        res += (f"; best {_label(best)}: {t_best * 1e6:.1f} us, {nbytes / t_best / 1e9:.0f} GB/s "
                f"({b.read_pct(nbytes / t_best):.0f} % of read)")
    b.rows.append((what, res))
