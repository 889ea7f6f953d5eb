"""Which LoRA adapter holds which device slot, for the scheduler; adapters read from disk kept on the host.

NOTE (slots): ``max_loras`` device slots (``jaxserve.lora.slots``; slot 0 is the base model's zeros). A
request with an adapter is admitted only when ``acquire`` finds it a slot: the slot that already holds its
adapter, else an empty one, else the least recently used slot no running request pins (its adapter is
overwritten: a device update, never a recompile). Otherwise the request stays waiting (queued, never
refused) and so do the adapter requests behind it, while requests without an adapter pass; it gets a slot once
the running requests of some adapter have finished. A running request pins its slot until it finishes or is
preempted.

Host cache: read adapters (``jaxserve.lora.read_adapter``), the ``max_cpu_loras`` most recently used; one
evicted is read again from its folder when next needed.
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict

from jaxserve.lora import LoRAAdapter, LoRARequest, read_adapter


WAITING_SCAN_S = 0.5


class LoRAManager:
    def __init__(self, write_slot, model_config, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None):
        self.write_slot = write_slot                # runner.write_lora_slot(slot, adapter)
        self.model_config, self.max_lora_rank = model_config, max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()     # adapter id -> read adapter (LRU order)
        self.slots: list[LoRARequest | None] = [None] * (max_loras + 1)   # slot -> adapter (index 0 unused)
        self.slot_of: dict[int, int] = {}
        self.recency: OrderedDict[int, None] = OrderedDict()          # resident adapter ids, least recent first
        self.pins: Counter[int] = Counter()                           # adapter id -> running requests
        self.names: dict[int, str] = {}                               # adapter id -> name
        self._waiting, self._waiting_at = "", -WAITING_SCAN_S

    def read(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter read and checked (``AdapterError`` if it cannot be served), from the host cache."""
        key = lora.lora_int_id
        adapter = self.host.get(key)
        if adapter is None:
            adapter = read_adapter(lora.lora_path, self.model_config, self.max_lora_rank)
            self.host[key] = adapter
            while len(self.host) > self.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(key)
        self.names[key] = lora.lora_name
        return adapter

    def acquire(self, req) -> bool:
        """Pin a slot holding ``req``'s adapter and set ``req.lora_slot``; False when every slot is pinned by
        other adapters (the request waits)."""
        lora = req.lora_request
        key = lora.lora_int_id
        slot = self.slot_of.get(key)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self._evict(slot)
            self.write_slot(slot, self.read(lora))
            self.slots[slot], self.slot_of[key] = lora, slot
        self.recency[key] = None
        self.recency.move_to_end(key)
        self.pins[key] += 1
        req.lora_slot = slot
        return True

    def release(self, req) -> None:
        """``req`` stopped running (finished or preempted): its slot may be reused once no request pins it."""
        key = req.lora_request.lora_int_id
        self.pins[key] -= 1
        if self.pins[key] <= 0:
            del self.pins[key]
        req.lora_slot = 0

    def _free_slot(self) -> int | None:
        for slot in range(1, len(self.slots)):
            if self.slots[slot] is None:
                return slot
        for key in self.recency:                 # least recently used first
            if not self.pins[key]:
                return self.slot_of[key]
        return None

    def _evict(self, slot: int) -> None:
        old = self.slots[slot]
        if old is not None:
            del self.slot_of[old.lora_int_id]
            self.recency.pop(old.lora_int_id, None)
            self.slots[slot] = None

    def running_names(self) -> str:
        """The adapters running requests use, comma-joined (vLLM's ``lora_requests_info`` label)."""
        return ",".join(sorted(self.names[key] for key in self.pins))

    def waiting_names(self, waiting) -> str:
        """The adapters of the ``waiting`` requests, comma-joined; a scan of the queue at most every
        ``WAITING_SCAN_S`` (the engine reports stats every step)."""
        now = time.monotonic()
        if now - self._waiting_at >= WAITING_SCAN_S:
            self._waiting_at = now
            self._waiting = ",".join(sorted({r.lora_request.lora_name for r in waiting if r.lora_request is not None}))
        return self._waiting
