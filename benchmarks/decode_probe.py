"""Decode attention launch configurations on one GPU, in about two device minutes (kernels_bench takes ~7).

    python benchmarks/decode_probe.py [--sections main,small,fp8,tune,sweep,long1,fp8b,mixed,fp8qk,fp8c,layout,fp8d,vt]

Times, with kernels_bench's method (jitted chains of calls over a >= 1 GiB pool, median of reps):
* main: decode B=64 ctx 2048 (32q/8kv, d128, bf16, pages of 16) -- the fused launch the engine used for
  every step, the decode-only launch (``decode_only=True``: the engine's uniform-decode steps) in several
  tile configurations, the stock kernel; plus the B=64 ctx-16 fixed-cost probe;
* small: batch 1-4 as the engine's smallest default bucket pads it (T = R = MIN_TOKEN_BUCKET), fused against decode-only;
* fp8: an e4m3 cache at B=8 ctx 32768 against bf16, fused and decode-only configurations;
* fp8qk: the fp8 cache with QK^T on e4m3 operands (``fp8_qk``), checked and timed;
* fp8c: fp8 at B=8 ctx 32768 over split counts x pipeline depths, and the fixed cost of splitting;
* layout: head-major (the engine's) against token-major cache pages (``kv_layout``), bf16 and fp8, checked
  and timed;
* fp8d: fp8 (its default layout) at 6 / 7 / 8 stages against bf16, B=8 ctx 32768 and B=64 ctx 8192, three
  interleaved rounds;
* vt: V pages stored transposed (``kv_layout="hnd-vt"``, an fp8 cache's layout since the tenth session), checked
  bit for bit against head-major, then timed against it, bf16 and fp8, two interleaved rounds.
An fp8 cache is timed in its default layout (V pages transposed) unless a variant names ``kv_layout``.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kernels_bench as kb

D = dict(decode_only=True)
FP8 = dict(cache_dtype=jnp.float8_e4m3fn, k_scale=np.float32(0.5))    # an e4m3 cache, per-tensor scale


def row(name, t, tbs=None):
    extra = f" | {tbs:.2f} TB/s | {100 * tbs / kb.CEIL_TBS:.0f}%" if tbs is not None else ""
    kb.log(f"| {name} | {t * 1e6:.1f} us{extra} |")


def try_decode(S, B, ctx, name, **cfg):
    try:
        t, tbs = kb.time_decode(S, B, ctx, **cfg)
    except Exception as e:   # a config that does not compile is reported, not fatal
        kb.log(f"| {name} {cfg} | failed: {type(e).__name__}: {str(e)[:300]} |")
        return None
    row(f"{name} {cfg or 'default'}", t, tbs)
    return t


def section_main(S):
    B, ctx = S.main_b, S.main_ctx
    kb.log(f"\n## decode B={B} ctx={ctx} {S.hq}q/{S.kvh}kv d={S.d} bf16 block {S.bs}")
    kb.log("| variant | time | KV read | % of 4.3 TB/s |\n|---|---|---|---|")
    try_decode(S, B, ctx, "stock", which="stock")
    variants = [dict(), dict(D), dict(D, decode_stages=4), dict(D, decode_stages=2),
                dict(D, decode_block_k=64), dict(D, decode_block_k=64, decode_stages=4),
                dict(D, decode_block_k=64, decode_stages=2), dict(D, decode_block_k=64, decode_warps=2),
                dict(D, decode_block_k=32, decode_stages=4), dict(D, decode_splits=2),
                dict(D, decode_splits=2, decode_block_k=64), dict(D, decode_warps=8)]
    for cfg in variants:
        try_decode(S, B, ctx, "ours", **cfg)
    for cfg in (dict(), dict(D), dict(D, decode_block_k=64)):
        try_decode(S, B, 16, "fixed cost B=64 ctx=16: ours", **cfg)
    try_decode(S, B, 16, "fixed cost B=64 ctx=16: stock", which="stock")


def section_tune(S):
    """Decode-only tile configurations around the first probe's best (block_k 64, 2 warps)."""
    B, ctx = S.main_b, S.main_ctx
    kb.log(f"\n## decode-only tiles, B={B} ctx={ctx}")
    kb.log("| variant | time | KV read | % of 4.3 TB/s |\n|---|---|---|---|")
    for bk, w, st in [(64, 2, 3), (64, 2, 2), (64, 2, 4), (64, 1, 3), (32, 1, 3), (32, 2, 4), (128, 2, 2),
                      (128, 2, 3), (128, 4, 2), (64, 4, 3)]:
        try_decode(S, B, ctx, "ours", **dict(D, decode_block_k=bk, decode_warps=w, decode_stages=st))
    try_decode(S, B, ctx, "ours, fused (before)", decode_block_k=128)


