"""A chat request's tools and tool_choice: checks, the constraint that enforces named and required
choices, and the parser that reads each choice's output (vLLM's semantics and messages)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from jaxserve.engine.structured_output.json_schema import relocate_refs
from jaxserve.sampling_params import StructuredOutputsParams

from .engine import ToolParser
from .json_formats import NamedToolChoiceParser, RequiredToolChoiceParser

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_SUBSCHEMA_KEYS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SCHEMA_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions")
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")       # OpenAI's rule for a function's name


class ToolRequestError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def schema_problem(schema: Any, where: str = "") -> str | None:
    """What makes `schema` not a JSON schema (None: fine). Checks the structure the keywords must have,
    so a typo'd schema is a 400 here rather than a template or grammar error later."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{where or 'the schema'} must be an object or a boolean, not {type(schema).__name__}"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if k not in _JSON_TYPES:
            return f"{where}.type: {k!r} is not a JSON type ({', '.join(sorted(_JSON_TYPES))})"
    if "required" in schema and not (isinstance(schema["required"], list)
                                     and all(isinstance(r, str) for r in schema["required"])):
        return f"{where}.required must be a list of property names"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{where}.enum must be a list"
    for key in _SCHEMA_MAP_KEYS:
        if key in schema:
            if not isinstance(schema[key], dict):
                return f"{where}.{key} must be an object of schemas"
            for name, sub in schema[key].items():
                if problem := schema_problem(sub, f"{where}.{key}.{name}"):
                    return problem
    for key in _SCHEMA_LIST_KEYS:
        if key in schema:
            if not isinstance(schema[key], list):
                return f"{where}.{key} must be a list of schemas"
            for n, sub in enumerate(schema[key]):
                if problem := schema_problem(sub, f"{where}.{key}[{n}]"):
                    return problem
    for key in _SUBSCHEMA_KEYS:
        if key in schema and (problem := schema_problem(schema[key], f"{where}.{key}")):
            return problem
    return None


def tool_dicts(tools: list[Any]) -> list[dict]:
    """The request's tools as the plain dicts chat templates and parsers read."""
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.function.name}
        if t.function.description is not None:
            fn["description"] = t.function.description
        fn["parameters"] = t.function.parameters if t.function.parameters is not None else \
            {"type": "object", "properties": {}}
        if t.function.strict is not None:
            fn["strict"] = t.function.strict
        out.append({"type": "function", "function": fn})
    return out


@dataclass
class ToolPlan:
    """How one chat request uses tools: `mode` is none | auto | named | required."""
    mode: str
    tools: list[dict] | None          # for the chat template (None: no tools sent)
    function_name: str | None = None  # the named choice
    parser_cls: type | None = None    # auto: the server's --tool-call-parser
    parallel: bool = True
    # auto: the server closes JSON schemas' objects by default (--structured-outputs-config
    # disable_additional_properties), so the calls the model starts are held to their tools' schemas
    closed_by_default: bool = True

    def new_parser(self) -> ToolParser | None:
        """A fresh parser for one generated choice (None: the output is plain content)."""
        if self.mode == "auto":
            return self.parser_cls(self.tools)
        if self.mode == "named":
            return NamedToolChoiceParser(self.function_name, self.tools)
        if self.mode == "required":
            return RequiredToolChoiceParser(self.tools)
        return None

    @property
    def needs_special_tokens(self) -> bool:
        return self.mode == "auto" and self.parser_cls.needs_special_tokens

    def constraint_schema(self) -> dict | None:
        """The JSON schema the output must follow: the named tool's parameters, or for `required` an
        array of one or more {"name": <a tool>, "parameters": <its schema>} (each tool's local `$ref`s
        pointing where its parameters now live)."""
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in self.tools or []}
        if self.mode == "named":
            return by_name[self.function_name]
        if self.mode == "required":
            one = len(by_name) == 1
            alternatives = [
                {"type": "object", "properties": {
                    "name": {"type": "string", "const": name},
                    "parameters": relocate_refs(params, "/items" + ("" if one else f"/anyOf/{i}")
                                                + "/properties/parameters")},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for i, (name, params) in enumerate(by_name.items())]
            schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                      "items": alternatives[0] if one else {"anyOf": alternatives}}
            if not self.parallel:
                schema["maxItems"] = 1
            return schema
        return None

    def strict(self) -> bool:
        """Whether a constrained tool says `strict: true` (its objects are then closed whatever the server's
        default; for `required`, any strict tool closes them all)."""
        tools = [t["function"] for t in self.tools or []]
        if self.mode == "named":
            tools = [f for f in tools if f["name"] == self.function_name]
        return any(f.get("strict") is True for f in tools)

    def structured_outputs(self) -> Any:
        """The structured-outputs constraint: named / required choices' JSON schema; for auto, where the tool
        parser's format has one and objects are closed (the server's default or a strict tool), a structural
        tag that leaves the text free and holds each call to a declared tool and its schema; else None."""
        if self.mode == "auto":
            tag = self.parser_cls.structural_tag(self.tools or [])
            if tag is None or not (self.closed_by_default or self.strict()):
                return None
            return StructuredOutputsParams(structural_tag=tag, disable_additional_properties=self.strict())
        schema = self.constraint_schema()
        if schema is None:
            return None
        return StructuredOutputsParams(json=schema, disable_additional_properties=self.strict())


