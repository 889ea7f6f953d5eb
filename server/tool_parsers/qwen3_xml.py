"""`qwen3_xml`: Qwen3-Coder's XML-style calls.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each becomes the JSON type its parameter's schema declares (a string stays a
string; numbers, booleans, objects and arrays are parsed), or, without a schema, JSON if it parses as
JSON and a string otherwise. Arguments stream one parameter at a time.
"""
from __future__ import annotations

import json
import re
from typing import Any

from .engine import Block, PartialCall, ToolParser, skip_ws
from .registry import register_tool_parser

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
FUNCTION, PARAMETER = "<function=", "<parameter="
END_PARAMETER, END_FUNCTION, END_TOOL_CALL = "</parameter>", "</function>", "</tool_call>"
_WAIT = object()


def _strip_newline(value: str) -> str:
    """The template puts the value on its own lines: drop one newline on each side, keep the rest."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def convert_value(raw: str, schema: dict | None) -> Any:
    kind = (schema or {}).get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind} if kind else set()
    if kinds == {"string"}:
        return raw
    stripped = raw.strip()
    if "null" in kinds and stripped.lower() in ("null", "none"):
        return None
    if kinds & {"integer", "number", "boolean", "object", "array"} or not kinds:
        try:
            return json.loads(stripped)
        except json.JSONDecodeError:
            if kinds & {"boolean"} and stripped.lower() in ("true", "false"):
                return stripped.lower() == "true"
    return raw


@register_tool_parser("qwen3_xml")
class Qwen3XmlToolParser(ToolParser):
    start_markers = ("<tool_call>", FUNCTION)

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._settled: dict[int, tuple[int, list[str]]] = {}   # block body -> (index after, pieces)

    def find_start(self, text: str, pos: int) -> tuple[int, int] | int:
        start = super().find_start(text, pos)
        if isinstance(start, tuple) and text.startswith(FUNCTION, start[0]):
            return start[0], start[0]  # a bare <function=...>: the body starts at the function tag
        return start

    def read_block(self, text: str, body: int, final: bool) -> Block | None:
        wrapped = not text.startswith(FUNCTION, body)
        i = skip_ws(text, body) if wrapped else body
        if not text.startswith(FUNCTION, i):
            if not final and FUNCTION.startswith(text[i:]):
                return Block()
            return None
        name_end = text.find(">", i + len(FUNCTION))
        if name_end < 0:
            if final or not _NAME.fullmatch(text[i + len(FUNCTION):] or "x"):
                return None
            return Block()
        name = text[i + len(FUNCTION):name_end]
        if not _NAME.fullmatch(name):
            return None
        properties = (self.tools.get(name, {}).get("parameters") or {}).get("properties") or {}
        # parameters already settled on an earlier feed are not read again (long values stream cheaply)
        j, pieces = self._settled.get(body, (name_end + 1, []))
        pieces = list(pieces)
        while True:
            j = skip_ws(text, j)
            if text.startswith(PARAMETER, j):
                key_end = text.find(">", j + len(PARAMETER))
                if key_end < 0:
                    break
                key = text[j + len(PARAMETER):key_end]
                close = self._parameter_close(text, key_end + 1, final)
                if close is _WAIT:
                    break
                if close < 0:                  # a missing </parameter> ends at the next tag
                    nxt = [k for k in (text.find(PARAMETER, key_end + 1), text.find(END_FUNCTION, key_end + 1))
                           if k >= 0]
                    if not nxt:
                        if final:
                            pieces.append(self._piece(key, text[key_end + 1:], properties))
                            j = len(text)
                        break
                    close, after = min(nxt), min(nxt)
                else:
                    after = close + len(END_PARAMETER)
                pieces.append(self._piece(key, text[key_end + 1:close], properties))
                j = after
                self._settled[body] = (j, list(pieces))
                continue
            if text.startswith(END_FUNCTION, j):
                end = j + len(END_FUNCTION)
                if wrapped:
                    k = skip_ws(text, end)
                    if text.startswith(END_TOOL_CALL, k):
                        end = k + len(END_TOOL_CALL)
                    elif not final and (k == len(text) or END_TOOL_CALL.startswith(text[k:])):
                        return Block([PartialCall(name, self._args(pieces, True), True)])
                return Block([PartialCall(name, self._args(pieces, True), True)], end)
            if j == len(text) or (not final and any(t.startswith(text[j:]) for t in (PARAMETER, END_FUNCTION))):
                break
            nxt = text.find("<", j + 1)        # stray text between the tags: skip it
            if nxt < 0:
                break
            j = nxt
        if final:
            return Block([PartialCall(name, self._args(pieces, True), True)], len(text))
        return Block([PartialCall(name, self._args(pieces, False))])

    @staticmethod
    def _parameter_close(text: str, start: int, final: bool) -> int | object:
        """Where the value from `start` ends: a `</parameter>` followed by the next tag (one followed by
        anything else is part of the value); -1 if there is none; _WAIT while that is not yet known."""
        close = text.find(END_PARAMETER, start)
        while close >= 0:
            k = skip_ws(text, close + len(END_PARAMETER))
            rest = text[k:k + len(PARAMETER)]
            if rest.startswith((PARAMETER, END_FUNCTION)) or (final and k == len(text)):
                return close
            if not final and len(text) - k < len(PARAMETER) and any(t.startswith(rest) for t in (PARAMETER, END_FUNCTION)):
                return _WAIT
            close = text.find(END_PARAMETER, close + 1)
        return -1

    @staticmethod
    def _piece(key: str, raw: str, properties: dict) -> str:
        value = convert_value(_strip_newline(raw), properties.get(key))
        return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"

    @staticmethod
    def _args(pieces: list[str], done: bool) -> str:
        if not pieces:
            return "{}" if done else ""
        return "{" + ", ".join(pieces) + ("}" if done else "")