def section_sweep(S):
    """B x ctx: the fused launch (what every step ran before), decode-only at its defaults, stock."""
    kb.log("\n## sweep: us and TB/s of K+V read")
    kb.log("| B | ctx | fused us | decode-only us | decode-only TB/s | % | stock us | stock TB/s |")
    kb.log("|---|---|---|---|---|---|---|---|")
    for B in S.sweep_b:
        for ctx in S.sweep_ctx:
            if kb.kv_bytes(S, B * ctx) > S.max_kv_gib * 2 ** 30:
                continue
            try:
                t0, _ = kb.time_decode(S, B, ctx)
                t1, b1 = kb.time_decode(S, B, ctx, **D)
                t2, b2 = kb.time_decode(S, B, ctx, which="stock")
            except Exception as e:
                kb.log(f"| {B} | {ctx} | failed: {type(e).__name__}: {str(e)[:200]} |")
                continue
            kb.log(f"| {B} | {ctx} | {t0 * 1e6:.1f} | {t1 * 1e6:.1f} | {b1:.2f} | {100 * b1 / kb.CEIL_TBS:.0f}% | "
                   f"{t2 * 1e6:.1f} | {b2:.2f} |")


def section_small(S):
    T = R = kb.MIN_TOKEN_BUCKET                     # the engine's batch-1 decode step
    P = 4096 // S.bs
    kb.log(f"\n## small-batch decode in the engine's T={T} bucket (R={R} request rows, tables {P} pages)")
    kb.log("| variant | time |\n|---|---|")
    variants = [dict(), dict(D), dict(D, decode_splits=1), dict(D, decode_splits=2), dict(D, decode_splits=4),
                dict(D, decode_splits=8), dict(D, decode_block_k=64), dict(D, decode_block_k=64, decode_splits=4),
                dict(D, decode_block_k=32, decode_splits=8)]
    for B, ctx in [(1, 256), (1, 2048), (4, 1024)]:
        inputs = kb.engine_decode_inputs(S, B, ctx, T, R, P)
        for cfg in variants:
            try:
                t = kb.time_engine_decode(S, B, inputs, **cfg)
            except Exception as e:
                kb.log(f"| B={B} ctx={ctx} {cfg} | failed: {type(e).__name__}: {str(e)[:200]} |")
                continue
            row(f"B={B} ctx={ctx} {cfg or 'default'}", t)
        try_decode(S, B, ctx, f"B={B} ctx={ctx} stock (B rows, no padding)", which="stock")


def section_fp8(S):
    for B, ctx in S.fp8_cases:
        kb.log(f"\n## fp8 (e4m3) cache, decode B={B} ctx={ctx}: time vs the bf16 cache")
        kb.log("| variant | time | bytes read/s | % |\n|---|---|---|---|")
        t16 = try_decode(S, B, ctx, "bf16 cache, decode-only", **D)
        try_decode(S, B, ctx, "bf16 cache, fused", decode_block_k=128)
        best = None
        for cfg in [dict(decode_block_k=128), dict(D), dict(D, decode_stages=10), dict(D, decode_stages=12),
                    dict(D, decode_block_k=32, decode_stages=8), dict(D, decode_block_k=32, decode_stages=12),
                    dict(D, decode_block_k=32, decode_warps=1, decode_stages=12),
                    dict(D, decode_warps=4, decode_stages=8)]:
            t = try_decode(S, B, ctx, "fp8", **FP8, **cfg)
            if t is not None and (best is None or t < best[0]):
                best = (t, cfg)
        if t16 and best:
            kb.log(f"\nfp8 best {best[1]}: {best[0] * 1e6:.1f} us = {best[0] / t16:.2f}x the bf16 decode-only time")


def fp8_against_bf16(S, title, B, ctx, cfgs):
    """A table: the bf16 cache's decode-only time, then each fp8 configuration and its ratio to it."""
    kb.log(f"\n## {title}\n| variant | time | bytes read/s | % |\n|---|---|---|---|")
    t16 = try_decode(S, B, ctx, "bf16 cache, decode-only", **D)
    for cfg in cfgs:
        t = try_decode(S, B, ctx, "fp8", **FP8, **cfg)
        if t and t16:
            kb.log(f"|   = {t / t16:.3f}x bf16 | | | |")


