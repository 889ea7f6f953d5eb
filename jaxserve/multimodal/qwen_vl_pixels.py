"""Qwen2-VL's image processor for one still RGB image, straight to the tower's pixel payload.

transformers' ``Qwen2VLImageProcessorPil`` resizes the image (PIL, to ``smart_resize``'s multiple of
``patch * merge``), rescales it in float64, normalizes it in float32 and flattens it into patches with the
frame repeated, which the front end then cut back to one frame by merge block (``processing.patch_blocks``).
Here the same PIL resize gives ``uint8`` pixels, which go by merge block in their own byte size, and one
table per channel maps each byte to what the rescale and normalize give it, in the payload's dtype: equal to
the processor's output, bit for bit, at a fraction of its host time. The table is computed with the
processor's own operations on the 256 byte values, so it is exact rather than close. For a 16-bit payload
two pixels of a patch row are looked up at once, in a table of the 65,536 byte pairs (numpy widens every
index to ``intp``: half the indices, half that work). ``byte_blocks`` and ``value_table`` are the two halves
apart: the front end sends an image's bytes and its table, a quarter of a float32 payload's size and half a
16-bit one's, and the tower looks the bytes up on the device (``qwen_vision.pack``'s ``tables``), the same values.
"""
from __future__ import annotations

import sys

import numpy as np

_PROCESSORS = ("Qwen2VLImageProcessorPil", "Qwen2VLImageProcessor")


class QwenVLPixels:
    """The payload ``[lh, lw, merge**2 * C * p * p]`` and ``image_grid_thw`` of an RGB image, as
    ``processing.patch_blocks`` makes them from ``processor``'s output (``of``: None for a processor or
    settings this does not cover: the caller runs the processor)."""

    def __init__(self, processor):
        self.min_pixels, self.max_pixels = processor.size["shortest_edge"], processor.size["longest_edge"]
        self.smart_resize = sys.modules[type(processor).__module__].smart_resize      # the processor's own
        self.patch, self.merge = int(processor.patch_size), int(processor.merge_size)
        self.resample = int(processor.resample)
        # HF's rescale (float64, then float32) and normalize (float32) of each byte value, per channel
        x = np.arange(256, dtype=np.float64)
        x = (x * processor.rescale_factor if processor.do_rescale else x).astype(np.float32)
        if processor.do_normalize:
            mean, std = (np.asarray(v, np.float32).reshape(-1, 1) for v in (processor.image_mean,
                                                                           processor.image_std))
            x = (x - mean) / std
        self.table = np.broadcast_to(x, (3, 256)).astype(np.float32)
        self._tables: dict = {}

    @classmethod
    def of(cls, processor) -> QwenVLPixels | None:
        if type(processor).__name__ not in _PROCESSORS or not processor.do_resize:
            return None
        mean, std = np.ravel(processor.image_mean), np.ravel(processor.image_std)
        if processor.do_normalize and not (mean.size in (1, 3) and std.size in (1, 3)):
            return None
        return cls(processor)

    def __call__(self, image, dtype) -> tuple[np.ndarray, dict]:
        """``image``: a PIL image in mode RGB."""
        blocks, extra = self.byte_blocks(image)
        lh, lw = blocks.shape[:2]
        blocks = blocks.reshape(lh, lw, self.merge ** 2, 3, self.patch, self.patch)
        table = self._table(np.dtype(dtype))
        if table.shape[1] > 256:            # a patch row's pixels two at a time: half the lookups
            blocks = blocks.view(np.uint16)
        out = np.empty(blocks.shape, table.dtype)
        for c in range(3):
            np.take(table[c], blocks[..., c, :, :], out=out[..., c, :, :], mode="clip")
        return out.view(dtype).reshape(lh, lw, -1), extra

    def byte_blocks(self, image) -> tuple[np.ndarray, dict]:
        """The payload before the lookup: the resized image's bytes ``[lh, lw, merge**2 * C * p * p]`` uint8 in
        the payload's order (``table``'s channel rows map them to the payload's values), and the grid."""
        p, m = self.patch, self.merge
        h, w = self.smart_resize(image.height, image.width, factor=p * m, min_pixels=self.min_pixels,
                                 max_pixels=self.max_pixels)
        pixels = np.asarray(image.resize((w, h), resample=self.resample))              # [h, w, 3] uint8
        lh, lw = h // (p * m), w // (p * m)
        # merge blocks row-major, each block's patches row-major, a patch (C, row, column): uint8, one copy
        blocks = np.ascontiguousarray(pixels.reshape(lh, m, p, lw, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5))
        return blocks.reshape(lh, lw, -1), {"image_grid_thw": np.array([1, lh * m, lw * m], np.int64)}

    def value_table(self, dtype) -> np.ndarray:
        """``[C, 256]``: what each byte of a channel is in the payload of ``dtype`` (the processor's rescale and
        normalize, cast), as the tower looks ``byte_blocks`` up on the device."""
        return self.table.astype(dtype)

    def _table(self, dtype: np.dtype) -> np.ndarray:
        """Per channel, what each byte maps to in ``dtype``; for an even patch side and a 16-bit ``dtype``, what
        each pair of bytes (two pixels of a patch row, read as one native ``uint16``) maps to: the two values as
        one ``uint32`` (a 256 KiB table a channel; float32's would be twice that, and measured no faster)."""
        table = self._tables.get(dtype)
        if table is None:
            table = self.table.astype(dtype)
            if self.patch % 2 == 0 and dtype.itemsize == 2:
                pairs = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
                table = np.ascontiguousarray(table[:, pairs]).view(f"u{2 * dtype.itemsize}").reshape(3, -1)
            self._tables[dtype] = table
        return table
