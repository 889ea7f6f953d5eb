"""Start-up: the step compiler (ahead-of-time executables on threads, first-needed first), the warm-up's
plan, padding up to a compiled bucket, --enforce-eager, and the persistent cache's thresholds."""
import functools
import os
import threading
import time

import pytest

from jaxserve import SamplingParams
from jaxserve.runner.step_compiler import StepCompiler
from support import FIXTURES
from support.tiny_models import tiny_llm

TINY = os.path.join(FIXTURES, "models", "tiny-llama3")


class FakeLowered:
    def __init__(self, key, log, delay=0.0, gate=None):
        self.key, self.log, self.delay, self.gate = key, log, delay, gate

    def compile(self):
        if self.gate is not None:
            self.gate.wait(10)
        time.sleep(self.delay)
        self.log.append(self.key)
        return f"exe-{self.key}"


def test_compiler_runs_queued_keys_in_priority_order_and_need_takes_one_over():
    log, gate = [], threading.Event()

    def lower(key):                             # the blocker waits in its compile, outside TRACE_LOCK
        return FakeLowered(key, log, gate=gate if key == "blocker" else None)
    c = StepCompiler(lower, workers=1)
    c.submit(["blocker"], priority=0)          # holds the one worker until the gate opens
    c.submit(["late", "later"], priority=5)
    c.submit(["soon"], priority=1)
    assert c.get("soon") is None and "soon" not in c
    assert c.need("later") == "exe-later"       # queued, not started: compiled on this thread at once
    assert c.on_first_use == ["later"]
    gate.set()
    assert c.wait_all(timeout=10)
    assert log == ["later", "blocker", "soon", "late"]
    assert len(c) == 4 and c.pending() == 0
    c.stop()


def test_compile_now_overlaps_compiles_and_is_not_a_first_use():
    c = StepCompiler(lambda k: FakeLowered(k, [], delay=0.3), workers=3)
    t0 = time.perf_counter()
    c.compile_now(["a", "b", "c", "d"])
    assert time.perf_counter() - t0 < 0.3 * 4 * 0.75        # four 0.3 s compiles on 3 threads + this one
    assert sorted(c.keys()) == ["a", "b", "c", "d"] and c.on_first_use == []
    c.stop()


def test_stop_drops_the_queue_and_a_failed_compile_raises_where_needed():
    def lower(key):
        if key == "bad":
            raise ValueError("cannot lower bad")
        return FakeLowered(key, [], delay=0.2)
    c = StepCompiler(lower, workers=1)
    c.submit(["slow", "never"])
    time.sleep(0.05)
    c.stop()
    assert "slow" in c and "never" not in c and c.wait_all(timeout=1)
    with pytest.raises(ValueError, match="cannot lower bad"):
        c.need("bad")
    assert c.need("never") == "exe-never"       # after stop a needed key still compiles, here


make_llm = functools.partial(tiny_llm, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4,
                             kv_cache_memory_bytes=1 << 22)


PROMPTS = [list(range(5, 5 + n)) for n in (3, 11, 20)]


def greedy(n=6):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def assert_runs_compiled_and_matches(llm, eager):
    """``llm`` generates PROMPTS with what it compiled already (nothing on first use) and gives the tokens of
    ``eager``, whose steps each run in their own bucket."""
    runner = llm.engine.core.runner
    before = runner.compiled_variants()
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert runner.compiled_variants() == before and runner.variants.on_first_use == []
    ref = eager.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


@pytest.fixture(scope="module")
def eager():
    return make_llm(enforce_eager=True)


def test_enforce_eager_compiles_nothing_ahead_and_each_step_its_own_bucket(eager):
    runner = eager.engine.core.runner
    assert runner.compiled_variants() == 0 and runner.variants.pending() == 0
    outs = eager.generate(PROMPTS, greedy(), use_tqdm=False)
    forwards = sorted(k[1] for k in runner.variants.keys() if k[0] == "forward")
    # a 34-token prefill (3 + 11 + 20) runs in 32 then 4 + decodes: only buckets some step needed exist
    assert set(forwards) < set(runner.buckets)
    assert set(runner.variants.keys()) == set(runner.variants.on_first_use)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


def test_warmup_compiles_the_smallest_and_largest_bucket_first_and_steps_pad_up(eager):
    llm = make_llm(enforce_eager=True)
    runner = llm.engine.core.runner
    first, rest = runner.variants.planned()
    assert {k[1] for k in first if k[0] == "forward"} == {runner.buckets[0], runner.buckets[-1]}
    assert {k[1] for k in rest if k[0] == "forward"} == set(runner.buckets[1:-1])
    runner.variants.compile_now(first)            # what the warm-up compiles before the engine answers
    assert runner.variants.route(8, False) == (32, False)       # 8 is not compiled: pads up to 32
    assert runner.variants.route(4, False) == (4, False)
    assert_runs_compiled_and_matches(llm, eager)


def test_warmup_for_known_prompts_compiles_their_buckets_only(eager):
    # what `jaxserve generate` does: no serving warm-up, then the first prefill's and the decodes' buckets
    llm = make_llm(skip_warmup=True)
    runner = llm.engine.core.runner
    runner.warmup_for([len(p) for p in PROMPTS])          # 34 tokens: a 32-token step, then 3 decodes
    assert sorted(k[1] for k in runner.variants.keys() if k[0] == "forward") == [4, 32]
    assert runner.variants.pending() == 0                  # nothing left to the background
    assert_runs_compiled_and_matches(llm, eager)


def test_compile_cache_keeps_every_executable(tmp_path):
    import jax

    from jaxserve.runner import compile_cache
    old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
           jax.config.jax_persistent_cache_min_entry_size_bytes, compile_cache._enabled_dir)
    try:
        compile_cache._enabled_dir = "set"          # as if the engine had chosen the folder before
        assert compile_cache.enable(str(tmp_path)) == str(tmp_path)
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
    finally:
        jax.config.update("jax_compilation_cache_dir", old[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", old[2])
        compile_cache._enabled_dir = old[3]


def test_compiler_retries_a_failed_lowering_once_then_surfaces_the_error():
    calls = []

    def lower(key):
        calls.append(key)
        if key == "flaky" and calls.count("flaky") == 1:
            raise KeyError("a trace raced on another thread")
        if key == "broken":
            raise ValueError("does not lower")
        return FakeLowered(key, [])
    c = StepCompiler(lower, workers=1)
    c.compile_now(["flaky"])
    assert c.get("flaky") == "exe-flaky" and calls.count("flaky") == 2
    with pytest.raises(ValueError, match="does not lower"):
        c.need("broken")
    assert calls.count("broken") == 2
    c.stop()


def test_wait_compiled_then_shutdown_leaves_no_compile_thread_holding_the_engine():
    # a benchmark measures after the background compiles, and the next engine claims memory this one let go
    llm = make_llm(token_buckets=[4, 8, 32])
    runner = llm.engine.core.runner
    assert llm.wait_compiled(timeout=300)
    assert runner.variants.pending() == 0 and runner.compiled_variants() > 0
    llm.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("step-compiler")]
