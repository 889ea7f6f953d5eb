"""The server with n-gram speculation (embedded SmolLM2, CPU) through the openai SDK: a stream's multi-token
deltas join to the non-streamed text, stop strings and seeded sampling hold, and /metrics counts drafts.
(Slow: a server of its own, and its speculative step variants compiled; the metrics' names and labels are
also checked on the scripted engine, test_server_app.)"""
from __future__ import annotations

import json

import httpx
import pytest

from support.servers import smol

pytestmark = pytest.mark.slow

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SERVER = smol("--speculative-config", json.dumps(SPEC))

PASSAGE = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
           "Repeat the sentence above exactly:")


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("jaxserve:spec_decode") or line.startswith("vllm:spec_decode"):
            name, value = line.rsplit(" ", 1)
            out[name.split(":", 1)[1]] = float(value)
    return out


def test_streamed_text_equals_the_whole_and_drafts_are_counted(server, client):
    kw = dict(model="smol", prompt=PASSAGE, max_tokens=40, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert "quick brown fox" in whole.text
    m = _metrics(server.url)
    drafts = next(v for k, v in m.items() if k.startswith("spec_decode_num_drafts"))
    accepted = next(v for k, v in m.items() if k.startswith("spec_decode_num_accepted_tokens_total{"))
    assert drafts > 0 and accepted > 0
    assert any(k.startswith("spec_decode_num_accepted_tokens_per_pos") and 'position="0"' in k for k in m)


def test_stop_strings_and_seeded_sampling(client):
    kw = dict(model="smol", prompt=PASSAGE, max_tokens=30, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    stop = text[10:14]
    a = client.completions.create(**kw, stop=[stop]).choices[0]
    assert a.finish_reason == "stop" and a.text == text[:text.index(stop)]
    kw = dict(model="smol", prompt=PASSAGE, max_tokens=20, temperature=1.0, top_p=0.95, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_stream_equals_non_stream(client, stream):
    msgs = [{"role": "user", "content": "Copy this list: apples, pears, plums, apples, pears, plums."}]
    ref = client.chat.completions.create(model="smol", messages=msgs, max_tokens=32, temperature=0)
    if not stream:
        assert ref.choices[0].message.content
        return
    chunks = list(client.chat.completions.create(model="smol", messages=msgs, max_tokens=32, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == ref.usage.completion_tokens
