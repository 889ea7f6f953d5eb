"""``use_beam_search`` through the server with the openai SDK (server/beam_search.py): the scripted engine first
(n beams best first, the limits and the fields beam search refuses as 400s, a client leaving mid-search), then
the real SmolLM2 server in float32 against HF transformers' num_beams (tests/fixtures/beam_search_golden.json),
in completions and chat, whole and streamed, its beams served the prompt's blocks from the prefix cache."""
from __future__ import annotations

import json
import os
import re
import socket
import time

import httpx
import openai
import pytest

from support import FIXTURES
from support.api_errors import api_error
from support.server_fakes import FakeEngine
from support.servers import scripted, serving
from support.servers import smol as smol_spec

MODEL = "fake-model"
GOLDEN = os.path.join(FIXTURES, "beam_search_golden.json")


SERVER = scripted(FakeEngine)


# -- the scripted engine ------------------------------------------------------------------------------------

def test_completions_return_n_beams_best_first(client, server):
    """Each scripted step offers its sampled token at -0.5 and 'a', 'b', ... at -1, -2, ...: the best beam takes
    the sampled token every step, the others trade one of them for a worse one, and the choices come best first
    with every position's candidates (logprobs) and the beams' one-token step requests gone."""
    r = client.completions.create(model=MODEL, prompt="hello", n=3, max_tokens=4, logprobs=1,
                                  extra_body={"use_beam_search": True, "length_penalty": 1.0})
    assert [c.index for c in r.choices] == [0, 1, 2]
    sums = [sum(c.logprobs.token_logprobs) for c in r.choices]
    assert sums[0] == pytest.approx(-2.0) and sums == sorted(sums, reverse=True) and sums[1] < sums[0]
    assert len({c.text for c in r.choices}) == 3 and all(len(c.logprobs.tokens) == 4 for c in r.choices)
    assert all(c.finish_reason == "length" for c in r.choices)
    steps = [rid for rid in server.engine.params_seen if rid.startswith(r.id)]
    assert len(steps) == 1 + 3 * 3                            # the prompt, then 3 beams x 3 steps
    assert {server.engine.params_seen[rid].max_tokens for rid in steps} == {1}
    assert {server.engine.params_seen[rid].logprobs for rid in steps} == {6}   # 2 x the width
    assert not server.engine.running


def test_chat_beams_and_the_stream_say_the_same(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5,
              extra_body={"use_beam_search": True})
    whole = client.chat.completions.create(**kw)
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) == 2
    streamed = ["", ""]
    finish = [None, None]
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert streamed == texts and finish == ["length", "length"]


def test_echo_prepends_the_prompt_to_every_beam(client):
    kw = dict(model=MODEL, prompt="hello", n=2, max_tokens=3, extra_body={"use_beam_search": True})
    plain, echoed = client.completions.create(**kw), client.completions.create(echo=True, **kw)
    assert [c.text for c in echoed.choices] == ["hello" + c.text for c in plain.choices]


def test_a_prompt_batch_searches_each_prompt(client):
    r = client.completions.create(model=MODEL, prompt=["ab", "xyz"], n=2, max_tokens=3,
                                  extra_body={"use_beam_search": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    single = client.completions.create(model=MODEL, prompt="xyz", n=2, max_tokens=3,
                                       extra_body={"use_beam_search": True})
    assert [c.text for c in r.choices[2:]] == [c.text for c in single.choices]


@pytest.mark.parametrize("body, param, message", [
    ({"n": 0}, "n", "n"),
    ({"n": 11}, "n", "use_beam_search: n (the beam width) must be at most 10: each beam step asks for the top 2 x "
                     "beam_width logprobs and max_logprobs is 20; got 11"),
    ({"n": 10**9}, "n", "n"),
    ({"length_penalty": "long"}, "length_penalty", "length_penalty"),
    ({"length_penalty": [1]}, "length_penalty", "length_penalty"),
    ({"use_beam_search": "yes"}, "use_beam_search", "use_beam_search"),
    ({"stop": ["x"]}, "stop", "use_beam_search does not combine with stop"),
    ({"top_p": 0.5}, "top_p", "does not combine with top_p"),
    ({"repetition_penalty": 1.2}, "repetition_penalty", "does not combine with repetition_penalty"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs", "does not combine with structured_outputs"),
    ({"logprobs": 21}, "logprobs", "at most 20 logprobs"),
])
def test_hostile_beam_search_requests_are_400_naming_the_field(http, body, param, message):
    e = api_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "use_beam_search": True,
                                                     "n": 2, **body}), 400)
    assert re.split(r"[.\[]", e["param"] or "")[0] == param, e
    assert message in e["message"], e


