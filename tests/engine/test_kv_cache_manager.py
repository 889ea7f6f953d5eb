"""KVCacheManager: block tables, prefix-cache lookups (never the whole prompt), stats, frees."""
import pytest

from jaxserve.engine.kv_cache_manager import KVCacheManager, cdiv
from jaxserve.engine.request import Request

BS = 4


def req(rid, tokens, salt=None):
    return Request(rid, tokens, cache_salt=salt)


def compute(mgr, r, n, hits=None):
    """Allocate and pretend the step computed n tokens (what the scheduler does around a step)."""
    assert mgr.allocate_slots(r, n, hits) is not None
    r.num_computed_tokens += n + (len(hits) * BS if hits else 0)
    mgr.cache_blocks(r, r.num_computed_tokens)


def test_block_table_covers_computed_plus_new_tokens():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    r = req("a", list(range(10)))
    new = mgr.allocate_slots(r, 6)
    assert len(new) == 2 and mgr.block_ids("a") == [b.block_id for b in new]
    r.num_computed_tokens = 6
    assert len(mgr.allocate_slots(r, 2)) == 0             # 8 tokens still fit in 2 blocks
    r.num_computed_tokens = 8
    assert len(mgr.allocate_slots(r, 3)) == 1
    assert len(mgr.block_ids("a")) == cdiv(11, BS) == 3
    assert 0 not in mgr.block_ids("a")
    assert mgr.num_free_blocks == 6 and mgr.usage == pytest.approx(3 / 9)


def test_allocate_returns_none_and_changes_nothing_when_the_pool_is_short():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)     # 3 usable blocks = 12 tokens
    a = req("a", list(range(8)))
    assert mgr.allocate_slots(a, 8) is not None
    b = req("b", list(range(100, 108)))
    assert mgr.allocate_slots(b, 8) is None
    assert mgr.block_ids("b") == [] and mgr.num_free_blocks == 1
    with pytest.raises(ValueError, match="positive"):
        mgr.allocate_slots(b, 0)


def test_free_releases_tail_first_and_is_idempotent():
    mgr = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    a = req("a", list(range(12)))
    mgr.allocate_slots(a, 12)
    held = mgr.block_ids("a")
    mgr.free(a)
    mgr.free(a)
    assert mgr.num_free_blocks == 5 and mgr.block_ids("a") == []
    tail = [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()][-3:]
    assert tail == held[::-1]


def test_shared_system_prompt_hits_full_blocks_only():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    system = list(range(1000, 1010))                      # 10 tokens: 2 full blocks + 2 tokens
    a = req("a", system + [1, 2, 3])
    assert mgr.get_computed_blocks(a) == ([], 0)
    compute(mgr, a, a.num_tokens)
    b = req("b", system + [7, 8, 9, 10, 11])
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits] == mgr.block_ids("a")[:2]
    compute(mgr, b, b.num_tokens - n, hits)
    assert mgr.block_ids("b")[:2] == mgr.block_ids("a")[:2]
    assert mgr.block_ids("b")[2:] != mgr.block_ids("a")[2:]
    assert all(blk.ref_cnt == 2 for blk in hits)
    st = mgr.prefix_cache_stats
    assert (st.requests, st.queries, st.hits) == (2, 13 + 15, 8)
    assert st.hit_rate == pytest.approx(8 / 28)
    # Freed blocks keep serving hits.
    mgr.free(a)
    mgr.free(b)
    c = req("c", system + [5])
    assert mgr.get_computed_blocks(c)[1] == 8


def test_a_fully_cached_prompt_still_recomputes_its_last_token():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    a = req("a", list(range(8)))                          # exactly 2 blocks
    compute(mgr, a, 8)
    mgr.free(a)
    again = req("again", list(range(8)))
    hits, n = mgr.get_computed_blocks(again)
    assert n == 4 and len(hits) == 1                      # not 8: the last token must be computed
    longer = req("longer", list(range(9)))
    assert mgr.get_computed_blocks(longer)[1] == 8


def test_only_computed_blocks_are_cached():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    a = req("a", list(range(16)))
    mgr.allocate_slots(a, 16)                             # scheduled, not computed yet
    assert mgr.get_computed_blocks(req("b", list(range(16)) + [1]))[1] == 0
    a.num_computed_tokens = 6
    mgr.cache_blocks(a, 6)                                # one block is full and computed
    assert mgr.get_computed_blocks(req("c", list(range(16)) + [1]))[1] == 4


def test_cache_salt_separates_namespaces():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    tokens = list(range(9))
    compute(mgr, req("a", tokens, salt="alice"), 9)
    assert mgr.get_computed_blocks(req("b", tokens, salt="bob"))[1] == 0
    assert mgr.get_computed_blocks(req("c", tokens))[1] == 0
    assert mgr.get_computed_blocks(req("d", tokens, salt="alice"))[1] == 8


def test_hits_sitting_in_the_free_queue_count_against_the_free_blocks():
    mgr = KVCacheManager(num_blocks=5, block_size=BS)     # 4 usable
    a = req("a", list(range(9)))
    compute(mgr, a, 9)                                    # 3 blocks, 2 of them cached
    mgr.free(a)
    assert mgr.num_free_blocks == 4
    b = req("b", list(range(8)) + list(range(50, 60)))    # 18 tokens: 5 blocks needed, 2 hit
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8
    # 3 new blocks are needed, but 2 of the 4 free ones are the hits themselves.
    assert mgr.allocate_slots(b, 10, hits) is None
    assert all(h.ref_cnt == 0 for h in hits) and mgr.num_free_blocks == 4
    c = req("c", list(range(8)) + [50, 51, 52])           # 11 tokens: 3 blocks, 2 hit -> 1 new
    hits, n = mgr.get_computed_blocks(c)
    assert mgr.allocate_slots(c, 3, hits) is not None
    assert mgr.num_free_blocks == 1


def test_prefix_hits_only_on_a_first_allocation():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    a = req("a", list(range(9)))
    compute(mgr, a, 9)
    b = req("b", list(range(9)))
    mgr.allocate_slots(b, 1)
    hits, _ = mgr.get_computed_blocks(b)
    with pytest.raises(ValueError, match="already holds blocks"):
        mgr.allocate_slots(b, 1, hits)


def test_prefix_caching_off():
    mgr = KVCacheManager(num_blocks=20, block_size=BS, enable_prefix_caching=False)
    compute(mgr, req("a", list(range(9))), 9)
    assert mgr.get_computed_blocks(req("b", list(range(9)))) == ([], 0)
    assert mgr.prefix_cache_stats.queries == 0


def test_pool_must_hold_max_model_len():
    with pytest.raises(ValueError, match="fewer than max_model_len 64"):
        KVCacheManager(num_blocks=16, block_size=4, max_model_len=64)   # 15 usable blocks = 60 tokens
    KVCacheManager(num_blocks=17, block_size=4, max_model_len=64)


def test_reset_prefix_cache():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    a = req("a", list(range(9)))
    compute(mgr, a, 9)
    assert not mgr.reset_prefix_cache()
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(req("b", list(range(9))))[1] == 0
