"""Hostile and careless clients against the in-process server on the scripted engine
(test_server_fakes): inputs that must be a 4xx in OpenAI's error shape, never a 500 or a stall, and the
HTTP details (methods, headers) that proxies, browsers and scrapers depend on."""
from __future__ import annotations

import logging

import httpx
import pytest

from test_server_fakes import FakeEngine, InProcessServer

MODEL = "fake-model"


@pytest.fixture(scope="module")
def server():
    srv = InProcessServer(FakeEngine())
    yield srv
    srv.stop()


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


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
            e = _error(http.post(path, content=body, headers={"content-type": "application/json"}), 400)
        assert "nested too deeply" in e["message"] and len(e["message"]) < 600, e
        records = [r for r in caplog.records if r.name == "jaxserve.server"]
        assert len(records) == 1 and records[0].exc_info is None, [r.getMessage() for r in records]
    assert http.post("/v1/completions", json={"prompt": "still fine", "max_tokens": 2}).status_code == 200


def test_top_k_below_minus_one_is_400(http, server):
    e = _error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "top_k": -2}), 400)
    assert e["param"] == "top_k" and "-2" in e["message"]
    for off in (-1, 0):   # vLLM's "no top-k filter"
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "top_k": off, "temperature": 1})
        assert r.status_code == 200, r.text
        assert server.engine.params_seen[r.json()["id"] + "-0"].top_k == 0


def test_unknown_model_name_is_not_echoed_unbounded(http):
    e = _error(http.post("/v1/completions", json={"model": "m" * 50_000, "prompt": "x"}), 404)
    assert e["code"] == "model_not_found" and len(e["message"]) < 300 and "50000 chars" in e["message"]
    e = _error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert "`gpt-9`" in e["message"]


def test_metrics_content_type_and_head(http):
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    r = http.head("/metrics")
    assert r.status_code == 200 and r.content == b""
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"


def test_unsupported_method_is_405_with_allow(http):
    e = _error(http.request("TRACE", "/v1/models"), 405)
    assert e["type"] == "invalid_request_error"
    r = http.request("TRACE", "/v1/models")
    assert "GET" in r.headers["allow"]
    assert "POST" in http.delete("/v1/completions").headers["allow"]


HEAVY_TEMPLATE = "{% for i in range(16000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}x"   # ~0.7 s of Jinja


def test_request_chat_template_refused_unless_trusted(http):
    msgs = [{"role": "user", "content": "x"}]
    e = _error(http.post("/v1/chat/completions", json={"messages": msgs, "chat_template": "{{ 'hi' }}"}), 400)
    assert e["param"] == "chat_template" and "--trust-request-chat-template" in e["message"]
    e = _error(http.post("/tokenize", json={"messages": msgs, "chat_template": "{{ 'hi' }}"}), 400)
    assert e["param"] == "chat_template"
    e = _error(http.post("/v1/chat/completions", json={"messages": msgs,
                                                       "chat_template_kwargs": {"chat_template": "{{ 'hi' }}"}}), 400)
    assert e["param"] == "chat_template"
    e = _error(http.post("/v1/chat/completions", json={"messages": msgs, "chat_template_kwargs": {"tokenize": True}}),
               400)
    assert e["param"] == "chat_template_kwargs" and "tokenize" in e["message"]


def test_trusted_request_template_renders_off_the_event_loop():
    import threading
    import time

    srv = InProcessServer(FakeEngine(), trust_request_chat_template=True)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
            tiny = "<|im_start|>{{ messages[0].content }}"
            r = http.post("/v1/chat/completions", json={**body, "chat_template": tiny})
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
