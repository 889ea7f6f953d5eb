"""The OpenAI error envelope as the server tests check it (on the scripted engine and the real server alike)."""
from __future__ import annotations

import httpx


def api_error(resp: httpx.Response, status: int) -> dict:
    """The ``error`` object of a response that must answer ``status``: exactly OpenAI's four fields."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]
