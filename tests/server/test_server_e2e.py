"""The real thing: `python -m jaxserve serve` (embedded SmolLM2, CPU) in a subprocess on a loopback port,
driven by the openai SDK. One server for the module; the SIGTERM drain test runs last and stops it."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from support.api_errors import api_error
from support.fault_injection_server import FAULT   # the server runs through it: requests holding FAULT fail
from support.server_process import MAX_MODEL_LEN, smol_server
from support.servers import smol

KEY = "e2e-key"


SERVER = smol("--api-key", KEY, "--drain-timeout", "60")


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f"jaxserve:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_greedy_stream_equals_non_stream(client):
    full = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    assert text.strip() and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 5
    chunks = list(client.chat.completions.create(model="smol", messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_forms_and_echo(client, http):
    r = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=8, temperature=0)
    text = r.choices[0].text
    ids = http.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    assert client.completions.create(model="smol", prompt=ids, max_tokens=8, temperature=0).choices[0].text == text
    s = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=8, temperature=0,
                                  stream=True, echo=True)
    assert "".join(c.choices[0].text for c in s) == "The capital of France is" + text
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"].endswith("The capital of France is")


def test_seeded_sampling_is_reproducible_and_n_differs(client):
    kw = dict(model="smol", prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.95, seed=1234)
    a = client.completions.create(n=2, **kw)
    b = client.completions.create(n=2, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # seed + i per choice


def test_stop_strings_and_extras(client):
    base = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    r = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(stop)]
    r = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == text[:text.index(stop) + len(stop)]
    r = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=6, temperature=0,
                                  extra_body={"min_tokens": 6, "ignore_eos": True, "top_k": 1,
                                              "repetition_penalty": 1.0})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"


def test_logprobs(client):
    r = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and all(x <= 0 for x in tops)
        assert t.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy picks the most likely token
    c = client.completions.create(model="smol", prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.top_logprobs[0]) == 2


def test_echo_logprobs_scores_the_prompt(client):
    """lm-eval's loglikelihood request: echo + logprobs + max_tokens=0 returns the prompt's token logprobs."""
    prompt = "The capital of France is Paris"
    r = client.completions.create(model="smol", prompt=prompt, echo=True, logprobs=2, max_tokens=0, temperature=0)
    c = r.choices[0]
    assert c.text == prompt and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert "".join(lp.tokens) == prompt and lp.token_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and len(lp.top_logprobs[1]) >= 2
    # " Paris" after "The capital of France is" is the model's own top choice
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
    # with a completion: the prompt part is the same, then the generated tokens follow
    r2 = client.completions.create(model="smol", prompt=prompt, echo=True, logprobs=2, max_tokens=3, temperature=0)
    lp2 = r2.choices[0].logprobs
    n = len(lp.tokens)
    assert lp2.token_logprobs[:n] == lp.token_logprobs and len(lp2.tokens) == n + 3
    assert r2.choices[0].text.startswith(prompt)


def test_prompt_logprobs_of_a_long_prompt_through_the_scheduler(client):
    """prompt_logprobs (vLLM's extra) of a prompt longer than the step budget (64): scored chunk by chunk as
    it prefills, the same numbers echo + logprobs gives, every position present."""
    prompt = " ".join(f"item{i}" for i in range(40))
    r = client.completions.create(model="smol", prompt=prompt, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    c = r.choices[0].model_dump()
    ids, plp = c["prompt_token_ids"], c["prompt_logprobs"]
    assert len(plp) == len(ids) > 64 and plp[0] is None
    assert all(str(t) in pos and pos[str(t)]["logprob"] <= 0 for t, pos in zip(ids[1:], plp[1:]))
    echo = client.completions.create(model="smol", prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    scored = echo.choices[0].logprobs.token_logprobs
    assert scored[0] is None and len(scored) == len(ids)
    assert scored[1:] == pytest.approx([pos[str(t)]["logprob"] for t, pos in zip(ids[1:], plp[1:])], abs=1e-4)


def test_errors(client, http, server):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="smol", prompt="hi " * 500, max_tokens=100)
    assert str(MAX_MODEL_LEN) in ei.value.body["message"] and "100" in ei.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "temperature": "warm"})
    assert api_error(r, 400)["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="smol", input="x")
    # an engine failure on a stream: before the 200 (within the header wait) it is an HTTP 500 with an
    # OpenAI body, after it an error event then [DONE] (the fake-engine tests pin both cases down)
    with http.stream("POST", "/v1/completions", json={"prompt": f"{FAULT} go", "max_tokens": 20,
                                                      "stream": True}) as resp:
        if resp.status_code == 200:
            events = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]" and "injected engine fault" in events[-2]
        else:
            resp.read()
            assert "injected engine fault" in api_error(resp, 500)["message"]
    r = http.post("/v1/completions", json={"prompt": f"{FAULT} go", "max_tokens": 5})
    assert api_error(r, 500)["message"]
    assert client.completions.create(model="smol", prompt="ok", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.slow  # ~20 s on 2 cores; the fake-engine suite runs 64 streams in the default run
def test_64_concurrent_streams(server, client):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(4)]
    refs = [client.completions.create(model="smol", prompt=p, max_tokens=10, temperature=0).choices[0].text
            for p in prompts]

    async def one(ac, i):
        s = await ac.completions.create(model="smol", prompt=prompts[i % 4], max_tokens=10, temperature=0,
                                        stream=True)
        return "".join([c.choices[0].text async for c in s])

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(64)))
    texts = asyncio.run(main())
    assert texts == [refs[i % 4] for i in range(64)]


def test_cancelling_long_requests_frees_everything(server, http):
    """Three streams (the SDK closes them) and one non-streamed request (the socket closes) leave early."""
    body = json.dumps({"prompt": "Write a long story", "max_tokens": 400, "ignore_eos": True}).encode()
    raw = socket.create_connection(("127.0.0.1", server.port))
    raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s" % (KEY.encode(), len(body), body))

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300) as ac:
            streams = [await ac.completions.create(model="smol", prompt=f"Write a long story {i}", max_tokens=400,
                                                   stream=True, extra_body={"ignore_eos": True}) for i in range(3)]
            for s in streams:
                async for _ in s:
                    break
            assert metric(http, 'num_requests_running') + metric(http, 'num_requests_waiting') == 4
            assert metric(http, 'kv_cache_usage_perc') > 0
            for s in streams:
                await s.close()
            raw.close()
    asyncio.run(main())
    deadline = time.monotonic() + 30
    while True:
        values = [metric(http, n) for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        if values == [0, 0, 0]:
            break
        assert time.monotonic() < deadline, f"still held after cancel: {values}"
        time.sleep(0.1)
    assert 'finished_reason="abort"' in http.get("/metrics").text
    # the engine loop's own counters: steps ran, and its time inside them covers its waits for the device
    steps, step_ms = metric(http, "engine_steps_total"), metric(http, "engine_step_ms_total")
    assert steps > 0 and step_ms >= metric(http, "engine_device_wait_ms_total") > 0
    assert metric(http, "engine_padded_tokens_total") >= metric(http, "engine_tokens_total") > 0


def test_models_health_version(http):
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["smol"]
    assert http.get("/v1/models").json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(http.base_url.join("/health")).status_code == 200  # no key needed
    assert http.get("/version").json()["version"]


@pytest.mark.slow     # a second server (~45 s); the engine tests cover multi-step decoding
def test_multi_step_server_streams_the_same_text(client):
    """A second server with --num-scheduler-steps 4 (the engine's multi-step decode behind the async front):
    streamed chat, stop strings, seeded sampling and concurrent streams give what the default server gives."""
    srv = smol_server("--num-scheduler-steps", "4")
    try:
        multi = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        ref = client.chat.completions.create(model="smol", messages=CHAT, max_tokens=24, temperature=0)
        chunks = list(multi.chat.completions.create(model="smol", messages=CHAT, max_tokens=24, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == ref.usage.completion_tokens
        assert "Paris" in ref.choices[0].message.content

        kw = dict(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        text = client.completions.create(**kw).choices[0].text
        assert multi.completions.create(**kw).choices[0].text == text
        stop = text[5:7]
        a = multi.completions.create(**kw, stop=[stop]).choices[0]
        assert a.finish_reason == "stop" and a.text == text[:text.index(stop)]

        kw = dict(model="smol", prompt="Once upon a time", max_tokens=16, temperature=1.0, top_p=0.95, seed=99)
        assert multi.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text

        kw = dict(model="smol", prompt="The capital of France is", max_tokens=9, temperature=0, logprobs=2)
        a, b = multi.completions.create(**kw).choices[0].logprobs, client.completions.create(**kw).choices[0].logprobs
        assert a.tokens == b.tokens and len(a.token_logprobs) == 9
        assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-4)
        assert [sorted(t) for t in a.top_logprobs] == [sorted(t) for t in b.top_logprobs]

        async def streams(base_url, key):
            c = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=300)

            async def one(i):
                s = await c.completions.create(model="smol", prompt=f"Item {i}:", max_tokens=10 + i, temperature=0,
                                               stream=True)
                return "".join([ch.choices[0].text async for ch in s])
            return await asyncio.gather(*(one(i) for i in range(6)))
        assert asyncio.run(streams(srv.url + "/v1", "none")) == asyncio.run(streams(str(client.base_url), KEY))
    finally:
        assert srv.stop() == 0, srv.tail()


def test_zz_sigterm_drains_in_flight_then_exits_0(server, client):
    """Runs last: SIGTERM while a stream is in flight; it completes, new connections fail, exit code 0."""
    result = {}

    def consume():
        s = client.completions.create(model="smol", prompt="Tell me about the sea", max_tokens=40, stream=True,
                                      extra_body={"ignore_eos": True})
        chunks = list(s)
        result["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        result["n"] = sum(1 for c in chunks if c.choices)

    t = threading.Thread(target=consume)
    t.start()
    deadline = time.monotonic() + 60
    while metric(httpx.Client(base_url=server.url), "num_requests_running") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert result.get("finish") == "length", result
    assert server.proc.wait(60) == 0, server.tail()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)