def section_fp8b(S):
    """fp8 split counts and pipeline depths around the default (64 keys, 2 warps, 7 stages = 112 KiB, two
    programs per SM; 8 stages = 128 KiB, one; the default was 8 until the ninth session)."""
    for B, ctx, extra in [(8, 32768, [dict(decode_splits=4), dict(decode_splits=16),
                                      dict(decode_block_k=32, decode_warps=1, decode_stages=12, decode_splits=16)]),
                          (64, 8192, [])]:
        fp8_against_bf16(S, f"fp8 B={B} ctx={ctx}", B, ctx,
                         [dict(D), dict(D, decode_stages=8), dict(D, decode_stages=5)] + [dict(D, **e) for e in extra])


def check_fp8_qk(S) -> bool:
    """fp8_qk (QK^T on e4m3 operands, q scaled per row) against the reference with the same q rounding:
    decode-only and fused launches (prefill tiles included), auto and 4 splits."""
    ok = True
    for q_lens, ctx_lens, launch in [([1] * 5, [700, 33, 1, 300, 17], dict(decode_only=True)),
                                     ([1, 1, 37, 1, 130, 1], [700, 33, 37, 1, 300, 17], dict(decode_only=False))]:
        for splits in (None, 4):
            rng = np.random.default_rng(11)
            q, k, v, md = kb.synthetic.make_batch(rng, q_lens, ctx_lens, block_size=S.bs, num_q_heads=S.hq,
                                                  num_kv_heads=S.kvh, head_dim=S.d, dtype=jnp.bfloat16,
                                                  pad_tokens=3, pad_reqs=1)
            scale = jnp.linspace(0.5, 1.5, S.kvh)
            k, v = kb.ref_attention.quantize_caches(k, v, jnp.float8_e4m3fn, scale, scale)
            kw = dict(sm_scale=S.d ** -0.5, k_scale=scale, v_scale=scale)
            ref = np.asarray(kb.ref_attention.ragged_paged_attention(q, k, v, md, fp8_query=True, **kw), np.float32)
            out = np.asarray(kb.pa.ragged_paged_attention(q, k, v, md, poison_output=True, decode_splits=splits,
                                                          interpret=S.interpret,
                                                          fp8_qk=True, **launch, **kw), np.float32)
            err = float(np.abs(out - ref).max() / np.abs(ref).max()) if not np.isnan(out).any() else float("nan")
            good = err <= 1e-2
            ok &= good
            kb.log(f"- fp8_qk {launch}, splits={splits or 'auto'}: {err:.2e} (tol 1e-02) {'ok' if good else 'FAIL'}")
    return ok


def section_fp8qk(S):
    """fp8 cache with QK^T on e4m3 operands (``fp8_qk``): K goes to the MMA as stored. Against the bf16
    decode-only time and the f16-operand fp8 default, at the issue's long-context cases."""
    kb.log("\n## fp8_qk correctness")
    try:
        check_fp8_qk(S)
    except Exception as e:
        kb.log(f"- fp8_qk check failed: {type(e).__name__}: {str(e)[:400]}")
    for B, ctx in [(8, 32768), (64, 8192), (64, 2048)]:
        fp8_against_bf16(S, f"fp8_qk B={B} ctx={ctx}", B, ctx,
                         [dict(D), dict(D, fp8_qk=True), dict(D, fp8_qk=True, decode_stages=6),
                          dict(D, fp8_qk=True, decode_stages=10),
                          dict(D, fp8_qk=True, decode_block_k=128, decode_stages=4), dict(D, fp8_qk=True, decode_warps=4)])


