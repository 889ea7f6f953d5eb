"""Async load generator: streamed `/v1/completions` over httpx, Poisson/gamma arrivals, a concurrency cap. Timing
follows vLLM's `bench serve` (TTFT: the first chunk with text; ITL: gaps between later ones; output tokens: the usage
chunk's, else the text chunks). A stream whose tokens all decode to no text (random weights beyond the serving
tokenizer's vocabulary) completes by its usage count, TTFT untimed (None); vLLM's bench counts it failed."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np

from .metrics import RequestTiming
from .workloads import RequestSpec, arrival_delays


async def stream_completion(client: httpx.AsyncClient, base_url: str, model: str, req: RequestSpec,
                            ignore_eos: bool, extra: dict | None = None) -> RequestTiming:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos,
            **(extra or {})}
    if "messages" in body:          # a chat request (images): the same stream, chat's route and deltas
        del body["prompt"]
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    rt = RequestTiming(prompt_tokens=req.prompt_len)
    rt.start = last = time.perf_counter()
    chunks, usage = 0, None
    try:
        async with client.stream("POST", f"{base_url}{route}", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rt.error = f"HTTP {resp.status_code}: {text[:300]}"
                return rt
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    rt.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    return rt
                if event.get("usage"):
                    usage = event["usage"]
                choices = event.get("choices") or []
                # (a chat stream's first chunk carries the role only: not a token)
                if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
                                or ("delta" not in choices[0] and choices[0].get("finish_reason") is None)):
                    now = time.perf_counter()
                    if chunks == 0:
                        rt.ttft = now - rt.start
                    else:
                        rt.itl.append(now - last)
                    last = now
                    chunks += 1
        rt.e2e = time.perf_counter() - rt.start
        usage = usage or {}               # no usage chunk: the text chunks are the tokens
        rt.output_tokens = int(usage.get("completion_tokens", chunks))
        rt.prompt_tokens = int(usage.get("prompt_tokens", rt.prompt_tokens))
        rt.success = chunks > 0 or rt.output_tokens > 0
        if chunks == 0:
            rt.ttft = None
            if not rt.success:
                rt.error = "stream ended without any output"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        rt.error = f"{type(e).__name__}: {e}"[:300]
    return rt


async def run_load(base_url: str, requests: list[RequestSpec], *, request_rate: float = float("inf"),
                   burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                   ignore_eos: bool = True, api_key: str | None = None, timeout_s: float = 600.0,
                   model: str | None = None, progress: bool = True, desc: str = "requests"
                   ) -> tuple[list[RequestTiming], float]:
    """Send every request (arrival gaps drawn from gamma(burstiness) at `request_rate`, at most
    `max_concurrency` in flight); returns (per-request timings in send order, wall duration in s)."""
    from tqdm.auto import tqdm
    delays = arrival_delays(np.random.default_rng(seed), len(requests), request_rate, burstiness)
    limit = max_concurrency or len(requests) or 1
    sem = asyncio.Semaphore(limit)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    bar = tqdm(total=len(requests), desc=desc, disable=not progress, dynamic_ncols=True)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits,
                                 headers=headers) as client:
        if model is None:
            (r := await client.get(f"{base_url}/v1/models")).raise_for_status()
            model = r.json()["data"][0]["id"]

        async def one(req: RequestSpec) -> RequestTiming:
            async with sem:
                r = await stream_completion(client, base_url, model, req, ignore_eos, req.extra)
            bar.update(1)
            return r

        t0 = time.perf_counter()
        tasks = []
        for req, delay in zip(requests, delays):
            if delay > 0:
                await asyncio.sleep(float(delay))
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration
