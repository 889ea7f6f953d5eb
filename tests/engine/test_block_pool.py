"""BlockPool: the LRU free queue, ref counts, the null block, the prefix-cache map."""
import pytest

from jaxserve.engine.block_pool import (NULL_BLOCK_ID, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock,
                                        hash_block_tokens)


def ids(blocks):
    return [b.block_id for b in blocks]


def test_null_block_matches_kernels_and_is_never_handed_out():
    from jaxserve.kernels.metadata import NULL_BLOCK
    assert NULL_BLOCK_ID == NULL_BLOCK
    pool = BlockPool(8, enable_caching=True)
    assert pool.num_free_blocks == 7
    got = pool.get_new_blocks(7)
    assert sorted(ids(got)) == list(range(1, 8))
    assert all(b.ref_cnt == 1 for b in got)
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block])          # ignored, never enters the free queue
    assert pool.num_free_blocks == 0 and pool.null_block.ref_cnt == 0


def test_pool_needs_two_blocks():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_free_queue_is_a_doubly_linked_fifo_with_o1_remove():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    q.remove(blocks[2])
    q.remove(blocks[0])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4]
    q.append(blocks[2])
    assert q.popleft() is blocks[1]
    assert ids(q.get_all_free_blocks()) == [3, 4, 2] and q.num_free_blocks == 3
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(blocks[1])
    with pytest.raises(RuntimeError, match="already in the free queue"):
        q.append(blocks[3])
    for _ in range(3):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft()


def test_freed_blocks_go_to_the_tail_in_the_order_given():
    pool = BlockPool(6, enable_caching=False)          # usable: 1..5
    a = pool.get_new_blocks(3)                         # 1, 2, 3
    assert ids(a) == [1, 2, 3]
    pool.free_blocks(reversed(a))                      # a request frees tail first
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 5, 3, 2, 1]
    # never-used blocks first, then the freed request's tail before its head
    assert ids(pool.get_new_blocks(4)) == [4, 5, 3, 2]


def test_double_free_is_detected():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([b])


def test_cached_blocks_survive_free_until_evicted_for_reuse():
    pool = BlockPool(4, enable_caching=True)           # usable: 1..3
    blocks = pool.get_new_blocks(2)
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    pool.cache_full_blocks(blocks, [h0, h1], 0, 2)
    assert pool.get_cached_block(h0) is blocks[0] and pool.get_cached_block(h1) is blocks[1]
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 3 and pool.usage == 0.0
    # still a hit while free
    assert pool.get_cached_block(h0) is blocks[0]
    # a hit is taken back with touch: out of the free queue, ref_cnt 1
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 2
    assert blocks[0] not in pool.free_block_queue.get_all_free_blocks()
    # allocation pops the never-cached block 3 first, then evicts block 2 (h1)
    new = pool.get_new_blocks(2)
    assert ids(new) == [3, blocks[1].block_id]
    assert pool.get_cached_block(h1) is None and blocks[1].block_hash is None
    assert pool.get_cached_block(h0) is blocks[0]      # held, so never evicted
    assert pool.usage == 1.0


def test_touch_shares_a_held_block():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b, pool.null_block])
    assert b.ref_cnt == 2 and pool.null_block.ref_cnt == 0
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([b])
    assert pool.num_free_blocks == 3


def test_same_content_is_not_cached_twice():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [5, 6])
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.free_blocks([b, a])
    assert pool.evict(a) and not pool.evict(b)
    assert pool.get_cached_block(h) is None


def test_caching_disabled_caches_nothing():
    pool = BlockPool(4, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_full_blocks([a], [h], 0, 1)
    assert pool.get_cached_block(h) is None and a.block_hash is None


def test_reset_prefix_cache_only_when_nothing_is_held():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks([a], [h], 0, 1)
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(h) is a
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h) is None and a.block_hash is None


def test_block_hashes_chain_parent_tokens_and_salt():
    h0 = hash_block_tokens(None, [1, 2, 3])
    assert hash_block_tokens(None, (1, 2, 3)) == h0
    assert hash_block_tokens(None, [1, 2, 4]) != h0
    assert hash_block_tokens(None, [1, 2, 3], "tenant-a") != h0
    a = hash_block_tokens(h0, [7, 8, 9])
    b = hash_block_tokens(hash_block_tokens(None, [0, 2, 3]), [7, 8, 9])
    assert a != b                                       # same tokens, different prefix
    assert {a: 1}.get(hash_block_tokens(h0, [7, 8, 9])) == 1
