"""The vision encoder's step and the encoder cache it fills, on the device.

The cache is one preallocated slab ``[capacity, hidden]`` (replicated under a mesh) with a host free list of
its rows: an image's embeddings take ``length`` rows (anywhere: no fragmentation), found by its content
hash. The engine's ``EncoderCacheManager`` decides what is kept and evicted with the same capacity, so an
image the scheduler admits always finds rows here; evicted hashes come back through ``free``.

``encode(features)`` runs the family's encoder over the step's new images, batched across requests, and writes each
image's rows into the slab in the same jitted call (the slab is donated: updated in place; padding rows target
distinct rows past its end, ``drop_targets``, and write nothing). A family of fixed-size images (``encode_images``:
LLaVA) is batched by pixel shape into batch buckets of powers of two (a family with ``image_slots``, LLaVA-NeXT,
says which rows of its encoder's output are an image's tokens: the others write nothing; ``warmup_pixel_shapes``,
which shapes to compile at start-up). A family of any image size (``pack_images`` / ``encode_packed``: Qwen-VL) is
bucketed by patch count: each image goes to the smallest bucket that holds it (at least ``min_patches``) of a ladder
of ``unit * m * 2**k`` patches, ``m`` in 4..7 (``patch_bucket``: steps of at most 1.25x, so under a fifth of a
bucket is padding), images of the smallest bucket share rows where they fit (first fit; the tower masks attention to
each image's own patches; in a larger bucket no two images fit a row, so its rows are packed ``single``: the
full-attention blocks attend by sequence length, with no mask), rows are batched in 1, 2, 3, 4, 6, 8, ... rows
(``row_batch``), so the compiled encoder programs are bounded by the bucket and batch counts, not the image sizes:
four buckets per doubling from ``min_patches`` to the largest image, times the row batches up to ``max_batch``.
These programs compile off the step loop: the row batches a step can fill under the encoder budget (``budget_rows``:
each row holds an image too large for the bucket below) are queued for the background compiler the moment a bucket
is first seen (``pending`` counts them: a benchmark waits for them, as for the step variants); until its own is
ready a batch runs in the smallest larger bucket compiled (more padding, no wait), and only a batch larger than
every compiled bucket waits for its program (logged; ``warmup`` queues the bucket of a square image of the token
budget, so after start-up only an image larger than that can wait); a batch whose exact row count is not compiled
yet takes a compiled one of up to twice its rows (padding rows) rather than waiting. Programs are per payload dtype
too: an RGB image comes as its bytes (uint8) with a value table per channel (``extra["pixel_table"]``, the front
end's ``QwenVLPixels``), which the tower looks up on the device: half a 16-bit payload's bytes to pack and copy to
the device.
``gather(scheduled)`` gives the decoder step its ``[2, T]`` index (token row, slab row) for the image tokens of the
step's chunks, padded to the step's T rows (padding rows point to distinct rows past the step's tokens and are
dropped): one image variant per token bucket, and the step reads the embeddings from the slab itself, so no per-step
device op builds them. A family whose image tokens attend to each other both ways (``bidirectional_images``) gets a
third row: each token row's attend limit (``AttentionMetadata.attend_limit``: its image's last position, -1 outside
images; the scheduler keeps an image's remaining tokens in one chunk).
"""
from __future__ import annotations

import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.multimodal.inputs import overlapping, pixel_dtype
from jaxserve.runner.step_compiler import StepCompiler



MIN_PATCH_BUCKET = 256            # the smallest patch bucket of a packed encoder (64 tokens at a 2x2 merge)
BUCKET_STEPS = (4, 5, 6, 7)       # a doubling of patch buckets in quarters (of ``unit * 2**k``)
# the least share of its packed patches an image's own patches are (the packing pads an image's partial
# windows; ``budget_rows``): 0.78 over every grid of up to 120 x 120 merge blocks at Qwen2.5-VL's windows,
# above its smallest bucket
PACKED_FILL = 0.75


