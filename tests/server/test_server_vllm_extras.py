"""vLLM's request extras over HTTP with the openai SDK (extra_body), on the scripted engine:
prompt_logprobs, return_token_ids, return_tokens_as_token_ids."""
from __future__ import annotations

import httpx
import openai
import pytest

from support.server_fakes import fake_prompt_logprobs
from support.servers import scripted

MODEL = "fake-model"
CHAT = [{"role": "user", "content": "hi"}]


SERVER = scripted()


def tokens(server, **body) -> list[int]:
    return httpx.post(server.url + "/tokenize", json=body).json()["tokens"]


def expected_prompt_logprobs(ids: list[int]) -> list:
    return [None if p is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in p.items()} for p in fake_prompt_logprobs(ids)]


def test_completions_prompt_logprobs_and_token_ids(client, server):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=3,
                                  extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    choice = r.choices[0].model_dump()
    ids = tokens(server, prompt="abc")
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == r.usage.completion_tokens == 3
    assert choice["prompt_logprobs"] == expected_prompt_logprobs(ids)
    assert server.engine.params_seen[r.id + "-0"].prompt_logprobs == 1
    plain = client.completions.create(model=MODEL, prompt="abc", max_tokens=3).choices[0].model_dump()
    assert plain["prompt_logprobs"] is None and plain["token_ids"] is None and plain["prompt_token_ids"] is None


def test_chat_prompt_logprobs_and_token_ids(client, server):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                       extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    body = r.model_dump()
    ids = tokens(server, messages=CHAT)
    assert body["prompt_token_ids"] == ids and body["prompt_logprobs"] == expected_prompt_logprobs(ids)
    assert len(body["choices"][0]["token_ids"]) == 2


def test_streamed_token_ids(client, server):
    full = client.completions.create(model=MODEL, prompt="xyz", max_tokens=4, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0].model_dump()
    chunks = [c.choices[0].model_dump() for c in client.completions.create(
        model=MODEL, prompt="xyz", max_tokens=4, temperature=0, stream=True, extra_body={"return_token_ids": True})]
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == full["token_ids"]
    chat = [c.model_dump() for c in client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=3, stream=True, extra_body={"return_token_ids": True})]
    assert chat[0]["prompt_token_ids"] == tokens(server, messages=CHAT)
    assert sum(len(c["choices"][0]["token_ids"] or []) for c in chat if c["choices"]) == 3


def test_tokens_as_token_ids_in_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=2, logprobs=2,
                                  extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert all(t.startswith("token_id:") and t[len("token_id:"):].isdigit() for t in lp.tokens)
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logprobs=True, top_logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": True})
    content = c.choices[0].logprobs.content
    assert all(t.token.startswith("token_id:") and t.bytes == list(t.token.encode()) for t in content)


def test_prompt_logprobs_refused_streamed_or_above_max(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="a", stream=True, extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"prompt_logprobs": 21})
    assert e.value.body["param"] == "prompt_logprobs" and "20" in e.value.body["message"]
