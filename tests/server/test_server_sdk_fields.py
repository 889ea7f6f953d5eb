"""What current SDKs and gateways send, through the server with the openai SDK: the fields that cannot change
the output (accepted, ignored, each named once in a warning; a bad value still a 400), completions'
top_logprobs holding the chosen token, and /tokenize rendering tools and chat_template_kwargs. The scripted
engine first, then the real SmolLM2 server with the tool-aware template docs/chat_templates ships."""
from __future__ import annotations

import logging
import re

import openai
import pytest

from support.api_errors import api_error
from support.server_fakes import FakeEngine
from support.servers import scripted, smol

MODEL = "fake-model"
CHAT = [{"role": "user", "content": "hi"}]
# every field server/request_fields.IGNORED_FIELDS lists, as the openai SDK sends it
IGNORED = {"store": True, "metadata": {"team": "a"}, "service_tier": "auto", "user": "u-1",
           "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"ttl": "30m"},
           "safety_identifier": "s-1", "verbosity": "low", "prediction": {"type": "content", "content": "hello"}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# a ChatML template that reads a chat_template_kwargs variable and renders tools
KWARGS_TEMPLATE = ("{% if greeting is defined %}[{{ greeting }}]{% endif %}"
                   "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
                   "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


SERVER = scripted(lambda: FakeEngine(chat_template=KWARGS_TEMPLATE))


def ignored_warnings(records) -> list[str]:
    return [r.getMessage().split("`")[1] for r in records
            if r.name == "jaxserve.server" and r.levelno == logging.WARNING and "accepts and ignores" in r.getMessage()]


# -- ignorable fields -------------------------------------------------------------------------------------

def test_ignored_fields_change_nothing_and_are_named_once(client, server, caplog):
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    with caplog.at_level(logging.WARNING, logger="jaxserve.server"):
        for _ in range(2):
            r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, **IGNORED)
            assert r.choices[0].message.content == plain.choices[0].message.content
        completion_fields = {k: v for k, v in IGNORED.items() if k != "prediction"}    # a chat-only field
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=completion_fields)
    assert sorted(ignored_warnings(caplog.records)) == sorted(IGNORED)        # each once, whatever the route
    assert server.engine.params_seen[r.id + "-0"] == server.engine.params_seen[plain.id + "-0"]


@pytest.mark.parametrize("field, value", [
    ("store", "yes"), ("metadata", {"a": 1}), ("metadata", ["a"]), ("service_tier", 3), ("user", {"id": 1}),
    ("prompt_cache_key", 1), ("prompt_cache_options", "30m"), ("safety_identifier", []), ("verbosity", 2),
    ("prediction", {"type": "image", "content": "x"}), ("prediction", {"type": "content"}),
])
def test_ignored_fields_with_bad_values_are_400(http, field, value):
    e = api_error(http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, field: value}), 400)
    assert re.split(r"[.\[]", e["param"])[0] == field, e


def test_fields_that_would_change_the_output_stay_400(client):
    for field, value in (("moderation", {"model": "omni"}), ("web_search_options", {}), ("modalities", ["audio"])):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={field: value})
        assert e.value.body["param"] == field and "not implemented" in e.value.body["message"], e.value.body


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, server, http):
    """vLLM's truncate_prompt_tokens: the engine gets the prompt's last N tokens, usage counts them, echo shows
    them; -1 keeps up to max_model_len; 0, < -1 and more than max_model_len are 400s."""
    tok = server.engine.tokenizer
    text = "one two three four five six seven eight"
    ids = tok.encode(text)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=2, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert server.engine.prompts_seen[r.id + "-0"] == ids[-3:] and r.usage.prompt_tokens == 3
    assert r.choices[0].text.startswith(tok.decode(ids[-3:]))
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, extra_body={"truncate_prompt_tokens": -1})
    assert server.engine.prompts_seen[r.id + "-0"] == ids
    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                       extra_body={"truncate_prompt_tokens": 2})
    assert len(server.engine.prompts_seen[c.id + "-0"]) == 2 and c.usage.prompt_tokens == 2
    for bad in (0, -2, server.engine.max_model_len + 1):
        e = api_error(http.post("/v1/completions", json={"prompt": text, "max_tokens": 1,
                                                         "truncate_prompt_tokens": bad}), 400)
        assert e["param"] == "truncate_prompt_tokens", e


# -- logprobs ------------------------------------------------------------------------------------------------

def test_completions_top_logprobs_hold_the_chosen_token(client):
    """The scripted engine's chosen token is its most likely; logprobs=0 gives it alone (vLLM's rule)."""
    r = client.completions.create(model=MODEL, prompt="hey", max_tokens=3, logprobs=0)
    lp = r.choices[0].logprobs
    assert [list(d) for d in lp.top_logprobs] == [[t] for t in lp.tokens]
    assert [d[t] for d, t in zip(lp.top_logprobs, lp.tokens)] == lp.token_logprobs


# -- /tokenize -----------------------------------------------------------------------------------------------

