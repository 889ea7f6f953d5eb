"""Hostile and careless clients against the in-process server on the scripted engine
(support/server_fakes.py): inputs that must be a 4xx in OpenAI's error shape, never a 500 or a stall, and the
HTTP details (methods, headers) that proxies, browsers and scrapers depend on."""
from __future__ import annotations

import logging

import httpx
import openai
import pytest

from support.api_errors import api_error
from support.server_fakes import FakeEngine, InProcessServer
from support.servers import scripted

MODEL = "fake-model"


SERVER = scripted()


def test_deeply_nested_json_is_400_with_one_log_line(http, caplog):
    depth = 3000   # ~6 KB: past msgspec's recursion guard
    nested = b"[" * depth + b"]" * depth
    bodies = {"/v1/completions": b'{"prompt": ' + nested + b"}",
              "/v1/chat/completions": b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": '
                                      b'{"a": ' + nested + b"}}",
              "/tokenize": nested}
    for path, body in bodies.items():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="jaxserve.server"):
            e = api_error(http.post(path, content=body, headers={"content-type": "application/json"}), 400)
        assert "nested too deeply" in e["message"] and len(e["message"]) < 600, e
        records = [r for r in caplog.records if r.name == "jaxserve.server"]
        assert len(records) == 1 and records[0].exc_info is None, [r.getMessage() for r in records]
    assert http.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 2}).status_code == 200


def test_top_k_below_minus_one_is_400(http, server):
    e = api_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "top_k": -2}), 400)
    assert e["param"] == "top_k" and "-2" in e["message"]
    for off in (-1, 0):   # vLLM's "no top-k filter"
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "top_k": off, "temperature": 1})
        assert r.status_code == 200, r.text
        assert server.engine.params_seen[r.json()["id"] + "-0"].top_k == 0


def test_unknown_model_name_is_not_echoed_unbounded(http):
    e = api_error(http.post("/v1/completions", json={"model": "m" * 50_000, "prompt": "x"}), 404)
    assert e["code"] == "model_not_found" and len(e["message"]) < 300 and "50000 chars" in e["message"]
    e = api_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert "`gpt-9`" in e["message"]


def test_metrics_content_type_and_head(http):
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    r = http.head("/metrics")
    assert r.status_code == 200 and r.content == b""
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


def test_unsupported_method_is_405_with_allow(http):
    e = api_error(http.request("TRACE", "/v1/models"), 405)
    assert e["type"] == "invalid_request_error"
    r = http.request("TRACE", "/v1/models")
    assert "GET" in r.headers["allow"]
    assert "POST" in http.delete("/v1/completions").headers["allow"]


HEAVY_TEMPLATE = "{% for i in range(16000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}x"   # ~0.7 s of Jinja


def test_request_chat_template_refused_unless_trusted(http):
    msgs = [{"role": "user", "content": "x"}]
    e = api_error(http.post("/v1/chat/completions", json={"messages": msgs, "chat_template": "{{ 'hi' }}"}), 400)
    assert e["param"] == "chat_template" and "--trust-request-chat-template" in e["message"]
    e = api_error(http.post("/tokenize", json={"messages": msgs, "chat_template": "{{ 'hi' }}"}), 400)
    assert e["param"] == "chat_template"
    e = api_error(http.post("/v1/chat/completions",
                            json={"messages": msgs, "chat_template_kwargs": {"chat_template": "{{ 'hi' }}"}}), 400)
    assert e["param"] == "chat_template"
    e = api_error(http.post("/v1/chat/completions",
                            json={"messages": msgs, "chat_template_kwargs": {"tokenize": True}}), 400)
    assert e["param"] == "chat_template_kwargs" and "tokenize" in e["message"]


