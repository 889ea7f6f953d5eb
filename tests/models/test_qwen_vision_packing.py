"""``qwen_vision.pack`` (one gather of the front end's merge blocks per image, layouts cached per grid) pinned
against a re-patchify of each image ``[C, H, W]`` into the slots its layout gives: equal patches, positions,
segments, windows and token indices for odd grids, partial windows, several images to a row and padding rows,
in float32 and bfloat16. The layout itself (``image_layout``): every block in one slot, each window's blocks
consecutive inside one span of ``window**2`` slots, the partial windows sharing spans (first fit)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jaxserve.models.layers.qwen_vision import QwenVisionSpec, image_blocks, image_layout, pack


def window_ids(lh: int, lw: int, window: int) -> np.ndarray:
    """Each merge block's window (windows row-major over the grid, as HF's ``get_window_index``)."""
    r, c = np.divmod(np.arange(lh * lw), lw)
    return (r // window) * -(-lw // window) + c // window


def reference_pack(spec: QwenVisionSpec, rows: list, num_rows: int, bucket: int):
    """Images ``[C, H, W]`` re-patchified into the slots of their layouts."""
    p, m, win = spec.patch_size, spec.merge, max(spec.window, 1)
    mm, per_row, c = m * m, bucket // (m * m), spec.in_channels
    patches = np.zeros((num_rows, bucket // mm, mm, c * p * p), np.float32)
    pos = np.zeros((num_rows, bucket // mm, mm, 2), np.int32)
    seg = np.full((num_rows, bucket // mm, mm), -1, np.int32)
    wid = np.full((num_rows, bucket // mm, mm), -1, np.int32)
    tokens = []
    for r, images in enumerate(rows):
        at = windows = 0
        for k, px in enumerate(images):
            gh, gw = px.shape[-2] // p, px.shape[-1] // p
            lh, lw = gh // m, gw // m
            lay = image_layout(gh, gw, m, win)
            slot = lay.rank
            blocks = np.asarray(px, np.float32).reshape(c, lh, m, p, lw, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
            patches[r, at + slot] = blocks.reshape(lh * lw, mm, c * p * p)
            hw = np.stack(np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij"), -1)
            hw = hw.reshape(lh, m, lw, m, 2).transpose(0, 2, 1, 3, 4).reshape(lh * lw, mm, 2)
            pos[r, at + slot] = hw
            seg[r, at + slot] = k
            ids = window_ids(lh, lw, win)
            wid[r, at + slot] = (ids + windows)[:, None]
            tokens.append(r * per_row + at + slot)
            at, windows = at + lay.size, windows + ids.max() + 1
    shape = (num_rows, bucket)
    return (patches.reshape(*shape, -1), pos.reshape(*shape, 2), seg.reshape(shape), wid.reshape(shape)), \
        tokens, num_rows * per_row


def spec(window: int) -> QwenVisionSpec:
    return QwenVisionSpec(hidden_size=32, intermediate_size=64, num_heads=2, depth=2, in_channels=3, patch_size=4,
                          merge=2, temporal_patch_size=2, out_hidden_size=16, rope_theta=10000.0, norm="rms",
                          mlp="gated", activation="silu", window=window)


# merge blocks (lh, lw) of each image per row: odd counts, partial windows, one block, a wide and a tall one
ROWS = [[(5, 7), (1, 1)], [(3, 9)], [(9, 2), (2, 2), (1, 3)]]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("window", [0, 2, 4])
def test_pack_equals_the_repatchifying_pack(window, dtype):
    s = spec(window)
    rng = np.random.default_rng(window)
    images = [[rng.standard_normal((3, lh * 8, lw * 8)).astype(np.float32) for lh, lw in row] for row in ROWS]
    need = max(sum(s.patches((lh, lw)) for lh, lw in row) for row in ROWS)
    bucket = s.unit * -(-need // s.unit)
    num_rows = len(ROWS) + 1                                      # and a padding row
    want, want_tokens, want_n = reference_pack(s, images, num_rows, bucket)
    payloads = [[image_blocks(px, 4, 2).astype(dtype) for px in row] for row in images]
    got, tokens, n = pack(s, payloads, num_rows, bucket)
    assert n == want_n and got[0].dtype == dtype
    np.testing.assert_array_equal(got[0], want[0].astype(dtype))
    for a, b in zip(got[1:], want[1:], strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(tokens, want_tokens, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("window", [1, 2, 3, 4])
@pytest.mark.parametrize("lh, lw", [(1, 1), (5, 7), (9, 2), (8, 8), (37, 37), (13, 30)])
def test_layout_keeps_windows_whole_in_shared_spans(lh, lw, window):
    lay = image_layout(lh * 2, lw * 2, 2, window)
    span = window * window
    assert lay.size % span == 0 and lay.valid.sum() == lh * lw == len(set(lay.rank.tolist()))
    np.testing.assert_array_equal(lay.src[lay.rank], np.arange(lh * lw))
    np.testing.assert_array_equal(lay.win[lay.rank], window_ids(lh, lw, window))
    assert (lay.win[lay.pads] == -1).all() and lay.num_windows == window_ids(lh, lw, window).max() + 1
    used = np.zeros(lay.size // span, int)
    for w in range(lay.num_windows):
        slots = lay.rank[window_ids(lh, lw, window) == w]            # the window's blocks, row-major
        assert len(set((slots // span).tolist())) == 1               # one span
        np.testing.assert_array_equal(slots, slots[0] + np.arange(len(slots)))     # consecutive, in order
        used[slots[0] // span] += len(slots)
    partial = np.sort(used[used < span])
    assert len(partial) < 2 or partial[0] + partial[1] > span        # first fit: no two partial spans merge


def test_layout_of_a_1036_pixel_square_pads_one_span():
    """74 x 74 patches (a 1024-pixel square resized): 81 whole windows and 19 edge ones in 5 spans."""
    lay = image_layout(74, 74, 2, 4)
    assert lay.size == 86 * 16 and lay.size * 4 - 74 * 74 == 28


def test_layout_arrays_are_cached_and_read_only():
    a = image_layout(10, 14, 2, 4)
    assert image_layout(10, 14, 2, 4) is a and not a.src.flags.writeable and not a.win.flags.writeable
    assert a.size == 3 * 16 and a.valid.sum() == 35 and len(a.pads) == a.size - 35


def test_single_rows_carry_each_images_patches_in_front():
    """``pack(single=True)``: each row's ``FullRows`` order lists its image's patches first (in packed order),
    then the padding; the inverse undoes it; the length is the image's patches; a row of two images is
    refused."""
    s = spec(2)
    rng = np.random.default_rng(0)
    images = [[image_blocks(rng.standard_normal((3, lh * 8, lw * 8)).astype(np.float32), 4, 2)] for lh, lw in
              [(5, 7), (3, 9)]]
    bucket = s.unit * -(-max(s.patches(px[0].shape) for px in images) // s.unit) + s.unit
    out, _, _ = pack(s, images, 3, bucket, single=True)
    seg, table, full = out[2], out[4], out[5]
    assert table is None
    for r in range(3):
        own = np.flatnonzero(seg[r] >= 0)
        assert full.lengths[r] == len(own)
        np.testing.assert_array_equal(full.order[r, :len(own)], own)
        assert (seg[r, full.order[r, len(own):]] < 0).all()
        np.testing.assert_array_equal(full.order[r][full.inverse[r]], np.arange(bucket))
    with pytest.raises(ValueError, match="2 images in a row of one"):
        pack(s, [[images[0][0], images[1][0]]], 1, 2 * bucket, single=True)