def test_tokenize_renders_tools_and_template_kwargs(http, server):
    tok = server.engine.tokenizer
    body = {"messages": CHAT, "tools": [WEATHER_TOOL], "chat_template_kwargs": {"greeting": "hello"}}
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    assert tok.decode(r.json()["tokens"]).startswith("[hello]TOOLS:get_weather;<|im_start|>user")
    plain = http.post("/tokenize", json={"messages": CHAT}).json()
    assert plain["count"] < r.json()["count"]


@pytest.mark.parametrize("body, param", [
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "dict"}}}]},
     "tools[0].function.parameters"),
    ({"messages": CHAT, "tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].function.name"),
    ({"messages": CHAT, "tools": "get_weather"}, "tools"),
    ({"messages": CHAT, "tools": [{"function": {"name": 3}}]}, "tools"),
    ({"prompt": "x", "tools": [WEATHER_TOOL]}, "tools"),
    ({"messages": CHAT, "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ({"messages": CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
])
def test_tokenize_bad_tools_are_400(http, body, param):
    e = api_error(http.post("/tokenize", json=body), 400)
    assert e["param"].startswith(param), e


def test_the_docs_tool_template_is_the_embedded_one_without_tools():
    """docs/chat_templates/hermes_tool_use.jinja renders what the embedded SmolLM2's own template does when no
    tools are sent (docs/tool_calling.md says so)."""
    import os
    from jaxserve.models.tokenizers import embedded_tokenizer
    tok = embedded_tokenizer()
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "chat_templates", "hermes_tool_use.jinja")) as f:
        template = f.read()
    for messages in (CHAT, [{"role": "system", "content": "Be brief."}] + CHAT,
                     CHAT + [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]):
        for gen in (True, False):
            assert tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                           add_generation_prompt=gen) == \
                tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


# -- the real server (embedded SmolLM2 on CPU, the tool-aware template from docs/) ---------------------------

REAL_SERVER = smol("--chat-template", "docs/chat_templates/hermes_tool_use.jinja")


def test_real_ignored_fields_are_accepted_and_logged_once(real, real_client):
    for _ in range(2):
        r = real_client.chat.completions.create(model="smol", messages=CHAT, max_tokens=4, temperature=0, **IGNORED)
        assert r.choices[0].message.content
    log = real.tail(200_000)
    for name in IGNORED:
        assert log.count(f"a request sent `{name}`") == 1, name


def test_real_chosen_token_in_top_logprobs_at_temperature_2(real_client):
    """vLLM's rule for completions: top-k plus the chosen token, which at temperature 2 is often not the top one."""
    r = real_client.completions.create(model="smol", prompt="The weather today is", max_tokens=12, temperature=2,
                                       logprobs=1, seed=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 12
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == token_lp and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in lp.top_logprobs)     # some sampled token was not the most likely


def test_real_chat_top_logprobs_are_the_top_k(real_client):
    """OpenAI's chat shape: exactly top_logprobs alternatives, most likely first, whatever was sampled."""
    r = real_client.chat.completions.create(model="smol", messages=CHAT, max_tokens=8, temperature=2, seed=3,
                                            logprobs=True, top_logprobs=2)
    for t in r.choices[0].logprobs.content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 2 and tops == sorted(tops, reverse=True) and t.logprob <= tops[0] + 1e-6


def test_real_tokenize_with_tools_matches_the_chat_prompt(real, real_client, http):
    body = {"model": "smol", "messages": CHAT, "tools": [WEATHER_TOOL]}
    tokens = http.post(real.url + "/tokenize", json=body).json()
    assert tokens["count"] > http.post(real.url + "/tokenize", json={"messages": CHAT}).json()["count"]
    text = http.post(real.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert '<tools>\n{"name": "get_weather"' in text
    r = real_client.chat.completions.create(model="smol", messages=CHAT, tools=[WEATHER_TOOL], tool_choice="none",
                                            max_tokens=1)
    assert r.usage.prompt_tokens == tokens["count"]      # /tokenize counts what chat sends the model


def test_real_langchain_chat_openai_with_the_fields_it_sends(real):
    """LangChain's ChatOpenAI sends service_tier, store and verbosity as request fields when set."""
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    llm = langchain_openai.ChatOpenAI(base_url=real.url + "/v1", api_key="x", model="smol", max_tokens=8,
                                      temperature=0, max_retries=0, service_tier="auto", store=True,
                                      verbosity="low", model_kwargs={"user": "u", "safety_identifier": "s"})
    assert llm.invoke("Hi").content
    assert "".join(chunk.content for chunk in llm.stream("Hi"))


def test_real_priority_needs_the_priority_policy(real, http):
    """Under the default FCFS policy a nonzero priority is a 400 naming it (vLLM's rule); 0 is the default."""
    for path, base in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        err = api_error(http.post(real.url + path, json={"model": "smol", "max_tokens": 2, "priority": 1, **base}), 400)
        assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"], err
        ok = http.post(real.url + path, json={"model": "smol", "max_tokens": 2, "priority": 0, **base})
        assert ok.status_code == 200
