"""Routes vLLM users probe beyond the chat/completions pair: OpenAI's retrieve-model and vLLM's
/tokenizer_info (behind --enable-tokenizer-info-endpoint, as in vLLM), on the scripted engine."""
from __future__ import annotations

import httpx
import openai
import pytest

from support.api_errors import api_error
from support.server_fakes import CHATML, FakeEngine, InProcessServer
from support.servers import scripted


SERVER = scripted(served_model_name=["org/model-a", "b"], enable_tokenizer_info_endpoint=True)


def test_retrieve_model(client, http):
    for name in ("org/model-a", "b"):       # a served name may hold a slash
        m = client.models.retrieve(name)
        assert (m.id, m.object, m.owned_by) == (name, "model", "jaxserve") and m.created > 0
        assert http.get(f"/v1/models/{name}").json()["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError) as ei:
        client.models.retrieve("gpt-9")
    assert ei.value.body["code"] == "model_not_found" and "gpt-9" in ei.value.body["message"]
    api_error(http.get("/v1/models/gpt-9"), 404)


def test_tokenizer_info(http, server):
    info = http.get("/tokenizer_info").json()
    tok = server.engine.tokenizer
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["eos_token"] == "<|endoftext|>" and info["chat_template"] == CHATML
    assert not {"vocab_file", "merges_file", "tokenizer_file", "tokenizer_object"} & set(info)


def test_tokenizer_info_is_off_by_default():
    srv = InProcessServer(FakeEngine())
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            assert http.get("/tokenizer_info").status_code == 404
    finally:
        srv.stop()
