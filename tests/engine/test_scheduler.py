"""Scheduler: token budget, seq cap, chunked prefill, prefix caching, preemption, priority, aborts and
finishes, on the fake device of support/fake_scheduler.py (which checks every step's KV context). Multi-step
decoding: test_scheduler_multi_step.py; the property-based state machine: test_scheduler_machine.py.
"""
from __future__ import annotations

import pytest

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams

from support.fake_scheduler import (EOS, apply, expected_outputs, make, params, preempted_since, prefill,
                                    read_tokens, run_to_completion, step)


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
