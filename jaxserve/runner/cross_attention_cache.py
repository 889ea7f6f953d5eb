"""The cross-attention cache of a cross-attention vision family (Mllama): each image's keys and values for
every cross layer, computed once by the encoder step into a slot of a fixed pool, read by every decoder step
of a request with that image until the request finishes.

The pool is two arrays (K, V) ``[cross layers, slots, keys per image, kv_heads, head_dim]`` (padding images target
distinct slots past the end and write nothing, ``drop_targets``), allocated once: ``--cross-attention-slots`` slots
(default: ``max_num_seqs``, at most 8); one slot holds ``max_num_tiles * num_patches`` keys of each cross layer
(Llama 3.2 11B: 8 layers x 6,404 keys x 8 heads x 128, K and V, in bf16: 200 MiB a slot). The runner allocates it
before the paged KV cache, which is then sized from the device memory left. Slots are keyed by the image's content
hash: two requests with one image share its slot. The engine's ``EncoderCacheManager`` (``whole_request``: an image
is held from the request's first step to its end, one slot per image) decides what is kept and evicted with the same
capacity, so a request with an image waits in the queue until a slot is free, and evicted hashes come back through
``free``.

``encode(features)`` runs the tower and each cross layer's k/v projections over the step's new images,
batched in powers of two, and writes their slots in the same jitted call (the pool is donated).
``gather(scheduled, T)`` gives a step with any image request its index ``[1 + 2 * max images, T]``: per
token row its mode (-1: a request without an image, whose rows skip the cross layers; 0: before the
prompt's first image, HF's fully masked row, which sees every key of every image and drops its cross MLP;
1: after an image), then each image's slot and the keys of it the token sees (HF's ``cross_attention_mask``:
the image's real tiles from its placeholder to the next image's, consecutive images sharing the text after
them, decode tokens as the prompt's last). A step without image requests gets None: the plain forward.
"""
from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.encoder_cache import _pow2, drop_targets

def _encode_and_store(family, cfg, params, pool, pixel_values, ar_ids, ar_mask, dst):
    k, v = family.encode_cross_kv(params, pixel_values, ar_ids, ar_mask, cfg)       # [L, B, N, kvh, d]
    def store(p, x):
        return p.at[:, dst].set(x.astype(p.dtype), mode="drop", unique_indices=True)
    return store(pool[0], k), store(pool[1], v)


