"""Data-parallel replicas (tiny Llama, CPU, two engine core processes): the router spreads requests and keeps
prefix affinity; greedy outputs equal one engine's, in input order; a soak with cancellations leaves both
replicas with nothing running, waiting or allocated; a killed replica fails its own streams (not the
others') instead of hanging, and the engine reports itself unhealthy; combinations not supported are refused."""
import asyncio
import os

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_engine import AsyncLLMEngine
from jaxserve.engine.core_client import use_multiprocess
from jaxserve.engine.dp_client import aggregate_stats, replica_devices
from jaxserve.engine.dp_router import ReplicaRouter
from jaxserve.errors import ReplicaLostError
from jaxserve.llm import engine_config_from_kwargs
from support import FIXTURES

from support.async_streams import delta, soak, stream
from test_engine_core_process import OPTS

TINY = os.path.join(FIXTURES, "models", "tiny-llama3")
# the replicas compile into the tests' persistent cache (each process would otherwise compile every step anew)
DP_OPTS = {**OPTS, "compilation_cache_dir": jax.config.jax_compilation_cache_dir}


# ---------------------------------------------------------------- the router
def test_router_spreads_requests_by_load():
    r = ReplicaRouter(2, block_size=4, slack=2)
    picks = [r.route(f"r{i}", [i, 1, 2]) for i in range(6)]        # under a block: no prefix
    assert picks == [0, 1, 0, 1, 0, 1] and r.load == [3, 3]
    for rid in ("r0", "r2", "r4"):
        assert r.release(rid) == 0
    assert r.release("r0") is None and r.load == [0, 3]
    assert [r.route(f"s{i}", [9]) for i in range(3)] == [0, 0, 0]  # the idle replica first
    r.kv_usage = [0.9, 0.1]
    r.release("s0")
    r.release("r1")
    assert r.load == [2, 2] and r.route("t", [9]) == 1              # equal load: the emptier KV cache


def test_router_keeps_prefix_affinity_until_the_replica_is_overloaded():
    r = ReplicaRouter(2, block_size=4, slack=3)
    system = [7, 7, 7, 7, 8, 8, 8, 8]
    r.route("other", [1, 2, 3, 4, 5])                               # replica 0 busier
    first = r.route("a", system + [1])
    assert first == 1
    # the shared prefix follows replica 1 until it holds `slack` more than the least loaded
    assert [r.route(f"b{i}", system + [i]) for i in range(3)] == [1, 1, 1]
    assert r.load == [1, 4]
    assert r.route("c", system + [5]) == 0                          # overloaded: balance wins
    assert r.route("d", system + [6]) == 0                          # the prefix's newest home
    # a deeper shared prefix beats a shallower one; another namespace (salt, adapter) is another prefix
    r2 = ReplicaRouter(3, block_size=2, slack=10)
    r2.load = [0, 5, 5]
    r2._homes[r2.prefix_hashes([1, 1])[0]] = 1
    r2._homes[r2.prefix_hashes([1, 1, 2, 2])[1]] = 2
    assert r2.route("deep", [1, 1, 2, 2, 3]) == 2
    assert r2.route("salted", [1, 1, 2, 2, 3], namespace=("salt", None)) == 0


def test_router_forgets_a_dead_replica():
    r = ReplicaRouter(2, block_size=2, slack=8)
    held = [r.route(f"r{i}", [5, 5, i]) for i in range(4)]
    assert held == [0, 0, 0, 0]                                     # one prefix, within the slack
    assert sorted(r.lose(0)) == ["r0", "r1", "r2", "r3"] and r.owner == {}
    assert [r.route(f"n{i}", [5, 5, i]) for i in range(3)] == [1, 1, 1]
    r.lose(1)
    with pytest.raises(LookupError):
        r.route("none", [1])


def test_stats_aggregate_across_replicas():
    a = {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.5, "prefix_cache_queries": 10,
         "prefix_cache_hits": 5, "prefix_cache_hit_rate": 0.5, "moe_expert_tokens_total": [1, 2],
         "iteration_tokens": ((4, 8), (1, 2, 0), 20), "lora_running": "x,y"}
    b = {"num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.1, "prefix_cache_queries": 30,
         "prefix_cache_hits": 0, "prefix_cache_hit_rate": 0.0, "moe_expert_tokens_total": [3, 4],
         "iteration_tokens": ((4, 8), (0, 1, 1), 30), "lora_running": "y,z"}
    s = aggregate_stats([a, b])
    assert (s["num_running"], s["num_waiting"]) == (3, 1) and s["kv_cache_usage"] == pytest.approx(0.3)
    assert s["prefix_cache_hit_rate"] == 5 / 40 and s["moe_expert_tokens_total"] == [4, 6]
    assert s["iteration_tokens"] == ((4, 8), (1, 3, 1), 50) and s["lora_running"] == "x,y,z"


