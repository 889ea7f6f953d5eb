"""vLLM's request fields that change the output, through the server with the openai SDK: logit_bias (OpenAI's),
allowed_token_ids, bad_words, chat's add_special_tokens / echo / documents, and request ids (X-Request-Id,
request_id). The scripted engine checks what reaches the engine and every 400; the real SmolLM2 server checks
that each field changes the output as vLLM's does."""
from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from support.api_errors import api_error
from support.server_fakes import CHATML, FakeEngine, InProcessServer, byte_tokenizer
from support.servers import scripted, smol

MODEL = "fake-model"
CHAT = [{"role": "user", "content": "hi"}]
# ChatML that lists the documents a RAG request sends before the messages
DOCS_TEMPLATE = "{% for d in documents or [] %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}" + CHATML


def bos_tokenizer():
    """The byte tokenizer with a BOS (<|endoftext|>) its encode adds when asked for special tokens."""
    from tokenizers.processors import TemplateProcessing
    tok = byte_tokenizer()
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok._tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                                       special_tokens=[("<|endoftext|>", bos)])
    return tok


SERVER = scripted(lambda: FakeEngine(tokenizer=bos_tokenizer(), chat_template=DOCS_TEMPLATE))


def seen(server, response_id: str):
    """The SamplingParams and prompt ids the engine got for a response's (only) choice."""
    rid = next(r for r in server.engine.params_seen if r.startswith(response_id + "-"))
    return server.engine.params_seen[rid], server.engine.prompts_seen[rid]


# -- logit_bias, allowed_token_ids, bad_words reach the engine; bad values are 400s naming them -------------

def test_token_restrictions_reach_sampling_params(client, server):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logit_bias={"104": 5, "7": -100},
                                       extra_body={"allowed_token_ids": [104, 105, 7], "bad_words": ["foo bar"]})
    params, _ = seen(server, r.id)
    assert params.logit_bias == {104: 5.0, 7: -100.0} and params.allowed_token_ids == [104, 105, 7]
    assert params.bad_words == ["foo bar"]
    c = client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"0": 100})
    assert seen(server, c.id)[0].logit_bias == {0: 100.0}
    plain = client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    params, _ = seen(server, plain.id)
    assert params.logit_bias is None and params.allowed_token_ids is None and params.bad_words is None


@pytest.mark.parametrize("body, param, message", [
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300 tokens, got 301"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias keys must be token ids (integers >= 0), got 'abc'"),
    ({"logit_bias": {"-4": 1}}, "logit_bias", "got '-4'"),
    ({"logit_bias": {"17": 150}}, "logit_bias", "logit_bias values must be numbers in [-100, 100], got 150.0 "
                                                "for token 17"),
    ({"logit_bias": {"17": "x"}}, "logit_bias", "Expected `float`"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "length >= 1"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids", ">= 0"),
    ({"bad_words": ["ok", "  "]}, "bad_words", "bad_words[1]"),
])
def test_bad_token_restrictions_are_400_naming_them(http, body, param, message):
    for path, base in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "x"})):
        e = api_error(http.post(path, json={**base, "max_tokens": 1, **body}), 400)
        assert e["param"].startswith(param) and message in e["message"], e


# -- chat's add_special_tokens, documents, echo -----------------------------------------------------------

def test_chat_add_special_tokens_and_documents_reach_the_prompt(client, server, http):
    tok = server.engine.tokenizer
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    _, ids = seen(server, r.id)
    assert bos not in ids                                              # vLLM's default for chat: none added
    with_bos = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                              extra_body={"add_special_tokens": True})
    assert seen(server, with_bos.id)[1] == [bos] + ids                 # on top of what the template wrote
    docs = [{"title": "Paris", "text": "capital of France"}]
    rag = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={"documents": docs})
    assert tok.decode(seen(server, rag.id)[1]).startswith("[doc Paris: capital of France]<|im_start|>user")
    assert api_error(http.post("/v1/chat/completions", json={"messages": CHAT, "documents": "x"}), 400)["param"] \
        == "documents"


def test_chat_echo_starts_the_reply_with_the_last_assistant_message(client):
    prefix = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    plain = client.chat.completions.create(model=MODEL, messages=prefix, max_tokens=4, temperature=0,
                                           extra_body={"add_generation_prompt": False,
                                                       "continue_final_message": True})
    echoed = client.chat.completions.create(model=MODEL, messages=prefix, max_tokens=4, temperature=0,
                                            extra_body={"add_generation_prompt": False,
                                                        "continue_final_message": True, "echo": True})
    assert echoed.choices[0].message.content == "The answer is" + plain.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=prefix, max_tokens=4, temperature=0,
                                                 stream=True, extra_body={"add_generation_prompt": False,
                                                                          "continue_final_message": True,
                                                                          "echo": True}))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices]
    assert deltas[1] == "The answer is" and "".join(d or "" for d in deltas) == echoed.choices[0].message.content
    # the last message is the user's, not the reply's role (assistant): nothing to echo (vLLM's rule)
    user_last = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                               extra_body={"echo": True})
    assert not user_last.choices[0].message.content.startswith("hi")
    # without a generation prompt the reply continues the last message whatever its role: echoed
    cont = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                          extra_body={"echo": True, "add_generation_prompt": False})
    assert cont.choices[0].message.content.startswith("hi")