def checked_tools(tools: list[Any]) -> list[dict]:
    """A request's tools, checked (names unique and of OpenAI's pattern, parameters a JSON schema), as the
    plain dicts chat templates and parsers read; ToolRequestError names the field at fault."""
    names: set[str] = set()
    for i, t in enumerate(tools):
        name = t.function.name
        if not name:
            raise ToolRequestError("a tool's function name must not be empty", f"tools[{i}].function.name")
        if not TOOL_NAME.fullmatch(name):
            shown = name if len(name) <= 80 else f"{name[:80]}... ({len(name)} characters)"
            raise ToolRequestError(f"tools[{i}].function.name {shown!r} must match ^[a-zA-Z0-9_-]{{1,64}}$ "
                                   "(letters, digits, underscores and dashes, at most 64)",
                                   f"tools[{i}].function.name")
        if name in names:
            raise ToolRequestError(f"two tools are named {name!r}", f"tools[{i}].function.name")
        names.add(name)
        params = t.function.parameters
        if params is not None and (problem := schema_problem(params, "parameters")):
            raise ToolRequestError(f"tool {name!r}: parameters is not a valid JSON schema: {problem}",
                                   f"tools[{i}].function.parameters")
    return tool_dicts(tools)


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None, *,
               enable_auto_tool_choice: bool, parser_cls: type | None, closed_by_default: bool = True) -> ToolPlan:
    """Check a request's tools and tool_choice; ToolRequestError names the field at fault."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise ToolRequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return ToolPlan("none", None)
    dicts = checked_tools(tools)
    names = {t["function"]["name"] for t in dicts}
    parallel = parallel_tool_calls is not False
    choice = "auto" if tool_choice is None else tool_choice   # OpenAI's default once tools are sent
    if choice == "none":
        return ToolPlan("none", dicts, parallel=parallel)
    if choice == "auto":
        if not enable_auto_tool_choice or parser_cls is None:
            raise ToolRequestError(AUTO_NEEDS_FLAGS, "tool_choice")
        return ToolPlan("auto", dicts, parser_cls=parser_cls, parallel=parallel, closed_by_default=closed_by_default)
    if choice == "required":
        return ToolPlan("required", dicts, parallel=parallel)
    name = choice.function.name
    if name not in names:
        raise ToolRequestError(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")
    return ToolPlan("named", dicts, function_name=name, parallel=parallel)


def template_messages(messages: list[Any]) -> list[dict]:
    """Chat messages as the dicts chat templates read: assistant tool calls with their arguments parsed
    to objects (templates such as Qwen3-Coder's iterate over them), tool results with tool_call_id (which
    a tool message must have, as OpenAI says)."""
    out = []
    for i, m in enumerate(messages):
        if m.role == "tool" and not m.tool_call_id:
            raise ToolRequestError(f"messages[{i}]: a message of role 'tool' needs the tool_call_id of the call "
                                   "it answers", f"messages[{i}].tool_call_id")
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                where = f"messages[{i}].tool_calls[{j}].function.arguments"
                try:
                    args = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
                except (json.JSONDecodeError, RecursionError) as e:
                    raise ToolRequestError(f"{where} is not JSON: {e}", where) from None
                if not isinstance(args, dict):
                    raise ToolRequestError(f"{where} must be a JSON object, got {type(args).__name__}", where)
                entry: dict[str, Any] = {"type": "function", "function": {"name": call.function.name,
                                                                          "arguments": args}}
                if call.id is not None:
                    entry["id"] = call.id
                calls.append(entry)
            d["tool_calls"] = calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out
