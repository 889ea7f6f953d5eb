"""The vision encoder's step and the encoder cache it fills, on the device.

The cache is one preallocated slab ``[capacity, hidden]`` (replicated under a mesh) with a host free list of
its rows: an image's embeddings take ``length`` rows (anywhere: no fragmentation), found by its content
hash. The engine's ``EncoderCacheManager`` decides what is kept and evicted with the same capacity, so an
image the scheduler admits always finds rows here; evicted hashes come back through ``free``.

``encode(features)`` runs the family's ``encode_images`` over the step's new images, batched across
requests by pixel shape (the patch count) into batch buckets of powers of two, and writes each image's
rows into the slab in the same jitted call (the slab is donated: updated in place). ``gather(scheduled)``
gives the decoder step its ``[2, T]`` index (token row, slab row) for the image tokens of the step's
chunks, padded to the step's T rows (padding rows point past the step's tokens and are dropped): one
image variant per token bucket, and the step reads the embeddings from the slab itself, so no per-step
device op builds them. A family whose image tokens attend to each other both ways (``bidirectional_images``)
gets a third row: each token row's attend limit (``AttentionMetadata.attend_limit``: its image's last
position, -1 outside images; the scheduler keeps an image's remaining tokens in one chunk).
"""
from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.multimodal.inputs import overlapping



def _encode_and_store(family, cfg, params, slab, pixel_values, dst):
    emb = family.encode_images(params, pixel_values, cfg)               # [B, N, hidden]
    return slab.at[dst].set(emb.reshape(-1, emb.shape[-1]).astype(slab.dtype), mode="drop")


class EncoderCache:
    def __init__(self, model, capacity: int, max_batch: int, mesh=None):
        self.family, self.cfg, self.params = model.family, model.config, model.params
        self.capacity, self.max_batch = capacity, max_batch
        rep = None
        if mesh is not None:
            from jaxserve.parallel import replicated  # noqa: PLC0415
            rep = replicated(mesh)
        dtype = jax.tree.leaves(model.params)[0].dtype
        shape = (capacity + 1, model.config.hidden_size)     # + a scratch row that padding images write
        self.slab = jnp.zeros(shape, dtype) if rep is None else jnp.zeros(shape, dtype, device=rep)
        self._step = jax.jit(partial(_encode_and_store, self.family, self.cfg), donate_argnums=(1,),
                             **({"out_shardings": rep} if rep is not None else {}))
        self.bidirectional = getattr(self.family, "bidirectional_images", False)
        self.rows: dict[str, np.ndarray] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self.num_images = 0
        self.encode_ms = 0.0              # host time of the encoder dispatches (the device runs them async)

    def warmup(self) -> float:
        """Compile the encoder's batch buckets at the tower's own image size (the size a fixed-resolution
        processor gives every image); other pixel shapes compile on first use. Returns the seconds taken."""
        t0 = time.perf_counter()
        size = dict(self.cfg.extra_dict.get("vision") or ()).get("image_size")
        if size:
            b = 1
            while b <= self.max_batch:
                pixels = np.zeros((b, 3, size, size), np.float32)
                self.slab = self._step(self.params, self.slab, pixels, np.full(b * self._tokens_per_image(size),
                                                                                 self.capacity, np.int32))
                b *= 2
            jax.block_until_ready(self.slab)
        return time.perf_counter() - t0

    def _tokens_per_image(self, size: int) -> int:
        out = jax.eval_shape(lambda p, x: self.family.encode_images(p, x, self.cfg), self.params,
                             jax.ShapeDtypeStruct((1, 3, size, size), np.float32))
        return out.shape[1]

    def free(self, hashes: list[str]) -> None:
        for h in hashes:
            rows = self.rows.pop(h, None)
            if rows is not None:
                self._free.extend(rows.tolist())

    def encode(self, features: list) -> None:
        """Encode the images not cached yet, batched by pixel shape, each written to its rows of the slab."""
        t0 = time.perf_counter()
        groups: dict[tuple, list] = {}
        for f in features:
            if f.hash not in self.rows and all(f.hash != g.hash for g in groups.get(f.pixel_values.shape, ())):
                groups.setdefault(f.pixel_values.shape, []).append(f)
        for shape, items in groups.items():
            for i in range(0, len(items), self.max_batch):
                self._encode_batch(shape, items[i:i + self.max_batch])
        self.encode_ms += (time.perf_counter() - t0) * 1e3

    def _encode_batch(self, shape: tuple, items: list) -> None:
        b = 1
        while b < len(items):
            b *= 2
        pixels = np.zeros((b, *shape), np.float32)
        n = items[0].length
        dst = np.full((b, n), self.capacity, np.int32)       # padding images write the scratch row
        for j, f in enumerate(items):
            if f.length != n:
                raise ValueError(f"images of one pixel shape with {f.length} and {n} tokens")
            if len(self._free) < n:
                raise RuntimeError("the encoder cache is full (the scheduler's encoder cache manager admitted "
                                   "more image tokens than its capacity)")
            rows = np.asarray([self._free.pop() for _ in range(n)], np.int32)
            self.rows[f.hash] = rows
            pixels[j], dst[j] = f.pixel_values, rows
        self.slab = self._step(self.params, self.slab, pixels, dst.reshape(-1))
        self.num_images += len(items)

    def gather(self, scheduled, num_tokens: int) -> np.ndarray | None:
        """``[2, T]`` int32: the step's image-token rows and their slab rows, padded (None: the step has none);
        ``[3, T]`` with the attend limits (``bidirectional``)."""
        dst, src, limit = [], [], []
        row0 = 0
        for s in scheduled:
            feats = s.request.mm_features
            start, end = s.start_pos, s.start_pos + s.num_new_tokens
            if feats is not None and start < s.request.num_prompt_tokens:
                for f in overlapping(feats, start, end):
                    a, b = max(start, f.offset), min(end, f.end)
                    dst.append(np.arange(row0 + a - start, row0 + b - start, dtype=np.int32))
                    src.append(self.rows[f.hash][a - f.offset:b - f.offset])
                    if self.bidirectional:
                        assert b == f.end, "an image's tokens split over steps (--disable-chunked-mm-input)"
                        limit.append(np.full(b - a, f.end - 1, np.int32))
            row0 += s.num_new_tokens
        if not dst:
            return None
        d, s_ = np.concatenate(dst), np.concatenate(src)
        index = np.empty((3 if self.bidirectional else 2, num_tokens), np.int32)
        index[0], index[1] = num_tokens, 0
        index[0, :len(d)], index[1, :len(d)] = d, s_
        if self.bidirectional:
            index[2] = -1
            index[2, d] = np.concatenate(limit)
        return index