# ---------------------------------------------------------------- refusals and devices
@pytest.mark.parametrize("kw, match", [
    (dict(pipeline_parallel_size=2), "pipeline"),
    (dict(distributed_executor_backend="mp"), "backend mp"),
    (dict(num_processes=2, distributed_coordinator="127.0.0.1:1234"), "one JAX process"),
    (dict(enable_expert_parallel=True), "expert"),
    (dict(data_parallel_size=0), "1 or more"),
])
def test_unsupported_combinations_are_refused_before_loading(kw, match):
    with pytest.raises(ValueError, match=match):
        engine_config_from_kwargs(TINY, **{"data_parallel_size": 2, **kw})


def test_replicas_need_their_own_processes():
    config = engine_config_from_kwargs(TINY, data_parallel_size=2)
    assert use_multiprocess(None, default=False, config=config)
    with pytest.raises(ValueError, match="own process"):
        use_multiprocess(False, default=True, config=config)


def test_each_replica_gets_its_own_gpus(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    config = engine_config_from_kwargs(TINY, data_parallel_size=2, tensor_parallel_size=2)
    assert replica_devices(config, None) == ["0,1", "2,3"]
    assert replica_devices(config, "4,5,6,7") == ["4,5", "6,7"]
    with pytest.raises(ValueError, match="need 4 GPUs"):
        replica_devices(config, "0,1,2")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert replica_devices(config, None) == [None, None]


# ---------------------------------------------------------------- two replicas
# One two-replica engine serves the tests below in turn (each start costs two processes): offline first, then
# behind the async front, whose last test kills a replica.
@pytest.fixture(scope="module")
def dp():
    llm = LLM(TINY, data_parallel_size=2, use_tqdm_on_load=False, **DP_OPTS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def front(dp):
    front = AsyncLLMEngine(dp.engine.config, engine=dp.engine)
    yield front
    front.shutdown(drain_timeout=0)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(1, 250, size=int(n)).tolist() for n in rng.integers(2, 40, size=12)]


def test_offline_generate_splits_the_batch_and_keeps_input_order(dp, prompts):
    one = LLM(TINY, use_tqdm_on_load=False, **OPTS)
    for params in (SamplingParams(temperature=0, max_tokens=16),
                   SamplingParams(temperature=0.8, seed=3, max_tokens=12, n=2, stop=["e"])):
        a = one.generate(prompts, params, use_tqdm=False)
        b = dp.generate(prompts, params, use_tqdm=False)
        assert [x.prompt_token_ids for x in b] == prompts
        assert [[(o.token_ids, o.text, o.finish_reason) for o in x.outputs] for x in a] == \
               [[(o.token_ids, o.text, o.finish_reason) for o in x.outputs] for x in b]
    per = dp.engine.stats()["replicas"]
    assert all(r["tokens_total"] > 0 for r in per), "one replica did all the work"
    assert dp.engine.client.router.owner == {}


def empty(per: list[dict]) -> bool:
    return all((r["num_running"], r["num_waiting"], r["kv_cache_usage"]) == (0, 0, 0.0) for r in per)


def test_soak_with_cancellations_leaves_both_replicas_empty(front):
    before = [r["tokens_total"] for r in front.stats()["replicas"]]
    soak(front, 60, 0.2, seed=2)
    per = front.stats()["replicas"]
    assert empty(per), per
    assert all(r["tokens_total"] > b for r, b in zip(per, before))
    assert front.engine.client.router.owner == {} and front.is_healthy()


@pytest.mark.slow
def test_long_soak_with_cancellations_leaves_both_replicas_empty(front):
    soak(front, 500, 0.2, seed=4)
    assert empty(front.stats()["replicas"])


def test_a_killed_replica_fails_its_streams_and_the_other_serves_on(front):
    killed_replica_fails_its_streams(front, lambda client: client.replicas[0].process.kill())


def killed_replica_fails_its_streams(front, kill) -> None:
    """``kill(client)`` ends replica 0 while both replicas stream: its streams fail with ReplicaLostError at
    once, the other's finish, the engine reports itself unhealthy (not dead) and the live replica takes new
    requests."""
    dead = []
    front.on_dead = lambda: dead.append(True)
    client = front.engine.client

    async def main():
        jobs = [asyncio.ensure_future(stream(front, f"d{i}", [3, 4, 5 + i], delta(temperature=0, max_tokens=240,
                                                                                   ignore_eos=True)))
                for i in range(6)]
        while not all(r["num_running"] for r in front.stats()["replicas"]):
            await asyncio.sleep(0.01)
        on_killed = {rid for rid, r in client.router.owner.items() if r == 0}
        kill(client)
        results = await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), timeout=60)
        return on_killed, results

    on_killed, results = asyncio.run(main())
    assert on_killed
    for i, r in enumerate(results):
        if f"d{i}" in on_killed:
            assert isinstance(r, ReplicaLostError) and "replica 0 died" in str(r), r
        else:
            assert r[2] == "length" and len(r[1]) == 240, r
    assert not front.is_healthy() and not dead and not front.dead

    async def late():
        return await asyncio.gather(*(stream(front, f"late{i}", [1, 2, i], delta(max_tokens=3)) for i in range(3)))
    assert all(r[2] == "length" for r in asyncio.run(late()))           # the live replica takes them
    assert front.stats()["replicas"][0]["dead"] is True
    assert not front.engine.output_processor.requests
