"""The scheduler's view of the runner's encoder cache: which images' encoder outputs are on the device, who
needs them, and the encoder budget of a step (vLLM v1's ``EncoderCacheManager`` and encoder budget).

NOTE (encoder scheduling): an image's encoder output must exist no later than the step that prefills its
first image token. When a step's chunk of a prompt reaches an image whose output is not cached, the image
is encoded in that step if its tokens fit both the step's encoder budget (``max_num_encoder_input_tokens``)
and the cache (``encoder_cache_size``, evicting outputs no request holds); otherwise the chunk stops just
before the image, which waits for a later step. A chunk may end inside an image (unless ``whole_images``:
``--disable-chunked-mm-input``, forced on where an image's tokens attend to each other both ways, so the
step computing them holds the image's remaining tokens all: the chunk stops before an image it cannot take
to its end). Its output stays cached
(held by the request) until the request's computed tokens pass the image's last token, then stays on as
unreferenced (another request with the same image takes it without encoding) until space is needed.
Evicted hashes are reported to the runner, which drops their device arrays (``take_freed``).
With ``whole_request`` (cross-attention models, Mllama: every token of a request with an image reads it) an
image is needed from the request's first chunk to its end: it is encoded before the first chunk runs
(which waits for room otherwise) and held until the request finishes, is preempted or aborted.
"""
from __future__ import annotations

from collections import OrderedDict

from jaxserve.engine.request import Request


class EncoderCacheManager:
    def __init__(self, budget: int, capacity: int, whole_images: bool = False, whole_request: bool = False):
        self.budget = budget                         # image tokens encoded per step
        self.capacity = capacity                     # image tokens cached
        self.whole_images = whole_images             # a chunk never ends inside an image
        self.whole_request = whole_request           # an image is needed by every chunk of its request
        self.used = 0
        self.cached: dict[str, int] = {}             # hash -> image tokens, for every output on the device
        self.holders: dict[str, set[str]] = {}       # hash -> ids of the requests that still need it
        self.unheld: OrderedDict[str, None] = OrderedDict()   # cached, held by none: evicted oldest first
        self._freed: list[str] = []
        self.num_encoded = 0                         # images encoded (stats)
        self.num_reused = 0                          # images a request found cached

    def fits_budget(self, num_tokens: int) -> bool:
        """Whether an image of ``num_tokens`` can ever be encoded (a request with a larger one is refused)."""
        return num_tokens <= min(self.budget, self.capacity)

    def schedule(self, req: Request, start: int, num_new: int, budget: int) -> tuple[int, list, int]:
        """The chunk ``[start, start + num_new)`` of ``req`` with its images: ``(num_new``, cut before the
        first image that cannot be encoded this step``, the features to encode, the encoder budget left)``.
        Takes the encoder outputs it needs (``cancel`` gives back what a step that did not run took)."""
        to_encode = []
        rid, end = req.request_id, start + num_new
        for f in req.mm_features:
            if not self.whole_request and f.offset >= end:
                break
            if not self.whole_request and f.offset + f.length <= start:
                continue
            if self.whole_images and f.offset + f.length > end:     # (a prefix hit may start inside it)
                return max(f.offset - start, 0), to_encode, budget
            held = self.holders.get(f.hash)
            if held is not None:                     # on the device (or encoded earlier in this step)
                if rid not in held:
                    held.add(rid)
                    self.unheld.pop(f.hash, None)
                    self.num_reused += f.offset >= start
                continue
            if f.length > budget or not self._make_room(f.length):
                if self.whole_request:      # all of the request's images or none: forget what this call took
                    self._forget(to_encode)
                    return 0, [], budget + sum(g.length for g in to_encode)
                return f.offset - start, to_encode, budget
            self.cached[f.hash] = f.length
            self.used += f.length
            self.holders[f.hash] = {rid}
            budget -= f.length
            to_encode.append(f)
            self.num_encoded += 1
        return num_new, to_encode, budget

    def whole_image_room(self, req: Request, start: int) -> int:
        """With ``whole_images``: the tokens from ``start`` to the end of the first image not computed by then,
        which a chunk holding any of it must reach (the scheduler lets it pass the long-prefill share, else a
        long image would wait for as long as decodes run); 0 otherwise."""
        if self.whole_images:
            for f in req.mm_features:
                if f.offset + f.length > start:
                    return f.offset + f.length - start
        return 0

    def cancel(self, req: Request, encoded: list) -> None:
        """Give back what ``schedule`` took for a chunk that is not dispatched: the outputs it was to
        encode are forgotten (never made), the others released."""
        self._forget(encoded)
        self.release_all(req)

    def _forget(self, encoded: list) -> None:
        for f in encoded:
            self.num_encoded -= 1
            self.holders.pop(f.hash, None)
            self.used -= self.cached.pop(f.hash)

    def release_computed(self, req: Request) -> None:
        """Release the images whose tokens ``req`` has all computed (``whole_request``: none before its end)."""
        if self.whole_request:
            return
        done = req.num_computed_tokens
        for f in req.mm_features:
            if f.offset + f.length <= done:
                self._release(req.request_id, f.hash)

    def release_all(self, req: Request) -> None:
        """Release every image of ``req`` (finished, aborted or preempted)."""
        for f in req.mm_features:
            self._release(req.request_id, f.hash)

    def take_freed(self) -> list[str]:
        """Hashes evicted since the last call: the runner drops their outputs."""
        freed, self._freed = self._freed, []
        return freed

    def _release(self, rid: str, h: str) -> None:
        held = self.holders.get(h)
        if held is not None and rid in held:
            held.discard(rid)
            if not held:
                self.unheld[h] = None

    def _make_room(self, num_tokens: int) -> bool:
        if num_tokens > self.capacity - self.used + sum(self.cached[h] for h in self.unheld):
            return False
        while self.capacity - self.used < num_tokens:
            h, _ = self.unheld.popitem(last=False)
            del self.holders[h]
            self.used -= self.cached.pop(h)
            self._freed.append(h)
        return True

    def stats(self) -> dict:
        return {"encoder_cache_usage": self.used / self.capacity if self.capacity else 0.0,
                "images_encoded_total": self.num_encoded, "images_reused_total": self.num_reused}
