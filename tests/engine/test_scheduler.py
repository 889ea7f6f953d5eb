"""Scheduler: token budget, seq cap, chunked prefill, prefix caching, preemption, placeholders, aborts.

A fake device stands in for the runner: it writes each scheduled token id into a flat slot array through
the request's block table (like write_kv) and reads the whole context back through the block table (like
paged attention), checking it equals the request's tokens. So a wrong block table, a prefix-cache hit on
a block with other content, or a shared block overwritten after eviction all fail loudly. Its "model"
samples a token that is a function of the context it read, so outputs are checkable after preemptions.
Each step runs as the engine core runs it: schedule, the device, ``update_from_output`` (placeholders), then
``apply_sampled_tokens`` reads the tokens and decides which requests finished, and the scheduler frees them.
"""
from __future__ import annotations


import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.kv_cache_manager import KVCacheManager, cdiv
from jaxserve.engine.core_outputs import apply_sampled_tokens
from jaxserve.engine.request import PLACEHOLDER, Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.scheduler_output import SchedulerOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

VOCAB = 50
EOS = 0


def next_token(context) -> int:
    """The fake model: deterministic in the whole context, never EOS unless the test wants it."""
    return 1 + (sum(context) * 7 + len(context) * 3) % (VOCAB - 1)


class FakeDevice:
    def __init__(self, kv: KVCacheManager):
        self.bs = kv.block_size
        self.slots = [None] * (kv.num_blocks * kv.block_size)

    def execute(self, out: SchedulerOutput, eos_at: dict[str, int] | None = None) -> dict[str, list[int]]:
        """One step. A multi-step entry (num_steps > 1) runs like the runner's device loop: each iteration
        writes the previous sampled token's K/V at the next position and samples again (on past an EOS)."""
        sampled = {}
        for e in out.scheduled:
            req, bs = e.request, self.bs
            end = e.start_pos + e.num_new_tokens
            assert e.num_steps == 1 or (e.num_new_tokens == 1 and e.samples), "only a decode runs several steps"
            # (it may hold more: lookahead left from a multi-step plan that fell back to single steps)
            assert len(e.block_ids) >= cdiv(end + e.num_steps - 1, bs), \
                "block table must cover computed + scheduled tokens (+ a multi-step entry's later positions)"
            assert 0 not in e.block_ids, "the null block was handed out"
            for p in range(e.start_pos, end):                       # write_kv
                self.slots[e.block_ids[p // bs] * bs + p % bs] = req.all_token_ids[p]
            context = [self.slots[e.block_ids[p // bs] * bs + p % bs] for p in range(end)]   # attention
            assert context == req.all_token_ids[:end], f"{req.request_id} read a wrong KV context"
            if e.samples:
                n_out = req.num_output_tokens
                toks = []
                for i in range(e.num_steps):
                    if i:                                           # feed the last token back
                        p = end - 1 + i
                        self.slots[e.block_ids[p // bs] * bs + p % bs] = toks[-1]
                        context = [self.slots[e.block_ids[q // bs] * bs + q % bs] for q in range(p + 1)]
                        assert context == req.all_token_ids[:end] + toks, f"{req.request_id}: wrong KV in loop"
                    eos = eos_at and eos_at.get(req.request_id) == n_out + i
                    toks.append(EOS if eos else next_token(context))
                sampled[req.request_id] = toks
        return sampled


def params(max_tokens=None, min_tokens=0, ignore_eos=False, stop_token_ids=(), logprobs=None, penalties=False):
    return SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                          stop_token_ids=list(stop_token_ids), logprobs=logprobs,
                          repetition_penalty=1.1 if penalties else 1.0, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def make(num_blocks=64, block_size=4, max_model_len=64, budget=32, max_seqs=8, chunked=True, caching=True,
         steps=1, policy="fcfs"):
    kv = KVCacheManager(num_blocks, block_size, caching, max_model_len)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                            enable_chunked_prefill=chunked, num_scheduler_steps=steps,
                                            scheduling_policy=policy),
                            CacheConfig(block_size=block_size, enable_prefix_caching=caching), kv, max_model_len)
    return sched, kv, FakeDevice(kv)


def read_tokens(sched, out, sampled) -> list[Request]:
    """The core reads a step whose placeholders are counted (the only ones: steps here are read before the
    next is scheduled) and the scheduler frees what it says finished. Returns those requests."""
    entries = [(e.request, e.request.num_output_tokens - e.request.num_placeholders) for e in out.scheduled
               if e.samples and e.request.status == RequestStatus.RUNNING]
    _, finished = apply_sampled_tokens(entries, sampled, None)
    return [r for status, ids in finished.items() for r in sched.finish_requests(ids, status)]


def apply(sched, out, sampled) -> list[Request]:
    """The engine's half of a step after the device: count its placeholders, then read its tokens."""
    sched.update_from_output(out)
    return read_tokens(sched, out, sampled)


def preempted_since(sched, num_preemptions) -> list[str]:
    """The requests preempted since the scheduler counted ``num_preemptions``, in order (each re-enters the
    waiting queue at the front)."""
    return [r.request_id for r in reversed(list(sched.waiting)[:sched.num_preemptions - num_preemptions])]


def step(sched, dev, eos_at=None):
    out = sched.schedule()
    return out, apply(sched, out, dev.execute(out, eos_at))


def run_to_completion(sched, dev, max_steps=2000):
    finished = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished
        finished += step(sched, dev)[1]
    raise AssertionError("requests did not finish: the scheduler is stuck")


def expected_outputs(prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


# ---------------------------------------------------------------------------------------------- basics
def test_add_request_lowers_the_length_limit_to_what_max_model_len_leaves():
    sched, kv, dev = make(max_model_len=64)
    a, b = Request("a", [1] * 60, params(max_tokens=10)), Request("b", [1] * 10, params(max_tokens=10))
    sched.add_request(a)
    sched.add_request(b)
    assert (a.max_output_tokens, b.max_output_tokens) == (4, 10)
    run_to_completion(sched, dev)
    assert (a.num_tokens, a.finish_reason, b.num_output_tokens, b.finish_reason) == (64, "length", 10, "length")


def test_scheduler_checks_its_kv_cache():
    kv = KVCacheManager(8, 4)
    with pytest.raises(ValueError, match="fewer than max_model_len 64"):
        Scheduler(SchedulerConfig(), CacheConfig(block_size=4), kv, 64)
    with pytest.raises(ValueError, match="block_size mismatch"):
        Scheduler(SchedulerConfig(), CacheConfig(block_size=16), kv, 16)


def test_request_reads_real_sampling_params():
    sp = SamplingParams(max_tokens=3, min_tokens=1, stop_token_ids=[9, 9, 8])
    sp.update_from_generation_config({"eos_token_id": [2, 5]}, eos_token_id=2)
    r = Request("a", [1, 2], sp, eos_token_ids=[])
    assert (r.max_tokens, r.max_output_tokens, r.min_tokens, r.ignore_eos) == (3, 3, 1, False)
    assert r.eos_token_ids == {2} and r.stop_token_ids == {9, 8, 5}
    r = Request("b", [1], SamplingParams(max_tokens=None, ignore_eos=True), eos_token_ids=2)
    r.append_placeholders(2)
    r.set_output_token(0, 2)
    r.set_output_token(1, 2)
    assert r.max_tokens is None and r.all_token_ids == [1, 2, 2] and r.num_placeholders == 0


def test_output_classes_keep_vllm_field_order():
    # Callers build these positionally, as with vLLM's.
    from dataclasses import fields

    from jaxserve import outputs
    names = {cls: [f.name for f in fields(cls)] for cls in (
        outputs.Logprob, outputs.CompletionOutput, outputs.RequestOutput, outputs.EmbeddingRequestOutput)}
    assert names[outputs.Logprob] == ["logprob", "rank", "decoded_token"]
    assert names[outputs.CompletionOutput] == ["index", "text", "token_ids", "cumulative_logprob", "logprobs",
                                               "finish_reason", "stop_reason"]
    assert names[outputs.RequestOutput] == ["request_id", "prompt", "prompt_token_ids", "prompt_logprobs",
                                            "outputs", "finished", "metrics", "num_cached_tokens"]
    assert names[outputs.EmbeddingRequestOutput] == ["request_id", "outputs", "prompt_token_ids", "finished"]
    assert not hasattr(outputs.CompletionOutput(0, "", [], None, None), "__dict__")    # slotted
    m = outputs.RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0)
    assert (m.time_in_queue, m.time_to_first_token) == (0.5, 1.0)


# ------------------------------------------------------------------------------------ budget and chunks
def test_chunked_prefill_decodes_first_and_samples_only_at_the_end():
    sched, kv, dev = make(budget=16, max_model_len=128, num_blocks=64)
    sched.add_request(Request("a", list(range(1, 41)), params(max_tokens=3)))   # 40 tokens: 16 + 16 + 8
    sched.add_request(Request("b", list(range(100, 110)), params(max_tokens=3)))
    out, _ = step(sched, dev)
    assert [(e.request_id, e.start_pos, e.num_new_tokens, e.samples) for e in out.scheduled] == [
        ("a", 0, 16, False)]
    out, _ = step(sched, dev)
    assert [(e.request_id, e.start_pos, e.num_new_tokens, e.samples) for e in out.scheduled] == [
        ("a", 16, 16, False)]
    out, _ = step(sched, dev)
    assert [(e.request_id, e.start_pos, e.num_new_tokens, e.samples) for e in out.scheduled] == [
        ("a", 32, 8, True), ("b", 0, 8, False)]
    assert sum(e.num_new_tokens for e in out.scheduled) == 16 and 1 not in [e.num_new_tokens for e in out.scheduled]
    out, _ = step(sched, dev)
    # a decodes (first), b finishes its prompt in the same step
    assert [(e.request_id, e.start_pos, e.num_new_tokens, e.samples) for e in out.scheduled] == [
        ("a", 40, 1, True), ("b", 8, 2, True)]
    assert [e.num_new_tokens for e in out.scheduled].count(1) == 1
    run_to_completion(sched, dev)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_without_chunked_prefill_a_prompt_waits_for_room():
    sched, kv, dev = make(budget=16, chunked=False)
    sched.add_request(Request("a", list(range(1, 11)), params(max_tokens=4)))
    sched.add_request(Request("b", list(range(20, 30)), params(max_tokens=4)))
    sched.add_request(Request("c", [5, 6], params(max_tokens=4)))
    out, _ = step(sched, dev)
    # b (10 tokens) does not fit the 6 left, and FCFS keeps c behind it
    assert [(e.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 10)]
    out, _ = step(sched, dev)
    assert [(e.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 1), ("b", 10), ("c", 2)]


def test_max_num_seqs_caps_the_batch():
    sched, kv, dev = make(max_seqs=2, budget=64)
    for i in range(4):
        sched.add_request(Request(str(i), [i + 1] * 3, params(max_tokens=2)))
    out, _ = step(sched, dev)
    assert [e.request_id for e in out.scheduled] == ["0", "1"] and sched.num_running == 2
    out, finished = step(sched, dev)
    assert [r.request_id for r in finished] == ["0", "1"]
    out, _ = step(sched, dev)
    assert [e.request_id for e in out.scheduled] == ["2", "3"]
    assert sched.get_request("0") is None and sched.get_request("1") is None


# --------------------------------------------------------------------------------------- prefix caching
def test_second_request_with_the_same_system_prompt_computes_only_its_suffix():
    sched, kv, dev = make(block_size=4, budget=64, max_model_len=64)
    system = list(range(10, 30))                                # 20 tokens = 5 full blocks
    a = Request("a", system + [1, 2, 3], params(max_tokens=4))
    sched.add_request(a)
    run_to_completion(sched, dev)
    b = Request("b", system + [4, 5], params(max_tokens=4))
    sched.add_request(b)
    out, _ = step(sched, dev)
    (e,) = out.scheduled
    assert (e.start_pos, e.num_new_tokens) == (20, 2)
    assert b.num_cached_tokens == 20
    run_to_completion(sched, dev)
    assert b.output_token_ids == expected_outputs(b.prompt_token_ids, 4)
    stats = sched.get_stats()
    assert stats["prefix_cache_hits"] == 20 and stats["prefix_cache_queries"] == 23 + 22


def test_prefix_caching_on_and_off_give_the_same_tokens():
    prompts = [list(range(1, 19)) + [i] * (i % 5 + 1) for i in range(12)]
    results = []
    for caching in (True, False):
        sched, kv, dev = make(num_blocks=40, block_size=4, budget=24, max_seqs=4, caching=caching)
        reqs = [Request(str(i), p, params(max_tokens=6)) for i, p in enumerate(prompts)]
        for r in reqs:
            sched.add_request(r)
        run_to_completion(sched, dev)
        results.append([r.output_token_ids for r in reqs])
        assert (sched.get_stats()["prefix_cache_hits"] > 0) == caching
    assert results[0] == results[1]
    assert results[0] == [expected_outputs(p, 6) for p in prompts]


# ------------------------------------------------------------------------------------------- preemption
def test_preemption_requeues_the_newest_and_keeps_its_outputs():
    # 8 usable blocks of 4 = 32 tokens; 3 requests of 8 prompt tokens growing to 8 + 10.
    sched, kv, dev = make(num_blocks=9, block_size=4, max_model_len=32, budget=64, caching=False)
    reqs = [Request(str(i), [i + 1] * 8, params(max_tokens=10)) for i in range(3)]
    preempted = run_preempting(sched, kv, dev, reqs)
    assert preempted and preempted[0] == "2"                      # the newest goes first
    assert sched.get_stats()["num_preemptions"] == len(preempted)


def run_preempting(sched, kv, dev, reqs) -> list[str]:
    """Run the requests (each 8 prompt tokens growing by 10) to the end; the ids preempted, in order."""
    for r in reqs:
        sched.add_request(r)
    preempted = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        before = sched.num_preemptions
        step(sched, dev)
        victims = [r.request_id for r in sched.waiting if r.status == RequestStatus.PREEMPTED
                   and r.num_computed_tokens == 0][:sched.num_preemptions - before]
        preempted += victims
        for victim in victims:
            req = sched.get_request(victim)
            assert kv.block_ids(victim) == [] and req.num_output_tokens > 0     # kept, recomputed later
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert r.output_token_ids == expected_outputs(r.prompt_token_ids, 10)
    assert kv.num_free_blocks == kv.num_usable_blocks
    return preempted


def test_preempted_request_recomputes_prompt_plus_outputs():
    sched, kv, dev = make(num_blocks=9, block_size=4, max_model_len=32, budget=64, caching=False)
    a = Request("a", [1] * 12, params(max_tokens=20))
    b = Request("b", [2] * 12, params(max_tokens=20))
    sched.add_request(a)
    sched.add_request(b)
    while not b.num_preemptions:
        step(sched, dev)
    n_out = b.num_output_tokens
    while a.status == RequestStatus.RUNNING:
        step(sched, dev)
    out, _ = step(sched, dev)
    (e,) = [e for e in out.scheduled if e.request_id == "b"]
    assert (e.start_pos, e.num_new_tokens, e.samples) == (0, 12 + n_out, True)


def test_a_running_request_preempts_itself_when_alone_it_cannot_grow():
    # Only possible when others hold blocks: b is older, a newer; a request that is last in the running
    # list and cannot allocate must preempt itself rather than anyone already scheduled.
    sched, kv, dev = make(num_blocks=5, block_size=4, max_model_len=16, budget=64, caching=False)
    sched.add_request(Request("a", [1] * 8, params(max_tokens=8)))
    sched.add_request(Request("b", [2] * 8, params(max_tokens=8)))
    out, _ = step(sched, dev)
    assert [e.request_id for e in out.scheduled] == ["a", "b"]          # 4 blocks: pool full
    out, _ = step(sched, dev)                                            # both need a 3rd block
    assert preempted_since(sched, 0) == ["b"] and [e.request_id for e in out.scheduled] == ["a"]
    finished = run_to_completion(sched, dev)
    assert {r.request_id for r in finished} == {"a", "b"}


# ------------------------------------------------------------------------------ priority scheduling
def test_priority_policy_admits_lower_values_first_ties_by_arrival():
    sched, kv, dev = make(max_seqs=1, policy="priority")
    for rid, prio, t in (("a", 5, 1.0), ("b", 0, 2.0), ("c", 0, 3.0), ("d", -1, 4.0), ("e", 0, 2.5)):
        sched.add_request(Request(rid, [1, 2, 3], params(max_tokens=2), arrival_time=t, priority=prio))
    order = []
    for _ in range(50):
        if not sched.has_unfinished_requests():
            break
        out, _ = step(sched, dev)
        order += [e.request_id for e in out.scheduled if e.start_pos == 0]
    assert order == ["d", "b", "e", "c", "a"]


def test_fcfs_ignores_priority():
    sched, kv, dev = make(max_seqs=1)
    for rid, prio in (("a", 5), ("b", 0)):
        sched.add_request(Request(rid, [1, 2, 3], params(max_tokens=2), priority=prio))
    out, _ = step(sched, dev)
    assert [e.request_id for e in out.scheduled] == ["a"]


def test_priority_preemption_takes_the_lowest_priority_running_request():
    # the setup of test_preemption_requeues_the_newest_and_keeps_its_outputs, where FCFS takes "2" first
    sched, kv, dev = make(num_blocks=9, block_size=4, max_model_len=32, budget=64, caching=False, policy="priority")
    reqs = [Request(str(i), [i + 1] * 8, params(max_tokens=10), arrival_time=float(i), priority=p)
            for i, p in enumerate((2, 0, 1))]
    preempted = run_preempting(sched, kv, dev, reqs)
    assert preempted and preempted[0] == "0"                      # priority 2: the lowest


def test_priority_queue_answers_the_schedulers_deque_calls():
    from jaxserve.engine.request_queue import PriorityRequestQueue, waiting_queue
    q = PriorityRequestQueue()
    a, b, c = (Request(r, [1], arrival_time=t, priority=p) for r, p, t in (("a", 1, 0.0), ("b", 0, 1.0), ("c", 1, 0.5)))
    for r in (a, b, c):
        q.append(r)
    assert q[0] is b and len(q) == 3 and [r.request_id for r in q] == ["b", "a", "c"]
    q.remove(a)
    assert [q.popleft().request_id for _ in range(2)] == ["b", "c"] and not q
    q.extendleft(reversed([c, a]))
    assert q.popleft() is a
    with pytest.raises(ValueError, match="scheduling-policy"):
        waiting_queue("lifo")


# ------------------------------------------------------------------------------ multi-step decoding
def prefill(sched, dev, *reqs):
    """Add the requests and run their (multi-token) prompts: afterwards each decodes."""
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched, dev)
    assert sorted(e.request_id for e in out.scheduled) == sorted(r.request_id for r in reqs)
    assert out.num_steps == 1 and all(e.num_steps == 1 and e.num_new_tokens > 1 for e in out.scheduled)
    return out


def test_num_scheduler_steps_must_be_positive():
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"num_scheduler_steps must be at least 1, got {bad}"):
            make(steps=bad)


def test_multi_step_decode_allocates_every_position_and_advances_by_all_steps():
    sched, kv, dev = make(steps=4, block_size=4)
    a = Request("a", [1, 2, 3], params(max_tokens=50))
    prefill(sched, dev, a)
    assert (a.num_computed_tokens, a.num_tokens, len(kv.block_ids("a"))) == (3, 4, 1)
    out = sched.schedule()
    (e,) = out.scheduled
    assert (out.num_steps, e.num_steps, e.start_pos, e.num_new_tokens, e.samples) == (4, 4, 3, 1, True)
    # positions 3..6 (start_pos + 3) are written this step: two blocks, where one step needs one
    assert len(e.block_ids) == 2 == cdiv(e.start_pos + 3 + 1, kv.block_size)
    assert e.block_ids == kv.block_ids("a")
    first = a.output_token_ids[0]
    sched.update_from_output(out)
    assert a.output_token_ids == [first] + [PLACEHOLDER] * 4 and a.num_placeholders == 4
    assert read_tokens(sched, out, {"a": [11, 12, 13, 14]}) == []
    assert a.num_computed_tokens == 3 + 4 and a.num_placeholders == 0
    assert a.output_token_ids == [first, 11, 12, 13, 14] and a.all_token_ids == [1, 2, 3, first, 11, 12, 13, 14]
    (e,) = sched.schedule().scheduled                # the last sampled token is the next step's input
    assert (e.start_pos, e.num_new_tokens) == (7, 1)


def test_multi_step_is_capped_by_max_tokens_and_max_model_len():
    sched, kv, dev = make(steps=4, max_model_len=12, num_blocks=32)
    a = Request("a", [1, 2, 3], params(max_tokens=3))                # 1 sampled by the prefill: 2 left
    b = Request("b", [4, 5, 6, 7, 8, 9, 10, 11, 12], params())       # 9 + 1 tokens: 2 before max_model_len
    c = Request("c", [13, 14], params(max_tokens=20))                 # room for all 4
    d = Request("d", [15, 16], params(max_tokens=2))                  # 1 left: one step
    prefill(sched, dev, a, b, c, d)
    out = sched.schedule()
    assert out.num_steps == 4
    assert {e.request_id: e.num_steps for e in out.scheduled} == {"a": 2, "b": 2, "c": 4, "d": 1}
    for e in out.scheduled:
        assert len(e.block_ids) == cdiv(e.start_pos + e.num_steps, kv.block_size), e.request_id
    finished = apply(sched, out, dev.execute(out))
    assert sorted(r.request_id for r in finished) == ["a", "b", "d"]
    assert a.finish_reason == b.finish_reason == d.finish_reason == "length"
    assert (a.num_output_tokens, b.num_tokens, d.num_output_tokens) == (3, 12, 2)
    assert a.output_token_ids == expected_outputs(a.prompt_token_ids, 3)
    assert b.output_token_ids == expected_outputs(b.prompt_token_ids, 3)
    assert all(kv.block_ids(r) == [] for r in "abd")
    assert (c.num_output_tokens, c.num_computed_tokens, c.status) == (5, 6, RequestStatus.RUNNING)
    # c: 7 tokens, 4 more steps to 11, then 1 (max_model_len 12)
    out, _ = step(sched, dev)
    assert (out.num_steps, out.scheduled[0].num_steps) == (4, 4)
    out, finished = step(sched, dev)
    assert (out.num_steps, out.scheduled[0].num_steps) == (1, 1) and finished == [c]
    assert c.finish_reason == "length" and c.output_token_ids == expected_outputs(c.prompt_token_ids, 10)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_multi_step_only_when_every_entry_decodes():
    sched, kv, dev = make(steps=4, budget=32)
    a = Request("a", [1, 2, 3], params(max_tokens=50))
    prefill(sched, dev, a)
    b = Request("b", list(range(5, 15)), params(max_tokens=50))
    sched.add_request(b)
    out = sched.schedule()
    assert [(e.request_id, e.num_new_tokens) for e in out.scheduled] == [("a", 1), ("b", 10)]
    assert out.num_steps == 1 and [e.num_steps for e in out.scheduled] == [1, 1]
    assert len(kv.block_ids("a")) == 1                # no lookahead blocks taken
    apply(sched, out, dev.execute(out))
    out = sched.schedule()                            # both decode now
    assert out.num_steps == 4 and [e.num_steps for e in out.scheduled] == [4, 4]


def test_one_token_prompt_chunk_is_not_multi_stepped():
    # Budget 2: a decodes (1 token) and b's prompt gets a 1-token chunk, so every entry has num_new_tokens
    # == 1, but b's chunk samples nothing: running it for 4 steps would write sampled tokens where b's
    # prompt belongs and count prompt positions as computed.
    sched, kv, dev = make(steps=4, budget=2)
    a = Request("a", [1, 2], params(max_tokens=6))
    prefill(sched, dev, a)
    b = Request("b", [5, 6, 7, 8, 9], params(max_tokens=6))
    sched.add_request(b)
    out = sched.schedule()
    assert [(e.request_id, e.num_new_tokens, e.samples) for e in out.scheduled] == [("a", 1, True),
                                                                                   ("b", 1, False)]
    (eb,) = [e for e in out.scheduled if e.request_id == "b"]
    assert eb.num_steps == 1
    apply(sched, out, dev.execute(out))
    assert b.num_computed_tokens == 1 and b.num_output_tokens == 0
    run_to_completion(sched, dev)
    assert a.output_token_ids == expected_outputs(a.prompt_token_ids, 6)
    assert b.output_token_ids == expected_outputs(b.prompt_token_ids, 6)


@pytest.mark.parametrize("kw", [dict(penalties=True), dict(min_tokens=3)], ids=["penalties", "min_tokens"])
def test_multi_step_off_while_a_request_needs_the_host_between_tokens(kw):
    sched, kv, dev = make(steps=4)
    a = Request("a", [1, 2, 3], params(max_tokens=50))
    b = Request("b", [4, 5, 6], params(max_tokens=50, **kw))
    prefill(sched, dev, a, b)
    out = sched.schedule()
    # one such request makes the whole step single: a does not run ahead either
    assert out.num_steps == 1 and [e.num_steps for e in out.scheduled] == [1, 1]
    assert len(kv.block_ids("a")) == len(kv.block_ids("b")) == 1
    apply(sched, out, dev.execute(out))
    if "min_tokens" in kw:                             # b has 2 outputs, 3rd is still below min_tokens
        out, _ = step(sched, dev)
        assert out.num_steps == 1
        out = sched.schedule()                         # min_tokens reached: multi-step again
        assert out.num_steps == 4 and [e.num_steps for e in out.scheduled] == [4, 4]
    else:
        for _ in range(3):
            out, _ = step(sched, dev)
            assert out.num_steps == 1 and [e.num_steps for e in out.scheduled] == [1, 1]


def test_multi_step_with_logprobs():
    # logprobs come back per iteration: a request asking for them runs multi-step like the others
    sched, kv, dev = make(steps=4)
    a = Request("a", [1, 2, 3], params(max_tokens=50))
    b = Request("b", [4, 5, 6], params(max_tokens=50, logprobs=2))
    prefill(sched, dev, a, b)
    out = sched.schedule()
    assert out.num_steps == 4 and [e.num_steps for e in out.scheduled] == [4, 4]


def test_multi_step_lookahead_never_preempts():
    # 3 usable blocks of 4. a and b (3-token prompts) hold one block each; 4 steps need a second block
    # each, and one is free: a (first) gets it, b runs one step, nobody is preempted.
    sched, kv, dev = make(num_blocks=4, block_size=4, max_model_len=12, steps=4, caching=False)
    a = Request("a", [1, 2, 3], params(max_tokens=6))
    b = Request("b", [4, 5, 6], params(max_tokens=6))
    prefill(sched, dev, a, b)
    assert kv.num_free_blocks == 1
    out = sched.schedule()
    assert sched.num_preemptions == 0 and out.num_steps == 4
    assert [(e.request_id, e.num_steps) for e in out.scheduled] == [("a", 4), ("b", 1)]
    assert kv.num_free_blocks == 0 and len(kv.block_ids("b")) == 1
    apply(sched, out, dev.execute(out))
    assert (a.num_output_tokens, b.num_output_tokens) == (5, 2)
    run_to_completion(sched, dev)
    assert a.output_token_ids == expected_outputs(a.prompt_token_ids, 6)
    assert b.output_token_ids == expected_outputs(b.prompt_token_ids, 6)

    # no free block at all: every entry runs one step, and the step is a single one
    sched, kv, dev = make(num_blocks=3, block_size=4, max_model_len=8, steps=4, caching=False)
    prefill(sched, dev, Request("a", [1, 2, 3], params(max_tokens=4)), Request("b", [4, 5, 6], params(max_tokens=4)))
    assert kv.num_free_blocks == 0
    out = sched.schedule()
    assert sched.num_preemptions == 0 and out.num_steps == 1 and [e.num_steps for e in out.scheduled] == [1, 1]


def test_multi_step_gives_the_same_tokens_in_fewer_steps():
    """Against single-step scheduling: the same tokens (an EOS mid-loop included), fewer steps, and the
    prefix cache still right afterwards (the fake device checks every KV read, cache hits included)."""
    prompts = [list(range(1, 19)) + [i] * (i % 5 + 1) for i in range(8)]
    eos_at = {"3": 6}                                  # prefill gives output 0; loops give 1-4, 5-8: EOS mid-loop
    results = []
    for steps in (1, 4):
        sched, kv, dev = make(num_blocks=80, block_size=4, max_model_len=64, budget=64, max_seqs=8, steps=steps)
        reqs = [Request(str(i), p, params(max_tokens=10 + i), eos_token_ids=[EOS]) for i, p in enumerate(prompts)]
        for r in reqs:
            sched.add_request(r)
        n = 0
        while sched.has_unfinished_requests():
            out, _ = step(sched, dev, eos_at)
            n += 1
            assert n < 100
        assert kv.num_free_blocks == kv.num_usable_blocks
        # a follow-up whose prompt is a finished request's whole sequence and more hits the cache
        x = Request("x", reqs[0].all_token_ids + [7, 7], params(max_tokens=5))
        sched.add_request(x)
        run_to_completion(sched, dev)
        assert x.num_cached_tokens >= 16 and x.output_token_ids == expected_outputs(x.prompt_token_ids, 5)
        results.append(([r.output_token_ids for r in reqs], [r.finish_reason for r in reqs], n))
    (single, single_reasons, n1), (multi, multi_reasons, n4) = results
    assert multi == single and multi_reasons == single_reasons
    assert single[3][-1] == EOS and len(single[3]) == 7 and single_reasons[3] == "stop"
    assert [len(o) for o in single] == [7 if i == 3 else 10 + i for i in range(8)]
    assert n4 < n1 / 2


# ------------------------------------------------------------------------------------- abort and finish
def test_abort_at_any_point_frees_everything():
    sched, kv, dev = make(budget=8, max_seqs=1)
    a = Request("a", list(range(1, 21)), params(max_tokens=5))
    b = Request("b", [3, 4], params(max_tokens=5))
    sched.add_request(a)
    sched.add_request(b)
    step(sched, dev)                                         # a is mid-prefill, b waits
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    aborted = sched.abort_requests(["a", "b", "unknown"])
    assert aborted == [a, b] and a.finish_reason == "abort" and b.finish_reason == "abort"
    assert not sched.has_unfinished_requests() and kv.num_free_blocks == kv.num_usable_blocks
    assert sched.schedule().scheduled == []


def test_abort_between_schedule_and_update_is_ignored_by_update():
    sched, kv, dev = make()
    a = Request("a", [1, 2, 3], params(max_tokens=5))
    sched.add_request(a)
    out = sched.schedule()
    sampled = dev.execute(out)
    sched.abort_requests("a")
    assert apply(sched, out, sampled) == []
    assert a.num_placeholders == 0 and a.finish_reason == "abort"
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_finish_requests_frees_wherever_the_request_is():
    sched, kv, dev = make(max_seqs=1)
    a = Request("a", [1, 2, 3], params(max_tokens=50))
    b = Request("b", [4, 5], params(max_tokens=50))
    sched.add_request(a)
    sched.add_request(b)
    step(sched, dev)
    step(sched, dev)
    assert (a.status, b.status) == (RequestStatus.RUNNING, RequestStatus.WAITING)
    assert sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_STOPPED) == [a, b]
    assert a.finish_reason == b.finish_reason == "stop" and a.metrics.finished_time is not None
    assert sched.finish_requests("a", RequestStatus.FINISHED_STOPPED) == []
    assert kv.num_free_blocks == kv.num_usable_blocks and not sched.has_unfinished_requests()
    with pytest.raises(ValueError, match="not a finished status"):
        sched.finish_requests("x", RequestStatus.RUNNING)


def test_a_request_at_its_length_limit_gets_no_more_steps_until_it_is_read():
    """Its last token is a placeholder: the scheduler stops giving it steps (and never preempts it) but
    does not finish it; the core does when it reads the token."""
    sched, kv, dev = make()
    a = Request("a", [1, 2, 3], params(max_tokens=2))
    sched.add_request(a)
    step(sched, dev)                                   # the prefill samples output 1
    out = sched.schedule()
    sampled = dev.execute(out)
    sched.update_from_output(out)                      # output 2 is dispatched: the limit
    assert list(sched.capped) == ["a"] and sched.running == [] and sched.num_running == 1
    assert a.status == RequestStatus.RUNNING and kv.block_ids("a") and sched.schedule().scheduled == []
    assert read_tokens(sched, out, sampled) == [a]
    assert a.finish_reason == "length" and a.output_token_ids == expected_outputs([1, 2, 3], 2)
    assert sched.capped == {} and kv.num_free_blocks == kv.num_usable_blocks


def test_eos_finishes_and_tokens_after_a_stop_are_dropped():
    sched, kv, dev = make(steps=4)
    a = Request("a", [1, 2, 3], params(max_tokens=50), eos_token_ids=[EOS])
    prefill(sched, dev, a)
    out = sched.schedule()
    assert out.num_steps == 4
    sched.update_from_output(out)
    finished = read_tokens(sched, out, {"a": [9, EOS, 11, 12]})
    assert finished == [a] and a.output_token_ids[1:] == [9, EOS] and a.num_placeholders == 0
    assert a.finish_reason == "stop" and a.stop_reason is None
    m = a.metrics                       # (the core's: the front end stamps the last token's time)
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_stale_output_is_refused():
    sched, kv, dev = make()
    sched.add_request(Request("a", [1, 2, 3], params(max_tokens=50)))
    out = sched.schedule()
    sched.update_from_output(out)
    with pytest.raises(RuntimeError, match="stale scheduler output"):
        sched.update_from_output(out)


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


def test_multi_step_with_a_request_that_has_no_sampling_params():
    sched, kv, dev = make(steps=4)
    a = Request("a", [1, 2, 3])
    sched.add_request(a)
    out = sched.schedule()
    sched.update_from_output(out)
    a.set_output_token(0, 7)
    out = sched.schedule()                  # a decode: must not trip over sampling_params=None
    assert out.scheduled[0].num_new_tokens == 1
