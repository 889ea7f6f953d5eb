"""Which data-parallel replica takes a request (``dp_client.DPClient`` asks; pure bookkeeping, no I/O).

NOTE the rule: a request goes to the live replica with the least load (requests sent to it and not finished:
its waiting + running as this front end counts them, ties broken by its last reported KV usage), unless a
replica was the last to take a request with the same prefix (chained hashes of the prompt's first
``AFFINITY_BLOCKS`` full KV blocks, the deepest match wins) and is not overloaded: its load is less than the
least load plus ``slack``. That replica has the prefix's blocks cached, so the prefill it skips outweighs a
slightly longer queue; past the slack, balance wins and the prefix gets a second home.
"""
from __future__ import annotations

from collections import OrderedDict

AFFINITY_BLOCKS = 4          # full prompt blocks a request's prefix hashes cover
REMEMBERED_PREFIXES = 1 << 16   # prefix hashes kept (the least recently routed forgotten first)


class ReplicaRouter:
    def __init__(self, num_replicas: int, block_size: int, slack: int):
        self.block_size = block_size
        self.slack = max(1, slack)
        self.load = [0] * num_replicas              # requests sent, not finished or aborted
        self.kv_usage = [0.0] * num_replicas        # each replica's last reported KV usage
        self.alive = [True] * num_replicas
        self.owner: dict[str, int] = {}             # request id -> its replica
        self._homes: OrderedDict[int, int] = OrderedDict()   # prefix hash -> the replica that last took it

    def prefix_hashes(self, prompt_token_ids, namespace=None) -> list[int]:
        """Chained hashes of the prompt's first full blocks (a block not full is never a prefix-cache hit)."""
        bs, hashes, h = self.block_size, [], hash(namespace)
        for i in range(min(AFFINITY_BLOCKS, len(prompt_token_ids) // bs)):
            h = hash((h, tuple(prompt_token_ids[i * bs:(i + 1) * bs])))
            hashes.append(h)
        return hashes

    def route(self, request_id: str, prompt_token_ids, namespace=None) -> int:
        """The replica for a new request (recorded as its owner). ``namespace``: what else keys its prefix
        cache (cache salt, LoRA adapter). Raises LookupError if no replica is alive."""
        live = [i for i, ok in enumerate(self.alive) if ok]
        if not live:
            raise LookupError("no data-parallel replica is alive")
        least = min(live, key=lambda i: (self.load[i], self.kv_usage[i], i))
        hashes = self.prefix_hashes(prompt_token_ids, namespace)
        chosen = least
        for h in reversed(hashes):                  # the deepest prefix some replica took
            home = self._homes.get(h)
            if home is not None:
                if self.alive[home] and self.load[home] < self.load[least] + self.slack:
                    chosen = home
                break
        for h in hashes:
            self._homes[h] = chosen
            self._homes.move_to_end(h)
        while len(self._homes) > REMEMBERED_PREFIXES:
            self._homes.popitem(last=False)
        self.owner[request_id] = chosen
        self.load[chosen] += 1
        return chosen

    def release(self, request_id: str) -> int | None:
        """A request finished or was aborted: its replica (None if unknown: a probe, or already released)."""
        replica = self.owner.pop(request_id, None)
        if replica is not None:
            self.load[replica] -= 1
        return replica

    def lose(self, replica: int) -> list[str]:
        """The replica died: it takes nothing more; returns the requests it held (released)."""
        self.alive[replica] = False
        lost = [rid for rid, r in self.owner.items() if r == replica]
        for rid in lost:
            del self.owner[rid]
        self.load[replica] = 0
        self._homes = OrderedDict((h, r) for h, r in self._homes.items() if r != replica)
        return lost
