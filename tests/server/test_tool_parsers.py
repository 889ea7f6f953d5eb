"""The tool-call parsers on outputs in the shapes each model family writes: well-formed, several calls,
text around calls, malformed JSON (text, no crash), end markers inside argument strings — each at once
and streamed in deltas of 1, 2, 5 characters and the whole text, which must all agree."""
from __future__ import annotations

import json
import textwrap

import pytest

from jaxserve.server.tool_parsers import (NamedToolChoiceParser, RequiredToolChoiceParser, ToolParser,
                                          get_tool_parser, import_tool_parser_plugin, tool_parser_names)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "tags": {"type": "array"}}}}}
DELTA_SIZES = (1, 2, 5, None)   # None: the whole text in one delta


def stream(parser: ToolParser, text: str, size: int | None) -> tuple[str, list[dict]]:
    """Feed `text` in pieces of `size`; check OpenAI's delta shape; return the content and the calls."""
    size = size or max(len(text), 1)
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    content, calls = [], []
    for k, piece in enumerate(pieces):
        out = parser.feed(piece, final=k == len(pieces) - 1)
        content.append(out.content)
        for d in out.tool_calls:
            if d.id is not None:   # the first delta of a call: a new index, its id and name
                assert d.index == len(calls) and d.name
                calls.append({"id": d.id, "name": d.name, "arguments": d.arguments})
            else:                  # later deltas: argument text of a call already started
                assert d.name is None and d.index < len(calls) and d.arguments
                calls[d.index]["arguments"] += d.arguments
    return "".join(content), calls


def check_all_ways(name: str, text: str, want_calls: list[tuple[str, dict]], want_content: str | None,
                   tools=(WEATHER,)) -> None:
    cls = get_tool_parser(name)
    at_once = cls(list(tools)).extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in at_once.tool_calls] == want_calls
    # beside calls, the content is stripped (None when empty); without calls it is the text as is
    assert at_once.content == (want_content.strip() or None if want_calls and want_content else want_content)
    ids = [c.id for c in at_once.tool_calls]
    assert len(set(ids)) == len(ids)
    for size in DELTA_SIZES:
        content, calls = stream(cls(list(tools)), text, size)
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(c.name, c.arguments) for c in at_once.tool_calls], f"delta size {size}"
        assert content.strip() == (want_content or "").strip(), f"delta size {size}"


def test_the_registry_has_vllms_names():
    assert {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml"} <= set(tool_parser_names())
    with pytest.raises(KeyError, match="unknown tool call parser 'nope'.*hermes"):
        get_tool_parser("nope")


# -- hermes (Qwen2.5 / Qwen3 / Hermes) --------------------------------------------------------------

QWEN_TWO_CALLS = ('I will check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                  '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}'
                  '\n</tool_call>')


def test_hermes_calls_with_text_before():
    check_all_ways("hermes", QWEN_TWO_CALLS, [("get_weather", {"city": "Paris", "days": 3}),
                                              ("get_weather", {"city": "Tokyo"})], "I will check both cities.\n")


def test_hermes_only_a_call_has_no_content():
    check_all_ways("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
                   [("get_weather", {})], None)


def test_hermes_end_marker_inside_a_string_and_text_after():
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "a</tool_call>b}{", "tags": ["]"]}}'
            '</tool_call> Done.')
    check_all_ways("hermes", text, [("get_weather", {"city": "a</tool_call>b}{", "tags": ["]"]})], " Done.")


def test_hermes_plain_text_and_a_lone_angle_bracket():
    check_all_ways("hermes", "Use a < b and <tool> tags.", [], "Use a < b and <tool> tags.")


@pytest.mark.parametrize("bad", [
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris",,}}</tool_call> after',
    '<tool_call>{name: get_weather}</tool_call> after',
    '<tool_call>{"arguments": {}}</tool_call> after',                      # no name
    '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call> after',  # not an object
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',       # cut off
])
def test_hermes_malformed_is_text(bad):
    check_all_ways("hermes", bad, [], bad)


def test_hermes_arguments_as_a_json_string():
    check_all_ways("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>',
                   [("get_weather", {"city": "Oslo"})], None)


def test_hermes_holds_back_only_what_may_be_a_marker():
    p = get_tool_parser("hermes")()
    assert p.feed("Hello <tool_").content == "Hello "
    assert p.feed("box>").content == "<tool_box>"


# -- llama3_json (Llama 3.1 / 3.2 / 3.3) -------------------------------------------------------------

def test_llama3_json_one_and_several_calls():
    check_all_ways("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
                   [("get_weather", {"city": "Paris"})], None)
    check_all_ways("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                                  '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}',
                   [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})], None)


