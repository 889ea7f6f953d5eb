"""Structural tags (vLLM's ``structural_tag``, xgrammar's first format): free text in which each tagged segment
must follow its JSON schema. The tag is ``{"structures": [{"begin": str, "schema": {...}, "end": str}, ...],
"triggers": [str, ...]}``; every ``begin`` starts with one of the triggers. The text is free until a trigger
appears; from there the output must be one of the structures that begin with it: the rest of its ``begin``, a
JSON value of its schema, its ``end``; then free text again, any number of times. It is how a server keeps
the arguments of ``tool_choice: "auto"`` calls to their tools' schemas (server/tool_parsers) while the model
may still answer in prose.

Compiled to llguidance's Lark: each trigger is a lazy lexeme (the shortest text ending in it), each structure a
rule ``trigger "rest of begin" %json {schema} "end"`` (llguidance's docs/syntax.md, "Tool calling")."""
from __future__ import annotations

import json
from typing import Any


def parse_structural_tag(value: Any) -> dict:
    """The tag as a dict with ``structures`` and ``triggers``, from its JSON text or a dict (vLLM's
    ``response_format`` shape, with ``"type": "structural_tag"``, is accepted too). ValueError names what is
    wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"structural_tag must be an object with structures and triggers, got {value!r:.80}")
    unknown = set(value) - {"type", "structures", "triggers"}
    if unknown or value.get("type", "structural_tag") != "structural_tag":
        raise ValueError("structural_tag takes type \"structural_tag\", structures and triggers only (xgrammar's "
                         f"first format); got {sorted(unknown) or value.get('type')}")
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(triggers, list) or not triggers or any(not isinstance(t, str) or not t for t in triggers):
        raise ValueError("structural_tag.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag.structures must be a non-empty list of {begin, schema, end}")
    out = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or set(s) - {"begin", "schema", "end"} or "begin" not in s or "end" not in s:
            raise ValueError(f"structural_tag.structures[{i}] must be an object with begin, schema and end")
        begin, end, schema = s["begin"], s["end"], s.get("schema", {})
        if not isinstance(begin, str) or not isinstance(end, str):
            raise ValueError(f"structural_tag.structures[{i}]: begin and end must be strings")
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"structural_tag.structures[{i}].schema must be a JSON schema (an object)")
        if not any(begin.startswith(t) for t in triggers):
            raise ValueError(f"structural_tag.structures[{i}].begin {begin!r:.80} starts with none of the triggers")
        out.append({"begin": begin, "schema": schema, "end": end})
    return {"structures": out, "triggers": list(triggers)}


def structural_tag_schemas(tag: dict) -> list:
    """The JSON schemas a (parsed) tag holds, for the limits' checks."""
    return [s["schema"] for s in tag["structures"]]


def structural_tag_lark(tag: dict, *, whitespace_flexible: bool) -> str:
    """llguidance's Lark grammar for a parsed tag (its schemas as they are to be enforced: closed by the
    caller where undeclared keys are refused); ``whitespace_flexible``: JSON whitespace between tokens is
    free."""
    triggers = sorted(set(tag["triggers"]), key=len, reverse=True)     # the longest trigger a begin starts with
    lines = ["%llguidance {}",
             "start: (" + " | ".join(f"tag_{i}" for i in range(len(tag["structures"]))) + ")* tag_end",
             "tag_end: TAG_TEXT", r"TAG_TEXT: /(.|\n)*/"]
    lines += [f"trig_{k}[lazy]: TAG_TEXT {json.dumps(t)}" for k, t in enumerate(triggers)]
    for i, s in enumerate(tag["structures"]):
        k = next(k for k, t in enumerate(triggers) if s["begin"].startswith(t))
        schema = s["schema"]
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}),
                                               "whitespace_flexible": whitespace_flexible}}
        rest = s["begin"][len(triggers[k]):]
        parts = [f"trig_{k}", json.dumps(rest) if rest else "", f"%json {json.dumps(schema)}",
                 json.dumps(s["end"]) if s["end"] else ""]
        lines.append(f"tag_{i}: " + " ".join(p for p in parts if p))
    return "\n".join(lines) + "\n"
