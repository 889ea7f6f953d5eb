"""`pythonic`: a Python list of keyword-argument calls, `[get_weather(city="Paris"), now()]`
(Llama 3.2 / 4 with their pythonic templates, ToolACE). Read with `ast`, never evaluated."""
from __future__ import annotations

import ast
import json
import re

from .engine import Block, PartialCall, ToolParser
from .registry import register_tool_parser
from .scan import value_end

_LIST_OF_CALLS = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_MAYBE_LIST_OF_CALLS = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?$")


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)):
        return f"{base}.{node.attr}"
    return None


def parse_calls(source: str) -> list[PartialCall] | None:
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        name = _dotted(node.func) if isinstance(node, ast.Call) else None
        if name is None or node.args or any(kw.arg is None for kw in node.keywords):
            return None            # positional or **kwargs arguments have no parameter names
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            text = json.dumps(args, ensure_ascii=False)
        except (ValueError, TypeError, SyntaxError):
            return None            # not a literal, or not JSON-representable (a set, bytes)
        calls.append(PartialCall(name, text, True))
    return calls


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    """The list is reported when its closing bracket arrives; text around it is content."""

    def find_start(self, text: str, pos: int) -> tuple[int, int] | int:
        m = _LIST_OF_CALLS.search(text, pos)
        if m:
            return m.start(), m.start()
        tail = text.rfind("[", pos)
        if tail >= 0 and _MAYBE_LIST_OF_CALLS.match(text, tail):
            return tail
        return len(text)

    def read_block(self, text: str, body: int, final: bool) -> Block | None:
        end = value_end(text, body, quotes="\"'", cache=self.scans)
        if end is None:
            return None if final else Block()
        if end < 0:
            return None
        calls = parse_calls(text[body:end])
        return None if calls is None else Block(calls, end)