def test_llama3_json_prose_first_is_content():
    text = 'The answer is {"name": "get_weather", "parameters": {}} as JSON.'
    check_all_ways("llama3_json", text, [], text)
    check_all_ways("llama3_json", '{"name": "get_weather", "parameters": {"city": "x",}}',
                   [], '{"name": "get_weather", "parameters": {"city": "x",}}')


def test_llama3_json_braces_in_strings():
    check_all_ways("llama3_json", '{"name": "get_weather", "parameters": {"city": "}{;"}}',
                   [("get_weather", {"city": "}{;"})], None)


# -- mistral ----------------------------------------------------------------------------------------

def test_mistral_array_format_and_9_char_ids():
    text = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_weather", "arguments": {"city": "]Lyon["}}]')
    check_all_ways("mistral", text, [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "]Lyon["})], None)
    calls = get_tool_parser("mistral")().extract(text).tool_calls
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)


def test_mistral_v11_format_with_text_before():
    text = ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "metric": true}'
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}')
    check_all_ways("mistral", text, [("get_weather", {"city": "Paris", "metric": True}),
                                     ("get_weather", {"city": "Nice"})], "Checking.")


def test_mistral_malformed_is_text():
    for bad in ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": }}]',
                '[TOOL_CALLS]get weather[ARGS]{}', '[TOOL_CALLS]get_weather[ARGS]{"city": "x"'):
        check_all_ways("mistral", bad, [], bad)


def test_mistral_wants_special_tokens_kept():
    assert get_tool_parser("mistral").needs_special_tokens


# -- pythonic (Llama 3.2 / 4) -----------------------------------------------------------------------

def test_pythonic_calls():
    text = '[get_weather(city="San Francisco", days=2, metric=False), get_weather(city=\'a)]"\', tags=["x"])]'
    check_all_ways("pythonic", text, [("get_weather", {"city": "San Francisco", "days": 2, "metric": False}),
                                      ("get_weather", {"city": 'a)]"', "tags": ["x"]})], None)


def test_pythonic_text_around_and_non_calls():
    check_all_ways("pythonic", "Sure: [get_weather(city='Oslo')] done", [("get_weather", {"city": "Oslo"})],
                   "Sure:  done")
    for text in ("See [1] and [a, b].", "[get_weather(1, 2)]", "[get_weather(city=open('x'))]",
                 "[get_weather(city='x'"):
        check_all_ways("pythonic", text, [], text)


# -- qwen3_xml (Qwen3-Coder) ------------------------------------------------------------------------

QWEN3_CODER = textwrap.dedent("""\
    Let me look.
    <tool_call>
    <function=get_weather>
    <parameter=city>
    New York
    </parameter>
    <parameter=days>
    4
    </parameter>
    <parameter=tags>
    ["a", "</parameter>"]
    </parameter>
    </function>
    </tool_call>
    <tool_call>
    <function=get_weather>
    <parameter=city>
    42
    </parameter>
    </function>
    </tool_call>""")


def test_qwen3_xml_types_follow_the_schema():
    check_all_ways("qwen3_xml", QWEN3_CODER, [
        ("get_weather", {"city": "New York", "days": 4, "tags": ["a", "</parameter>"]}),
        ("get_weather", {"city": "42"})], "Let me look.\n")


def test_qwen3_xml_streams_one_parameter_at_a_time():
    p = get_tool_parser("qwen3_xml")([WEATHER])
    first = p.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n")
    assert first.tool_calls[0].name == "get_weather" and first.tool_calls[0].arguments == ""
    # a value ends at a </parameter> that the next tag follows (one inside the value does not end it)
    assert p.feed("<parameter=days>").tool_calls[0].arguments == '{"city": "Oslo"'
    rest = p.feed("\n2\n</parameter>\n</function>\n</tool_call>", final=True)
    assert rest.tool_calls[0].arguments == ', "days": 2}'


def test_qwen3_xml_without_schema_and_bare_function_and_no_parameters():
    check_all_ways("qwen3_xml", "<function=ping>\n</function> ok", [("ping", {})], " ok", tools=())
    check_all_ways("qwen3_xml", "<function=f>\n<parameter=x>\n{\"a\": 1}\n</parameter>\n<parameter=y>\nhi\n"
                                "</parameter>\n</function>", [("f", {"x": {"a": 1}, "y": "hi"})], None, tools=())


def test_qwen3_xml_malformed_is_text():
    for bad in ("<tool_call>\nnot a function\n</tool_call>", "<function=bad name>\n</function>"):
        check_all_ways("qwen3_xml", bad, [], bad)