def test_trusted_request_template_renders_off_the_event_loop(monkeypatch):
    import threading
    import time

    from jaxserve.server import prompts as prompts_mod
    monkeypatch.setattr(prompts_mod, "REQUEST_TEMPLATE_TIMEOUT_S", 120.0)   # a loaded machine renders slower
    srv = InProcessServer(FakeEngine(), trust_request_chat_template=True)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            body = {"messages": [{"role": "user", "content": "x"}]}
            tiny = "<|im_start|>{{ messages[0].content }}"
            r = http.post("/v1/chat/completions", json={**body, "max_tokens": 1, "chat_template": tiny})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == 2   # the request's template ran: <|im_start|> and "x"
            t0 = time.monotonic()
            assert http.post("/tokenize", json={**body, "chat_template": HEAVY_TEMPLATE}).status_code == 200
            render_s = time.monotonic() - t0
            heavy = {**body, "chat_template": HEAVY_TEMPLATE}
            slow = threading.Thread(target=http.post, args=("/tokenize",), kwargs={"json": heavy})
            slow.start()
            time.sleep(render_s / 4)
            t0 = time.monotonic()
            assert httpx.get(srv.url + "/health", timeout=60).status_code == 200
            health_s = time.monotonic() - t0
            slow.join()
            assert health_s < render_s / 2, (health_s, render_s)   # on the loop it would wait out the render
    finally:
        srv.stop()


