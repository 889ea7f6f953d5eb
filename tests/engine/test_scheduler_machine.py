"""The scheduler as a hypothesis state machine: random add / step / abort / finish on a tiny pool, block and
request invariants after every operation, and everything drains at the end; on the fake device of
support/fake_scheduler.py.
"""
from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxserve.engine.kv_cache_manager import cdiv
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler_output import SchedulerOutput

from support.fake_scheduler import EOS, VOCAB, apply, make, next_token, params


# ------------------------------------------------------------------------ property-based state machine
class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort / finish with a tiny pool (preemption is frequent), invariants after
    every operation, and at the end everything must drain (nothing stuck, nothing lost)."""

    @initialize(block_size=st.sampled_from([2, 4]), max_model_len=st.sampled_from([12, 24]),
                spare_blocks=st.integers(0, 6), budget=st.integers(1, 30), max_seqs=st.integers(1, 5),
                chunked=st.booleans(), caching=st.booleans(), steps=st.sampled_from([1, 3]))
    def setup(self, block_size, max_model_len, spare_blocks, budget, max_seqs, chunked, caching, steps):
        num_blocks = 1 + cdiv(max_model_len, block_size) + spare_blocks
        self.sched, self.kv, self.dev = make(num_blocks, block_size, max_model_len, budget, max_seqs,
                                             chunked, caching, steps=steps)
        self.budget, self.max_seqs = budget, max_seqs
        self.added: dict[str, Request] = {}
        self.finished: set[str] = set()
        self.next_id = 0
        self.shared_prefix = [7] * max_model_len        # so requests share cached blocks

    @rule(prefix_len=st.integers(0, 12), suffix=st.lists(st.integers(1, VOCAB - 1), max_size=14),
          max_tokens=st.one_of(st.none(), st.integers(1, 8)), eos=st.booleans())
    def add(self, prefix_len, suffix, max_tokens, eos):
        prompt = self.shared_prefix[:prefix_len] + suffix
        rid = f"r{self.next_id}"
        self.next_id += 1
        r = Request(rid, prompt, params(max_tokens=max_tokens), eos_token_ids=[EOS] if eos else [])
        too_long = len(prompt) > self.sched.max_model_len
        unchunkable = not self.sched.enable_chunked_prefill and len(prompt) > self.budget
        if not prompt or too_long or unchunkable:      # the engine refuses these before the scheduler
            return
        self.sched.add_request(r)
        self.added[rid] = r

    @rule(eos_for=st.integers(0, 10))
    def step(self, eos_for):
        before = self.sched.num_preemptions
        out = self.sched.schedule()
        self.check_schedule(out)
        eos_at = {f"r{eos_for}": 1}
        if self.sched.num_preemptions > before:
            event("preempted")
        if out.num_steps > 1:
            event("multi-step")
        finished = apply(self.sched, out, self.dev.execute(out, eos_at))
        for r in finished:
            assert r.is_finished() and r.request_id not in self.finished
            self.finished.add(r.request_id)

    @precondition(lambda self: self.added)
    @rule(data=st.data(), finish=st.booleans())
    def abort_or_finish(self, data, finish):
        rid = data.draw(st.sampled_from(sorted(self.added)))
        if finish:
            got = self.sched.finish_requests([rid], RequestStatus.FINISHED_STOPPED)
        else:
            got = self.sched.abort_requests([rid])
        if rid in self.finished:
            assert got == []
        else:
            assert [r.request_id for r in got] == [rid]
            self.finished.add(rid)

    def check_schedule(self, out: SchedulerOutput):
        sched, kv = self.sched, self.kv
        assert sum(e.num_new_tokens for e in out.scheduled) <= self.budget
        assert len(out.scheduled) <= self.max_seqs and sched.num_running <= self.max_seqs
        assert len({e.request_id for e in out.scheduled}) == len(out.scheduled)
        sizes = [e.num_new_tokens for e in out.scheduled]
        num_decodes = sizes.count(1)
        assert sizes[:num_decodes] == [1] * num_decodes                # decodes first
        for e in out.scheduled:
            r = e.request
            assert r.status == RequestStatus.RUNNING and e.start_pos == r.num_computed_tokens
            assert 0 < e.num_new_tokens and e.start_pos + e.num_new_tokens <= r.num_tokens
            assert e.samples == (e.start_pos + e.num_new_tokens == r.num_tokens)
            assert e.start_pos + e.num_new_tokens <= sched.max_model_len
            assert e.block_ids == kv.block_ids(r.request_id)
            # the table covers this step's positions; it may hold more, up to the lookahead of a multi-step
            # plan that fell back to single steps (no entry could use all N), never beyond N positions
            assert cdiv(e.start_pos + e.num_new_tokens + e.num_steps - 1, kv.block_size) <= len(e.block_ids) \
                <= cdiv(e.start_pos + e.num_new_tokens + sched.num_scheduler_steps - 1, kv.block_size)
            # multi-step: only decodes, never past max_model_len or max_tokens
            assert 1 <= e.num_steps <= out.num_steps
            if e.num_steps > 1:
                assert r.num_tokens + e.num_steps <= sched.max_model_len
                assert r.max_tokens is None or r.num_output_tokens + e.num_steps <= r.max_tokens
        assert out.num_steps in (1, sched.num_scheduler_steps)
        if out.num_steps > 1:
            assert num_decodes == len(out.scheduled) and max(e.num_steps for e in out.scheduled) > 1
        scheduled_ids = {e.request_id for e in out.scheduled}
        assert not any(r.request_id in scheduled_ids for r in sched.waiting)     # the preempted among them
        self.check_blocks()

    @invariant()
    def check_blocks(self):
        if not hasattr(self, "kv"):
            return
        sched, kv, pool = self.sched, self.kv, self.kv.block_pool
        holders: dict[int, int] = {}
        for rid, blocks in kv.req_to_blocks.items():
            assert rid in sched.requests, "a finished request still holds blocks"
            assert kv.block_ids(rid) == [b.block_id for b in blocks]
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        assert 0 not in holders and pool.null_block.ref_cnt == 0
        free = pool.free_block_queue.get_all_free_blocks()
        assert len(free) == pool.num_free_blocks and len({b.block_id for b in free}) == len(free)
        assert pool.null_block not in free
        for b in pool.blocks[1:]:
            assert b.ref_cnt == holders.get(b.block_id, 0), f"ref count of {b} is wrong"
        assert all(b.ref_cnt == 0 for b in free)
        assert pool.num_free_blocks + len(holders) == pool.num_blocks - 1
        for h, b in pool.cached_block_hash_to_block.items():
            assert b.block_hash is h
        assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached_block_hash_to_block)

    @invariant()
    def check_requests(self):
        if not hasattr(self, "sched"):
            return
        sched, kv = self.sched, self.kv
        live = set(sched.requests)
        assert live | self.finished == set(self.added) and not live & self.finished, "a request was lost"
        running = [r.request_id for r in sched.running]
        waiting = [r.request_id for r in sched.waiting]
        assert sorted(running + waiting) == sorted(live)
        for r in sched.running:
            assert r.status == RequestStatus.RUNNING
            # exactly the computed tokens' blocks, or up to a fallen-back multi-step plan's lookahead beyond them
            assert cdiv(r.num_computed_tokens, kv.block_size) <= len(kv.block_ids(r.request_id)) \
                <= cdiv(r.num_computed_tokens + sched.num_scheduler_steps - 1, kv.block_size)
            assert r.num_computed_tokens < r.num_tokens <= sched.max_model_len
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert kv.block_ids(r.request_id) == [] and r.num_computed_tokens == 0
        for rid in self.finished:
            r = self.added[rid]
            assert r.is_finished() and kv.block_ids(rid) == []
            assert r.max_tokens is None or r.num_output_tokens <= r.max_tokens

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # Every step computes at least one token, and a request never needs more than max_model_len of them
        # (more with preemptions: they recompute); a fixed 500 was too few for 33 requests of 24 tokens
        # decoded one token per step (found by hypothesis).
        limit = 100 + 4 * self.sched.max_model_len * len(self.sched.requests)
        for _ in range(limit):
            if not self.sched.has_unfinished_requests():
                break
            self.step(eos_for=-1)
        assert not self.sched.has_unfinished_requests(), "requests stuck: the scheduler made no progress"
        self.check_blocks()
        if self.kv.prefix_cache_stats.hits:
            event("prefix-cache hits")
        pool = self.kv.block_pool
        assert pool.num_free_blocks == pool.num_blocks - 1
        for r in self.added.values():
            # every token is the one its context implies (or an EOS the test injected), preemptions or not
            for k, token in enumerate(r.output_token_ids):
                assert token in (EOS, next_token(r.all_token_ids[:r.num_prompt_tokens + k]))


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