def section_fp8c(S):
    """fp8 at B=8 ctx 32768 (the case at the 0.6x line): split counts x pipeline depths that change how many
    programs share an SM (8 stages of 64-key fp8 tiles = 128 KiB: one per SM; 7, the default: two; 4: three), and the
    fixed cost of splitting (B=8 ctx 256: splits 8 against 1, i.e. the combine launch and the partials)."""
    fp8_against_bf16(S, "fp8 B=8 ctx=32768: splits x stages", 8, 32768,
                     [dict(D), dict(D, decode_splits=4, decode_stages=7), dict(D, decode_splits=4, decode_stages=6),
                      dict(D, decode_splits=2, decode_stages=8), dict(D, decode_splits=2, decode_stages=12),
                      dict(D, decode_splits=8, decode_stages=4), dict(D, decode_splits=16, decode_stages=7),
                      dict(D, decode_splits=8, decode_block_k=128, decode_stages=3),
                      dict(D, decode_splits=8, decode_block_k=32, decode_warps=1, decode_stages=8),
                      dict(D, decode_splits=4, decode_block_k=32, decode_warps=1, decode_stages=8),
                      dict(D, decode_splits=4, fp8_qk=True, decode_stages=7)])
    kb.log("\n## fixed cost of splitting, B=8 ctx=256\n| variant | time | bytes read/s | % |\n|---|---|---|---|")
    for cache in ({}, FP8):
        for splits in (1, 8):
            try_decode(S, 8, 256, "fp8" if cache else "bf16", **cache, **dict(D, decode_splits=splits))


def section_mixed(S):
    """The mixed step (200 decodes + 2 chunks of 1024) with the Mosaic GPU prefill: its decode launch is a
    launch of its own, so it could take the decode-only tile size; timed against the fused Triton launch."""
    nd, nc, c = S.mixed_decodes, S.mixed_chunks, S.mixed_chunk
    ql, cl = [1] * nd + [c] * nc, [S.mixed_ctx] * nd + [2 * c] * nc
    base = dict(prefill_kernel="mgpu", fused=False)
    kb.log(f"\n## mixed step {nd} decodes + {nc} x {c}\n| variant | time |\n|---|---|")
    for _ in range(2):
        for name, cfg in [("mgpu + decode tiles 128 keys / 4 warps", dict(base, decode_block_k=128, decode_warps=4)),
                          ("mgpu + decode tiles 64 keys / 2 warps", dict(base, decode_block_k=64, decode_warps=2)),
                          ("fused triton", dict(decode_block_k=128, decode_warps=4))]:
            t, _ = kb.time_ragged(S, ql, cl, **cfg)
            row(name, t)


def section_long1(S):
    """Batch 1 at long context: the split count (decode-only now caps splits at >= 512 keys each)."""
    kb.log("\n## batch 1, long context\n| variant | time | KV read | % |\n|---|---|---|---|")
    for ctx in (8192, 32768):
        try_decode(S, 1, ctx, f"ctx {ctx} fused", decode_block_k=128)
        try_decode(S, 1, ctx, f"ctx {ctx} decode-only", **D)
        try_decode(S, 1, ctx, f"ctx {ctx} stock", which="stock")


def check_same_output(S, layout, to_layout) -> bool:
    """Pages in ``layout`` (``to_layout(k, v)`` of the head-major caches) give the head-major (the engine's)
    output bit for bit, bf16 and fp8, decode-only."""
    ok = True
    for cache in ({}, FP8):
        q, k, v, tables, seq_lens, _ = kb.decode_inputs(S, S.main_b, S.main_ctx, cache_dtype=cache.get("cache_dtype"))
        scale = cache.get("k_scale")
        outs = []
        for name, (kk, vv) in (("hnd", (k, v)), (layout, to_layout(k, v))):
            step = kb.ours_decode_step(S, k_scale=scale, v_scale=scale, kv_layout=name, **D)
            outs.append(np.asarray(jax.jit(step)(q, kk, vv, tables[0], seq_lens), np.float32))
        same = bool(np.array_equal(outs[0], outs[1]))
        ok &= same
        kb.log(f"- {'fp8' if cache else 'bf16'} B={S.main_b} ctx={S.main_ctx}: {layout} equals hnd bit for bit: {same}")
    return ok


def check_layout(S) -> bool:
    """Token-major pages (``kv_layout="nhd"``) give the same output as head-major, bit for bit."""
    return check_same_output(S, "nhd", lambda k, v: (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)))


