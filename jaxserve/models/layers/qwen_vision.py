"""The vision tower of Qwen2-VL and Qwen2.5-VL as ``flax.nnx`` modules, and the host packing of images into its
input, bucketed by patch count.

One tower, the two generations' differences as ``QwenVisionSpec`` choices: Qwen2-VL's blocks have LayerNorms
(with bias) and an ``fc2(act(fc1(.)))`` MLP and attend over the whole image in every block, its merger a
LayerNorm; Qwen2.5-VL's have RMSNorms and a SwiGLU MLP with biases, attend within windows of ``window x
window`` merge blocks except at ``full_blocks``, its merger an RMSNorm. Both: the 3-D patch embedding (a
still image is its own second frame), the 2-D rotary of each patch's row and column, the merger mapping each
``merge x merge`` block of patches to one text token.

Packing (``pack``): the images of one encoder call are laid out along rows of ``bucket`` patches (a size from a
small set: the runner's ``EncoderCache`` picks it from a ladder of about 1.2x steps, so the tower compiles once per
bucket, not per image size). Within a row each image takes consecutive spans of ``unit`` patches (one window): each
whole window a span, the partial windows of its right and bottom edges several to a span (``ImageLayout``), so
window attention is a reshape of the row into spans of ``unit`` patches masked to equal window ids and an image
pads at most its last few spans; without windows a merge block is the unit. Each patch carries its image's segment
id and its window's id (padding: -1): attention is masked to equal ids (within the image or the window, as HF's
``cu_seqlens`` and ``cu_window_seqlens``; pads only see pads), so padding never reaches an image's rows; full
attention over a long row runs in blocks of queries (scores ``block x N``, not ``N x N``). A row that holds one
image (``pack(single=True)``: every bucket but the smallest) also carries its patches' order with the image's own
first and their count (``FullRows``): a fused attention call then attends over the gathered patches by sequence
length, with no ``N x N`` mask to read. The merged tokens come back in the packed order; ``pack`` says where each
image's tokens (row-major) are. An image arrives as the front end made it (``image_blocks``' layout: the
processor's patch order, merge blocks row-major, in the tower's dtype), so packing it is one gather of whole merge
blocks into its slots, by index arrays cached per grid size.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import envs

from .decoder import COLUMN, COLUMN_BIAS, REPLICATED, ROW, _param, _w
from .norms import rms_norm
from .vision import _attend, _fc_mlp, _qkv, attention_implementation, layer_norm


QUERY_BLOCK = 4096       # full attention over a longer row runs in query blocks of at most this many patches


@dataclasses.dataclass(frozen=True)
class QwenVisionSpec:
    hidden_size: int                 # the ViT's width
    intermediate_size: int
    num_heads: int
    depth: int
    in_channels: int
    patch_size: int
    merge: int                       # spatial_merge_size
    temporal_patch_size: int
    out_hidden_size: int             # the text model's width (the merger's output)
    rope_theta: float
    norm: str                        # "layer" (Qwen2-VL) | "rms" (Qwen2.5-VL)
    mlp: str                         # "fc" (Qwen2-VL: fc2(act(fc1))) | "gated" (Qwen2.5-VL: SwiGLU)
    activation: str
    window: int = 0                  # window side in merge blocks; 0: full attention in every block
    full_blocks: tuple[int, ...] = ()    # blocks with full attention when windowed
    eps: float = 1e-6

    @property
    def unit(self) -> int:
        """Patches of one window (a merge block without windows): the granularity of the packed layout."""
        return max(self.window, 1) ** 2 * self.merge ** 2

    def windowed(self, block: int) -> bool:
        return self.window > 0 and block not in self.full_blocks

    def patches(self, pixel_shape: tuple) -> int:
        """Packed patches of an image whose payload is ``[lh, lw, ...]`` merge blocks (its partial windows
        padded)."""
        return image_layout(pixel_shape[0] * self.merge, pixel_shape[1] * self.merge, self.merge,
                            max(self.window, 1)).size * self.merge ** 2


@dataclasses.dataclass(frozen=True)
class ImageLayout:
    """Where the merge blocks of a ``grid_h x grid_w`` patch grid go in the packed layout: spans of ``window**2``
    slots (merge blocks), each whole window in a span of its own (windows row-major, blocks row-major within
    one), the partial windows of the right and bottom edges packed several to a span (first fit, largest
    first), a span's leftover slots padding."""
    src: np.ndarray          # [size] each slot's merge block (row-major index; a pad slot: 0, zeroed after)
    pads: np.ndarray         # the pad slots
    rank: np.ndarray         # [lh * lw] each merge block's slot
    pos: np.ndarray          # [size, merge**2, 2] each slot's patches' (row, column); pads 0
    valid: np.ndarray        # [size] bool: the slot holds a block
    win: np.ndarray          # [size] each slot's window (0 .. num_windows - 1); pads -1
    num_windows: int
    size: int                # slots, in merge blocks: a multiple of window**2