class CrossAttentionCache:
    def __init__(self, model, num_slots: int, max_batch: int, mesh=None):
        self.family, self.cfg, self.params = model.family, model.config, model.params
        self.capacity, self.max_batch = num_slots, max_batch
        self.max_images = (self.family.cross_index_rows(self.cfg) - 1) // 2
        layers, self.num_keys, kv_heads, head_dim = self.family.cross_kv_shape(self.cfg)
        vision = dict(self.cfg.extra_dict["vision"])
        self.tiles, self.tile_size = int(vision["max_num_tiles"]), int(vision["image_size"])
        self.keys_per_tile = self.num_keys // self.tiles
        rep = None
        if mesh is not None:
            from jaxserve.parallel import replicated  # noqa: PLC0415
            rep = replicated(mesh)
        dtype = jax.tree.leaves(model.params)[0].dtype
        shape = (layers, num_slots, self.num_keys, kv_heads, head_dim)
        make = (lambda: jnp.zeros(shape, dtype)) if rep is None else (lambda: jnp.zeros(shape, dtype, device=rep))
        self.slab = (make(), make())           # the decoder step reads it as the multimodal slab
        self._step = jax.jit(partial(_encode_and_store, self.family, self.cfg), donate_argnums=(1,),
                             **({"out_shardings": (rep, rep)} if rep is not None else {}))
        self.slots: dict[str, int] = {}
        self.visible: dict[str, int] = {}      # hash -> keys of its real tiles
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_images = 0
        self.encode_ms = 0.0

    def scheduler_limits(self) -> tuple[int, int]:
        """(images encoded per step, images cached) for the engine's ``EncoderCacheManager``: an image's
        placeholder is one token, so its token counts are image counts."""
        return self.capacity, self.capacity

    def warmup(self) -> float:
        t0 = time.perf_counter()
        b = 1
        while b <= self.max_batch:
            self._run(np.zeros((b, self.tiles, 3, self.tile_size, self.tile_size), np.float32),
                      np.ones(b, np.int32), np.ones((b, self.tiles), np.int32), drop_targets(b, self.capacity))
            b *= 2
        jax.block_until_ready(self.slab)
        return time.perf_counter() - t0

    def _run(self, pixels, ar_ids, ar_mask, dst) -> None:
        self.slab = self._step(self.params, self.slab, pixels, ar_ids, ar_mask, dst)

    def free(self, hashes: list[str]) -> None:
        for h in hashes:
            slot = self.slots.pop(h, None)
            if slot is not None:
                self.visible.pop(h, None)
                self._free.append(slot)

    def encode(self, features: list) -> None:
        """Encode the images not cached yet, each into a free slot."""
        t0 = time.perf_counter()
        new = list({f.hash: f for f in features if f.hash not in self.slots}.values())
        for i in range(0, len(new), self.max_batch):
            items = new[i:i + self.max_batch]
            b = _pow2(len(items))
            pixels = np.zeros((b, self.tiles, 3, self.tile_size, self.tile_size), np.float32)
            ar_ids, ar_mask = np.zeros(b, np.int32), np.zeros((b, self.tiles), np.int32)
            dst = drop_targets(b, self.capacity)                # padding images write nothing
            for j, f in enumerate(items):
                if not self._free:
                    raise RuntimeError("the cross-attention cache is full (the scheduler's encoder cache "
                                       "manager admitted more images than its slots)")
                pixels[j] = f.pixel_values.reshape(pixels.shape[1:])
                ar_ids[j] = int(np.asarray(f.extra["aspect_ratio_ids"]).reshape(-1)[0])
                ar_mask[j] = np.asarray(f.extra["aspect_ratio_mask"]).reshape(-1)
                dst[j] = self.slots[f.hash] = self._free.pop()
                self.visible[f.hash] = int(np.asarray(f.extra["num_tiles"]).reshape(-1)[0]) * self.keys_per_tile
            self._run(pixels, ar_ids, ar_mask, dst)
            self.num_images += len(items)
        self.encode_ms += (time.perf_counter() - t0) * 1e3

    def gather(self, scheduled, num_tokens: int) -> np.ndarray | None:
        """The step's cross-attention index (int32, module docstring), or None: no request of it has an
        image."""
        index = None
        row0 = 0
        for s in scheduled:
            feats = s.request.mm_features
            if feats:
                if index is None:
                    index = np.zeros((1 + 2 * self.max_images, num_tokens), np.int32)
                    index[0] = -1
                rows = slice(row0, row0 + s.num_new_tokens)
                last = s.request.num_prompt_tokens - 1
                pos = np.minimum(np.arange(s.start_pos, s.start_pos + s.num_new_tokens), last)
                before = pos < feats[0].offset
                index[0, rows] = ~before
                for i, (f, end) in enumerate(zip(feats, attended_until(feats, last + 1))):
                    seen = (pos >= f.offset) & (pos < end)
                    index[1 + i, rows] = self.slots[f.hash]
                    index[1 + self.max_images + i, rows] = np.where(before, self.num_keys,
                                                                    np.where(seen, self.visible[f.hash], 0))
            row0 += s.num_new_tokens
        return index


def attended_until(features: list, prompt_len: int) -> list[int]:
    """Where each image's text ends (HF's ``get_cross_attention_token_mask``): at the next image's placeholder
    or the prompt's end; an image right before the next one shares that one's text."""
    ends = [f.offset for f in features[1:]] + [prompt_len]
    for i in range(len(features) - 2, -1, -1):
        if ends[i] == features[i].offset + 1:
            ends[i] = ends[i + 1]
    return ends
