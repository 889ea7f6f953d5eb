"""Per-request block tables on top of the BlockPool, and the prefix-cache lookups.

A request's block table covers its computed tokens plus the tokens scheduled this step:
``len(blocks) == cdiv(num_computed_tokens + num_new_tokens, block_size)`` after allocate_slots (or more:
a multi-step decode allocates its lookahead, and when it then runs single steps the blocks wait for them).
Blocks enter the prefix cache only once their K/V are computed (`cache_blocks`, called by the
scheduler after each step), so a lookup can never hit a block whose content is not written yet.
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxserve.engine.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from jaxserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative counters, in tokens like vLLM: `queries` tokens looked up, `hits` served from cache."""
    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_model_len: int | None = None, images_key_every_block: bool = False):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        # every token of a prompt with images depends on them (cross-attention models): the first block's
        # hash holds them all, and through the chain every later block's
        self.images_key_every_block = images_key_every_block
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        if max_model_len is not None and self.num_usable_blocks * block_size < max_model_len:
            # Otherwise one long request could never fit, even alone, and would wait forever.
            raise ValueError(
                f"the KV cache holds {self.num_usable_blocks * block_size} tokens "
                f"({self.num_usable_blocks} blocks of {block_size}), fewer than max_model_len "
                f"{max_model_len}: lower max_model_len or give the KV cache more memory")
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as plain ids, kept alongside so block_ids() is a C-level list copy.
        self.req_to_block_ids: dict[str, list[int]] = {}
        # How many of a request's leading blocks are already in the prefix cache (or were offered to it).
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # -- sizes ----------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    # -- prefix cache ---------------------------------------------------------------------------------
    def _update_block_hashes(self, req: Request, num_full_blocks: int) -> None:
        """Extend req.block_hashes to cover its first `num_full_blocks` full blocks of tokens."""
        hashes = req.block_hashes
        tokens = req.all_token_ids
        bs = self.block_size
        features = req.mm_features
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else None
            # The salt joins the first block's hash, and through the chain every later block's.
            extra = req.cache_salt if i == 0 else None
            if i == 0 and req.lora_request is not None:     # an adapter's K/V are its own
                extra = (extra, "lora", req.lora_request.lora_int_id, req.lora_request.lora_path)
            if features is not None:
                # a block's image tokens are one id: the images it overlaps (by content hash) tell it apart
                images = tuple(f.hash for f in features if f.offset < (i + 1) * bs and f.offset + f.length > i * bs
                               or i == 0 and self.images_key_every_block)
                if images:
                    extra = (extra, images)
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], extra))

    def get_computed_blocks(self, req: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's tokens: (blocks, number of tokens they hold).

        Never the whole sequence: its last token is always recomputed, to get logits to sample from.
        Does not take the blocks: pass them to allocate_slots, which counts the lookup in
        prefix_cache_stats once it succeeds (a request retried over several steps counts once).
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        self._update_block_hashes(req, max_blocks)
        computed: list[KVCacheBlock] = []
        for block_hash in req.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    def cache_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Enter the request's full blocks whose K/V are computed (the first num_computed_tokens tokens)
        into the prefix cache. Called by the scheduler after each step."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens, req.num_tokens) // self.block_size
        num_cached = self.num_cached_blocks.get(req.request_id, 0)
        if num_full <= num_cached:              # the common case (a decode inside a block): nothing new
            return
        blocks = self.req_to_blocks.get(req.request_id)
        if not blocks:
            return
        num_full = min(num_full, len(blocks))
        if num_full <= num_cached:
            return
        self._update_block_hashes(req, num_full)
        self.block_pool.cache_full_blocks(blocks, req.block_hashes, num_cached, num_full)
        self.num_cached_blocks[req.request_id] = num_full

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # -- allocation -----------------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> list[KVCacheBlock] | None:
        """Make the block table cover req.num_computed_tokens (+ the prefix-cache hits in
        new_computed_blocks) + num_new_tokens tokens.

        Returns the newly allocated blocks (possibly none), or None, changing nothing, when the pool
        cannot supply them. new_computed_blocks come from get_computed_blocks for a request that holds
        no blocks yet; they are shared (ref_cnt + 1), not copied.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        req_blocks = self.req_to_blocks.get(req.request_id)
        if (req_blocks is not None and not new_computed_blocks
                and req.num_computed_tokens + num_new_tokens <= len(req_blocks) * self.block_size):
            return []                           # the common case (a decode inside its last block)
        new_computed_blocks = new_computed_blocks or []
        is_first_allocation = req_blocks is None
        if is_first_allocation:
            req_blocks = []
        elif new_computed_blocks:
            raise ValueError(f"request {req.request_id} already holds blocks; prefix hits apply only to "
                             "a request's first allocation")
        num_computed = req.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(req_blocks) - len(new_computed_blocks)
        # Hit blocks nobody holds sit in the free queue: taking them shrinks what is left to allocate.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            return None

        if is_first_allocation:
            self.req_to_blocks[req.request_id] = req_blocks
            self.req_to_block_ids[req.request_id] = []
            self.num_cached_blocks[req.request_id] = len(new_computed_blocks)
            if self.enable_prefix_caching:
                stats = self.prefix_cache_stats
                stats.requests += 1
                stats.queries += req.num_tokens
                stats.hits += len(new_computed_blocks) * self.block_size
        req_block_ids = self.req_to_block_ids[req.request_id]
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            req_block_ids.extend(b.block_id for b in new_computed_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        req_block_ids.extend(b.block_id for b in new_blocks)
        return new_blocks

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first (so its tail is evicted before its shared prefix).
        Safe to call for a request that holds none."""
        blocks = self.req_to_blocks.pop(req.request_id, None)
        self.num_cached_blocks.pop(req.request_id, None)
        self.req_to_block_ids.pop(req.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def live_block_ids(self, request_id: str) -> list[int]:
        """The request's block table, the manager's own list (no copy: a step's inputs read it that step;
        it only grows until the request frees it, and a new allocation after a free is a new list)."""
        ids = self.req_to_block_ids.get(request_id)
        return ids if ids is not None else []

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (physical block ids, a fresh list); empty if it holds none."""
        ids = self.req_to_block_ids.get(request_id)
        return list(ids) if ids else []
