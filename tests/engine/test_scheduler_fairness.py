"""Fair prefill: with chunked prefill a long prompt shares the step with decodes and short prompts (the
scheduler's NOTE): the others are served within a step or two, the step stays full, and long prompts alone
run at full width. The fake device of support/fake_scheduler.py checks every step's KV context."""
from __future__ import annotations

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler

from support.fake_scheduler import FakeDevice, expected_outputs, params, run_to_completion, step

BUDGET = 16


def make(threshold=None, budget=BUDGET, max_seqs=8, num_blocks=128, block_size=4, max_model_len=256):
    kv = KVCacheManager(num_blocks, block_size, True, max_model_len)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                      long_prefill_token_threshold=threshold),
                      CacheConfig(block_size=block_size, enable_prefix_caching=True), kv, max_model_len)
    return sched, FakeDevice(kv)


def prompt(n: int, seed: int) -> list[int]:
    return [1 + (seed * 31 + i * 7) % 90 for i in range(n)]


def chunks(out) -> dict[str, int]:
    return {s.request_id: s.num_new_tokens for s in out.scheduled}


def test_a_long_prompt_alone_runs_at_full_width():
    sched, dev = make()
    sched.add_request(Request("long", prompt(100, 1), params(max_tokens=2)))
    sizes = [chunks(step(sched, dev)[0])["long"] for _ in range(6)]
    assert sizes == [BUDGET] * 6


def test_a_short_request_is_served_at_once_beside_a_long_prefill_and_the_step_stays_full():
    sched, dev = make()
    long_ = Request("long", prompt(200, 1), params(max_tokens=2))
    sched.add_request(long_)
    step(sched, dev)
    step(sched, dev)
    short = Request("short", prompt(3, 2), params(max_tokens=4))
    sched.add_request(short)
    out, _ = step(sched, dev)
    assert chunks(out) == {"short": 3, "long": BUDGET - 3}            # the short prompt whole, the rest topped up
    for _ in range(3):                                                # its decodes every step, beside the prefill
        out, _ = step(sched, dev)
        assert chunks(out) == {"short": 1, "long": BUDGET - 1}
    assert short.is_finished() and short.output_token_ids == expected_outputs(short.prompt_token_ids, 4)
    assert long_.status == RequestStatus.RUNNING


