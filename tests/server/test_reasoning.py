"""--reasoning-parser deepseek_r1 | qwen3: the thinking part split off into message.reasoning_content (streamed
as delta.reasoning_content) as vLLM splits it, at any delta size; include_reasoning, enable_thinking and
reasoning_effort; tool calls read from the content after the thinking part. The parsers alone, then the
server on a scripted engine whose template opens <think>, then the real SmolLM2 server with such a template."""
from __future__ import annotations

import json

import pytest

from support.api_errors import api_error
from support.servers import serving, smol
from jaxserve.server.reasoning import REASONING_PARSERS, Qwen3ThinkingParser, ThinkingParser
from support.tool_calls import TIME_TOOL, WEATHER_TOOL, ScriptedEngine, make_server

DELTA_SIZES = (1, 2, 5, None)     # None: the whole text at once


def split(parser_cls, text: str, size: int | None) -> tuple[str, str]:
    parser, size = parser_cls(), size or max(len(text), 1)
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    outs = [parser.feed(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)]
    return "".join(o.reasoning for o in outs), "".join(o.content for o in outs)


@pytest.mark.parametrize("size", DELTA_SIZES)
@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>\nI think.\n</think>\n\nAnswer.", "\nI think.\n", "\n\nAnswer."),
    ("I think.</think>Answer.", "I think.", "Answer."),                 # the template opened <think>
    ("Still thinking when max_tokens cut", "Still thinking when max_tokens cut", ""),
    ("  <think>x</think>y", "x", "y"),
    ("</think>Answer", "", "Answer"),
    ("a </thi", "a </thi", ""),
    ("x<think>y</think>z", "x<think>y", "z"),                         # only a leading <think> opens it
    ("<thin", "<thin", ""),
    ("one</think>two</think>", "one", "two</think>"),
])
def test_the_split_is_the_same_at_any_delta_size(name, text, reasoning, content, size):
    assert split(REASONING_PARSERS[name], text, size) == (reasoning, content)


@pytest.mark.parametrize("size", DELTA_SIZES)
@pytest.mark.parametrize("text, reasoning, content", [
    ("plan it<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "plan it",
     "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"),
    ("a <tool_call> is how I call</think>ok", "a <tool_call> is how I call", "ok"),
    ("cut at <tool_call>", "cut at <tool_call>", ""),
])
def test_qwen3_ends_the_thinking_part_at_a_tool_call(text, reasoning, content, size):
    assert split(Qwen3ThinkingParser, text, size) == (reasoning, content)
    if "<function=" in text:     # deepseek_r1 knows no such end
        assert split(ThinkingParser, text, size) == (text, "")


def test_the_prompt_closes_the_thinking_part():
    assert ThinkingParser.prompt_closes_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not ThinkingParser.prompt_closes_thinking("<|im_start|>assistant\n<think>\n")
    assert not ThinkingParser.prompt_closes_thinking("<|im_start|>assistant\n")
    assert not ThinkingParser.prompt_closes_thinking("earlier </think> turn\n<|im_start|>assistant\n<think>\n")


# -- the server on a scripted engine --------------------------------------------------------------------------

