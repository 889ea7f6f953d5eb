"""A scripted OpenAI-ish SSE completions server for the benchmark load generator's tests (tests/bench/conftest.py
serves it on a loopback port as the ``scripted_server`` fixture)."""
from __future__ import annotations

import asyncio
import json


class ScriptedServer:
    """A raw-ASGI OpenAI-ish server: each completion streams `max_tokens` one-token chunks `gap` s apart
    and a usage chunk; records the peak number of requests in flight. Prompts of [13] get HTTP 400."""

    def __init__(self, gap: float):
        self.gap, self.in_flight, self.peak, self.bodies = gap, 0, 0, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["path"] == "/v1/models":
            await self._send(send, 200, json.dumps({"data": [{"id": "scripted"}]}).encode())
            return
        if scope["path"] != "/v1/completions":
            await self._send(send, 404, b'{"error": {"message": "not found"}}')
            return
        req = json.loads(body)
        self.bodies.append(req)
        if req["prompt"] == [13]:
            await self._send(send, 400, b'{"error": {"message": "bad prompt"}}')
            return
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(req["max_tokens"]):
            await asyncio.sleep(self.gap)
            chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True})
        usage = {"choices": [], "usage": {"prompt_tokens": len(req["prompt"]), "completion_tokens": req["max_tokens"]}}
        self.in_flight -= 1
        await send({"type": "http.response.body", "body": f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()})

    @staticmethod
    async def _send(send, status, body):
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})