def test_openapi_declares_bearer_auth_only_with_an_api_key(http):
    assert "security" not in http.get("/schema/openapi.json").json()
    srv = InProcessServer(FakeEngine(), api_key="k")
    try:
        schema = httpx.get(srv.url + "/schema/openapi.json", timeout=30).json()
        assert schema["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
        assert schema["security"] == [{"bearer": []}]
        assert schema["paths"]["/health"]["get"]["security"] == [{}]        # the probes stay open
        assert "security" not in schema["paths"]["/v1/completions"]["post"]  # the global rule applies
    finally:
        srv.stop()


def test_text_too_long_for_any_tokenization_is_400_before_tokenizing(http, server, monkeypatch):
    """max_model_len 256 x 12 characters (the fake vocabulary's longest token, <|im_start|>): a longer text
    is refused without running the tokenizer (a multi-megabyte prompt cost gigabytes to tokenize)."""
    calls = []
    tok = server.engine.tokenizer
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    huge = "hello " * 600                  # 3,600 characters
    for path, body, param in (("/v1/completions", {"prompt": huge}, "prompt"),
                              ("/v1/completions", {"prompt": ["x", huge]}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
                              ("/tokenize", {"prompt": huge}, "prompt")):
        e = api_error(http.post(path, json=body), 400)
        assert e["code"] == "context_length_exceeded" and e["param"] == param and "3600 characters" in e["message"]
    assert calls in ([], [1])              # at most the short "x" of the batch
    assert http.post("/v1/completions", json={"prompt": "hello " * 20, "max_tokens": 1}).status_code == 200


def test_long_texts_tokenize_a_few_at_a_time():
    """Tokenizing memory is a multiple of the text: long texts go to worker threads, at most
    TOKENIZE_THREADS at once however many requests arrive together."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from jaxserve.server.prompts import TOKENIZE_THREADS

    engine = FakeEngine(max_model_len=8192)
    lock, active, peak = threading.Lock(), [0], [0]
    real = engine.tokenizer.encode

    def encode(*a, **kw):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.2)
        with lock:
            active[0] -= 1
        return real(*a, **kw)
    engine.tokenizer.encode = encode
    srv = InProcessServer(engine)
    try:
        def post(_):
            return httpx.post(srv.url + "/tokenize", json={"prompt": "y" * 5000}, timeout=60).status_code
        with ThreadPoolExecutor(12) as pool:
            assert list(pool.map(post, range(12))) == [200] * 12
        assert 1 < peak[0] <= TOKENIZE_THREADS, peak
    finally:
        srv.stop()


def test_drain_timeout_ends_open_streams_with_an_error_and_done():
    """SIGTERM's drain timeout running out: a stream that already has its 200 gets an error event and
    [DONE] (not a cut connection), a request still waiting a 503, and both engine requests are aborted."""
    import json
    import threading
    import time

    engine = FakeEngine(slow_delay=0.05)
    srv = InProcessServer(engine)
    runs = srv.app.state.serving.runs
    loop = srv.server.servers[0].get_loop()
    try:
        waiting = {}

        def non_stream():
            waiting["r"] = httpx.post(srv.url + "/v1/completions", json={"prompt": "SLOW", "max_tokens": 200},
                                      timeout=60)
        t = threading.Thread(target=non_stream)
        t.start()
        events = []
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                          json={"prompt": "SLOW", "max_tokens": 200, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 3:
                    t0 = time.monotonic()
                    loop.call_soon_threadsafe(runs.start_drain, 1.0)
        elapsed = time.monotonic() - t0
        t.join(10)
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data: "):])["error"]
        assert error["code"] == "draining" and "--drain-timeout" in error["message"]
        assert 0.8 < elapsed < 5, elapsed                       # at the timeout less its grace (0.1 s)
        assert api_error(waiting["r"], 503)["code"] == "draining"
        assert engine.running == {} and len(engine.aborted) == 2
        assert httpx.get(srv.url + "/health").status_code == 503
    finally:
        srv.stop()


def test_time_to_first_token_counts_from_the_request_arrival():
    """TTFT and e2e latency start when the request reaches the server (vLLM's rule), so time spent before
    the engine sees it (here a tokenizer taking 0.3 s) is in them, as the client sees it."""
    import time

    import openai
    from prometheus_client.parser import text_string_to_metric_families

    engine = FakeEngine()
    real = engine.tokenizer.encode
    engine.tokenizer.encode = lambda *a, **kw: time.sleep(0.3) or real(*a, **kw)
    srv = InProcessServer(engine)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        t0 = time.monotonic()
        stream = client.completions.create(model=MODEL, prompt="ttft", max_tokens=3, stream=True)
        next(iter(stream))
        client_ttft = time.monotonic() - t0
        list(stream)
        samples = {s.name: s.value for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
                   for s in f.samples}
        ttft = samples["jaxserve:time_to_first_token_seconds_sum"]
        assert samples["jaxserve:time_to_first_token_seconds_count"] == 1
        assert 0.3 <= ttft <= client_ttft, (ttft, client_ttft)
        assert samples["jaxserve:e2e_request_latency_seconds_sum"] >= ttft
    finally:
        srv.stop()


def test_trusted_request_template_is_bounded_in_time_and_output(monkeypatch):
    """Even trusted, a request's template stops at its time bound (a 400, the server free) and a prompt it
    renders past max_model_len's character bound is a 400 before tokenizing."""
    import time

    from jaxserve.server import prompts as prompts_mod

    monkeypatch.setattr(prompts_mod, "REQUEST_TEMPLATE_TIMEOUT_S", 1.5)
    srv = InProcessServer(FakeEngine(), trust_request_chat_template=True)
    try:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
        t0 = time.monotonic()
        e = api_error(httpx.post(srv.url + "/v1/chat/completions", json={**body, "chat_template": endless},
                                 timeout=60), 400)
        assert e["param"] == "chat_template" and "1.5 s" in e["message"] and time.monotonic() - t0 < 8
        # the 12 MB render below must not meet the time bound on a loaded machine: only its size is the point
        monkeypatch.setattr(prompts_mod, "REQUEST_TEMPLATE_TIMEOUT_S", 60.0)
        e = api_error(httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                                 json={**body, "chat_template": "{{ 'hello ' * 2000000 }}"}), 400)
        assert e["code"] == "context_length_exceeded" and e["param"] == "messages", e
        for _ in range(3):      # the worker threads the timeouts interrupted serve on
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                           json={**body, "chat_template": "<|im_start|>{{ messages[0].content }}"})
            assert r.status_code == 200, r.text
    finally:
        srv.stop()


def test_slow_clients_get_408_and_the_connection_closed(caplog):
    """A client trickling its headers or its body, or opening a connection and sending nothing, is cut
    after --read-timeout (uvicorn alone held such connections forever), with one info line, no error."""
    import socket
    import time

    srv = InProcessServer(FakeEngine(), read_timeout=0.5)
    try:
        def talk(*parts: bytes) -> tuple[bytes, float]:
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            t0 = time.monotonic()
            for p in parts:
                s.sendall(p)
                time.sleep(0.1)
            data = b""
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
            s.close()
            return data, time.monotonic() - t0
        half_head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Len"
        half_body = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
                    b"Content-Length: 100\r\n\r\n{\"prompt\": "
        for parts in ((half_head,), (half_body,), ()):
            data, took = talk(*parts)
            assert data.startswith(b"HTTP/1.1 408") and b"--read-timeout" in data, data
            assert took < 5, took
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200   # a whole request in time is served
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, errors
    finally:
        srv.stop()


def test_prompts_times_n_is_capped(http):
    e = api_error(http.post("/v1/completions", json={"prompt": ["a"] * 100, "n": 128, "max_tokens": 1}), 400)
    assert "12800 choices" in e["message"] and "--max-request-choices 1024" in e["message"] and e["param"] == "n"
    e = api_error(http.post("/v1/completions", json={"prompt": [[1, 2]] * 9, "n": 128, "max_tokens": 1}), 400)
    assert "1152 choices" in e["message"]


def test_metrics_parse_and_report_a_dead_engine():
    """The scrape parses with prometheus_client's own text parser; a stuck engine is unhealthy; a dead one
    is unhealthy and dead, and its running / waiting / KV gauges read 0, not the last figures it reported."""
    from prometheus_client.parser import text_string_to_metric_families

    engine = FakeEngine()
    srv = InProcessServer(engine)
    try:
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "m", "max_tokens": 2}).status_code == 200

        def scrape() -> dict:
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text) for s in f.samples}
        lbl = (("model_name", MODEL),)
        samples = scrape()
        assert samples[("jaxserve:engine_healthy", lbl)] == 1.0
        assert samples[("jaxserve:generation_tokens_total", lbl)] == 2
        assert samples[("jaxserve:engine_dead", lbl)] == 0.0
        engine.running.update(a=3, b=5)        # two requests hold blocks when the loop stops
        engine.healthy = False                 # stuck: its figures are still the truth
        samples = scrape()
        assert samples[("jaxserve:engine_healthy", lbl)] == 0.0 and samples[("jaxserve:engine_dead", lbl)] == 0.0
        assert samples[("jaxserve:num_requests_running", lbl)] == 2.0
        engine.dead = True                     # dead: every request it held has failed
        samples = scrape()
        assert samples[("jaxserve:engine_healthy", lbl)] == 0.0 and samples[("jaxserve:engine_dead", lbl)] == 1.0
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert samples[(f"jaxserve:{gauge}", lbl)] == 0.0, gauge
        assert samples[("jaxserve:generation_tokens_total", lbl)] == 2      # totals stay
    finally:
        srv.stop()