def drop_targets(n: int, end: int) -> np.ndarray:
    """``n`` distinct scatter targets past a slab of ``end`` rows, for padding rows: a ``mode="drop"`` scatter
    writes nothing there, and with every index distinct it may be marked ``unique_indices`` so XLA stores rows
    plainly (with repeated indices a 16-bit scatter is a compare-and-swap loop per element on the GPU, and
    padding rows all on one scratch row serialize on its words)."""
    return np.arange(end, end + n, dtype=np.int32)


def _encode_and_store(encode, cfg, params, slab, inputs, dst):
    emb = encode(params, inputs, cfg)                                   # [B, N, hidden]
    return slab.at[dst].set(emb.reshape(-1, emb.shape[-1]).astype(slab.dtype), mode="drop", unique_indices=True)


def patch_bucket(patches: int, unit: int, floor: int) -> int:
    """The smallest bucket of the ladder that holds ``patches`` (and ``floor``): ``unit * n`` patches, ``n`` in
    1, 2, 3, then ``m * 2**k`` for ``m`` in ``BUCKET_STEPS`` (4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ...): each
    step at most 1.25x the one before, so padding is under a fifth of a bucket past the third unit, and
    ``len(BUCKET_STEPS)`` buckets per doubling of the largest image bound the compiled programs."""
    n = -(-max(patches, floor, 1) // unit)
    if n <= BUCKET_STEPS[0]:
        return unit * n
    k = (n - 1).bit_length() - BUCKET_STEPS[0].bit_length()      # n in (4 * 2**k, 8 * 2**k]: 4 << (k + 1) holds it
    return unit * next(m << j for j in (k, k + 1) for m in BUCKET_STEPS if m << j >= n)


def smallest_in_bucket(bucket: int, unit: int, floor: int) -> int:
    """The fewest packed patches an image of ``bucket`` has: one more than the bucket below holds (1 in the
    smallest bucket)."""
    lo, hi = 1, bucket
    while lo < hi:                       # patch_bucket is monotone in the patch count
        mid = (lo + hi) // 2
        if patch_bucket(mid, unit, floor) >= bucket:
            hi = mid
        else:
            lo = mid + 1
    return lo


def budget_rows(bucket: int, unit: int, floor: int, tokens_per_row: int, budget: int, max_batch: int) -> int:
    """The most rows of ``bucket`` patches one encoder call can need when a step encodes at most ``budget``
    image tokens: a row holds at least one image of this bucket, of at least ``smallest_in_bucket`` packed
    patches, ``PACKED_FILL`` of them its own (the budget counts an image's own tokens)."""
    least = smallest_in_bucket(bucket, unit, floor) * tokens_per_row * PACKED_FILL / bucket
    return max(1, min(max_batch, int(budget // max(least, 1.0))))


def _payload_kind(pixels: np.ndarray, table: np.ndarray | None) -> str:
    """The dtype part of a packed program's key: the payload's, and a uint8 payload's value table's."""
    name = np.dtype(pixels.dtype).name
    return name if table is None else f"{name}>{np.dtype(table.dtype).name}"


def _row_inputs(batch: list) -> tuple[list, list | None]:
    """The payloads of a batch's rows of images, and their value tables (uint8 payloads; else None)."""
    pixels = [[f.pixel_values for f in r] for r in batch]
    if "pixel_table" not in batch[0][0].extra:
        return pixels, None
    return pixels, [[f.extra["pixel_table"] for f in r] for r in batch]


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def row_batch(n: int) -> int:
    """The rows a packed encoder call of ``n`` rows computes: 1, 2, 3, then ``2**k`` or ``1.5 * 2**k`` (a row
    is a whole bucket of compute, so padding rows cost at most a third of the call past the third row, not
    up to half)."""
    if n <= 3:
        return max(n, 1)
    p = _pow2(n)
    return p * 3 // 4 if n <= p * 3 // 4 else p


class EncoderCache:
    def __init__(self, model, capacity: int, max_batch: int, mesh=None, min_patches: int = MIN_PATCH_BUCKET,
                 budget: int | None = None, warm_tokens: int | None = None):
        self.family, self.cfg, self.params = model.family, model.config, model.params
        self.packed = hasattr(self.family, "encode_packed")
        self.min_patches = min_patches
        # a packed family's smallest patch bucket: the only one whose rows may hold several images (``_single``)
        self._smallest = patch_bucket(1, self.family.patch_unit(self.cfg), min_patches) if self.packed else 0
        self.capacity, self.max_batch = capacity, max_batch
        self.budget = capacity if budget is None else budget        # image tokens a step encodes at most
        self.warm_tokens = warm_tokens or self.budget       # an image of these tokens fits the warm-up's bucket
        rep = None
        if mesh is not None:
            from jaxserve.parallel import replicated  # noqa: PLC0415
            rep = replicated(mesh)
        dtype = jax.tree.leaves(model.params)[0].dtype
        # the dtype the front end sends pixel payloads in (the warm-up's value table takes it)
        self.payload_dtype = pixel_dtype(str(getattr(model.dtype, "__name__", model.dtype)))
        shape = (capacity, model.config.hidden_size)
        self.slab = jnp.zeros(shape, dtype) if rep is None else jnp.zeros(shape, dtype, device=rep)
        encode = self.family.encode_packed if self.packed else self.family.encode_images
        self._step = jax.jit(partial(_encode_and_store, encode, self.cfg), donate_argnums=(1,),
                             **({"out_shardings": rep} if rep is not None else {}))
        self.bidirectional = getattr(self.family, "bidirectional_images", False)
        self.rows: dict[str, np.ndarray] = {}
        # packed families: each program's argument shapes, compiled by ``compiler``
        self._slab_shape = jax.ShapeDtypeStruct(self.slab.shape, self.slab.dtype, sharding=self.slab.sharding)
        self._arg_shapes: dict[tuple[int, str, int], tuple] = {}    # (bucket, payload dtype, rows) -> shapes
        self._seen: set[tuple[int, str]] = set()
        # the row counts a packed call may run: ``row_batch``'s values up to ``max_batch``'s
        self._row_batches = sorted({row_batch(n) for n in range(1, max_batch + 1)})
        self.compiler = StepCompiler(self._lower)
        self._free = list(range(capacity - 1, -1, -1))
        self.num_images = 0
        self.encode_ms = 0.0              # host time of the encoder dispatches (the device runs them async)

    def warmup(self) -> float:
        """Compile the encoder's batch buckets at the tower's own image size (the size a fixed-resolution
        processor gives every image); other pixel shapes compile on first use. A packing family queues the
        patch bucket of a square image of ``warm_tokens`` (the runner's: the token budget, at most the encoder
        budget) for the background compiler: once it is compiled, an image that fits it never waits for a
        compile (it runs there while its own bucket compiles, ``_larger_bucket``). Returns the seconds taken."""
        t0 = time.perf_counter()
        if self.packed and hasattr(self.family, "warmup_payload"):
            payload, table = self.family.warmup_payload(self.cfg, self.warm_tokens, self.payload_dtype)
            bucket = patch_bucket(self.family.packed_patches(self.cfg, payload.shape),
                                  self.family.patch_unit(self.cfg), self.min_patches)
            self._queue_bucket((bucket, _payload_kind(payload, table)), [[payload]],
                               None if table is None else [[table]])
        size = dict(self.cfg.extra_dict.get("vision") or ()).get("image_size")
        shapes = self.family.warmup_pixel_shapes(self.cfg) if hasattr(self.family, "warmup_pixel_shapes") \
            else [(3, size, size)] if size else []
        for shape in shapes:
            b = 1
            while b <= self.max_batch:
                pixels = np.zeros((b, *shape), np.float32)
                dst = drop_targets(b * self._tokens_per_image(shape), self.capacity)
                self.slab = self._step(self.params, self.slab, pixels, dst)
                b *= 2
        jax.block_until_ready(self.slab)
        return time.perf_counter() - t0

    def _tokens_per_image(self, shape: tuple) -> int:
        out = jax.eval_shape(lambda p, x: self.family.encode_images(p, x, self.cfg), self.params,
                             jax.ShapeDtypeStruct((1, *shape), np.float32))
        return out.shape[1]

    def free(self, hashes: list[str]) -> None:
        for h in hashes:
            rows = self.rows.pop(h, None)
            if rows is not None:
                self._free.extend(rows.tolist())

    def encode(self, features: list) -> None:
        """Encode the images not cached yet, each written to its rows of the slab."""
        t0 = time.perf_counter()
        new: dict[str, object] = {}
        for f in features:
            if f.hash not in self.rows:
                new.setdefault(f.hash, f)
        if self.packed:
            self._encode_packed(list(new.values()))
        else:
            groups: dict[tuple, list] = {}
            for f in new.values():
                groups.setdefault(f.pixel_values.shape, []).append(f)
            for shape, items in groups.items():
                for i in range(0, len(items), self.max_batch):
                    self._encode_batch(shape, items[i:i + self.max_batch])
        self.encode_ms += (time.perf_counter() - t0) * 1e3

    def _take_rows(self, f) -> np.ndarray:
        if len(self._free) < f.length:
            raise RuntimeError("the encoder cache is full (the scheduler's encoder cache manager admitted "
                               "more image tokens than its capacity)")
        tail = len(self._free) - f.length                  # the free list's last rows, popped (last first)
        rows = np.asarray(self._free[tail:][::-1], np.int32)
        del self._free[tail:]
        self.rows[f.hash] = rows
        return rows

    def _encode_batch(self, shape: tuple, items: list) -> None:
        b = _pow2(len(items))
        pixels = np.zeros((b, *shape), np.float32)
        # each image's encoder rows: all of them, in order; or (``image_slots``: LLaVA-NeXT's anyres images)
        # the rows its tokens are, of an output of a size the pixel shape fixes
        slots = [self.family.image_slots(self.cfg, f) if hasattr(self.family, "image_slots")
                 else (f.length, slice(None)) for f in items]
        n = slots[0][0]
        dst = drop_targets(b * n, self.capacity).reshape(b, n)     # padding images and unused rows write nothing
        for j, (f, (n_j, rows)) in enumerate(zip(items, slots)):
            if n_j != n:
                raise ValueError(f"images of one pixel shape with {n_j} and {n} encoder rows")
            pixels[j] = f.pixel_values
            dst[j, rows] = self._take_rows(f)
        self.slab = self._step(self.params, self.slab, pixels, dst.reshape(-1))
        self.num_images += len(items)

    def bucket_rows(self, features: list, bucket: int | None = None) -> dict[int, list[list]]:
        """The images by patch bucket (or all in rows of ``bucket``, which holds each), packed first-fit into
        rows of it (one image a row where the bucket is ``_single``)."""
        unit = self.family.patch_unit(self.cfg)
        rows: dict[int, list[list]] = {}
        for f in features:
            n = self.family.packed_patches(self.cfg, f.pixel_values.shape)
            b = bucket or patch_bucket(n, unit, self.min_patches)
            open_rows = rows.setdefault(b, [])
            for row in open_rows if not self._single(b) else ():
                if row[0] + n <= b:
                    row[0] += n
                    row.append(f)
                    break
            else:
                open_rows.append([n, f])
        return {b: [row[1:] for row in rs] for b, rs in rows.items()}

    def _encode_packed(self, features: list) -> None:
        by_dtype: dict[str, list] = {}          # a program per payload dtype too (uint8: and its tables')
        for f in features:
            by_dtype.setdefault(_payload_kind(f.pixel_values, f.extra.get("pixel_table")), []).append(f)
        for dtype, feats in by_dtype.items():
            for bucket, rows in self.bucket_rows(feats).items():
                for i in range(0, len(rows), self.max_batch):
                    batch = rows[i:i + self.max_batch]
                    kind = (bucket, dtype)
                    if kind not in self._seen:
                        self._queue_bucket(kind, *_row_inputs(batch))
                    b = self._rows_to_run(kind, len(batch))
                    if (*kind, b) not in self.compiler:
                        larger = self._larger_bucket(kind, batch)
                        if larger is not None:          # this bucket compiles in the background meanwhile
                            kind, b, batch = larger
                    self._run_packed(kind, b, batch)

    def _run_packed(self, kind: tuple[int, str], b: int, batch: list) -> None:
        pixels, tables = _row_inputs(batch)
        inputs, tokens, num_out = self.family.pack_images(self.cfg, pixels, b, kind[0], tables,
                                                          single=self._single(kind[0]))
        dst = drop_targets(num_out, self.capacity)                # padding tokens write nothing
        for f, slots in zip((f for r in batch for f in r), tokens):
            if len(slots) != f.length:
                raise ValueError(f"an image of {len(slots)} tokens with {f.length} placeholders")
            dst[slots] = self._take_rows(f)
        step = self.compiler.need((*kind, b), "an image batch")
        self.slab = step(self.params, self.slab, inputs, dst)
        self.num_images += sum(len(r) for r in batch)

    def _larger_bucket(self, kind: tuple[int, str], batch: list):
        """For images whose own program is not compiled yet: the smallest larger bucket with a compiled program
        that holds them (more padding, no wait), as ``(kind, rows to run, the images in its rows)``; None when
        there is none (the step waits for its own)."""
        feats = [f for r in batch for f in r]
        ready = sorted({k[0] for k in self.compiler.keys() if k[1] == kind[1] and k[0] > kind[0]})
        for bucket in ready:
            rows = self.bucket_rows(feats, bucket)[bucket]
            b = next((r for r in self._row_batches if r >= len(rows) and (bucket, kind[1], r) in self.compiler),
                     None)
            if b is not None:
                return (bucket, kind[1]), b, rows
        return None

    # ---------------------------------------------------------------- a packed family's programs
    def _queue_bucket(self, kind: tuple[int, str], pixels: list, tables: list | None = None) -> None:
        """A (bucket, payload dtype) seen for the first time: the argument shapes of each of its row batches
        (``pack_images``' arrays lead with the row count: one row packed gives them all), this batch's own and
        those a step can fill under the encoder budget (``budget_rows``) queued for the background compiler (a
        larger batch, should one come, compiles when it does)."""
        self._seen.add(kind)
        own = row_batch(len(pixels))
        one_row, _, tokens_per_row = self.family.pack_images(self.cfg, pixels[:1], 1, kind[0],
                                                             None if tables is None else tables[:1],
                                                             single=self._single(kind[0]))
        for b in self._row_batches:
            self._arg_shapes[(*kind, b)] = (
                jax.tree.map(lambda a, b=b: jax.ShapeDtypeStruct((b, *a.shape[1:]), a.dtype), one_row),
                jax.ShapeDtypeStruct((b * tokens_per_row,), np.int32))
        rows = budget_rows(kind[0], self.family.patch_unit(self.cfg), self.min_patches, tokens_per_row, self.budget,
                           self.max_batch)
        # this batch's own first: a step waits for it only when no larger bucket is compiled (``_larger_bucket``)
        self.compiler.submit([(*kind, own)] + [(*kind, b) for b in self._row_batches if b != own and
                                               b <= row_batch(rows)])

    def _single(self, bucket: int) -> bool:
        """Whether rows of ``bucket`` hold one image each: every bucket above the smallest (an image there has
        more than the bucket below's patches, over half of its own: two never fit)."""
        return bucket > self._smallest

    def pending(self) -> int:
        """Row batches queued or compiling in the background."""
        return self.compiler.pending()

    def _rows_to_run(self, kind: tuple[int, str], n: int) -> int:
        """The rows to run ``n`` rows of ``kind`` in: ``row_batch(n)``, or while that compiles a compiled
        batch of up to twice as many rows."""
        b = row_batch(n)
        if (*kind, b) in self.compiler:
            return b
        ready = [r for r in self._row_batches if b < r <= 2 * b and (*kind, r) in self.compiler]
        return ready[0] if ready else b

    def _lower(self, key: tuple[int, str, int]):
        inputs, dst = self._arg_shapes[key]
        return self._step.lower(self.params, self._slab_shape, inputs, dst)

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
        index[0], index[1] = drop_targets(num_tokens, num_tokens), 0      # padding: distinct rows past T
        index[0, :len(d)], index[1, :len(d)] = d, s_
        if self.bidirectional:
            index[2] = -1
            index[2, d] = np.concatenate(limit)
        return index
