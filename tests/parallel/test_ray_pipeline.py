"""``serve --pipeline-parallel-size 2 --distributed-executor-backend ray`` on a local Ray cluster of two nodes
(``ray.cluster_utils.Cluster`` on 127.0.0.1, one CPU device per JAX process): the openai SDK gets one
process's greedy text, and a killed stage worker ends every in-flight stream with an error event, /health
answers 503 (or the server is already gone) and the server exits 1, nothing hanging."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

from support import xla_flags
from support.ray_cluster import LOOPBACK_ENV, local_ray_cluster
from support.server_process import MAX_MODEL_LEN, ServerProcess, start_long_streams

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
         "--dtype", "float32", "--served-model-name", "smol", "--pipeline-parallel-size", "2",
         "--distributed-executor-backend", "ray", "--skip-warmup")
PROMPTS = ["The capital of France is", "Write a story about a cat"]


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray_cluster(2) as cluster:
        yield cluster


def _stage_worker_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "ray::StageWorker"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _one_process_texts() -> list[str]:
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    llm = LLM(None, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=64, max_num_seqs=8,
              skip_warmup=True, use_tqdm_on_load=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_ray_pipeline_server_matches_one_process_and_fails_fast(ray_cluster):
    # the driver joins the cluster on the loopback address its nodes use (Ray otherwise maps 127.0.0.1 to the
    # host's network address), with one CPU device per JAX process
    env = {"RAY_ADDRESS": ray_cluster.address, **LOOPBACK_ENV, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=1")}
    srv = ServerProcess(*FLAGS, env=env, startup_timeout=400)
    try:
        assert len(_stage_worker_pids()) == 1
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        texts = [client.completions.create(model="smol", prompt=p, max_tokens=12, temperature=0).choices[0].text
                 for p in PROMPTS]
        assert texts == _one_process_texts()

        threads, results = start_long_streams(srv.url, 2, wait_s=120)
        for pid in _stage_worker_pids():
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        health = None
        while time.monotonic() - killed < 10:
            try:
                health = httpx.get(srv.url + "/health", timeout=2).status_code
            except httpx.HTTPError:
                health = "gone"                      # the server already exited: also not healthy
            if health != 200:
                break
            time.sleep(0.2)
        assert health in (503, "gone"), health
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a stream hung after a stage worker died"
        for i, lines in results.items():
            assert lines[-1] == "data: [DONE]", (i, lines[-3:])
            error = json.loads(lines[-2][len("data: "):])
            assert "error" in error and "engine" in error["error"]["message"], error   # (the transfer or the watcher)
        assert srv.proc.wait(60) == 1
    finally:
        srv.stop()
