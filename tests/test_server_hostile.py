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


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


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
