"""`serve --data-parallel-size 2` with the embedded SmolLM2 (two engine core processes) through the openai SDK:
requests spread over both replicas, /metrics labels each replica's figures engine="i", greedy completions equal
one engine's, and a replica killed mid-stream errors its own streams (an error chunk, then [DONE]) while the
other's finish, /health answers 503 and the server keeps serving on the replica left. (The fast suite's
tests/engine/test_data_parallel.py checks the same on the tiny Llama without HTTP.)"""
import json
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from support.server_process import smol_server, start_long_streams

PROMPTS = ["1, 2, 3, 4,", "The capital of France is", "Once upon a time", "def add(a, b):", "Red, green,",
           "The sun rises in the"]


def replica_pids(srv) -> list[int]:
    found = re.search(r"in 2 data-parallel replica processes \(pids (\d+), (\d+)\)", srv.tail(1 << 20))
    assert found, srv.tail()
    return [int(found.group(1)), int(found.group(2))]


def complete_all(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)

    def one(prompt):
        return client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def metric(text: str, name: str) -> dict[str, float]:
    """engine label -> value of a jaxserve:NAME series."""
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^jaxserve:{name}{{engine="(\d*)",model_name="smol"}} (\S+)$', text, re.M)}


def test_metrics_label_each_replicas_figures():
    from types import SimpleNamespace

    from server.metrics import ServerMetrics
    per = [{"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.5, "prefix_cache_queries": 7},
           {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "prefix_cache_queries": 3, "dead": True}]
    stats = {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "prefix_cache_queries": 10,
             "structured_verdict_compilations": 4, "replicas": per}
    engine = SimpleNamespace(stats=lambda: stats, is_healthy=lambda: False, dead=False, max_model_len=64)
    text = ServerMetrics(engine, "smol").render().decode()
    assert metric(text, "num_requests_running") == {"0": 2.0, "1": 0.0}
    assert metric(text, "kv_cache_usage_perc") == {"0": 0.5, "1": 0.0}
    assert metric(text, "prefix_cache_queries_total") == {"0": 7.0, "1": 3.0}
    # a figure only the front end keeps: one series, its engine label empty
    assert metric(text, "structured_output_verdict_compilations_total") == {"": 4.0}
    assert 'jaxserve:engine_healthy{model_name="smol"} 0.0' in text


@pytest.mark.slow          # two SmolLM2 processes start and warm up: about a minute on two CPU cores
def test_two_replicas_serve_the_sdk_and_a_killed_one_fails_only_its_streams():
    srv = smol_server("--data-parallel-size", "2")
    try:
        serves_and_survives_a_killed_replica(srv)
    finally:
        srv.stop()


def serves_and_survives_a_killed_replica(srv) -> list[str]:
    """Both replicas of ``srv`` serve the SDK's greedy completions (returned) and label their /metrics; then
    replica 0's process is killed mid-stream: its streams end with an error chunk and [DONE], the other's
    finish, /health answers 503 and the replica left serves the same completions."""
    pids = replica_pids(srv)
    texts = complete_all(srv.url)
    assert all(texts)
    scrape = httpx.get(srv.url + "/metrics").text
    assert set(metric(scrape, "num_requests_running")) == {"0", "1"}
    queries = metric(scrape, "prefix_cache_queries_total")
    assert set(queries) == {"0", "1"} and all(v > 0 for v in queries.values()), queries   # both took some
    threads, results = start_long_streams(srv.url, 6, wait_s=60)
    os.kill(pids[0], signal.SIGKILL)
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a stream hung after its replica died"
    failed = 0
    for i, lines in results.items():
        assert lines[-1] == "data: [DONE]", (i, lines[-3:])
        last = json.loads(lines[-2][len("data: "):])
        if "error" in last:
            failed += 1
            assert "data-parallel replica 0 died" in last["error"]["message"], last
        else:
            assert last["choices"][0]["finish_reason"] == "length", last
    assert 0 < failed < 6, "the streams did not fail with their replica (or all of them did)"
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 503
    assert complete_all(srv.url) == texts           # the replica left serves on, with the same outputs
    assert metric(httpx.get(srv.url + "/metrics").text, "num_requests_running")["0"] == 0
    return texts


@pytest.mark.slow
def test_two_replicas_give_one_engines_greedy_completions():
    one = smol_server()
    try:
        expected = complete_all(one.url)
    finally:
        assert one.stop() == 0
    two = smol_server("--data-parallel-size", "2")
    try:
        assert complete_all(two.url) == expected
    finally:
        assert two.stop() == 0
