"""Tool calling through the HTTP server with the openai SDK over a scripted model: tools in the prompt,
tool_choice checks, history with tool calls and results, auto tool choice parsed from the model output
(streaming at several delta sizes), named and required choices, and the launcher flags. The real SmolLM2
server: test_tool_calls_real.py."""
from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import openai
import pytest

from support.tool_calls import NAMED, TIME_TOOL, WEATHER_TOOL, ScriptedEngine, ask, make_server

TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.fixture(scope="module")
def auto():
    engine = ScriptedEngine(replies=[("TWO_CALLS", TWO_CALLS), ("MISTRAL", "x")])
    srv, client = make_server(engine, enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield engine, client, srv
    srv.stop()


@pytest.fixture(scope="module")
def plain():
    engine = ScriptedEngine()
    srv, client = make_server(engine)
    yield engine, client, srv
    srv.stop()


def error_of(call) -> tuple[int, str, str | None]:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    body = e.value.body if isinstance(e.value.body, dict) else {}
    err = body.get("error", body)
    return e.value.status_code, err.get("message", ""), err.get("param")


# -- prompts and history ------------------------------------------------------------------------------

def test_tools_reach_the_prompt(plain):
    engine, client, _ = plain
    without = client.chat.completions.create(model="fake-model", messages=ask("hi"), max_tokens=4)
    with_tools = client.chat.completions.create(model="fake-model", messages=ask("hi"), max_tokens=4,
                                                tools=[WEATHER_TOOL], tool_choice="none")
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens
    assert '"name": "get_weather"' in engine.prompts_seen[with_tools.id + "-0"]
    assert with_tools.choices[0].message.tool_calls in (None, [])


def test_history_with_tool_calls_and_results_renders(plain):
    engine, client, _ = plain
    history = ask("Weather in Paris?") + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    r = client.chat.completions.create(model="fake-model", messages=history, tools=[WEATHER_TOOL],
                                       tool_choice="none", max_tokens=8)
    assert r.choices[0].message.content == "Plain an"
    prompt = engine.prompts_seen[r.id + "-0"]
    # arguments rendered as an object (tojson of a dict), not as a quoted string
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert '<tool_response id="call_1">18 C, sunny</tool_response>' in prompt


def test_history_with_arguments_that_are_not_json_is_a_400(plain):
    _, client, _ = plain
    history = ask("x") + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]
    status, message, param = error_of(lambda: client.chat.completions.create(
        model="fake-model", messages=history, max_tokens=4))
    assert status == 400 and param == "messages[1].tool_calls[0].function.arguments" and "not JSON" in message


# -- bad requests ---------------------------------------------------------------------------------------

def test_auto_without_the_flags_is_vllms_400(plain):
    _, client, _ = plain
    for kw in ({"tool_choice": "auto"}, {}):   # no tool_choice with tools means "auto"
        status, message, param = error_of(lambda: client.chat.completions.create(
            model="fake-model", messages=ask("hi"), tools=[WEATHER_TOOL], max_tokens=4, **kw))
        assert status == 400 and param == "tool_choice"
        assert message == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@pytest.mark.parametrize("kw, param, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER_TOOL]},
     "tool_choice", "Tool 'nope' has not been passed in `tools`"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice", "`tools` must be set"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "dict"}}}], "tool_choice": "none"},
     "tools[0].function.parameters", "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "object", "required": "a"}}}}}], "tool_choice": "none"},
     "tools[0].function.parameters", "parameters.properties.a.required"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL], "tool_choice": "none"}, "tools[1].function.name", "two tools"),
])
def test_bad_tool_requests_are_400_naming_the_field(auto, kw, param, words):
    _, client, _ = auto
    status, message, got = error_of(lambda: client.chat.completions.create(
        model="fake-model", messages=ask("hi"), max_tokens=4, **kw))
    assert status == 400 and got == param and words in message


def test_role_tool_is_accepted(plain):
    _, client, _ = plain
    r = client.chat.completions.create(model="fake-model", max_tokens=4, messages=ask("hi") + [
        {"role": "tool", "tool_call_id": "x", "content": "42"}])
    assert r.choices[0].finish_reason in ("stop", "length")


# -- auto: parsed from the model's output -------------------------------------------------------------

def check_two_calls(message) -> None:
    calls = message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {})]
    assert all(c.type == "function" for c in calls) and len({c.id for c in calls}) == 2


def test_auto_returns_the_calls_the_model_writes(auto):
    _, client, _ = auto
    r = client.chat.completions.create(model="fake-model", messages=ask("TWO_CALLS please"),
                                       tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=400)
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content == "Let me check."
    check_two_calls(r.choices[0].message)


def test_auto_without_calls_is_plain_content(auto):
    _, client, _ = auto
    r = client.chat.completions.create(model="fake-model", messages=ask("just talk"), tools=[WEATHER_TOOL])
    assert r.choices[0].message.content == "Plain answer." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_parallel_tool_calls_false_keeps_the_first(auto):
    _, client, _ = auto
    r = client.chat.completions.create(model="fake-model", messages=ask("TWO_CALLS"), parallel_tool_calls=False,
                                       tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=400)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("tokens_per_output", [1, 2, 5, 0])   # 0: the whole reply in one output
