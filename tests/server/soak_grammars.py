"""The structured-output kinds of tests/server/soak.py's hostile mix: each kind's request, the statuses that
are a correct answer, and a check of what a constrained request generated (None: valid).

Hostile: a deep GBNF rule chain (compiled off the loop or refused by its time budget), $defs 2,000 deep,
500 optional properties, a 60,000-option choice, a grammar past the parser's runtime limits, a tool with 600
parameters, a seed past 2^64. Constrained and valid: a distinct 5,000-option choice, a small JSON schema;
their outputs must follow the constraint."""
from __future__ import annotations

import json
import random
import re
from typing import Callable

GRAMMAR_HOSTILE = {
    "deep_grammar": {200, 400},
    "deep_schema": {400},
    "wide_schema": {400},
    "huge_choice": {400},
    "wide_grammar": {400},
    "wide_tool": {400},
    "bad_seed": {400},
    "big_choice": {200},
    "json_schema": {200},
}
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                         "population": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["name", "population"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Answer."}]

Check = Callable[[dict], "str | None"]


def _no_check(_: dict) -> None:
    return None


def _ref_chain(depth: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _text(answer: dict) -> tuple[str, str]:
    choice = answer["choices"][0]
    return choice.get("text", (choice.get("message") or {}).get("content")) or "", choice["finish_reason"]


def _check_choice(options: list[str]) -> Check:
    def check(answer: dict) -> str | None:
        text, finish = _text(answer)
        if finish == "stop" and text not in options or finish == "length" and not any(
                o.startswith(text) for o in options):
            return f"{text!r} ({finish}) is not one of the options"
        return None
    return check


def _check_city(answer: dict) -> str | None:
    import jsonschema
    text, finish = _text(answer)
    if finish != "stop":
        return None if finish == "length" else f"finish_reason {finish}"
    try:
        jsonschema.validate(json.loads(text), CITY)
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{text!r}: {str(e)[:100]}"
    return None


def grammar_request(kind: str, rng: random.Random) -> tuple[str, dict, Check]:
    """(path, JSON body, the check of a 200's answer) of one request of ``kind``."""
    k = rng.randrange(1 << 30)
    completion = {"prompt": "Write:", "max_tokens": 8}
    if kind == "deep_grammar":          # distinct each time: each compiles (or runs past its budget) alone
        grammar = "root ::= r0\n" + "\n".join(f'r{i} ::= "a" r{i + 1}' for i in range(3000)) + f'\nr3000 ::= "b{k}"'

        def check(answer: dict) -> str | None:
            text, _ = _text(answer)
            return None if re.fullmatch(r"a*(b\d*)?", text) else f"{text!r} is outside the grammar"
        return "/v1/completions", {**completion, "guided_grammar": grammar}, check
    if kind == "deep_schema":
        return "/v1/chat/completions", {"messages": ASK, "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": _ref_chain(2000)}}}, _no_check
    if kind == "wide_schema":
        schema = {"type": "object", "properties": {f"p{i}_{k}": {"type": "integer"} for i in range(500)}}
        return "/v1/completions", {**completion, "guided_json": schema}, _no_check
    if kind == "huge_choice":
        return "/v1/completions", {**completion, "guided_choice": [f"c{i} {k}" for i in range(60_000)]}, _no_check
    if kind == "wide_grammar":
        grammar = "start: " + " | ".join(f'"option number {i} {k}"' for i in range(2500))
        return "/v1/completions", {**completion, "guided_grammar": grammar}, _no_check
    if kind == "wide_tool":
        tool = {"type": "function", "function": {"name": "wide", "parameters": {
            "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}}}
        return "/v1/chat/completions", {"messages": ASK, "max_tokens": 8, "tools": [tool],
                                        "tool_choice": "required"}, _no_check
    if kind == "bad_seed":
        return "/v1/completions", {**completion, "seed": 2**64 + k, "temperature": 1.0}, _no_check
    if kind == "big_choice":
        options = [f"pick {k} item {i}" for i in range(5000)]
        return "/v1/completions", {**completion, "max_tokens": 12, "guided_choice": options}, _check_choice(options)
    # json_schema
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a city as JSON."}],
                                    "max_tokens": 48, "temperature": rng.choice([0.0, 0.8]),
                                    "response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "city", "schema": CITY}}}, _check_city
