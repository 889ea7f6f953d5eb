"""`serve --data-parallel-size 2 --distributed-executor-backend ray` with the embedded SmolLM2 on a local Ray
cluster of two one-CPU nodes (127.0.0.1): each replica's engine core in a Ray actor on its own node. Through the
openai SDK the greedy completions equal one engine's; killing one replica's actor process mid-stream errors its
own streams (an error chunk, then [DONE]) while the other's finish, /health answers 503 and the server serves
on with the replica left."""
import pytest

from support.ray_cluster import LOOPBACK_ENV, local_ray_cluster
from support.server_process import MAX_MODEL_LEN, smol_server
from test_data_parallel_server import PROMPTS, serves_and_survives_a_killed_replica

pytest.importorskip("ray")


def one_engines_texts() -> list[str]:
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    llm = LLM(None, max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=64, skip_warmup=True,
              use_tqdm_on_load=False)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    finally:
        llm.shutdown()
    return [o.outputs[0].text for o in outs]


@pytest.mark.slow          # a Ray cluster and two SmolLM2 actors start and warm up
def test_ray_replicas_serve_the_sdk_and_a_killed_actor_fails_only_its_streams():
    expected = one_engines_texts()
    with local_ray_cluster(2) as cluster:
        srv = smol_server("--data-parallel-size", "2", "--distributed-executor-backend", "ray",
                          env={"RAY_ADDRESS": cluster.address, **LOOPBACK_ENV, "JAX_PLATFORMS": "cpu"})
        try:
            assert serves_and_survives_a_killed_replica(srv) == expected
        finally:
            srv.stop()
