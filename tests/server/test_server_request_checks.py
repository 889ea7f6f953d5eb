"""The request checks on the scripted engine (support/server_fakes.py): seeds, tool names and tool
limits, message shapes, stop strings with lone surrogates, the prompt's logprobs sent once with n > 1, and a
constraint that fails in the engine (finish_reason "error", or a 400 before any token)."""
from __future__ import annotations

import json

import pytest

from support.api_errors import api_error
from support.servers import scripted


SERVER = scripted()


def chat(http, messages=None, **kw):
    return http.post("/v1/chat/completions", json={"messages": messages or [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 2, **kw})


def tool(name="get_weather", **parameters):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", **parameters}}}


# ---------------------------------------------------------------------------------------------- seeds
@pytest.mark.parametrize("seed, n, message", [
    (2**64, 1, "seed must be an integer in [0, 2^64)"),
    (-5, 1, "seed must be an integer in [0, 2^64)"),
    (2**64 - 1, 2, "seed + n must be at most 2^64"),
])
def test_seeds_outside_the_range_are_400(http, seed, n, message):
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        e = api_error(http.post(path, json={**body, "max_tokens": 1, "seed": seed, "n": n, "temperature": 1}), 400)
        assert e["param"] == "seed" and message in e["message"], e


def test_the_largest_seeds_and_minus_one_run(http, server):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "seed": 2**64 - 2, "n": 2,
                                           "temperature": 1})
    assert r.status_code == 200, r.text
    assert [server.engine.params_seen[f"{r.json()['id']}-{i}"].seed for i in range(2)] == [2**64 - 2, 2**64 - 1]
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "seed": -1, "n": 2, "temperature": 1})
    assert [server.engine.params_seen[f"{r.json()['id']}-{i}"].seed for i in range(2)] == [None, None]   # no seed


# ---------------------------------------------------------------------------------------------- tools
@pytest.mark.parametrize("name", ["get weather", "get.weather", "x" * 65, "wetter_über"])
def test_tool_names_follow_openais_pattern(http, name):
    e = api_error(chat(http, tools=[tool(name)], tool_choice="none"), 400)
    assert e["param"] == "tools[0].function.name" and "^[a-zA-Z0-9_-]{1,64}$" in e["message"], e


def test_tool_count_and_parameter_count_limits(http):
    e = api_error(chat(http, tools=[tool(f"t{i}") for i in range(129)], tool_choice="none"), 400)
    assert e["param"] == "tools" and "max_tools=128" in e["message"] and "--structured-outputs-config" in e["message"]
    wide = tool("wide", properties={f"p{i}": {"type": "string"} for i in range(600)})
    e = api_error(chat(http, tools=[wide], tool_choice="none"), 400)
    assert e["param"] == "tools[0].function.parameters" and "max_tool_parameters=500" in e["message"], e
    assert chat(http, tools=[tool("a-valid_name-64" + "x" * 49)], tool_choice="none").status_code == 200


# ---------------------------------------------------------------------------------------------- message shapes
def test_a_tool_message_needs_its_tool_call_id(http):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "w", "arguments": "{}"}}]},
                {"role": "tool", "content": "sunny"}]
    e = api_error(chat(http, messages), 400)
    assert e["param"] == "messages[2].tool_call_id" and "messages[2]" in e["message"], e


@pytest.mark.parametrize("arguments, message", [('{"city": ', "is not JSON"), ("[1, 2]", "must be a JSON object")])
def test_assistant_tool_call_arguments_must_be_a_json_object(http, arguments, message):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "w", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    e = api_error(chat(http, messages), 400)
    assert e["param"] == "messages[1].tool_calls[0].function.arguments" and message in e["message"], e


# ---------------------------------------------------------------------------------------------- stop strings
def test_a_stop_string_with_a_lone_surrogate_is_a_400_that_says_so(http):
    body = b'{"prompt": "x", "max_tokens": 2, "stop": ["ok", "a\\ud800"]}'
    e = api_error(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400)
    assert "lone UTF-16 surrogate" in e["message"] and "\\ud800" in e["message"], e


# ---------------------------------------------------------------------------------------------- prompt logprobs
def test_the_prompt_is_scored_once_with_n_choices(http, server):
    prompt = "a fairly long prompt " * 10
    one = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 1, "n": 1,
                                             "echo": True, "logprobs": 2, "prompt_logprobs": 2})
    four = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 1, "n": 4,
                                              "echo": True, "logprobs": 2, "prompt_logprobs": 2})
    assert one.status_code == four.status_code == 200, four.text
    rid = four.json()["id"]
    scored = [server.engine.params_seen[f"{rid}-{i}"].prompt_logprobs for i in range(4)]
    assert scored[0] == 2 and scored[1:] == [None, None, None]           # computed once
    choices = four.json()["choices"]
    assert choices[0]["prompt_logprobs"] == one.json()["choices"][0]["prompt_logprobs"]
    assert all(c["prompt_logprobs"] is None for c in choices[1:])
    n_prompt = len(choices[0]["logprobs"]["tokens"]) - 1
    assert all(c["logprobs"]["token_logprobs"][:n_prompt] == [None] * n_prompt for c in choices[1:])
    assert len(four.content) < 2 * len(one.content)                      # sent once, not four times


# ---------------------------------------------------------------------------------------------- a failed grammar
@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_fails_before_any_token_is_a_400(http, stream):
    r = http.post("/v1/completions", json={"prompt": "GRAMMAR_FAILS_AT_0", "max_tokens": 4, "stream": stream})
    e = api_error(r, 400)
    assert "too complex for the grammar parser" in e["message"], e


def test_a_grammar_that_fails_later_ends_with_finish_reason_error(http):
    r = http.post("/v1/completions", json={"prompt": "GRAMMAR_FAILS_AT_2", "max_tokens": 4})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "error", r.text
    assert "too complex" in choice["stop_reason"] and len(choice["text"]) == 2
    with http.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "GRAMMAR_FAILS_AT_2"}], "max_tokens": 4, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "error"
