"""Limits on a request's constraint, checked before any grammar is compiled.

Each limit (``jaxserve.config_decoding.StructuredOutputsLimits``) is a key of ``--structured-outputs-config`` (beside
``disable_any_whitespace``); a constraint over one is refused with an ``InvalidRequestError`` (HTTP 400) that
names the limit, the request's value and the key that raises it. The defaults admit far more than OpenAI's
Structured Outputs does (5,000 properties, 10 levels of nested objects, 1,000 enum values) and stop the
shapes that would take the server down: rule and ``$ref`` chains deep enough to exhaust a compiler thread's
stack, and lists large enough to hold a worker for seconds or a cache for gigabytes.

The checks are linear in the constraint's size, stop at the first limit exceeded, and recurse no deeper than
the depth limit (the walks that follow the request's nesting are iterative).
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterable

from jaxserve.config_decoding import StructuredOutputsLimits
from jaxserve.errors import InvalidRequestError

from .structural_tag import parse_structural_tag, structural_tag_schemas

CONFIG_FLAG = "--structured-outputs-config"

# which request field a constraint kind came from (the 400's ``param``)
PARAM_OF_KIND = {"json": "json_schema", "json_object": "response_format", "regex": "regex", "choice": "choice",
                 "grammar": "grammar", "structural_tag": "structural_tag"}
NOUN_OF_KIND = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice list",
                "grammar": "grammar", "structural_tag": "structural tag"}


def over_limit(what: str, value: Any, limit: str, limits: StructuredOutputsLimits, param: str | None):
    """The 400 for a value over a limit: what it is, its value, the limit and the key that raises it."""
    bound = getattr(limits, limit)
    return InvalidRequestError(
        f"{what} ({value}) exceeds {limit}={bound}; the server's {CONFIG_FLAG} '{{\"{limit}\": ...}}' raises it",
        param=param)


# ---------------------------------------------------------------------------------------------- constraints
def constraint_spec(params) -> str:
    """``params.spec`` (the constraint as one string: the cache's key), or the depth refusal for a schema
    nested deeper than the JSON encoder goes."""
    try:
        return params.spec
    except RecursionError:
        raise InvalidRequestError(
            f"the JSON schema's nesting depth exceeds max_json_schema_depth (it is deeper than JSON encoding "
            f"goes); the server's {CONFIG_FLAG} '{{\"max_json_schema_depth\": ...}}' sets the limit",
            param=PARAM_OF_KIND[params.kind]) from None


def constraint_key(params) -> tuple:
    """The compiled-grammar cache's key of a constraint: its kind, ``constraint_spec`` and whether it asked
    for closed objects (``disable_additional_properties``: another grammar where the engine's default is
    open). The end-of-thinking marker is not part of the grammar."""
    return params.kind, constraint_spec(params), bool(getattr(params, "disable_additional_properties", False))


def check_constraint_size(kind: str, spec: str, choice: list | None, limits: StructuredOutputsLimits) -> None:
    """The O(1) checks: the constraint's size and a choice list's length."""
    param = PARAM_OF_KIND[kind]
    if choice is not None and len(choice) > limits.max_choice_options:
        raise over_limit("the choice list's option count", len(choice), "max_choice_options", limits, param)
    if len(spec) > limits.max_constraint_bytes // 4:    # a str's UTF-8 is at most 4 bytes a character
        size = len(spec.encode("utf-8", "surrogatepass"))
        if size > limits.max_constraint_bytes:
            raise over_limit(f"the {NOUN_OF_KIND[kind]}'s size in bytes", size, "max_constraint_bytes", limits, param)


def check_constraint(params, limits: StructuredOutputsLimits, spec: str | None = None) -> None:
    """All the checks of a ``StructuredOutputsParams`` (raises InvalidRequestError naming the limit);
    ``spec``: its ``spec``, where the caller has it already."""
    kind = params.kind
    check_constraint_size(kind, constraint_spec(params) if spec is None else spec, params.choice, limits)
    if kind == "json":
        check_json_schema(params.json, limits)
    elif kind == "grammar":
        check_grammar(params.grammar, limits)
    elif kind == "structural_tag":
        try:
            tag = parse_structural_tag(params.structural_tag)
        except ValueError as e:
            raise InvalidRequestError(str(e), param="structural_tag") from None
        for schema in structural_tag_schemas(tag):
            check_json_schema(schema, limits, param="structural_tag")



# a rule or terminal definition at the start of a line: Lark's ``name:`` / ``?name.2:`` or GBNF's ``name ::=``
_RULE = re.compile(r"^[ \t]*(?:[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?[ \t]*:(?!:)|[A-Za-z0-9_-]+[ \t]*::=)",
                   re.MULTILINE)
_JSON_DIRECTIVE = re.compile(r"%json\b")


def check_grammar(grammar: str, limits: StructuredOutputsLimits) -> None:
    """A grammar's rule count, and the JSON schemas it embeds (Lark's ``%json { ... }``)."""
    rules = len(_RULE.findall(grammar))
    if rules > limits.max_grammar_rules:
        raise over_limit("the grammar's rule count", rules, "max_grammar_rules", limits, "grammar")
    decoder = json.JSONDecoder()
    for m in _JSON_DIRECTIVE.finditer(grammar):
        start = len(grammar) - len(grammar[m.end():].lstrip())
        try:
            schema, _ = decoder.raw_decode(grammar, start)
        except ValueError:
            continue                     # not a JSON value: llguidance reports the grammar error
        check_json_schema(schema, limits, param="grammar")


# ---------------------------------------------------------------------------------------------- JSON schemas
_MAP_KEYWORDS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DEFS = ("$defs", "definitions")


def check_json_schema(schema: Any, limits: StructuredOutputsLimits, *, param: str = "json_schema") -> None:
    """A JSON schema's depth (following ``$ref``), property, enum and optional-property counts, and whether
    it has a finite instance at all."""
    refs = _walk(schema, limits, param)
    targets = {ref: _resolve(schema, ref) for ref in refs}
    _check_depth_through_refs(schema, targets, limits, param)
    if not _has_finite_instance(schema, targets):
        raise InvalidRequestError(
            "the JSON schema has no finite instance: a part every value needs is false or an empty enum, or "
            "a $ref cycle through required properties, minItems or allOf has no way out", param=param)


def _walk(schema: Any, limits: StructuredOutputsLimits, param: str) -> set[str]:
    """One pass over the document: its plain nesting depth, the property, enum and optional-property
    counts; returns the local ``$ref`` strings it holds."""
    max_depth = limits.max_json_schema_depth
    properties = enums = 0
    refs: set[str] = set()
    stack: list[tuple[Any, int, bool]] = [(schema, 1, True)]    # (node, depth, is a schema)
    while stack:
        node, depth, is_schema = stack.pop()
        if depth > max_depth:
            raise over_limit("the JSON schema's nesting depth", f"more than {max_depth}", "max_json_schema_depth",
                             limits, param)
        if isinstance(node, dict):
            if is_schema:
                ref = node.get("$ref")
                if isinstance(ref, str) and ref.startswith("#"):
                    refs.add(ref)
                enum = node.get("enum")
                if isinstance(enum, list):
                    enums += len(enum)
                props = node.get("properties")
                if isinstance(props, dict):
                    properties += len(props)
                    required = node.get("required")
                    named = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
                    optional = len(props) - len(named & props.keys())
                    if optional > limits.max_optional_properties:
                        raise InvalidRequestError(
                            f"an object of the JSON schema has {optional} optional properties; the grammar "
                            f"parser takes at most {limits.max_optional_properties} in one object at "
                            f"max_parser_row_items={limits.max_parser_row_items} (make more of them required, "
                            f"or raise it with the server's {CONFIG_FLAG} '{{\"max_parser_row_items\": ...}}')",
                            param=param)
                for key, value in node.items():
                    if isinstance(value, (dict, list)):
                        if key in _MAP_KEYWORDS and isinstance(value, dict):
                            stack.extend((v, depth + 2, True) for v in value.values())
                        else:
                            stack.append((value, depth + 1, key not in ("enum", "const", "default", "examples")))
            else:
                stack.extend((v, depth + 1, False) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1, is_schema) for v in node if isinstance(v, (dict, list)))
    if properties > limits.max_json_schema_properties:
        raise over_limit("the JSON schema's property count", properties, "max_json_schema_properties", limits,
                         param)
    if enums > limits.max_json_enum_values:
        raise over_limit("the JSON schema's enum value count", enums, "max_json_enum_values", limits, param)
    return refs


def _resolve(root: Any, ref: str) -> Any:
    """A local ``$ref``'s target (``#``, ``#/$defs/name``, any JSON pointer), or None if it names nothing
    here (an anchor, a missing key: llguidance reports those)."""
    from urllib.parse import unquote
    node = root
    pointer = unquote(ref[1:])
    if not pointer:
        return root
    if not pointer.startswith("/"):
        return None
    for part in pointer[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _children(node: Any, targets: dict[str, Any]) -> Iterable[Any]:
    """The containers a node leads to while a compiler expands it: its own, and a ``$ref``'s target."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _DEFS:
                continue                    # definitions are reached through their $refs
            if isinstance(value, (dict, list)):
                yield value
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = targets.get(ref)
            if isinstance(target, (dict, list)):
                yield target
    else:
        for value in node:
            if isinstance(value, (dict, list)):
                yield value


