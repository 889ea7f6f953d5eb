"""Formats whose calls are JSON objects: hermes, llama3_json, mistral, and the array tool_choice=required
produces. A call is reported only once its JSON is complete and parsed (so it is never taken back)."""
from __future__ import annotations

import json
import re
from typing import Any

from .engine import Block, PartialCall, ToolParser, call_arguments, mistral_id, skip_ws
from .registry import register_tool_parser
from .scan import value_end

_INCOMPLETE = "incomplete"


def read_json(text: str, i: int, final: bool, cache: dict | None = None) -> tuple[Any, int] | str | None:
    """The JSON object or array starting at text[i] (after whitespace) and the index after it;
    _INCOMPLETE if the text may still complete it; None if it is not JSON. `cache`: see value_end."""
    i = skip_ws(text, i)
    if i == len(text):
        return None if final else _INCOMPLETE
    if text[i] not in "{[":
        return None
    end = value_end(text, i, cache=cache)
    if end is None:
        return None if final else _INCOMPLETE
    if end < 0:
        return None
    try:
        return json.loads(text[i:end]), end
    except json.JSONDecodeError:
        return None


def json_call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> PartialCall | None:
    """{"name": ..., "arguments" (or "parameters"): {...}} as a call; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    value = next((obj[k] for k in args_keys if k in obj), None)
    args = call_arguments(value)
    return None if args is None else PartialCall(obj["name"], args, True)


def expect_marker(text: str, i: int, marker: str, final: bool) -> int | str | None:
    """Index after `marker` at text[i] (after whitespace); _INCOMPLETE while it may still come; None if
    something else is there. At the end of the text a missing end marker is forgiven."""
    i = skip_ws(text, i)
    if text.startswith(marker, i):
        return i + len(marker)
    if i == len(text):
        return i if final else _INCOMPLETE
    if not final and marker.startswith(text[i:]):
        return _INCOMPLETE
    return None


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them
    (Hermes 2/3, Qwen2.5, Qwen3, QwQ)."""
    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"

    @classmethod
    def structural_tag(cls, tools: list[dict]) -> dict | None:
        # the layout the Hermes / Qwen chat templates show the model
        return {"triggers": ["<tool_call>"], "structures": [
            {"begin": '<tool_call>\n{"name": ' + json.dumps(f["name"]) + ', "arguments": ',
             "schema": f.get("parameters") or {"type": "object"}, "end": "}\n</tool_call>"}
            for f in (t["function"] for t in tools)]}

    def read_block(self, text: str, body: int, final: bool) -> Block | None:
        got = read_json(text, body, final, self.scans)
        if got is None or got == _INCOMPLETE:
            return None if got is None else Block()
        obj, after = got
        call = json_call(obj)
        if call is None:
            return None
        end = expect_marker(text, after, self.end_marker, final)
        if end is None or end == _INCOMPLETE:
            return None if end is None else Block()
        return Block([call], end)


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 / 3.3 JSON calls: the output *starts* with `{"name": ..., "parameters": {...}}`
    (after an optional `<|python_tag|>`); several calls are separated by `;`. An output that starts with
    prose is content, as in vLLM."""
    python_tag = "<|python_tag|>"
    needs_special_tokens = True

    def find_start(self, text: str, pos: int) -> tuple[int, int] | int:
        if pos != self.block_end:
            return len(text)           # prose came first: the rest is content
        j = skip_ws(text, pos)
        if self.calls and text.startswith(";", j):
            j = skip_ws(text, j + 1)
        if text.startswith(self.python_tag, j):
            j = skip_ws(text, j + len(self.python_tag))
        if j == len(text) or self.python_tag.startswith(text[j:]) or (self.calls and text[j:] == ";"):
            return pos                 # nothing decided yet
        return (pos, j) if text[j] == "{" else len(text)

    def read_block(self, text: str, body: int, final: bool) -> Block | None:
        got = read_json(text, body, final, self.scans)
        if got is None or got == _INCOMPLETE:
            return None if got is None else Block()
        call = json_call(got[0])
        return None if call is None else Block([call], got[1])


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    """Mistral's `[TOOL_CALLS]`: either a JSON array of calls (`[TOOL_CALLS][{"name": ..., "arguments":
    {...}}, ...]`, tokenizers before v11) or `[TOOL_CALLS]name[ARGS]{...}` per call (v11 and later).
    Call ids are 9 alphanumeric characters, the only ids Mistral's templates accept."""
    start_markers = ("[TOOL_CALLS]",)
    args_marker = "[ARGS]"
    needs_special_tokens = True

    def new_id(self) -> str:
        return mistral_id()

    def read_block(self, text: str, body: int, final: bool) -> Block | None:
        i = skip_ws(text, body)
        if i == len(text):
            return None if final else Block()
        if text[i] == "[":
            got = read_json(text, i, final, self.scans)
            if got is None or got == _INCOMPLETE:
                return None if got is None else Block()
            items, end = got
            calls = [json_call(x) for x in items] if isinstance(items, list) and items else [None]
            return None if any(c is None for c in calls) else Block(calls, end)
        if text[i] == "{":             # a single object without the array
            got = read_json(text, i, final, self.scans)
            if got is None or got == _INCOMPLETE:
                return None if got is None else Block()
            call = json_call(got[0])
            return None if call is None else Block([call], got[1])
        name = _MISTRAL_NAME.match(text, i)
        if name is None:
            return None
        j = name.end()
        if not text.startswith(self.args_marker, j):
            if j == len(text) or self.args_marker.startswith(text[j:]):
                return None if final else Block()
            return None
        got = read_json(text, j + len(self.args_marker), final, self.scans)
        if got is None or got == _INCOMPLETE:
            return None if got is None else Block()
        args = call_arguments(got[0])
        return None if args is None else Block([PartialCall(name.group(), args, True)], got[1])


# the opening of a call in the array tool_choice="required" writes, up to where its arguments start
_REQUIRED_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"\s*:\s*')


def cut_off_calls(text: str, body: int) -> list[PartialCall]:
    """The calls of a JSON array of calls that max_tokens cut off: each complete one, then the one it cut
    with the arguments text written so far (as a named choice reports its cut-off arguments). A call cut
    before its arguments began is not reported."""
    calls: list[PartialCall] = []
    i = skip_ws(text, body) + 1                 # after the '['
    while True:
        i = skip_ws(text, i)
        if i == len(text) or text[i] != "{":
            return calls
        end = value_end(text, i)
        if end is None:                         # the call max_tokens cut
            head = _REQUIRED_CALL_HEAD.match(text, i)
            if head is not None:
                calls.append(PartialCall(json.loads(head.group(1)), text[head.end():]))
            return calls
        try:
            call = json_call(json.loads(text[i:end]), ("parameters", "arguments"))
        except json.JSONDecodeError:
            return calls
        if call is None:
            return calls
        calls.append(call)
        i = skip_ws(text, end)
        if not text.startswith(",", i):
            return calls
        i += 1


class RequiredToolChoiceParser(ToolParser):
    """What tool_choice="required" makes the model write (a constrained JSON array of
    {"name": ..., "parameters": {...}}): the whole output is one block. An array max_tokens cut off is
    read as far as it goes (``cut_off_calls``) once the output is final."""
    name = "required"

    def find_start(self, text: str, pos: int) -> tuple[int, int] | int:
        if pos != 0 or self.calls:
            return len(text)
        j = skip_ws(text, 0)
        if j == len(text):
            return 0
        return (0, j) if text[j] == "[" else len(text)

    def read_block(self, text: str, body: int, final: bool) -> Block | None:
        got = read_json(text, body, final=False, cache=self.scans)
        if got == _INCOMPLETE:
            if not final:
                return Block()
            calls = cut_off_calls(text, body)
            return Block(calls, len(text)) if calls else None
        if got is None:
            return None
        items, end = got
        calls = [json_call(x, ("parameters", "arguments")) for x in items] if isinstance(items, list) else [None]
        return None if not calls or any(c is None for c in calls) else Block(calls, end)


class NamedToolChoiceParser(ToolParser):
    """tool_choice naming a function: the constrained output *is* the arguments object, streamed as is."""

    def __init__(self, function_name: str, tools: list[dict] | None = None):
        super().__init__(tools)
        self.name = function_name

    def find_start(self, text: str, pos: int) -> tuple[int, int] | int:
        return (0, 0) if pos == 0 and not self.calls else len(text)

    def read_block(self, text: str, body: int, final: bool) -> Block:
        return Block([PartialCall(self.name, text, final)], len(text) if final else None)


__all__ = ["HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "RequiredToolChoiceParser",
           "NamedToolChoiceParser"]