# -- request ids ------------------------------------------------------------------------------------------

def test_request_ids_name_the_response_as_vllm(client, http):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                       extra_headers={"X-Request-Id": "trace-42"})
    assert r.id == "chatcmpl-trace-42"
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"request_id": "mine"})
    assert r.id == "cmpl-mine"
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"request_id": "mine"},
                                  extra_headers={"X-Request-Id": "hdr"})
    assert r.id == "cmpl-hdr"                                          # the header wins, as in vLLM
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, stream=True,
                                                 extra_body={"request_id": "s-1"}))
    assert {c.id for c in chunks} == {"chatcmpl-s-1"}
    assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).id.startswith("chatcmpl-")
    # a client's id need not be unique: the same id at once runs both (the engine's ids stay distinct)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        ids = list(pool.map(lambda _: client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4, extra_headers={"X-Request-Id": "dup"}).id, range(4)))
    assert ids == ["chatcmpl-dup"] * 4
    assert "x-request-id" not in http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).headers
    e = api_error(http.post("/v1/completions", json={"prompt": "x", "request_id": "r" * 513}), 400)
    assert e["param"] == "request_id"


def test_request_id_headers_echo_the_request_id():
    srv = InProcessServer(FakeEngine(), enable_request_id_headers=True)
    try:
        with httpx.Client(base_url=srv.url) as http:
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "abc"})
            assert r.headers["x-request-id"] == "abc" and r.json()["id"] == "cmpl-abc"
            generated = http.get("/health").headers["x-request-id"]
            assert len(generated) == 32 and int(generated, 16) >= 0
            with http.stream("POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "stream": True},
                             headers={"X-Request-Id": "s"}) as s:
                assert s.headers["x-request-id"] == "s" and "chatcmpl-s" in s.read().decode()
    finally:
        srv.stop()


# -- the real server (embedded SmolLM2 on CPU): each field changes the output as vLLM's does -------------------

REAL_SERVER = smol()


def token_ids(real, text: str) -> list[int]:
    return httpx.post(real.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


PROMPT = "The capital of France is"


def completion_ids(real_client, extra_body=None, **kw) -> list[int]:
    r = real_client.completions.create(model="smol", prompt=PROMPT, **{"max_tokens": 8, "temperature": 0, **kw},
                                       extra_body={"return_token_ids": True, **(extra_body or {})})
    return r.choices[0].model_dump()["token_ids"]


def test_real_logit_bias_forces_and_bans_tokens(real, real_client):
    target = token_ids(real, " Berlin")
    assert len(target) == 1
    assert completion_ids(real_client, logit_bias={str(target[0]): 100}) == target * 8
    plain = completion_ids(real_client)
    banned = completion_ids(real_client, logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    chat = real_client.chat.completions.create(model="smol", messages=CHAT, max_tokens=4, temperature=0,
                                               logit_bias={str(target[0]): 100})
    assert chat.choices[0].message.content == " Berlin" * 4
    with pytest.raises(openai.BadRequestError) as e:
        real_client.completions.create(model="smol", prompt=PROMPT, max_tokens=2, logit_bias={"49152": 1})
    assert e.value.body["param"] == "logit_bias" and "outside the vocabulary (size 49152)" in e.value.body["message"]


def test_real_allowed_token_ids_restrict_the_output(real, real_client):
    allowed = token_ids(real, " yes no maybe")
    for temperature in (0, 1.5):
        ids = completion_ids(real_client, temperature=temperature, seed=1, extra_body={"allowed_token_ids": allowed})
        assert ids and set(ids) <= set(allowed)
    with pytest.raises(openai.BadRequestError) as e:
        completion_ids(real_client, extra_body={"allowed_token_ids": [1, 10 ** 6]})
    assert e.value.body["param"] == "allowed_token_ids"


def test_real_bad_words_are_never_generated(real, real_client):
    """Greedy writes " Paris": with bad_words ["Paris"] neither "Paris" nor " Paris" (vLLM's two spellings)
    appears; a two-token word's last token is blocked only after its first."""
    plain = completion_ids(real_client)
    paris = token_ids(real, " Paris")
    assert plain[:len(paris)] == paris
    ids = completion_ids(real_client, extra_body={"bad_words": ["Paris"]})
    for word in (token_ids(real, "Paris"), paris):
        assert all(ids[i:i + len(word)] != word for i in range(len(ids)))
    two = plain[:2]                                   # the first two tokens greedy writes (" Paris", "."), a word
    word = httpx.post(real.url + "/detokenize", json={"tokens": two}).json()["prompt"]
    assert token_ids(real, " " + word.lstrip()) == two
    ids = completion_ids(real_client, extra_body={"bad_words": [word]})
    assert ids[0] == two[0] and ids[1] != two[1]


def test_real_chat_echo_and_request_id(real_client):
    prefix = [*CHAT, {"role": "assistant", "content": "Hello! The capital of France is"}]
    r = real_client.chat.completions.create(model="smol", messages=prefix, max_tokens=4, temperature=0,
                                            extra_headers={"X-Request-Id": "real-1"},
                                            extra_body={"echo": True, "add_generation_prompt": False,
                                                        "continue_final_message": True})
    assert r.id == "chatcmpl-real-1"
    assert r.choices[0].message.content.startswith("Hello! The capital of France is") and \
        len(r.choices[0].message.content) > len(prefix[-1]["content"])