def _check_depth_through_refs(schema: Any, targets: dict[str, Any], limits: StructuredOutputsLimits,
                              param: str) -> None:
    """The longest path of nested containers from the root, each ``$ref`` read as its target written in
    place (a target already on the path ends it: recursion counts once). Iterative: the path can be far
    deeper than Python's own stack."""
    if not isinstance(schema, (dict, list)) or not targets:
        return                              # no $ref: the plain walk measured it
    max_depth = limits.max_json_schema_depth
    height: dict[int, int] = {}             # id(container) -> the height of its expansion
    on_path: set[int] = set()
    path: list[tuple[Any, Iterable[Any], int]] = [(schema, iter(_children(schema, targets)), 1)]
    on_path.add(id(schema))

    def too_deep():
        return over_limit("the JSON schema's nesting depth through $ref", f"more than {max_depth}",
                          "max_json_schema_depth", limits, param)

    while path:
        node, children, best = path[-1]
        child = next(children, None)
        if child is None:
            path.pop()
            on_path.discard(id(node))
            height[id(node)] = best
            if path:
                parent, siblings, parent_best = path[-1]
                path[-1] = (parent, siblings, max(parent_best, best + 1))
            continue
        key = id(child)
        if key in on_path:
            continue
        known = height.get(key)
        if known is not None:
            if len(path) + known > max_depth:
                raise too_deep()
            path[-1] = (node, children, max(best, known + 1))
            continue
        if len(path) + 1 > max_depth:
            raise too_deep()
        on_path.add(key)
        path.append((child, iter(_children(child, targets)), 1))


