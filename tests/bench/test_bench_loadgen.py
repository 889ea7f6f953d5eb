"""Benchmarks: the load generator against a scripted SSE server (support/scripted_sse_server.py): timings, the
concurrency cap, HTTP errors, Poisson sends."""
from __future__ import annotations

import asyncio

import numpy as np

from jaxserve.benchmarks import metrics, workloads


# ------------------------------------------------------------------ load generator vs a scripted SSE server
def test_loadgen_timings_and_concurrency_cap(scripted_server):
    from jaxserve.benchmarks.loadgen import run_load
    app, url = scripted_server
    reqs = workloads.random_requests(np.random.default_rng(0), 6, 5, 4, 1000)
    app.peak = 0
    timings, duration = asyncio.run(run_load(url, reqs, max_concurrency=2, progress=False))
    assert app.peak == 2                                           # the cap is reached and never exceeded
    assert all(t.success and t.output_tokens == 4 and t.prompt_tokens == 5 for t in timings)
    assert all(len(t.itl) == 3 for t in timings)
    gaps = sorted(g for t in timings for g in t.itl)                # the server's 20 ms gaps (a late read
    assert gaps[len(gaps) // 2] >= 0.015                            # can shorten one on a loaded machine)
    # a late first read lengthens ttft and shortens the rest, but nothing is read before the server's four sleeps
    assert all(t.ttft >= 0.015 and t.e2e >= 4 * 0.02 - 0.005 for t in timings)
    assert duration >= 3 * 4 * 0.02                                # 6 requests, 2 at a time, 80 ms each
    body = app.bodies[-1]
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
    m = metrics.serving_metrics(timings, duration)
    assert m["completed"] == 6 and m["output_tokens"] == 24 and m["failed"] == 0


def test_loadgen_reports_http_errors(scripted_server):
    from jaxserve.benchmarks.loadgen import run_load
    _, url = scripted_server
    reqs = [workloads.RequestSpec([13], 1, 3), workloads.RequestSpec([1, 2], 2, 2)]
    timings, _ = asyncio.run(run_load(url, reqs, progress=False))
    assert not timings[0].success and timings[0].error.startswith("HTTP 400") and "bad prompt" in timings[0].error
    assert timings[1].success and timings[1].output_tokens == 2


def test_loadgen_poisson_rate_spreads_sends(scripted_server):
    from jaxserve.benchmarks.loadgen import run_load
    _, url = scripted_server
    reqs = workloads.random_requests(np.random.default_rng(0), 5, 3, 1, 1000)
    timings, duration = asyncio.run(run_load(url, reqs, request_rate=20.0, seed=3, progress=False))
    gaps = workloads.arrival_delays(np.random.default_rng(3), 5, 20.0)
    starts = [t.start for t in timings]
    assert starts == sorted(starts)
    # sleeps never end early; a busy machine may make them late, not by half a second
    for i in range(1, 5):
        assert gaps[1:i + 1].sum() - 0.005 <= starts[i] - starts[0] <= gaps[1:i + 1].sum() + 0.5
