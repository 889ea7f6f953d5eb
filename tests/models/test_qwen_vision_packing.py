"""``qwen_vision.pack`` (one gather of the front end's merge blocks per image, layouts cached per grid) pinned
against the packing it replaced (a re-patchify of each image ``[C, H, W]`` in the engine core), kept here as
the reference: equal patches, positions, segments and token indices for odd grids, partial windows, several
images to a row and padding rows, in float32 and bfloat16."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jaxserve.models.layers.qwen_vision import QwenVisionSpec, image_blocks, image_layout, pack


def reference_layout(grid_h: int, grid_w: int, merge: int, window: int):
    lh, lw = grid_h // merge, grid_w // merge
    r, c = np.divmod(np.arange(lh * lw), lw)
    wid = (r // window) * -(-lw // window) + c // window
    order = np.argsort(wid, kind="stable")
    first = np.searchsorted(wid[order], wid[order])
    slot = wid[order] * window * window + np.arange(lh * lw) - first
    return order, slot, int(-(-lh // window) * -(-lw // window) * window * window)


def reference_pack(spec: QwenVisionSpec, rows: list, num_rows: int, bucket: int):
    """The packing of images ``[C, H, W]`` before the payload became the processor's blocks."""
    p, m, win = spec.patch_size, spec.merge, max(spec.window, 1)
    mm, per_row, c = m * m, bucket // (m * m), spec.in_channels
    patches = np.zeros((num_rows, bucket // mm, mm, c * p * p), np.float32)
    pos = np.zeros((num_rows, bucket // mm, mm, 2), np.int32)
    seg = np.full((num_rows, bucket // mm, mm), -1, np.int32)
    tokens = []
    for r, images in enumerate(rows):
        at = 0
        for k, px in enumerate(images):
            gh, gw = px.shape[-2] // p, px.shape[-1] // p
            lh, lw = gh // m, gw // m
            order, slot, size = reference_layout(gh, gw, m, win)
            blocks = np.asarray(px, np.float32).reshape(c, lh, m, p, lw, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
            patches[r, at + slot] = blocks.reshape(lh * lw, mm, c * p * p)[order]
            hw = np.stack(np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij"), -1)
            hw = hw.reshape(lh, m, lw, m, 2).transpose(0, 2, 1, 3, 4).reshape(lh * lw, mm, 2)
            pos[r, at + slot] = hw[order]
            seg[r, at + slot] = k
            flat = np.empty(lh * lw, np.int64)
            flat[order] = r * per_row + at + slot
            tokens.append(flat)
            at += size
    shape = (num_rows, bucket)
    return (patches.reshape(*shape, -1), pos.reshape(*shape, 2), seg.reshape(shape)), tokens, num_rows * per_row


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
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    for a, b in zip(tokens, want_tokens, strict=True):
        np.testing.assert_array_equal(a, b)


def test_layout_arrays_are_cached_and_read_only():
    a = image_layout(10, 14, 2, 4)
    assert image_layout(10, 14, 2, 4) is a and not a.src.flags.writeable
    assert a.size == 2 * 2 * 16 and a.valid.sum() == 35 and len(a.pads) == a.size - 35