@pytest.mark.parametrize("penalty", [1e308, -1e308, 0.0])
def test_extreme_length_penalties_still_answer(client, penalty):
    r = client.completions.create(model=MODEL, prompt="hi", n=2, max_tokens=3,
                                  extra_body={"use_beam_search": True, "length_penalty": penalty})
    assert len(r.choices) == 2


def test_chat_beam_search_refuses_a_constraining_tool_choice(http):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    e = api_error(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "use_beam_search": True, "tools": [tool],
        "tool_choice": "required"}), 400)
    assert e["param"] == "tool_choice" and "use_beam_search does not combine with tool_choice" in e["message"]


def test_a_client_leaving_mid_search_ends_it(server):
    """The scripted engine takes 50 ms a token with SLOW in the prompt: a 60-step search outlives the client,
    whose leaving aborts the step in flight and submits no further step."""
    eng = server.engine
    body = json.dumps({"prompt": "SLOW", "max_tokens": 60, "n": 2, "use_beam_search": True}).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.monotonic() + 10
    while sum(1 for rid in eng.params_seen if "-beam2." in rid) < 2:      # a few steps in
        assert time.monotonic() < deadline
        time.sleep(0.01)
    s.close()
    time.sleep(0.5)
    seen = len(eng.params_seen)
    time.sleep(0.5)
    assert len(eng.params_seen) == seen and not eng.running
    assert any("-beam" in rid for rid in eng.aborted)         # the step in flight when the client left


# -- the real SmolLM2 server against HF ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol():
    yield from serving(smol_spec("--dtype", "float32"))


@pytest.fixture(scope="module")
def smol_client(smol):
    return openai.OpenAI(base_url=smol.url + "/v1", api_key="none", max_retries=0, timeout=600)


def prefix_cache_hits(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(r"^[\w:]*prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))


def test_server_completions_match_hf_beams(smol_client, smol, golden):
    """Token-id prompts through /v1/completions: every choice the beam HF ranks at its place."""
    for case in golden["cases"]:
        if case["kind"] != "plain":
            continue
        r = smol_client.completions.create(
            model="smol", prompt=case["prompt_ids"], n=case["beam_width"], max_tokens=case["max_tokens"],
            extra_body={"use_beam_search": True, "length_penalty": case["length_penalty"],
                        "return_token_ids": True, "include_stop_str_in_output": True})
        assert [c.token_ids for c in r.choices] == [b["ids"] for b in case["beams"]], case["prompt"]
        assert r.choices[0].text == case["beams"][0]["text"]


def test_server_chat_matches_hf_beams_whole_and_streamed(smol_client, smol, golden):
    """A chat answer that ends in EOS: the beams HF ranks, whole and streamed; every step after the first found
    the prompt's full blocks in the prefix cache for each of its beams."""
    case = next(c for c in golden["cases"] if c["kind"] == "chat" and c["beams"][0]["ids"][-1] == golden["eos_token_id"])
    kw = dict(model="smol", messages=[{"role": "user", "content": case["prompt"]}], n=case["beam_width"],
              max_tokens=case["max_tokens"],
              extra_body={"use_beam_search": True, "length_penalty": case["length_penalty"], "return_token_ids": True})
    hits = prefix_cache_hits(smol.url)
    r = smol_client.chat.completions.create(**kw)
    num_steps = len(case["beams"][0]["ids"])             # at least: the best beam grew a token a step
    full_blocks = len(case["prompt_ids"]) // 16 * 16
    assert full_blocks >= 32
    # the engine's counters trail its outputs by at most a step
    assert prefix_cache_hits(smol.url) - hits >= (num_steps - 2) * case["beam_width"] * full_blocks
    assert [c.message.content for c in r.choices] == [b["text"] for b in case["beams"]]
    best = r.choices[0]
    assert best.finish_reason == "stop" and best.token_ids == case["beams"][0]["ids"][:-1]   # EOS left out
    streamed = [""] * case["beam_width"]
    for chunk in smol_client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [b["text"] for b in case["beams"]]
