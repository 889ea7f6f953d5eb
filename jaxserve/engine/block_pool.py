"""The pool of fixed-size KV cache blocks: ref counts, an O(1) LRU free queue, the prefix-cache map.

Design (vLLM v1's): every block that no request holds sits in one doubly linked free queue, cached or
not. Allocation pops from the head; a cached block is evicted from the hash map only when it is popped
for reuse, so freed blocks keep serving prefix hits until the pool actually needs them. Callers free a
request's blocks tail first, so its tail blocks (least shared) are evicted before its prefix.
Block 0 is the null block (kernels/metadata.py NULL_BLOCK): padding writes there; it is never handed out.
"""
from __future__ import annotations

from typing import Iterable, Sequence

NULL_BLOCK_ID = 0  # == jaxserve.kernels.metadata.NULL_BLOCK (not imported: this module stays JAX-free)

# Seed of the hash chain for a request's first block.
_ROOT_HASH = hash("jaxserve-prefix-cache-root")


class BlockHash:
    """The identity of a full block of tokens: a chained hash plus the tokens themselves.

    Equality compares the tokens too, so a hash collision between different contents can never alias
    two blocks in the cache map (only the parent link relies on the hash value alone).
    """
    __slots__ = ("hash_value", "token_ids", "extra_keys")

    def __init__(self, hash_value: int, token_ids: tuple[int, ...], extra_keys: object = None):
        self.hash_value = hash_value
        self.token_ids = token_ids
        self.extra_keys = extra_keys

    def __hash__(self) -> int:
        return self.hash_value

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BlockHash) and self.hash_value == other.hash_value
                and self.token_ids == other.token_ids and self.extra_keys == other.extra_keys)

    def __repr__(self) -> str:
        return f"BlockHash({self.hash_value:#x}, {len(self.token_ids)} tokens)"


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: object = None) -> BlockHash:
    """Chain: hash(parent hash, this block's token ids, extra keys such as the cache salt)."""
    token_ids = tuple(token_ids)
    parent_value = _ROOT_HASH if parent is None else parent.hash_value
    return BlockHash(hash((parent_value, token_ids, extra_keys)), token_ids, extra_keys)


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0                              # requests holding this block
        self.block_hash: BlockHash | None = None      # set while the block is in the prefix-cache map
        self.prev_free: KVCacheBlock | None = None    # free-queue links (None when not in the queue)
        self.next_free: KVCacheBlock | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (head = evicted first); O(1) everywhere.

    Sentinel head/tail nodes keep the link updates branch-free. A block is in the queue iff its
    prev_free/next_free are set.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free block left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail (for tests and debugging)."""
        out = []
        block = self._head.next_free
        while block is not self._tail:
            out.append(block)
            block = block.next_free
        return out


class BlockPool:
    """`num_blocks` blocks, block 0 reserved as the null block, so num_blocks - 1 can be handed out."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # Content -> the one block holding it. A block is in the map iff its block_hash is set; blocks
        # with the same content computed side by side are not deduplicated (block tables stay
        # append-only), the later one just stays out of the map.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are evicted on demand)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks that requests hold (0..1)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Enter blocks[num_cached_blocks:num_full_blocks] (full, K/V computed) into the prefix cache."""
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue
            block_hash = block_hashes[i]
            if block_hash in self.cached_block_hash_to_block:
                continue                                   # same content already cached elsewhere
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the LRU head (evicting cached ones), each with ref_cnt 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.num_free_blocks} are free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self.evict(block)
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def evict(self, block: KVCacheBlock) -> bool:
        """Drop the block from the prefix-cache map (its content is about to be overwritten)."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        del self.cached_block_hash_to_block[block_hash]
        block.block_hash = None
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A request takes a share of (cached) blocks: ref_cnt += 1, out of the free queue if it was there."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks nobody holds join the free queue's tail in the order
        given (so pass them in eviction order: a request's blocks tail first)."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after a weight update). Only when no request holds blocks."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