def test_auto_streams_openai_deltas_at_any_delta_size(auto, tokens_per_output):
    engine, client, _ = auto
    engine.tokens_per_output = tokens_per_output
    try:
        chunks = list(client.chat.completions.create(model="fake-model", messages=ask("TWO_CALLS"), stream=True,
                                                     tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=400))
    finally:
        engine.tokens_per_output = 1
    content, calls = "", {}
    for ch in chunks:
        delta = ch.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.index not in calls:   # the first delta of a call: index, id, type, name
                assert d.id and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
            else:                      # later deltas: argument text only
                assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert content.strip() == "Let me check."
    full = client.chat.completions.create(model="fake-model", messages=ask("TWO_CALLS"),
                                          tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=400)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]


def test_the_sdk_stream_helper_assembles_the_calls(auto):
    _, client, _ = auto
    with client.chat.completions.stream(model="fake-model", messages=ask("TWO_CALLS"),
                                        tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=400) as s:
        final = s.get_final_completion()
    check_two_calls(final.choices[0].message)


def test_mistral_parser_keeps_special_tokens():
    engine = ScriptedEngine(default_reply='[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}')
    srv, client = make_server(engine, enable_auto_tool_choice=True, tool_call_parser="mistral")
    try:
        r = client.chat.completions.create(model="fake-model", messages=ask("x"), tools=[WEATHER_TOOL], max_tokens=99)
        (call,) = r.choices[0].message.tool_calls
        assert len(call.id) == 9 and json.loads(call.function.arguments) == {"city": "Oslo"}
        assert engine.params_seen[r.id + "-0"].skip_special_tokens is False
    finally:
        srv.stop()


# -- named / required ---------------------------------------------------------------------------------

def test_named_choice_constrains_to_the_parameters_schema():
    engine = ScriptedEngine(default_reply='{"city": "Paris"}')
    srv, client = make_server(engine)
    try:
        r = client.chat.completions.create(model="fake-model", messages=ask("x"), tools=[WEATHER_TOOL, TIME_TOOL],
                                           tool_choice=NAMED, max_tokens=99)
        assert engine.params_seen[r.id + "-0"].structured_outputs.json == WEATHER_TOOL["function"]["parameters"]
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
    finally:
        srv.stop()


def test_required_choice_constrains_to_an_array_of_calls():
    engine = ScriptedEngine(default_reply='[{"name": "get_time", "parameters": {}}]')
    srv, client = make_server(engine)
    try:
        r = client.chat.completions.create(model="fake-model", messages=ask("x"), tools=[WEATHER_TOOL, TIME_TOOL],
                                           tool_choice="required", max_tokens=99)
        schema = engine.params_seen[r.id + "-0"].structured_outputs.json
        assert schema["type"] == "array" and schema["minItems"] == 1
        assert [alt["properties"]["name"]["const"] for alt in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
        assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]
    finally:
        srv.stop()


def test_required_without_parallel_calls_admits_exactly_one_call():
    """The grammar the server builds for tool_choice "required" with parallel_tool_calls false: one call,
    neither none nor two."""
    from jaxserve.engine.structured_output import StructuredOutputManager
    from jaxserve.models.tokenizers import embedded_tokenizer
    from jaxserve.server.request_types import ChatTool
    from jaxserve.server.tool_parsers.choice import plan_tools
    tok = embedded_tokenizer()
    manager = StructuredOutputManager(tok, len(tok), (tok.eos_token_id,))
    tools = msgspec.convert([WEATHER_TOOL, TIME_TOOL], list[ChatTool])

    def accepts(plan, text: str) -> bool:
        m = manager.compile(plan.structured_outputs()).deep_copy()
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()
    call = '{"name":"get_time","parameters":{}}'
    one, two = f"[{call}]", f"[{call},{call}]"
    single = plan_tools(tools, "required", False, enable_auto_tool_choice=False, parser_cls=None)
    parallel = plan_tools(tools, "required", True, enable_auto_tool_choice=False, parser_cls=None)
    assert accepts(single, one) and not accepts(single, two) and not accepts(single, "[]")
    assert accepts(parallel, one) and accepts(parallel, two) and not accepts(parallel, "[]")


