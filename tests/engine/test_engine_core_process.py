"""The engine core in its own process (tiny Llama, CPU): the same outputs as the in-process engine, aborts and
stop strings through the front end, a killed core fails every request instead of hanging, and a soak with
cancellations leaves nothing running, waiting or allocated."""
import asyncio
import os
import time

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.errors import EngineDeadError
from jaxserve.llm import engine_config_from_kwargs
from support import FIXTURES
from support.async_streams import delta, soak, stream

TINY = os.path.join(FIXTURES, "models", "tiny-llama3")
OPTS = dict(dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=64, max_num_seqs=16,
            kv_cache_memory_bytes=1 << 24, compilation_cache_dir="", skip_warmup=True)


@pytest.fixture(scope="module")
def pair():
    """(in-process LLM, split LLM) on the same model and seed."""
    inproc = LLM(TINY, multiprocess=False, use_tqdm_on_load=False, **OPTS)
    split = LLM(TINY, multiprocess=True, use_tqdm_on_load=False, **OPTS)
    yield inproc, split
    split.shutdown()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(1, 250, size=int(n)).tolist() for n in rng.integers(2, 40, size=10)]


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.request_id == y.request_id and x.prompt_token_ids == y.prompt_token_ids
        assert x.prompt_logprobs == y.prompt_logprobs
        assert len(x.outputs) == len(y.outputs)
        for o, p in zip(x.outputs, y.outputs):
            assert (o.index, o.token_ids, o.text, o.finish_reason, o.stop_reason) == \
                   (p.index, p.token_ids, p.text, p.finish_reason, p.stop_reason)
            assert o.logprobs == p.logprobs and o.cumulative_logprob == p.cumulative_logprob


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=20),
    SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20, logprobs=2),
    SamplingParams(temperature=0.9, max_tokens=12, n=3, seed=5),
    SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=2, logprobs=1),
    # stop strings, some spanning tokens; with and without the string in the output
    SamplingParams(temperature=0, max_tokens=40, stop=["e", " t", "\ufffd\ufffd"]),
    SamplingParams(temperature=0, max_tokens=40, stop=["\ufffd\ufffd\ufffd"], include_stop_str_in_output=True),
    SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[9, 17, 33], min_tokens=2),
], ids=["greedy", "seeded-logprobs", "n3", "prompt-logprobs", "stop-strings", "stop-included", "stop-ids"])
def test_split_engine_gives_the_in_process_outputs(pair, prompts, params):
    inproc, split = pair
    a = inproc.generate(prompts, params, use_tqdm=False)
    b = split.generate(prompts, params, use_tqdm=False)
    same(a, b)
    if params.stop:
        assert any(o.outputs[0].stop_reason in params.stop for o in b), "no stop string was hit: weak test"


def test_split_engine_facts_name_the_kv_cache_before_any_step(pair):
    """The server's start-up line reads the KV block count from the facts: a split core sends it at ready,
    before any step has carried stats."""
    inproc, split = pair
    assert inproc.engine.facts().num_kv_blocks == inproc.engine.core.runner.num_blocks > 0
    assert split.engine.facts().num_kv_blocks == inproc.engine.core.runner.num_blocks


def test_split_engine_frees_everything(pair, prompts):
    _, split = pair
    split.generate(prompts, SamplingParams(temperature=0, max_tokens=40, stop=["e"]), use_tqdm=False)
    deadline = time.monotonic() + 10
    while split.engine.stats()["num_running"] and time.monotonic() < deadline:   # the last aborts' stats
        split.engine.step(timeout_s=0.1)
    stats = split.engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0


# ---------------------------------------------------------------- the async front
def async_config():
    return engine_config_from_kwargs(TINY, **OPTS)


@pytest.fixture(scope="module")
def fronts():
    inproc = AsyncLLMEngine(async_config(), multiprocess=False, progress=False)
    split = AsyncLLMEngine(async_config(), multiprocess=True, progress=False)
    yield inproc, split
    inproc.shutdown(drain_timeout=1)
    split.shutdown(drain_timeout=1)


def test_async_streams_match_and_aborts_reach_the_core(fronts, prompts):
    inproc, split = fronts
    params = [delta(temperature=0, max_tokens=30, stop=[" t", "e"]), delta(temperature=0.7, seed=11, max_tokens=25),
              delta(temperature=0, max_tokens=200, ignore_eos=True)]

    async def run(front):
        jobs = [stream(front, f"s{i}", p, params[i % 3], stop_after=(3 if i % 3 == 2 else None))
                for i, p in enumerate(prompts)]
        return await asyncio.gather(*jobs)

    a, b = asyncio.run(run(inproc)), asyncio.run(run(split))
    assert a == b
    deadline = time.monotonic() + 10
    while split.stats()["num_running"] + split.stats()["num_waiting"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = split.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0
    assert split.is_healthy()


def test_soak_with_cancellations_leaves_nothing_behind(fronts):
    soak(fronts[1], 200, 0.2)


@pytest.mark.slow
def test_long_soak_with_cancellations_leaves_nothing_behind(fronts):
    soak(fronts[1], 2000, 0.2, seed=1)


def test_a_killed_core_fails_every_stream_instead_of_hanging():
    front = AsyncLLMEngine(async_config(), multiprocess=True, progress=False)
    dead = []
    front.on_dead = lambda: dead.append(True)

    async def main():
        jobs = [asyncio.ensure_future(stream(front, f"d{i}", [3, 4, 5 + i], delta(temperature=0, max_tokens=200,
                                                                                   ignore_eos=True)))
                for i in range(6)]
        await asyncio.sleep(0.5)
        while front.stats().get("num_running", 0) == 0:      # every stream started
            await asyncio.sleep(0.05)
        front.engine.client.process.kill()
        return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), timeout=30)

    try:
        results = asyncio.run(main())
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "exit" in str(results[0])
        deadline = time.monotonic() + 5
        while not dead and time.monotonic() < deadline:      # called right after the streams got the error
            time.sleep(0.01)
        assert not front.is_healthy() and dead == [True]

        async def late():
            async for _ in front.generate([1, 2], delta(max_tokens=2), "late"):
                pass
        with pytest.raises(EngineDeadError):
            asyncio.run(late())
    finally:
        front.shutdown(drain_timeout=0)