def _has_finite_instance(schema: Any, targets: dict[str, Any]) -> bool:
    """Whether the schema admits some finite JSON value, as far as a cheap reading can tell: the least fixed
    point over its ``$ref`` targets of "has a finite instance", where a schema needs its ``allOf`` parts,
    one ``anyOf`` / ``oneOf`` branch, the schemas of an object's required properties and of an array's
    first ``minItems`` items. A schema that might be something other than an object or array (no ``type``,
    or a type list with another type) is taken to have one. Only a definite "no" refuses a request."""
    if not targets:
        return schema is not False
    try:
        return _least_fixed_point(schema, targets)
    except RecursionError:          # nesting raised far past the default depth: no verdict, no refusal
        return True


def _least_fixed_point(schema: Any, targets: dict[str, Any]) -> bool:
    finite: dict[int, bool] = {id(t): False for t in targets.values() if t is not None}
    by_id = {id(t): t for t in targets.values() if t is not None}
    readers: dict[int, set[int]] = {k: set() for k in finite}     # target -> targets whose verdict read it

    def holds(node: Any, reads: set[int]) -> bool:
        if node is False:
            return False
        if not isinstance(node, dict):
            return True
        ref = node.get("$ref")
        if isinstance(ref, str) and ref in targets and targets[ref] is not None:
            tid = id(targets[ref])
            reads.add(tid)
            if not finite[tid]:
                return False
        for part in _schemas(node.get("allOf")):
            if not holds(part, reads):
                return False
        for key in ("anyOf", "oneOf"):
            branches = _schemas(node.get(key))
            if branches and not any(holds(b, reads) for b in branches):
                return False
        if isinstance(node.get("enum"), list) and not node["enum"]:
            return False
        kind = node.get("type")
        if kind == "object" or kind == ["object"]:
            props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            for name in node.get("required") or ():
                if isinstance(name, str) and name in props and not holds(props[name], reads):
                    return False
        elif kind == "array" or kind == ["array"]:
            need = node.get("minItems") if isinstance(node.get("minItems"), int) else 0
            prefix = _schemas(node.get("prefixItems"))
            for item in prefix[:need]:
                if not holds(item, reads):
                    return False
            if need > len(prefix) and isinstance(node.get("items"), (dict, bool)) \
                    and not holds(node["items"], reads):
                return False
        return True

    pending = list(finite)
    while pending:
        tid = pending.pop()
        if finite[tid]:
            continue
        reads: set[int] = set()
        if holds(by_id[tid], reads):
            finite[tid] = True
            pending.extend(readers[tid])
        else:
            for r in reads:
                readers[r].add(tid)
    return holds(schema, set())


def _schemas(value: Any) -> list:
    return value if isinstance(value, list) else []


# ---------------------------------------------------------------------------------------------- tools
def check_tools(tools: list | None, limits: StructuredOutputsLimits) -> None:
    """A chat request's tools: how many, and how many parameters each declares. Takes the request's tool
    objects or their JSON (``{"type": "function", "function": {"name", "parameters"}}``)."""
    if not tools:
        return
    if len(tools) > limits.max_tools:
        raise over_limit("the request's tool count", len(tools), "max_tools", limits, "tools")
    for i, tool in enumerate(tools):
        function = _field(tool, "function")
        params = _field(function, "parameters") if function is not None else None
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(props, dict) and len(props) > limits.max_tool_parameters:
            name = _field(function, "name")
            raise over_limit(f"tools[{i}] ({name!r})'s parameter count", len(props), "max_tool_parameters",
                             limits, f"tools[{i}].function.parameters")


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