def test_two_long_prompts_and_a_stream_of_short_ones():
    """Long prompts take turns (one at a time while short work waits); each short request's first token
    comes within two steps of its arrival; every request's tokens are right."""
    sched, dev = make()
    longs = [Request(f"long{i}", prompt(120, 10 + i), params(max_tokens=3)) for i in range(2)]
    for r in longs:
        sched.add_request(r)
    shorts, waited = [], []
    for k in range(40):
        if k % 3 == 0:
            r = Request(f"short{k}", prompt(2 + k % 5, 20 + k), params(max_tokens=3))
            sched.add_request(r)
            shorts.append((r, k))
        out, _ = step(sched, dev)
        scheduled = chunks(out)
        assert sum(scheduled.values()) <= BUDGET
        for r, arrived in shorts:
            if r.num_output_tokens and not any(w[0] is r for w in waited):
                waited.append((r, k - arrived + 1))
        long_prefills = [s for s in out.scheduled if s.request.num_prompt_tokens - s.start_pos > BUDGET // 2]
        assert len(long_prefills) <= 1 or not any(rid.startswith("short") for rid in scheduled)
    run_to_completion(sched, dev)
    assert max(w for _, w in waited) <= 2, waited
    for r in longs + [r for r, _ in shorts]:
        assert r.finish_reason == "length" and r.output_token_ids == expected_outputs(r.prompt_token_ids, 3)


def test_running_decodes_are_not_starved_by_a_long_prefill_admitted_before_them():
    sched, dev = make()
    long_ = Request("long", prompt(150, 3), params(max_tokens=2))
    sched.add_request(long_)
    decoders = [Request(f"d{i}", prompt(2, 4 + i), params(max_tokens=30)) for i in range(4)]
    step(sched, dev)
    for r in decoders:
        sched.add_request(r)
    for _ in range(8):
        out, _ = step(sched, dev)
    assert all(r.num_output_tokens == 8 for r in decoders)           # a token every step


def test_threshold_zero_keeps_the_old_order():
    sched, dev = make(threshold=0)
    sched.add_request(Request("long", prompt(100, 1), params(max_tokens=2)))
    step(sched, dev)
    sched.add_request(Request("short", prompt(3, 2), params(max_tokens=2)))
    assert chunks(step(sched, dev)[0]) == {"long": BUDGET}            # the running prefill takes the step


def test_an_image_taken_whole_passes_the_long_share_beside_decodes():
    """A model whose image tokens attend both ways computes each image in one step: an image longer than the
    long-prefill share (8 of 16) still gets its chunk while decodes keep running, instead of waiting for them
    to end; the decodes keep a token every step."""
    import numpy as np

    from jaxserve.engine.encoder_cache_manager import EncoderCacheManager
    from jaxserve.multimodal.inputs import ImageFeature
    kv = KVCacheManager(128, 4, True, 256)
    enc = EncoderCacheManager(16, 64, whole_images=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=BUDGET),
                      CacheConfig(block_size=4, enable_prefix_caching=True), kv, 256, enc)
    dev = FakeDevice(kv)
    decoders = [Request(f"d{i}", prompt(2, 4 + i), params(max_tokens=30)) for i in range(2)]
    for r in decoders:
        sched.add_request(r)
    step(sched, dev)
    image = ImageFeature("img", 5, 12, np.zeros(1))
    req = Request("img", prompt(30, 9), params(max_tokens=2), mm_features=[image])
    sched.add_request(req)
    sizes = []
    for _ in range(4):
        out, _ = step(sched, dev)
        sizes.append(chunks(out).get("img"))
        assert chunks(out)["d0"] == 1 and chunks(out)["d1"] == 1
    assert sizes[:2] == [5, 12] and req.num_computed_tokens >= image.end     # up to the image, then all of it


def test_default_encoder_budget_lets_image_prompts_fill_the_step():
    """With the default encoder limits (twice the token budget), prompts that are mostly one image each fill
    the step's token budget, the next prompt's chunk ending inside its image, as text prompts do; with an
    encoder budget of one token budget the first step stops the later prompts before their images and runs 14
    of its 16 tokens (a step pads to its token bucket: it costs a full one)."""
    import numpy as np

    from jaxserve.engine.encoder_cache_manager import EncoderCacheManager
    from jaxserve.multimodal.inputs import ImageFeature
    results = {}
    for budget in (None, BUDGET):
        sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=BUDGET, max_num_encoder_input_tokens=budget)
        kv = KVCacheManager(128, 4, True, 256)
        sched = Scheduler(sc, CacheConfig(block_size=4, enable_prefix_caching=True), kv, 256,
                          EncoderCacheManager(*sc.encoder_limits()))
        for i in range(3):           # 12 tokens each: one text token, a 10-token image, one text token
            sched.add_request(Request(f"r{i}", prompt(12, 20 + i), params(max_tokens=2),
                                      mm_features=[ImageFeature(f"img{i}", 1, 10, np.zeros(1))]))
        results[budget] = chunks(step(sched, FakeDevice(kv))[0])
    assert sc.encoder_limits() == (BUDGET, BUDGET) and SchedulerConfig(max_num_batched_tokens=BUDGET) \
        .encoder_limits() == (2 * BUDGET, 2 * BUDGET)
    assert results[None] == {"r0": 12, "r1": 4}                       # r1's chunk ends inside its image
    assert results[BUDGET] == {"r0": 12, "r1": 1, "r2": 1}            # they stop before their images