# DeepSeek-R1's shape: the generation prompt opens <think>; Qwen3's enable_thinking false closes it at once
THINK_TEMPLATE = (
    "{% if tools %}Tools:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
REPLY = "Paris is in France.\n</think>\n\nParis."
CALL_REPLY = ('I should call get_time.</think>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
CALL_IN_THOUGHT = ('Maybe <tool_call>{"name": "get_time", "arguments": {}}</tool_call>? No.</think>Noon.')
ASK = [{"role": "user", "content": "Where is Paris?"}]


@pytest.fixture(scope="module")
def thinking():
    engine = ScriptedEngine(replies=[("CALL_IN_THOUGHT", CALL_IN_THOUGHT), ("CALL", CALL_REPLY)],
                            default_reply=REPLY, chat_template=THINK_TEMPLATE)
    srv, client = make_server(engine, reasoning_parser="deepseek_r1", enable_auto_tool_choice=True,
                              tool_call_parser="hermes")
    yield engine, client, srv
    srv.stop()


def streamed(client, **kw) -> tuple[str, str, dict, str | None]:
    """A streamed answer's reasoning, content, tool calls {index: [name, arguments]} and finish reason."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")   # both names, one text
        reasoning += extra.get("reasoning_content") or ""
        content += delta.content or ""
        for d in delta.tool_calls or []:
            calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


@pytest.mark.parametrize("tokens_per_output", [1, 2, 5, 0])
def test_thinking_part_split_streamed_and_not(thinking, tokens_per_output):
    engine, client, _ = thinking
    r = client.chat.completions.create(model="fake-model", messages=ASK, max_tokens=200)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == "Paris is in France.\n"
    assert msg.content == "\n\nParis." and r.choices[0].finish_reason == "stop"
    engine.tokens_per_output = tokens_per_output
    try:
        assert streamed(client, model="fake-model", messages=ASK, max_tokens=200) == \
            ("Paris is in France.\n", "\n\nParis.", {}, "stop")
    finally:
        engine.tokens_per_output = 1


def test_cut_off_in_the_thinking_part_is_all_reasoning(thinking):
    _, client, _ = thinking
    r = client.chat.completions.create(model="fake-model", messages=ASK, max_tokens=8)
    assert r.choices[0].message.model_extra["reasoning_content"] == "Paris is"
    assert r.choices[0].message.content is None and r.choices[0].finish_reason == "length"
    assert streamed(client, model="fake-model", messages=ASK, max_tokens=8) == ("Paris is", "", {}, "length")


def test_include_reasoning_false_drops_it(thinking):
    _, client, _ = thinking
    kw = dict(model="fake-model", messages=ASK, max_tokens=200, extra_body={"include_reasoning": False})
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.model_extra["reasoning_content"] is None and msg.content == "\n\nParis."
    assert streamed(client, **kw) == ("", "\n\nParis.", {}, "stop")


def test_enable_thinking_false_reaches_the_template_and_the_answer_is_content(thinking):
    engine, client, _ = thinking
    kw = dict(model="fake-model", messages=ASK, max_tokens=200,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    r = client.chat.completions.create(**kw)
    assert engine.prompts_seen[r.id + "-0"].endswith("assistant\n<think>\n\n</think>\n\n")
    assert r.choices[0].message.content == REPLY and r.choices[0].message.model_extra["reasoning_content"] is None
    assert streamed(client, **kw) == ("", REPLY, {}, "stop")


def test_reasoning_effort_reaches_the_template_and_none_turns_thinking_off(thinking):
    engine, client, _ = thinking
    r = client.chat.completions.create(model="fake-model", messages=ASK, max_tokens=200, reasoning_effort="low")
    assert "effort=low\n" in engine.prompts_seen[r.id + "-0"]
    assert r.choices[0].message.model_extra["reasoning_content"] == "Paris is in France.\n"
    r = client.chat.completions.create(model="fake-model", messages=ASK, max_tokens=200, reasoning_effort="none")
    assert r.choices[0].message.content == REPLY and r.choices[0].message.model_extra["reasoning_content"] is None


@pytest.mark.parametrize("tokens_per_output", [1, 3, 0])
def test_tool_calls_are_read_after_the_thinking_part(thinking, tokens_per_output):
    engine, client, _ = thinking
    engine.tokens_per_output = tokens_per_output
    try:
        kw = dict(model="fake-model", tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=400)
        r = client.chat.completions.create(messages=[{"role": "user", "content": "CALL"}], **kw)
        msg = r.choices[0].message
        assert msg.model_extra["reasoning_content"] == "I should call get_time."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [("get_time", {})]
        assert r.choices[0].finish_reason == "tool_calls" and not msg.content
        reasoning, content, calls, finish = streamed(client, messages=[{"role": "user", "content": "CALL"}], **kw)
        assert (reasoning, content.strip(), finish) == ("I should call get_time.", "", "tool_calls")
        assert [(n, json.loads(a)) for n, a in calls.values()] == [("get_time", {})]
        # a call written inside the thinking part is thought, not called
        r = client.chat.completions.create(messages=[{"role": "user", "content": "CALL_IN_THOUGHT"}], **kw)
        msg = r.choices[0].message
        assert not msg.tool_calls and msg.content == "Noon." and "<tool_call>" in msg.model_extra["reasoning_content"]
    finally:
        engine.tokens_per_output = 1


@pytest.mark.parametrize("tokens_per_output", [1, 3, 0])
def test_a_constrained_answer_thinks_first(thinking, tokens_per_output):
    """A named tool choice or a response format holds after the thinking part (vLLM's rule): the constraint
    carries the end marker's token ids, where the engine starts its grammar; the answer splits as any other."""
    engine, client, _ = thinking
    engine.default_reply, engine.tokens_per_output = 'Paris, then.</think>\n{"city": "Paris"}', tokens_per_output
    named = dict(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}}
    try:
        r = client.chat.completions.create(model="fake-model", messages=ASK, max_tokens=99, **named)
        (call,) = r.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert r.choices[0].message.model_extra["reasoning_content"] == "Paris, then."
        marker = engine.params_seen[r.id + "-0"].structured_outputs.reasoning_end_token_ids
        assert marker == list(b"</think>")          # the fake tokenizer spells bytes
        reasoning, content, calls, finish = streamed(client, model="fake-model", messages=ASK, max_tokens=99, **named)
        assert reasoning == "Paris, then." and [json.loads(a) for _, a in calls.values()] == [{"city": "Paris"}]
        r = client.chat.completions.create(model="fake-model", messages=ASK, max_tokens=99, **schema)
        assert json.loads(r.choices[0].message.content) == {"city": "Paris"}
        assert r.choices[0].message.model_extra["reasoning_content"] == "Paris, then."
        # thinking off: the constraint holds from the first token, and carries no marker
        r = client.chat.completions.create(model="fake-model", messages=ASK, max_tokens=99, reasoning_effort="none",
                                           **schema)
        assert engine.params_seen[r.id + "-0"].structured_outputs.reasoning_end_token_ids is None
    finally:
        engine.default_reply, engine.tokens_per_output = REPLY, 1


@pytest.mark.parametrize("field, value", [("include_reasoning", "no"), ("include_reasoning", [True]),
                                          ("reasoning_effort", "extreme"), ("reasoning_effort", 2),
                                          ("chat_template_kwargs", "enable_thinking=false")])
def test_bad_reasoning_fields_are_400(thinking, field, value):
    import httpx
    _, _, srv = thinking
    body = {"messages": ASK, "max_tokens": 2, field: value}
    e = api_error(httpx.post(srv.url + "/v1/chat/completions", json=body), 400)
    assert e["param"] == field, e


def test_without_the_flag_the_answer_is_all_content():
    engine = ScriptedEngine(default_reply=REPLY, chat_template=THINK_TEMPLATE)
    srv, client = make_server(engine)
    try:
        msg = client.chat.completions.create(model="fake-model", messages=ASK, max_tokens=200).choices[0].message
        assert msg.content == REPLY and msg.model_extra["reasoning_content"] is None
    finally:
        srv.stop()


def test_the_flag_takes_vllms_names():
    from jaxserve.cli import build_parser
    from jaxserve.server.args import server_args_from_namespace
    for name in ("deepseek_r1", "qwen3"):
        ns = build_parser().parse_args(["serve", "--reasoning-parser", name])
        assert server_args_from_namespace(ns).reasoning_parser == name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "deepseek"])