def section_layout(S):
    """Cache page layout: head-major [blocks, kv_heads, block, d] (the engine's), where one head's page is one
    contiguous run (2 KiB fp8, 4 KiB bf16 at d=128, pages of 16), against token-major [blocks, block,
    kv_heads, d] (16 rows of 128/256 bytes a kv_heads*d stride apart), same kernel otherwise."""
    kb.log("\n## cache layout: head-major (hnd, default) vs token-major (nhd)")
    check_layout(S)
    N = dict(D, kv_layout="nhd")
    for B, ctx in [(8, 32768), (64, 8192), (64, 2048), (1, 32768), (256, 2048)]:
        kb.log(f"\n### B={B} ctx={ctx}\n| variant | time | bytes read/s | % |\n|---|---|---|---|")
        t16n = try_decode(S, B, ctx, "bf16 nhd", **N)
        t16 = try_decode(S, B, ctx, "bf16 hnd", **D)
        H = dict(D, kv_layout="hnd")                  # head-major V too (an fp8 cache's default transposes it)
        cfgs = [dict(N), dict(H), dict(H, decode_stages=6), dict(H, decode_stages=8), dict(H, fp8_qk=True)]
        if (B, ctx) != (8, 32768):
            cfgs = cfgs[:2]
        for cfg in cfgs:
            t = try_decode(S, B, ctx, "fp8", **FP8, **cfg)
            if t and t16 and t16n:
                kb.log(f"|   = {t / t16:.3f}x bf16 hnd, {t / t16n:.3f}x bf16 nhd | | | |")


def section_fp8d(S):
    """fp8 pipeline depth at the two long-context cases, interleaved with the bf16 reading over 3 rounds: one
    run read 7 stages at 0.597x the bf16 time against 0.615x for the default 8 (B=8 ctx 32768, eighth session),
    within the spread of single readings, so the rounds say whether the default should move."""
    for B, ctx in S.fp8_cases:
        kb.log(f"\n## fp8 depth B={B} ctx={ctx}, 3 interleaved rounds\n| variant | time | bytes read/s | % |\n|---|---|---|---|")
        for rnd in range(3):
            t16 = try_decode(S, B, ctx, f"round {rnd + 1}: bf16", **D)
            for st in (6, 7, 8):
                t = try_decode(S, B, ctx, f"round {rnd + 1}: fp8", **FP8, **dict(D, decode_stages=st))
                if t and t16:
                    kb.log(f"|   = {t / t16:.3f}x bf16 | | | |")


def check_vt(S) -> bool:
    """Transposed V pages (``kv_layout="hnd-vt"``) give the head-major output bit for bit."""
    return check_same_output(S, "hnd-vt", lambda k, v: (k, jnp.swapaxes(v, 2, 3)))


def section_vt(S):
    """V pages transposed per page ([blocks, kv_heads, D, block]: P.V takes V^T as a K-major operand, as QK^T
    takes K, so an fp8 V tile needs no 8-bit transpose on its way to the MMA) against head-major pages."""
    kb.log("\n## transposed V pages (hnd-vt) vs head-major (hnd), decode-only launch")
    try:
        check_vt(S)
    except Exception as e:                  # Triton may refuse the 3-D gather + reshape: report, keep timing
        kb.log(f"- hnd-vt check failed: {type(e).__name__}: {str(e)[:600]}")
    VT = dict(D, kv_layout="hnd-vt")
    for B, ctx in [(8, 32768), (64, 8192), (64, 2048)]:
        kb.log(f"\n### B={B} ctx={ctx}, 2 interleaved rounds\n| variant | time | bytes read/s | % |\n|---|---|---|---|")
        for rnd in range(2):
            t16 = try_decode(S, B, ctx, f"round {rnd + 1}: bf16 hnd", **D)
            try_decode(S, B, ctx, f"round {rnd + 1}: bf16 hnd-vt", **VT)
            for name, cfg in (("fp8 hnd", dict(D, kv_layout="hnd")), ("fp8 hnd-vt", dict(VT)),
                              ("fp8 hnd-vt 5 stages", dict(VT, decode_stages=5)),
                              ("fp8 hnd-vt 7 stages", dict(VT, decode_stages=7))):
                t = try_decode(S, B, ctx, f"round {rnd + 1}: {name}", **FP8, **cfg)
                if t and t16:
                    kb.log(f"|   = {t / t16:.3f}x bf16 hnd | | | |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="main,small,fp8")
    args = ap.parse_args(argv)
    S = kb.Sizes()
    kb.log(f"# decode_probe: jax {jax.__version__}, device {jax.devices()[0].device_kind}")
    for sec in args.sections.split(","):
        {"main": section_main, "small": section_small, "fp8": section_fp8, "tune": section_tune,
         "sweep": section_sweep, "long1": section_long1,
         "fp8b": section_fp8b, "mixed": section_mixed, "fp8qk": section_fp8qk,
         "fp8c": section_fp8c, "layout": section_layout, "fp8d": section_fp8d, "vt": section_vt}[sec](S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