def _window_spans(sizes: np.ndarray, span: int) -> tuple[np.ndarray, int]:
    """Each window's first slot when windows of ``sizes`` blocks are laid in spans of ``span`` slots: the whole
    windows a span each in order, then the partial ones (an image's right and bottom edges) first fit, largest
    first, so no window crosses a span; and the slots the spans take."""
    whole = sizes == span
    start = np.empty(len(sizes), np.intp)
    start[whole] = np.arange(int(whole.sum())) * span
    spans = int(whole.sum())
    free: list[list[int]] = []                       # [span, slots used] of the spans with room left
    for w in np.flatnonzero(~whole)[np.argsort(-sizes[~whole], kind="stable")]:
        n = int(sizes[w])
        for f in free:
            if f[1] + n <= span:
                start[w], f[1] = f[0] * span + f[1], f[1] + n
                break
        else:
            start[w] = spans * span
            free.append([spans, n])
            spans += 1
    return start, spans * span


@functools.lru_cache(maxsize=256)
def image_layout(grid_h: int, grid_w: int, merge: int, window: int) -> ImageLayout:
    """The ``ImageLayout`` of one grid size (cached: images of a size share it; its arrays are read-only)."""
    lh, lw = grid_h // merge, grid_w // merge
    r, c = np.divmod(np.arange(lh * lw), lw)
    wid = (r // window) * -(-lw // window) + c // window
    order = np.argsort(wid, kind="stable")                  # the blocks in window order
    first = np.searchsorted(wid[order], wid[order])           # each block's window's first place in order
    sizes = np.bincount(wid)
    start, size = _window_spans(sizes, window * window)
    slot = start[wid[order]] + np.arange(lh * lw) - first
    src, rank, valid = np.zeros(size, np.intp), np.empty(lh * lw, np.intp), np.zeros(size, bool)
    win = np.full(size, -1, np.int32)
    src[slot], rank[order], valid[slot], win[slot] = order, slot, True, wid[order]
    hw = np.stack(np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij"), -1)      # [gh, gw, 2]
    hw = hw.reshape(lh, merge, lw, merge, 2).transpose(0, 2, 1, 3, 4).reshape(lh * lw, merge * merge, 2)
    pos = np.where(valid[:, None, None], hw[src], 0).astype(np.int32)
    layout = ImageLayout(src, np.flatnonzero(~valid), rank, pos, valid, win, len(sizes), size)
    for a in (layout.src, layout.pads, layout.rank, layout.pos, layout.valid, layout.win):
        a.flags.writeable = False
    return layout


def image_blocks(image: np.ndarray, patch: int, merge: int) -> np.ndarray:
    """An image ``[C, H, W]`` as the tower's pixel payload ``[H / (patch * merge), W / (patch * merge),
    merge**2 * C * patch**2]``: its merge blocks row-major, each block's patches row-major, a patch
    flattened (C, row, column) — the Qwen2-VL processor's patch order, one frame."""
    c, h, w = image.shape
    lh, lw = h // (patch * merge), w // (patch * merge)
    x = image.reshape(c, lh, merge, patch, lw, merge, patch).transpose(1, 4, 2, 5, 0, 3, 6)
    return np.ascontiguousarray(x).reshape(lh, lw, -1)


class FullRows(NamedTuple):
    """Rows of one image each, for full attention by sequence length: ``order [R, N]`` the row's patches with
    the image's first (in packed order), ``inverse [R, N]`` its inverse, ``lengths [R]`` the image's patches."""
    order: np.ndarray
    inverse: np.ndarray
    lengths: np.ndarray


def full_rows(seg: np.ndarray) -> FullRows:
    """``FullRows`` of segment ids ``[R, N]`` (each row one image, 0, or none; padding -1)."""
    order = np.argsort(seg < 0, axis=1, kind="stable").astype(np.int32)
    return FullRows(order, np.argsort(order, axis=1).astype(np.int32), (seg >= 0).sum(axis=1, dtype=np.int32))


def pack(spec: QwenVisionSpec, rows: list[list[np.ndarray]], num_rows: int, bucket: int,
         tables: list[list[np.ndarray]] | None = None, single: bool = False) \
        -> tuple[tuple[np.ndarray, ...], list[np.ndarray], int]:
    """Images as pixel payloads ``[lh, lw, merge**2 * C * p * p]`` (``image_blocks``' layout; ``rows``: the
    images of each row, at most ``bucket`` packed patches a row) as the tower's input ``(patches [R, bucket,
    C*p*p] in the payloads' dtype, positions [R, bucket, 2], segments [R, bucket], windows [R, bucket])`` of
    ``num_rows`` rows (segment: the image in its row, window: the window in its row; pads -1); per image (in
    ``rows`` order) the flat indices of its merged tokens (row-major) among the tower's outputs; their number,
    ``R * bucket / merge**2``. An image is one gather of its blocks into its slots (the layout of each grid
    size is cached), so this is a copy of the pixels, not a re-patchify. ``tables``: uint8 payloads (the image's
    bytes) with each image's ``[C, 256]`` byte -> value table (``QwenVLPixels.value_table``; the images of a row
    share one): the input gains each row's, ``[R, C, 256]``, which the tower looks the bytes up in. ``single``:
    rows of at most one image, the input then ``(..., table or None, FullRows)``."""
    m, win = spec.merge, max(spec.window, 1)
    mm, per_row = m * m, bucket // (m * m)
    dtype = np.result_type(*(px.dtype for images in rows for px in images)) if any(rows) else np.float32
    patches = np.empty((num_rows, per_row, mm * spec.in_channels * spec.patch_size ** 2), dtype)
    pos = np.zeros((num_rows, per_row, mm, 2), np.int32)
    seg = np.full((num_rows, per_row), -1, np.int32)
    wid = np.full((num_rows, per_row), -1, np.int32)
    tokens = []
    for r, images in enumerate(rows):
        if single and len(images) > 1:
            raise ValueError(f"{len(images)} images in a row of one")
        at, windows = 0, 0                                      # at: in merge blocks
        for k, px in enumerate(images):
            lh, lw = px.shape[:2]
            lay = image_layout(lh * m, lw * m, m, win)
            if at + lay.size > per_row:
                raise ValueError(f"images of {(at + lay.size) * mm} packed patches in a row of {bucket}")
            dest = patches[r, at:at + lay.size]
            np.take(px.reshape(lh * lw, -1).astype(dtype, copy=False), lay.src, axis=0, out=dest, mode="clip")
            dest[lay.pads] = 0
            pos[r, at:at + lay.size] = lay.pos
            seg[r, at:at + lay.size][lay.valid] = k
            wid[r, at:at + lay.size][lay.valid] = lay.win[lay.valid] + windows
            tokens.append(r * per_row + at + lay.rank)
            at, windows = at + lay.size, windows + lay.num_windows
        patches[r, at:] = 0
    patches[len(rows):] = 0
    shape = (num_rows, per_row * mm)
    out = (patches.reshape(*shape, -1), pos.reshape(*shape, 2), np.repeat(seg, mm, axis=1),
           np.repeat(wid, mm, axis=1))
    if tables is not None:
        if dtype != np.uint8:
            raise ValueError(f"value tables for {dtype} pixels (they map uint8 ones)")
        first = next(t[0] for t in tables if t)
        table = np.zeros((num_rows, *first.shape), first.dtype)
        for r, ts in enumerate(tables):
            if ts and any(not np.array_equal(t, ts[0]) for t in ts[1:]):
                raise ValueError("images of different value tables in one row")
            table[r] = ts[0] if ts else 0
        out += (table,)
    elif dtype == np.uint8:
        raise ValueError("uint8 pixels without their value tables")
    if single:
        out = out[:4] + (out[4] if tables is not None else None, full_rows(out[2]))
    return out, tokens, num_rows * per_row


def axial_rotary(pos: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """The 2-D rotary of patches at ``pos [..., 2]`` (row, column): cos/sin ``[..., head_dim]`` float32, the
    first quarter of the frequencies turned by the row, the second by the column, the halves repeated
    (rotate-half style), as HF's ``VisionRotaryEmbedding``."""
    dim = head_dim // 2
    inv = (1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))).astype(np.float32)
    pos = pos.astype(jnp.float32)
    freqs = jnp.concatenate([pos[..., :1] * inv, pos[..., 1:] * inv], axis=-1)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE of ``x [R, N, heads, hd]`` in float32 (HF's vision rotary), cast back to its dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


def _query_block(n: int) -> int:
    """The largest divisor of ``n`` of at most ``QUERY_BLOCK`` (a row of ``n`` patches attends in such blocks)."""
    return next(d for d in range(min(n, QUERY_BLOCK), 0, -1) if n % d == 0)


def _attend_segments(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, span: int | None,
                     full: FullRows | None = None) -> jax.Array:
    """Attention among patches of one id ``seg``: over the whole row (``span`` None: ids are images) or within
    consecutive spans of ``span`` patches (``N x span`` scores: ids are windows, several to a span). A row
    longer than ``QUERY_BLOCK`` attends in blocks of queries, one after another (``block x N`` scores at a
    time, not ``N x N``; a fused attention needs no blocks). ``full``: rows of one image, which a fused call
    attends over gathered in front, by sequence length."""
    r, n, heads, hd = q.shape
    impl = attention_implementation(q)
    if span is None and full is not None and impl is not None and envs.JAXSERVE_VISION_SEQ_LENGTHS:
        q, k, v = (jnp.take_along_axis(t, full.order[:, :, None, None], axis=1) for t in (q, k, v))
        out = jax.nn.dot_product_attention(q, k, v, query_seq_lengths=full.lengths,
                                           key_value_seq_lengths=full.lengths, implementation=impl)
        return jnp.take_along_axis(out, full.inverse[:, :, None, None], axis=1).reshape(r, n, heads * hd)
    if span is not None:
        q, k, v = (t.reshape(r * n // span, span, heads, hd) for t in (q, k, v))
        seg = seg.reshape(r * n // span, span)
    elif n > QUERY_BLOCK and impl is None:
        block = _query_block(n)
        qs = q.reshape(r, n // block, block, heads, hd).swapaxes(0, 1)
        segs = seg.reshape(r, n // block, block).swapaxes(0, 1)
        out = jax.lax.map(lambda a: _attend(a[0], k, v, a[1][:, :, None] == seg[:, None, :]), (qs, segs))
        return out.swapaxes(0, 1).reshape(r, n, heads * hd)
    out = _attend(q, k, v, seg[:, :, None] == seg[:, None, :], impl)
    return out.reshape(r, n, heads * hd)


class QwenVisionLayer(nnx.Module):
    """One ViT block: norm, attention with the 2-D rotary, norm, MLP (the spec's kinds)."""

    def __init__(self, spec: QwenVisionSpec):
        d, i = spec.hidden_size, spec.intermediate_size
        self.spec = spec
        self.norm1, self.norm2 = _param((d,), REPLICATED, "ones"), _param((d,), REPLICATED, "ones")
        if spec.norm == "layer":
            self.norm1_bias, self.norm2_bias = _param((d,), REPLICATED, "zeros"), _param((d,), REPLICATED, "zeros")
        self.wq, self.wk, self.wv = (_param((d, d), COLUMN) for _ in range(3))
        self.wq_bias, self.wk_bias, self.wv_bias = (_param((d,), COLUMN_BIAS, "zeros") for _ in range(3))
        self.wo, self.wo_bias = _param((d, d), ROW), _param((d,), REPLICATED, "zeros")
        if spec.mlp == "gated":
            self.gate, self.up = _param((d, i), COLUMN), _param((d, i), COLUMN)
            self.gate_bias, self.up_bias = _param((i,), COLUMN_BIAS, "zeros"), _param((i,), COLUMN_BIAS, "zeros")
            self.down, self.down_bias = _param((i, d), ROW), _param((d,), REPLICATED, "zeros")
        else:
            self.fc1, self.fc1_bias = _param((d, i), COLUMN), _param((i,), COLUMN_BIAS, "zeros")
            self.fc2, self.fc2_bias = _param((i, d), ROW), _param((d,), REPLICATED, "zeros")

    def _norm(self, x: jax.Array, which: str) -> jax.Array:
        if self.spec.norm == "layer":
            return layer_norm(x, _w(getattr(self, which)), _w(getattr(self, which + "_bias")), self.spec.eps)
        return rms_norm(x, _w(getattr(self, which)), self.spec.eps)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, seg: jax.Array, span: int | None,
                 full: FullRows | None = None):
        """``seg``: each patch's image (full attention, ``span`` None; ``full``: rows of one image, their
        order) or window (``span`` patches a span)."""
        spec = self.spec
        q, k, v = _qkv(self, self._norm(x, "norm1"), spec.num_heads)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        x = x + _attend_segments(q, k, v, seg, span, full) @ _w(self.wo) + _w(self.wo_bias)
        h = self._norm(x, "norm2")
        if spec.mlp == "fc":
            return x + _fc_mlp(self, h, spec.activation)
        h = jax.nn.silu(h @ _w(self.gate) + _w(self.gate_bias)) * (h @ _w(self.up) + _w(self.up_bias))
        return x + h @ _w(self.down) + _w(self.down_bias)


class PatchMerger(nnx.Module):
    """The merger: a norm (the spec's kind), then each ``merge x merge`` block of patch features (consecutive
    rows) concatenated through ``fc2(gelu(fc1(.)))`` into one token of the text model's width."""

    def __init__(self, spec: QwenVisionSpec):
        m = spec.hidden_size * spec.merge ** 2
        self.spec = spec
        self.norm = _param((spec.hidden_size,), REPLICATED, "ones")
        if spec.norm == "layer":
            self.norm_bias = _param((spec.hidden_size,), REPLICATED, "zeros")
        self.fc1, self.fc1_bias = _param((m, m), COLUMN), _param((m,), COLUMN_BIAS, "zeros")
        self.fc2, self.fc2_bias = _param((m, spec.out_hidden_size), ROW), \
            _param((spec.out_hidden_size,), REPLICATED, "zeros")

    def __call__(self, x: jax.Array) -> jax.Array:
        spec = self.spec
        r, n, d = x.shape
        h = layer_norm(x, _w(self.norm), _w(self.norm_bias), spec.eps) if spec.norm == "layer" \
            else rms_norm(x, _w(self.norm), spec.eps)
        return _fc_mlp(self, h.reshape(r, n // spec.merge ** 2, d * spec.merge ** 2), "gelu")


class QwenVisionTower(nnx.Module):
    def __init__(self, spec: QwenVisionSpec):
        p = spec.patch_size
        self.spec = spec
        self.patch_embed = _param((spec.in_channels * spec.temporal_patch_size * p * p, spec.hidden_size),
                                  REPLICATED)
        self.layers = nnx.List([QwenVisionLayer(spec) for _ in range(spec.depth)])
        self.merger = PatchMerger(spec)

    def __call__(self, patches: jax.Array, pos: jax.Array, seg: jax.Array, win: jax.Array,
                 table: jax.Array | None = None, full: FullRows | None = None) -> jax.Array:
        """``pack``'s arrays → merged tokens ``[R, bucket / merge**2, out_hidden_size]`` in the packed order."""
        spec = self.spec
        w = _w(self.patch_embed)
        r, n, _ = patches.shape
        if table is not None:       # uint8 pixels: each channel's byte looked up in its row's table
            c = spec.in_channels
            idx = patches.reshape(r, n, c, -1).astype(jnp.int32) + (jnp.arange(c, dtype=jnp.int32) * 256)[:, None]
            patches = jnp.take_along_axis(table.reshape(r, c * 256), idx.reshape(r, -1), axis=1,
                                          mode="clip").reshape(r, n, -1)
            patches = jnp.where(seg[..., None] >= 0, patches, 0)         # padding patches zero, as float ones
        # each patch flattened (C, frame, row, col) as the 3-D convolution reads it, both frames the image
        x = patches.astype(w.dtype).reshape(r, n, spec.in_channels, 1, -1)
        x = jnp.broadcast_to(x, (r, n, spec.in_channels, spec.temporal_patch_size, x.shape[-1]))
        x = x.reshape(r, n, -1) @ w
        cos, sin = axial_rotary(pos, spec.hidden_size // spec.num_heads, spec.rope_theta)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, win, spec.unit) if spec.windowed(i) else layer(x, cos, sin, seg, None, full)
        return self.merger(x)
