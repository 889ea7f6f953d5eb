"""LLaVA-NeXT's "anyres" geometry, shared by the front end (how many image tokens an image takes) and the model
(which of its encoder's rows each of those tokens is).

An image of ``(height, width)`` is resized into the best resolution of ``image_grid_pinpoints`` (HF's
``select_best_resolution``: the most effective pixels, then the least waste) and cut into tiles of the
tower's ``image_size``; the tower also sees the whole image resized (the base tile). The tiles' ``P x P``
patch features form a ``(gh * P) x (gw * P)`` grid, cropped back to the image's aspect ratio (HF's
``unpad_image``: the padding the resize added, split evenly) with ``image_newline`` after each row. The image's
tokens: the base tile's ``P * P``, then the cropped grid row by row, each row followed by a newline.
"""
from __future__ import annotations

import numpy as np


def select_best_resolution(size: tuple[int, int], pinpoints) -> tuple[int, int]:
    """The ``(height, width)`` of ``pinpoints`` an image of ``size`` (height, width) is resized into (HF's rule)."""
    h, w = size
    best, best_effective, best_waste = None, 0, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        effective = min(int(w * scale) * int(h * scale), w * h)
        waste = pw * ph - effective
        if effective > best_effective or (effective == best_effective and waste < best_waste):
            best, best_effective, best_waste = (int(ph), int(pw)), effective, waste
    return best


def tile_grid(size: tuple[int, int], pinpoints, tile: int) -> tuple[int, int]:
    """The tiles ``(rows, columns)`` of an image of ``size`` (height, width) besides its base tile."""
    h, w = select_best_resolution(size, pinpoints)
    return h // tile, w // tile


def unpadded_window(size: tuple[int, int], grid_h: int, grid_w: int) -> tuple[int, int, int, int]:
    """The rows ``[r0, r1)`` and columns ``[c0, c1)`` of a ``grid_h x grid_w`` patch grid that hold an image of
    ``size`` (height, width) resized into it (HF's ``unpad_image``, its float rounding included)."""
    h, w = (int(s) for s in size)
    if w / h > grid_w / grid_h:
        new_h = int(round(h * (grid_w / w), 7))
        pad = (grid_h - new_h) // 2
        return pad, grid_h - pad, 0, grid_w
    new_w = int(round(w * (grid_h / h), 7))
    pad = (grid_w - new_w) // 2
    return 0, grid_h, pad, grid_w - pad


def num_image_tokens(size: tuple[int, int], pinpoints, tile: int, patch: int) -> int:
    """The base tile's patches plus the cropped grid's, with a newline per row (without a class token)."""
    p = tile // patch
    gh, gw = tile_grid(size, pinpoints, tile)
    r0, r1, c0, c1 = unpadded_window(size, gh * p, gw * p)
    return p * p + (r1 - r0) * (c1 - c0 + 1)


def max_rows(num_tiles: int, pinpoints, tile: int, patch: int) -> int:
    """The most patch rows a grid of ``num_tiles`` tiles (base tile included) has among ``pinpoints``: the
    newline rows an encoder output for that many tiles holds."""
    rows = [ph // tile for ph, pw in pinpoints if (ph // tile) * (pw // tile) + 1 == num_tiles]
    return max(rows, default=0) * (tile // patch)


def tile_counts(pinpoints, tile: int) -> list[int]:
    """The tile counts (base tile included) images can have: one encoder program each."""
    return sorted({(ph // tile) * (pw // tile) + 1 for ph, pw in pinpoints})


def token_slots(size: tuple[int, int], pinpoints, tile: int, patch: int) -> np.ndarray:
    """For each of the image's tokens, its row of the encoder's output ``[T * P * P + max_rows, hidden]``
    (the ``T`` tiles' patch features in tile order, then ``max_rows`` copies of ``image_newline``)."""
    p = tile // patch
    gh, gw = tile_grid(size, pinpoints, tile)
    r0, r1, c0, c1 = unpadded_window(size, gh * p, gw * p)
    y, x = np.meshgrid(np.arange(r0, r1), np.arange(c0, c1), indexing="ij")
    grid = p * p + ((y // p) * gw + x // p) * (p * p) + (y % p) * p + x % p       # [rows, cols]
    newline = (gh * gw + 1) * p * p + np.arange(r1 - r0)
    return np.concatenate([np.arange(p * p), np.concatenate([grid, newline[:, None]], axis=1).reshape(-1)]
                          ).astype(np.int32)