def test_auto_calls_are_held_to_their_tools_schemas():
    """tool_choice "auto" with the hermes format: the server's structural tag leaves the text free, and a call the
    model starts must name a declared tool and give only its declared keys (objects closed by default); with
    objects open by default and no strict tool, auto stays unconstrained."""
    from jaxserve.engine.structured_output import StructuredOutputManager
    from jaxserve.models.tokenizers import embedded_tokenizer
    from jaxserve.server.request_types import ChatTool
    from jaxserve.server.tool_parsers import get_tool_parser
    from jaxserve.server.tool_parsers.choice import plan_tools
    tok = embedded_tokenizer()
    manager = StructuredOutputManager(tok, len(tok), (tok.eos_token_id,))
    tools = msgspec.convert([WEATHER_TOOL, TIME_TOOL], list[ChatTool])
    hermes = get_tool_parser("hermes")
    plan = plan_tools(tools, "auto", True, enable_auto_tool_choice=True, parser_cls=hermes)
    constraint = plan.structured_outputs()
    assert constraint.kind == "structural_tag"

    def accepts(text: str) -> bool:
        m = manager.compile(constraint).deep_copy()
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
    assert accepts("It is sunny, I think.")
    assert accepts("Let me check.\n" + call) and accepts(call + "\n" + call + " Done.")
    assert not accepts(call.replace('"Paris"}', '"Paris","country":"FR"}'))         # an undeclared key
    assert not accepts(call.replace("get_weather", "get_wether"))                      # an undeclared tool
    assert not accepts(call.replace('{"city":"Paris"}', '{}'))                         # a required key missing
    open_plan = plan_tools(tools, "auto", True, enable_auto_tool_choice=True, parser_cls=hermes,
                           closed_by_default=False)
    assert open_plan.structured_outputs() is None
    strict = msgspec.convert([{**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "strict": True}}],
                             list[ChatTool])
    strict_plan = plan_tools(strict, "auto", True, enable_auto_tool_choice=True, parser_cls=hermes,
                             closed_by_default=False)
    assert strict_plan.structured_outputs().disable_additional_properties is True
    assert plan_tools(tools, "auto", True, enable_auto_tool_choice=True,
                      parser_cls=get_tool_parser("pythonic")).structured_outputs() is None   # no tag: parsed only


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice, reply, want", [
    ("required", '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Pa"}}]',
     [("get_time", "{}"), ("get_weather", '{"city": "Pa')]),
    (NAMED, '{"city": "Paris", "unit": "C"}', [("get_weather", '{"city": "Pa')]),
])
def test_a_call_cut_off_by_max_tokens_is_reported_alike_for_named_and_required(choice, reply, want, stream):
    """tool_calls with the arguments written so far, finish_reason "length", no content: whether the
    choice is named or required, streamed or not."""
    engine = ScriptedEngine(default_reply=reply)
    srv, client = make_server(engine)
    max_tokens = len(reply.encode()) - len(reply.rsplit("Pa", 1)[1].encode())     # cut right after "Pa"
    try:
        kw = dict(model="fake-model", messages=ask("x"), tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice,
                  max_tokens=max_tokens)
        if stream:       # (the SDK's stream helper raises on "length"; the chunks are read as they come)
            calls, content, finish = {}, "", None
            for chunk in client.chat.completions.create(stream=True, **kw):
                delta = chunk.choices[0].delta
                content += delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
                for d in delta.tool_calls or []:
                    name, args = calls.get(d.index, (d.function.name, ""))
                    calls[d.index] = (name, args + (d.function.arguments or ""))
            got = [calls[i] for i in sorted(calls)]
        else:
            r = client.chat.completions.create(**kw)
            msg, finish = r.choices[0].message, r.choices[0].finish_reason
            got, content = [(c.function.name, c.function.arguments) for c in msg.tool_calls], msg.content
        assert got == want and finish == "length" and not content
    finally:
        srv.stop()


# -- launcher flags -------------------------------------------------------------------------------------

def serve_flags(*flags: str) -> subprocess.CompletedProcess:
    """Parse `serve` flags the way the launcher does, up to (not including) loading a model."""
    code = ("import sys; from jaxserve.cli import build_parser; from jaxserve.server.args import "
            "server_args_from_namespace as f; a = f(build_parser().parse_args(['serve', *sys.argv[1:]])); "
            "print(a.enable_auto_tool_choice, a.tool_call_parser)")
    return subprocess.run([sys.executable, "-c", code, *flags], capture_output=True, text=True, timeout=120)


def test_launcher_tool_flags(tmp_path):
    ok = serve_flags("--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml")
    assert ok.returncode == 0 and ok.stdout.split() == ["True", "qwen3_xml"], ok.stderr
    bad = serve_flags("--enable-auto-tool-choice", "--tool-call-parser", "hermez")
    assert bad.returncode == 1 and "unknown tool call parser 'hermez'; available: hermes" in bad.stderr
    assert "Traceback" not in bad.stderr
    missing = serve_flags("--enable-auto-tool-choice")
    assert missing.returncode == 1 and "--enable-auto-tool-choice needs --tool-call-parser" in missing.stderr
    plugin = tmp_path / "plug.py"
    plugin.write_text("from jaxserve.server.tool_parsers import ToolParser, register_tool_parser\n"
                      "@register_tool_parser('my_plugin')\nclass P(ToolParser):\n    start_markers = ('<c>',)\n")
    ok = serve_flags("--tool-parser-plugin", str(plugin), "--tool-call-parser", "my_plugin")
    assert ok.returncode == 0 and ok.stdout.split() == ["False", "my_plugin"], ok.stderr
