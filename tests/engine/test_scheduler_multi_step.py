"""Multi-step decoding in the scheduler (``num_scheduler_steps``): lookahead blocks, caps by max_tokens and
max_model_len, when it falls back to single steps, and that it gives the same tokens in fewer steps; on the
fake device of support/fake_scheduler.py.
"""
from __future__ import annotations

import pytest

from jaxserve.engine.kv_cache_manager import cdiv
from jaxserve.engine.request import PLACEHOLDER, Request, RequestStatus

from support.fake_scheduler import (EOS, apply, expected_outputs, make, params, prefill, read_tokens,
                                    run_to_completion, step)


# ------------------------------------------------------------------------------ multi-step decoding
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


def test_multi_step_with_a_request_that_has_no_sampling_params():
    sched, kv, dev = make(steps=4)
    a = Request("a", [1, 2, 3])
    sched.add_request(a)
    out = sched.schedule()
    sched.update_from_output(out)
    a.set_output_token(0, 7)
    out = sched.schedule()                  # a decode: must not trip over sampling_params=None
    assert out.scheduled[0].num_new_tokens == 1