# what vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana) and the list query
VLLM_DASHBOARD_SERIES = [
    "e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum", "e2e_request_latency_seconds_count",
    "prompt_tokens_total", "generation_tokens_total",
    "time_per_output_token_seconds_bucket", "time_per_output_token_seconds_sum",
    "time_per_output_token_seconds_count", "num_requests_running", "num_requests_waiting",
    "time_to_first_token_seconds_bucket", "time_to_first_token_seconds_sum", "time_to_first_token_seconds_count",
    "gpu_cache_usage_perc", "gpu_prefix_cache_hit_rate", "kv_cache_usage_perc",
    "request_prompt_tokens_bucket", "request_generation_tokens_bucket", "request_success_total",
    "request_queue_time_seconds_sum", "request_prefill_time_seconds_sum", "request_decode_time_seconds_sum",
    "request_inference_time_seconds_sum", "request_max_num_generation_tokens_sum", "request_params_n_bucket",
    "request_params_max_tokens_bucket", "request_time_per_output_token_seconds_bucket",
    "iteration_tokens_total_bucket", "iteration_tokens_total_sum", "inter_token_latency_seconds_bucket",
    "num_preemptions_total", "prefix_cache_queries_total", "prefix_cache_hits_total", "cache_config_info",
]


def test_vllm_dashboard_series_under_the_vllm_prefix():
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    srv = InProcessServer(FakeEngine(), metrics_prefix="vllm")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=5, n=2)
        samples: dict = {}
        for family in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
            for s in family.samples:
                samples.setdefault(s.name, []).append(s)
        missing = [n for n in VLLM_DASHBOARD_SERIES if "vllm:" + n not in samples]
        assert not missing, missing
        one = {n: samples["vllm:" + n][0].value for n in VLLM_DASHBOARD_SERIES if len(samples["vllm:" + n]) == 1}
        count = {s.labels["le"]: s.value for s in samples["vllm:request_params_n_bucket"]}
        assert count["1.0"] == 0 and count["2.0"] == 2                      # two prompts, n=2 each
        assert one["request_max_num_generation_tokens_sum"] == 10          # 5 tokens, per prompt
        gen = {s.labels["le"]: s.value for s in samples["vllm:request_generation_tokens_bucket"]}
        assert gen["5.0"] == 4 and gen["2.0"] == 0                         # four choices of 5 tokens
        steps = {s.labels["le"]: s.value for s in samples["vllm:iteration_tokens_total_bucket"]}
        assert (steps["1.0"], steps["8.0"], steps["128.0"], steps["+Inf"]) == (1, 2, 3, 3)
        assert one["iteration_tokens_total_sum"] == 109
        assert one["gpu_prefix_cache_hit_rate"] == 0.4
        assert one["gpu_cache_usage_perc"] == one["kv_cache_usage_perc"]
    finally:
        srv.stop()


