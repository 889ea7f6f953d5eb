"""``ImageFeature``: one image of a prompt, as the engine and the runner see it.

The contract (docs/design.md, "Multimodal"): the front end expands each image's placeholder into
``length`` copies of the model's image token starting at prompt index ``offset``; the runner's encoder step
turns ``pixel_values`` (and the family's ``extra`` arrays, e.g. a grid size) into ``[length, hidden]``
embeddings, which the decoder step writes over the embeddings of those token rows. ``hash`` identifies the
image by content (the encoder cache's key and part of the prefix-cache key of every KV block it overlaps).
A family whose text model needs more than 1-D positions (M-RoPE) or a mask beyond causal (bidirectional
image attention) reads them from ``extra`` of the features of a request; LLaVA needs neither.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np


@dataclasses.dataclass(slots=True)
class ImageFeature:
    hash: str                         # content hash (hex): the encoder cache key
    offset: int                       # index of the first image token in the prompt
    length: int                       # how many image tokens the placeholder expands to
    pixel_values: np.ndarray          # the processor's output (Qwen-VL RGB: bytes, extra["pixel_table"])
    extra: dict = dataclasses.field(default_factory=dict)   # family-specific arrays (grid sizes, ...)

    @property
    def end(self) -> int:
        return self.offset + self.length


def image_hash(pixels: np.ndarray, mode: str, kwargs_key: str = "") -> str:
    """A content hash of a decoded image: its size, mode and pixel bytes (two encodings of one picture hash
    alike), and the processor options it is prepared with (other options give other model inputs)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{pixels.shape}|{pixels.dtype}|{mode}|{kwargs_key}".encode())
    h.update(np.ascontiguousarray(pixels).data)
    return h.hexdigest()


def overlapping(features: list[ImageFeature], start: int, end: int) -> list[ImageFeature]:
    """The features with at least one token in prompt positions ``[start, end)``."""
    return [f for f in features if f.offset < end and f.end > start]


def pixel_dtype(name: str | None):
    """The payload dtype of a model of dtype ``name``: a 16-bit float as itself (the tower computes in it),
    float32 otherwise."""
    if name in ("bfloat16", "float16"):
        import ml_dtypes  # noqa: PLC0415  (jax's dependency)
        return np.float16 if name == "float16" else ml_dtypes.bfloat16
    return np.float32