# -- the real server: the embedded SmolLM2 behind a template whose generation prompt opens <think> -----------

REAL_TEMPLATE = THINK_TEMPLATE.replace("{% if tools %}Tools:{% for t in tools %}{{ t.function.name }};"
                                       "{% endfor %}\n{% endif %}", "")


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    template = tmp_path_factory.mktemp("templates") / "think.jinja"
    template.write_text(REAL_TEMPLATE)
    yield from serving(smol("--reasoning-parser", "deepseek_r1", "--chat-template", str(template)))


def completion_of_the_chat_prompt(real, real_client, **template_kwargs) -> str:
    """What the model writes after the chat prompt, read through /v1/completions (no reasoning parser there)."""
    import httpx
    ids = httpx.post(real.url + "/tokenize", json={"messages": ASK, **template_kwargs}).json()["tokens"]
    return real_client.completions.create(model="smol", prompt=ids, max_tokens=24, temperature=0).choices[0].text


def test_real_thinking_part_is_the_models_text_streamed_and_not(real, real_client):
    text = completion_of_the_chat_prompt(real, real_client)
    assert "</think>" not in text and text      # the small model never closes it: all of it is thinking
    kw = dict(model="smol", messages=ASK, max_tokens=24, temperature=0)
    msg = real_client.chat.completions.create(**kw).choices[0].message
    assert msg.model_extra["reasoning_content"] == text and msg.content is None
    assert streamed(real_client, **kw)[:2] == (text, "")
    dropped = real_client.chat.completions.create(**kw, extra_body={"include_reasoning": False}).choices[0].message
    assert dropped.model_extra["reasoning_content"] is None and dropped.content is None


def test_real_enable_thinking_false_answers_in_content(real, real_client):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    text = completion_of_the_chat_prompt(real, real_client, **off)
    kw = dict(model="smol", messages=ASK, max_tokens=24, temperature=0, extra_body=off)
    msg = real_client.chat.completions.create(**kw).choices[0].message
    assert msg.content == text and msg.model_extra["reasoning_content"] is None
    assert streamed(real_client, **kw)[:2] == ("", text)