# -- tool_choice named / required (the constrained outputs) -----------------------------------------

@pytest.mark.parametrize("size", DELTA_SIZES)
def test_named_choice_streams_the_output_as_arguments(size):
    content, calls = stream(NamedToolChoiceParser("get_weather"), '{"city": "Paris"}', size)
    assert content == "" and calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city": "Paris"}'


@pytest.mark.parametrize("size", DELTA_SIZES)
def test_required_choice_array(size):
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    content, calls = stream(RequiredToolChoiceParser(), text, size)
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("size", DELTA_SIZES)
@pytest.mark.parametrize("text, want", [
    ('[{"name": "get_weather", "parameters": {"city": "Par', [("get_weather", '{"city": "Par')]),
    ('[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"ci',
     [("get_time", "{}"), ("get_weather", '{"ci')]),
    ('[{"name": "get_weather", "parameters": ', [("get_weather", "")]),
])
def test_required_choice_cut_off_reports_the_partial_call_as_named_does(text, want, size):
    """max_tokens cut the array: the complete calls, then the cut one with the arguments written so far
    (a named choice's cut-off output is its partial arguments, read the same way)."""
    content, calls = stream(RequiredToolChoiceParser(), text, size)
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == want
    name, partial_args = want[-1]
    _, named = stream(NamedToolChoiceParser(name), partial_args, size)
    assert [(c["name"], c["arguments"]) for c in named] == [want[-1]]


@pytest.mark.parametrize("text", ["[", '[{"name": "get_w', "[1, 2"])
def test_required_choice_cut_before_a_call_is_named_is_content(text):
    extracted = RequiredToolChoiceParser().extract(text)
    assert extracted.tool_calls == [] and extracted.content == text


# -- plugins ----------------------------------------------------------------------------------------

def test_plugin_file_registers_a_parser(tmp_path):
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(textwrap.dedent("""\
        import json
        from jaxserve.server.tool_parsers import Block, PartialCall, ToolParser, register_tool_parser

        @register_tool_parser("arrow_test")
        class ArrowParser(ToolParser):
            '''CALL name -> {json} END'''
            start_markers = ("CALL ",)

            def read_block(self, text, body, final):
                end = text.find(" END", body)
                if end < 0:
                    return None if final else Block()
                name, _, args = text[body:end].partition(" -> ")
                try:
                    args = json.dumps(json.loads(args))
                except ValueError:
                    return None
                return Block([PartialCall(name, args, True)], end + 4)
        """))
    import_tool_parser_plugin(str(plugin))
    check_all_ways("arrow_test", 'ok CALL get_weather -> {"city": "Rome"} END', [("get_weather", {"city": "Rome"})],
                   "ok ")
    with pytest.raises(FileNotFoundError):
        import_tool_parser_plugin(str(tmp_path / "missing.py"))


# -- any split of any recorded output gives the at-once answer ------------------------------------------

RECORDED = [("hermes", QWEN_TWO_CALLS), ("qwen3_xml", QWEN3_CODER),
            ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "P\\"aris"}[TOOL_CALLS]get_weather[ARGS]{}'),
            ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b"}}; '
                            '{"name": "get_weather", "parameters": {}}'),
            ("pythonic", "ok [get_weather(city='x]'), get_weather(days=1)] bye"),
            ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "a",,}}</tool_call> tail')]


@pytest.mark.parametrize("name, text", RECORDED)
def test_random_splits_agree_with_at_once(name, text):
    from hypothesis import given, settings, strategies as st

    cls = get_tool_parser(name)
    want = cls([WEATHER]).extract(text)

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.integers(1, len(text)), max_size=12))
    def check(cuts):
        bounds = [0, *sorted(set(cuts)), len(text)]
        p = cls([WEATHER])
        outs = [p.feed(text[a:b], final=k == len(bounds) - 2) for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        assert [(c.name, c.arguments) for c in p.calls] == [(c.name, c.arguments) for c in want.tool_calls]
        content = "".join(o.content for o in outs)
        assert (content.strip() or None if want.tool_calls else content) == want.content

    check()


def test_long_arguments_stream_in_linear_time():
    """A long call (a file's content as an argument) streamed one character at a time stays cheap: the
    scan of an unfinished value resumes where it stopped."""
    import time
    args = json.dumps({"path": "a.py", "content": "x = '}'\n" * 2000})
    text = '<tool_call>{"name": "write", "arguments": ' + args + '}</tool_call>'
    p, t0 = get_tool_parser("hermes")(), time.perf_counter()
    for ch in text:
        p.feed(ch)
    p.feed("", final=True)
    assert p.calls[0].arguments == args and time.perf_counter() - t0 < 2.0
