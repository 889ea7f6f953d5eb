"""``--data-parallel-size 2 --distributed-executor-backend ray`` on a local Ray cluster of two one-CPU nodes
(``ray.cluster_utils.Cluster`` on 127.0.0.1; tiny Llama, CPU): each replica's engine core runs in its own
actor, one per node, on sockets it bound on its node's address; greedy outputs equal one engine's; killing one
replica's actor fails its in-flight streams (not the other's) at once and the engine reports itself unhealthy,
while the replica left serves on."""
import pytest

ray = pytest.importorskip("ray")

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.engine.async_engine import AsyncLLMEngine  # noqa: E402
from support.ray_cluster import local_ray_cluster  # noqa: E402
from test_data_parallel import DP_OPTS, TINY, killed_replica_fails_its_streams  # noqa: E402
from test_engine_core_process import OPTS  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray_cluster(2, join_here=True) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def prompts():
    return [[(7 * i + j) % 250 + 1 for j in range(3 + 2 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def expected(prompts):
    one = LLM(TINY, use_tqdm_on_load=False, **OPTS)
    try:
        return [[o.token_ids for o in x.outputs] for x in one.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        one.shutdown()


@pytest.mark.slow     # Ray replicas of TP=2 each (~35 s)
def test_replicas_with_tensor_parallelism_inside(ray_cluster, prompts, expected):
    # (first: the cluster's two CPUs then go to the replicas of the fixture below)
    llm = LLM(TINY, data_parallel_size=2, tensor_parallel_size=2, distributed_executor_backend="ray",
              use_tqdm_on_load=False, **DP_OPTS)
    try:
        assert [[o.token_ids for o in x.outputs] for x in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    finally:
        llm.shutdown()


def test_replicas_the_cluster_has_no_room_for_are_refused_with_what_was_asked(ray_cluster):
    from ray.util.placement_group import placement_group_table

    from jaxserve.executor.ray_replicas import RayReplicas
    with pytest.raises(RuntimeError, match=r"no room for 3 data-parallel replicas of \{'CPU': 1\} each"):
        RayReplicas(3, 1, timeout_s=2)
    assert all(g["state"] == "REMOVED" for g in placement_group_table().values())     # nothing left reserved


@pytest.fixture(scope="module")
def dp(ray_cluster):
    llm = LLM(TINY, data_parallel_size=2, distributed_executor_backend="ray", use_tqdm_on_load=False, **DP_OPTS)
    yield llm
    llm.shutdown()


def test_replicas_run_in_actors_on_both_nodes_and_match_one_engine(dp, prompts, expected):
    from ray.util.placement_group import placement_group_table

    placement = dp.engine.client.placement
    assert all(c.input_address.startswith("tcp://127.0.0.1:") and c.output_address.startswith("tcp://127.0.0.1:")
               for c in placement.cores)
    assert len(set(placement_group_table(placement.group)["bundles_to_node_id"].values())) == 2
    got = dp.generate(prompts, GREEDY, use_tqdm=False)
    assert [[o.token_ids for o in x.outputs] for x in got] == expected
    per = dp.engine.stats()["replicas"]
    assert all(r["tokens_total"] > 0 for r in per), "one replica did all the work"


def test_a_killed_replica_actor_fails_its_streams_and_the_other_serves_on(dp):
    front = AsyncLLMEngine(dp.engine.config, engine=dp.engine)
    try:
        killed_replica_fails_its_streams(front, lambda client: ray.kill(client.placement.actors[0], no_restart=True))
    finally:
        front.shutdown(drain_timeout=0)
