"""Ragged paged attention for NVIDIA GPUs in Pallas (Triton lowering).

Same function as ``ref_attention.ragged_paged_attention`` over the engine's cache layout
``[num_blocks, kv_heads, block_size, head_dim]``, whose fp8 caches store V pages transposed,
``[num_blocks, kv_heads, head_dim, block_size]`` (``ref_attention.v_transposed``); ``k_scale``/``v_scale``
dequantize an fp8 cache.

One launch runs two kinds of tile over one output buffer (the tiles: ``paged_attention_tiles``):

* **prefill tiles** cover requests with ``q_len > 1`` in blocks of ``block_q`` tokens; a tile is
  ``block_q * group`` rows (tokens x the q heads of one kv head), so one K/V read serves the whole GQA
  group; causal masking and the sliding window come from each row's absolute position. Tiles find their
  request in-kernel (binary search over ``qsl[r] // block_q + r``), so there is no XLA pre-pass;
* **decode tiles** take requests with ``q_len == 1``, one per (request, kv head, split): the KV axis is
  split ``num_splits`` ways (flash-decoding) when there are too few (request, head) pairs to fill the
  chip, and a small second kernel (``flash_decoding.combine``) merges the splits' softmax states.

A step the caller marks ``decode_only`` (every real request has ``q_len == 1``; the engine knows this on the
host and compiles a variant for it) runs the decode tiles alone: no prefill tile slots, and a program size of
its own (64-key tiles in 2 warps, 2 programs per SM, so one program's first loads overlap the other's
streaming), which reads K/V faster than the mixed launch's one-program-per-SM tiles. That launch can also
write the step's K/V (``write_kv``): each token's own key and value come from registers, so a batch-1 decode
layer runs one attention launch and no separate K/V write; where the host bounds the contexts
(``md.max_seq_len``), the split count comes from that bound rather than the block tables' span.

K/V are read a page-row at a time: token ``pos`` of request ``r`` is row
``(block_tables[r, pos // block_size] * kv_heads + h) * block_size + pos % block_size`` of the cache seen as
``[num_blocks * kv_heads * block_size, head_dim]`` -- a gather of contiguous ``head_dim`` rows, each page's
``block_size`` rows one contiguous run, that Triton turns into 16-byte vector loads pipelined over
``num_stages``. Interior KV chunks (below every row's
diagonal, inside every row's window) skip all masking.

Why Triton and not Mosaic GPU (``jax.experimental.pallas.mosaic_gpu``) for decode:
* decode is a memory-bound gather through block tables. Triton expresses it as pointer arithmetic on any
  page size, and its 16-byte vector loads stream K/V close to the HBM read ceiling once context is long
  (kernels/README.md has the figures); a Mosaic GPU kernel would need one small TMA per 16-token page and
  head (one contiguous ``[block_size, head_dim]`` run, 4 KiB in bf16), which gains nothing for a stream
  this size;
* prefill is compute-bound, and there Mosaic GPU's wgmma + warp specialisation matter, so prefill tokens of
  large steps go to ``prefill_mgpu`` (``prefill_kernel``, below). Decodes stay here;
* Triton also runs in interpret mode on CPU, which is how the tests check this kernel.
The Pallas Triton lowering is deprecated in JAX 0.11 but present and working in the pinned 0.11.2.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import flash_decoding, paged_attention_tiles as tiles, prefill_mgpu
from .device_info import num_sms
from .triton_rows import next_pow2
from .metadata import AttentionMetadata
from .ref_attention import head_scale
from .ref_attention import v_transposed as v_transposed_dtype

MGPU_MIN_TOKENS = 512  # prefill_kernel="auto": token slots from which a step uses the Mosaic GPU prefill


def _prefill_tokens(md: AttentionMetadata, T: int):
    """[T] bool: token t belongs to a real request with more than one new token."""
    qsl = md.query_start_loc.astype(jnp.int32)
    tok = jnp.arange(T, dtype=jnp.int32)
    r = jnp.clip(jnp.searchsorted(qsl, tok, side="right") - 1, 0, qsl.shape[0] - 2)
    return (tok < qsl[md.num_seqs]) & (qsl[r + 1] - qsl[r] > 1)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "soft_cap", "sliding_window", "interpret", "decode_block_k", "decode_splits",
    "decode_warps", "decode_stages", "prefill_block_m", "prefill_block_k", "poison_output", "dot_dtype",
    "prefill_kernel", "mgpu_block_kv", "mgpu_stages", "decode_only", "num_q_heads", "write_kv"))
def ragged_paged_attention(q, k_cache, v_cache, md: AttentionMetadata, *, sm_scale: float,
                           soft_cap: float | None = None, sliding_window: int | None = None,
                           k_scale=None, v_scale=None, interpret: bool = False,
                           decode_block_k: int | None = None, decode_splits: int | None = None,
                           decode_warps: int | None = None, decode_stages: int | None = None,
                           prefill_block_m: int = 128, prefill_block_k: int | None = None,
                           poison_output: bool = False, dot_dtype=None, prefill_kernel: str = "triton",
                           mgpu_block_kv: int = 128, mgpu_stages: int = 2, decode_only: bool | None = None,
                           num_q_heads: int | None = None, write_kv: bool = False):
    """Pallas version of ``ref_attention.ragged_paged_attention`` (same arguments, same result).

    ``num_q_heads``: the queries are the first ``num_q_heads`` heads of ``q [T, H, D]`` (default: all ``H``);
    the heads after them are skipped, so ``q`` can be the step's q, k and v packed in one array (``ops.
    write_kv_and_attend``). The output is ``[T, num_q_heads, D]``.

    ``k_scale``/``v_scale``: dequantisation scales (scalar or ``[kv_heads]``) of an fp8 cache, else None.
    The ``decode_*``/``prefill_*`` knobs are tile sizes and Triton launch parameters (static); prefill and
    decode tiles share one launch and its decode warps/stages.
    ``poison_output`` (tests): start real tokens' rows as NaN so a row no kernel writes fails the check.
    ``dot_dtype``: operand dtype of the kernel's two matmuls. Default: q's dtype, except that a bf16 q over
    an fp8 cache uses f16: e4m3 -> f16 is one hardware conversion on Hopper, e4m3 -> bf16 is not (with bf16
    operands the fp8 cache decoded slower than a bf16 cache); q and the softmax weights are then f16 too; q tiles are cast in the kernel after their load, and the kernel stores
    q's dtype.
    ``decode_stages``: default 3; with an fp8 cache 4, or in the decode-only launch's 64-key tiles 6.
    ``decode_block_k`` default 64 in the decode-only launch, else 128; ``prefill_block_k`` 64; over an fp8
    cache's transposed V pages both at least the page size (a V^T tile spans whole pages).
    ``prefill_kernel``: ``"triton"`` (prefill tiles in this file), ``"mgpu"`` (the Mosaic GPU kernel of
    ``prefill_mgpu`` for the prefill tokens, then the decode launch, wherever ``prefill_mgpu.supported``;
    else triton) or ``"auto"`` (mgpu where supported and the step has at least ``MGPU_MIN_TOKENS`` token
    slots: its extra launch is nothing next to a long prefill but shows on small decode steps). The
    default here is triton (the benchmarks' baseline); the engine's ``pallas`` backend passes auto.
    ``decode_only`` (default: ``md.decode_only``): every real request has ``q_len == 1``; only the decode
    launch runs, so no prefill tile slots are scheduled and its shared memory is the decode tile's alone.
    The flash-decoding split count (``decode_splits`` default) comes from the requests, kv heads and the longest
    context the step can see: ``md.max_seq_len`` where the host bounds it, else the block tables' span.
    ``write_kv`` (decode-only steps; ``q`` packed as ``[T, num_q_heads + 2 * kv_heads, D]``, K then V behind
    the queries, as ``ops.write_kv_and_attend`` packs them): the decode launch also stores each real token's
    K/V at ``md.slot_mapping`` (``kv_write_pallas.write_kv``'s result, in the same launch, padding tokens
    skipped) and attends to it; returns ``(out, k_cache, v_cache)``. Each token's slot must be its request's
    position ``seq_len - 1`` (or ``PAD_SLOT``), as the engine's are.
    """
    if prefill_kernel not in ("triton", "mgpu", "auto"):
        raise ValueError(f"prefill_kernel must be triton, mgpu or auto, got {prefill_kernel!r}")
    q_stride = q.shape[1]                          # heads per token in q's rows; the first hq are the queries
    hq = num_q_heads or q_stride
    if not 0 < hq <= q_stride:
        raise ValueError(f"num_q_heads={num_q_heads} must be in [1, {q_stride}] (q has {q_stride} heads)")
    fp8_cache = jnp.dtype(k_cache.dtype).itemsize == 1
    if dot_dtype is None and fp8_cache and q.dtype == jnp.bfloat16:
        dot_dtype = jnp.float16
    if decode_only is None:
        decode_only = md.decode_only
    # Decode tile defaults (tuned on the H200 with benchmarks' decode sweep). The mixed launch shares one
    # program size with the prefill tiles (one program per SM), where 128-key tiles did best. The
    # decode-only launch runs 64-key tiles in 2 warps: 96 KiB of shared memory at 3 stages, 2 programs per
    # SM, so one program's first loads overlap the other's streaming. An fp8 cache (V pages transposed)
    # wants a deeper pipeline: 6 stages did best, 5 and 7 were within noise or slower.
    v_transposed = v_transposed_dtype(v_cache.dtype)
    nb, kvh, bs, _ = k_cache.shape
    if decode_block_k is None:
        decode_block_k = 64 if decode_only else 128
        if v_transposed:                            # a V^T tile spans whole pages (pages of 128: 128-key tiles)
            decode_block_k = max(decode_block_k, bs)
    if prefill_block_k is None:
        prefill_block_k = max(64, bs) if v_transposed else 64
    if decode_warps is None:
        decode_warps = 2 if decode_only else 4
    if decode_stages is None:
        decode_stages = 3
        if fp8_cache:       # the decode-only launch's 64-key fp8 tiles take a deeper pipeline (128-key ones: 4)
            decode_stages = 6 if decode_only and decode_block_k <= 64 else 4
    # q tiles are cast to the matmul dtype in the kernel, after their load: no XLA pass over q (or over the
    # packed q/k/v array) and no cast of the output back (the kernel stores q's dtype)
    tile_dot = jnp.dtype(dot_dtype) if dot_dtype is not None and jnp.dtype(dot_dtype) != q.dtype else None
    q_only = q if hq == q_stride else q[:, :hq]    # the queries alone, for the Mosaic GPU prefill (its TMA)
    # the Mosaic GPU prefill takes no fp8 cache: such steps keep their prefill tokens on the Triton tiles
    mgpu_ok = not v_transposed and tile_dot is None and prefill_mgpu.supported(
        q_only, k_cache, soft_cap=soft_cap, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale,
        block_kv=mgpu_block_kv, stages=mgpu_stages)
    limited = md.attend_limit is not None     # the Mosaic GPU prefill has no attend limit: Triton tiles
    use_mgpu = mgpu_ok and not limited and (prefill_kernel == "mgpu" or (prefill_kernel == "auto" and not interpret
                                                         and q.shape[0] >= MGPU_MIN_TOKENS))
    T, _, d = q.shape
    if write_kv and not (decode_only and q_stride == hq + 2 * k_cache.shape[1]):
        raise ValueError(f"write_kv needs a decode-only step and q packed as [T, {hq} + 2 x {k_cache.shape[1]}, D] "
                         f"(got decode_only={decode_only}, {q_stride} heads)")
    if not v_transposed and v_cache.shape != k_cache.shape:
        raise ValueError(f"a {v_cache.dtype} V cache needs pages shaped like K's {k_cache.shape}, got "
                         f"{v_cache.shape}")
    R, P = md.block_tables.shape
    if hq % kvh:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({kvh})")
    group = hq // kvh
    group_pad = next_pow2(group)
    qsl = md.query_start_loc.astype(jnp.int32)
    ins = (qsl, md.seq_lens.astype(jnp.int32), md.num_seqs.reshape(1).astype(jnp.int32),
           md.block_tables.reshape(R * P).astype(jnp.int32), head_scale(k_scale, kvh), head_scale(v_scale, kvh),
           q.reshape(T * q_stride, d), k_cache.reshape(nb * bs * kvh, d),
           v_cache.reshape(nb * kvh * d, bs) if v_transposed else v_cache.reshape(nb * bs * kvh, d))
    if write_kv:
        ins += (md.slot_mapping.astype(jnp.int32),)
    if limited:       # the rows of a request with q_len 1 never need it (an image's last token sees itself)
        if decode_only:
            raise ValueError("md.attend_limit needs prefill tiles: the step cannot be decode_only")
        ins += (md.attend_limit.astype(jnp.int32),)
    common = dict(kv_heads=kvh, block_size=bs, pages_per_seq=P, sm_scale=float(sm_scale),
                  soft_cap=soft_cap, sliding_window=sliding_window, v_transposed=v_transposed)
    block_q = max(1, prefill_block_m // group_pad)
    n_prefill = T // block_q + R                   # tile slots of the in-kernel prefill schedule
    if v_transposed and (decode_block_k % bs or (not decode_only and prefill_block_k % bs)
                         or tuple(v_cache.shape) != (nb, kvh, d, bs)):
        raise ValueError(f"an fp8 cache needs V pages [blocks, kv_heads, head_dim, block_size] and key tiles "
                         f"a multiple of block_size; got {v_cache.shape}, block_k {decode_block_k} / {prefill_block_k}")
    span = P * bs if md.max_seq_len is None else min(P * bs, md.max_seq_len)    # the longest context it can see
    splits = decode_splits or flash_decoding.pick_splits(R, kvh, span, decode_block_k)
    if splits & (splits - 1):
        raise ValueError(f"decode_splits must be a power of two, got {splits}")
    prefill_kw = dict(group=group, group_pad=group_pad, block_q=block_q, block_k=prefill_block_k,
                      q_stride=q_stride, dot_dtype=tile_dot, **common)
    decode_kw = dict(group=group, rows=max(16, group_pad), num_splits=splits, block_k=decode_block_k,
                     q_stride=q_stride, dot_dtype=tile_dot, **common)  # tl.dot needs M >= 16

    # The first launch allocates the output and writes every real token's rows; padding tokens' rows are left
    # unwritten (the model never reads them back: logits are taken at real tokens only, and every op on the
    # way is row-wise). ``poison_output`` (tests) passes in a buffer instead: real rows NaN, padding zero.
    first_ins, first_alias = ins, {}
    if poison_output:
        real = jnp.repeat(jnp.arange(T) < qsl[md.num_seqs], hq)
        out = jnp.where(real[:, None], jnp.nan, jnp.zeros((T * hq, d), q.dtype)).astype(q.dtype)
        first_ins, first_alias = ins + (out,), {len(ins): 0}
    out_shape = jax.ShapeDtypeStruct((T * hq, d), q.dtype)
    part_shapes = (jax.ShapeDtypeStruct((splits * R * hq, d), jnp.float32),
                   jax.ShapeDtypeStruct((splits * R * hq,), jnp.float32),
                   jax.ShapeDtypeStruct((splits * R * hq,), jnp.float32))
    decode_params = plgpu.CompilerParams(num_warps=decode_warps, num_stages=decode_stages)

    cache_shapes = (jax.ShapeDtypeStruct(ins[7].shape, k_cache.dtype),
                    jax.ShapeDtypeStruct(ins[8].shape, v_cache.dtype))

    def decode_launch(ins_, alias, name):
        """The decode tiles alone: straight into the output (1 split) or the splits' softmax states; with
        ``write_kv`` the caches too (aliased to their inputs: updated in place)."""
        shapes = (out_shape,) if splits == 1 else part_shapes
        if write_kv:
            alias = {**alias, 7: len(shapes), 8: len(shapes) + 1}
            shapes += cache_shapes
        res = pl.pallas_call(
            functools.partial(tiles.decode_kernel, tile_kw=decode_kw, n_in=len(ins_), write_kv=write_kv),
            grid=(R, kvh, splits), out_shape=shapes, input_output_aliases=alias,
            compiler_params=decode_params, interpret=interpret,
            name=name + ("_write_kv" if write_kv else ""))(*ins_)       # the trace tells the two apart
        if write_kv:
            new_caches.extend(res[-2:])
            res = res[:-2]
        return res[0] if splits == 1 else tuple(res)

    new_caches = []

    parts, out = (), None
    if decode_only:
        if splits == 1:
            out = decode_launch(first_ins, first_alias, "ragged_paged_decode")
        else:
            parts = decode_launch(ins, {}, "ragged_paged_decode_split")
            out = first_ins[len(ins)] if poison_output else None
    elif not use_mgpu:
        res = pl.pallas_call(
            functools.partial(tiles.fused_kernel, n_prefill=n_prefill, prefill_kw=prefill_kw, decode_kw=decode_kw,
                              n_in=len(first_ins), limited=limited),
            grid=(n_prefill + R * splits, kvh),
            out_shape=(out_shape,) + (part_shapes if splits > 1 else ()),
            input_output_aliases=first_alias, compiler_params=decode_params, interpret=interpret,
            name="ragged_paged_attention")(*first_ins)
        out, parts = res[0], tuple(res[1:])
    else:                                  # Mosaic GPU prefill, then the decode launch into its output
        out = prefill_mgpu.prefill_attention(q_only, k_cache, v_cache, md, sm_scale=float(sm_scale),
                                             block_kv=mgpu_block_kv, stages=mgpu_stages, num_programs=num_sms(),
                                             interpret=interpret).reshape(T * hq, d)
        if poison_output:                  # keep the kernel's prefill rows, the poisoned buffer elsewhere
            out = jnp.where(jnp.repeat(_prefill_tokens(md, T), hq)[:, None], out, first_ins[9])
        if splits == 1:
            out = decode_launch(ins + (out,), {9: 0}, "ragged_paged_decode")
        else:
            parts = decode_launch(ins, {}, "ragged_paged_decode_split")
    if splits > 1:
        # the combine writes the decode rows into ``out`` (aliased) or, decode-only, allocates the output
        outs = (out,) if out is not None else ()
        out = flash_decoding.combine(ins[0], ins[1], ins[2], ins[5], parts, outs, out_shape=out_shape,
                                    grid=(R, kvh), num_splits=splits, group=group, group_pad=group_pad,
                                    num_q_heads=hq, interpret=interpret)
    out = out.reshape(T, hq, d)                    # the kernels store q's dtype
    if write_kv:
        return out, new_caches[0].reshape(k_cache.shape), new_caches[1].reshape(v_cache.shape)
    return out