def test_unknown_request_fields_are_400_naming_each(client, http):
    """No field that could change the output is accepted and ignored: every top-level field a request type
    lacks is named in one 400 (through the openai SDK's extra_body, as clients send them), OpenAI's and vLLM's
    fields this server does not implement say so, and a nested unknown key names its path."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       extra_body={"frobnicate": 1, "kv_transfer_params": {}})
    err = e.value.body
    assert err["param"] == "frobnicate" and err["code"] == "unknown_parameter", err
    assert "`frobnicate`, `kv_transfer_params`" in err["message"] \
        and "`kv_transfer_params` is not implemented" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"logits_processors": ["m.P"]})
    assert e.value.body["param"] == "logits_processors" and "not implemented" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="x", extra_body={"normalize": True})
    assert e.value.body["param"] == "normalize"
    for path, body in (("/tokenize", {"prompt": "x", "bogus": 1}), ("/detokenize", {"tokens": [1], "bogus": 1})):
        assert api_error(http.post(path, json=body), 400)["param"] == "bogus"
    e = api_error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "structured_outputs": {"regex": "a", "bogus": 1}}), 400)
    assert "bogus" in e["message"] and "structured_outputs" in e["message"], e


def test_fields_clients_send_are_accepted(client, http):
    """What the openai SDK, LangChain's ChatOpenAI (its request payload, tools and structured output) and
    vLLM's documented extra sampling params send is accepted."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=str(client.base_url), api_key="x", temperature=0.5, max_tokens=3, top_p=0.9,
                      seed=1, logprobs=True, top_logprobs=2, frequency_penalty=0.1, presence_penalty=0.1,
                      stop=["zz"], stream_usage=True, model_kwargs={"user": "u"},
                      extra_body={"top_k": 3, "min_p": 0.05, "repetition_penalty": 1.1})
    assert chat.invoke([HumanMessage("hi")]).content is not None
    assert "".join(c.content for c in chat.stream([HumanMessage("hi")])) is not None
    tool = {"type": "function", "function": {"name": "f", "description": "d",
                                              "parameters": {"type": "object", "properties": {}}}}
    tools = chat.bind_tools([tool], tool_choice="none", parallel_tool_calls=False)
    assert tools.invoke([HumanMessage("hi")]) is not None
    vllm_extras = {"top_k": 2, "min_p": 0.1, "repetition_penalty": 1.1, "stop_token_ids": [7], "ignore_eos": True,
                   "min_tokens": 1, "include_stop_str_in_output": False, "skip_special_tokens": True,
                   "spaces_between_special_tokens": True, "prompt_logprobs": 1, "return_token_ids": True,
                   "return_tokens_as_token_ids": False, "add_generation_prompt": True,
                   "continue_final_message": False, "chat_template_kwargs": {}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       n=1, stream_options=None, user="u", extra_body=vllm_extras)
    assert r.choices[0].finish_reason is not None
    completion_extras = {k: v for k, v in vllm_extras.items()
                         if k not in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")}
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2, echo=False, best_of=1, suffix=None,
                                  extra_body={**completion_extras, "add_special_tokens": True})
    assert r.choices[0].finish_reason is not None
