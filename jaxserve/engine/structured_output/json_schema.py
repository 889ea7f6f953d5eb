"""JSON-schema rewrites before a schema becomes a grammar: strict objects (no undeclared keys unless the
schema allows them) and local ``$ref``s moved with a schema embedded in another document.

NOTE (strict objects, xgrammar's strict mode as vLLM serves it): an object schema that declares
``properties`` or ``patternProperties`` and leaves ``additionalProperties`` unset gets
``additionalProperties: false``; one that sets it keeps what it says. Schemas that are intersected share their
keys: the parts of an ``allOf`` (a ``$ref`` beside ``properties`` is one too) are each closed over the keys
any part declares, and the branches of an ``anyOf`` / ``oneOf`` beside ``properties`` over the keys of that
object and of the branch itself (so one branch's keys never leak into another). A local ``$ref`` part of an
``allOf`` is written in place (the shared definition stays closed over its own keys); where a part cannot be
read (a remote or cyclic ``$ref``) the group is left open. ``required`` names count as declared. ``not`` and
``if`` / ``then`` / ``else`` are left as they are (closing them would turn a condition around).
"""
from __future__ import annotations

from typing import Any

from .limits import _resolve

_ONE = ("items", "additionalItems", "contains", "propertyNames", "unevaluatedItems", "additionalProperties")
_MANY = ("prefixItems",)
_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_LEFT_AS_IS = ("not", "if", "then", "else", "enum", "const", "default", "examples")
_EMPTY = (frozenset(), frozenset())     # (names, patterns) a closure must admit


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` whose object schemas allow no undeclared keys (see the module NOTE)."""
    return _Closer(schema).close(schema, _EMPTY)


def relocate_refs(schema: Any, path: str) -> Any:
    """A copy of ``schema`` for embedding at JSON pointer ``path`` (``"/items/properties/parameters"``) of
    another document: each local ``$ref`` (``#``, ``#/$defs/X``) points where its target now lives."""
    if isinstance(schema, dict):
        out = {}
        for key, value in schema.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#") \
                    and (value == "#" or value.startswith("#/")):
                out[key] = "#" + path + value[1:]
            elif key in _LEFT_AS_IS:
                out[key] = value
            elif isinstance(value, dict) and key in _MAPS + ("patternProperties",):
                out[key] = {k: relocate_refs(v, path) for k, v in value.items()}
            else:
                out[key] = relocate_refs(value, path)
        return out
    if isinstance(schema, list):
        return [relocate_refs(v, path) for v in schema]
    return schema


def _declares_object(node: dict) -> bool:
    return isinstance(node.get("properties"), dict) or isinstance(node.get("patternProperties"), dict)


def _own_keys(node: dict) -> tuple[frozenset, frozenset]:
    props = node.get("properties")
    names = set(props) if isinstance(props, dict) else set()
    required = node.get("required")
    if isinstance(required, list):
        names.update(r for r in required if isinstance(r, str))
    patterns = node.get("patternProperties")
    return frozenset(names), frozenset(patterns) if isinstance(patterns, dict) else frozenset()


def _union(*keys: tuple[frozenset, frozenset]) -> tuple[frozenset, frozenset]:
    return frozenset().union(*(k[0] for k in keys)), frozenset().union(*(k[1] for k in keys))


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


class _Closer:
    def __init__(self, root: Any):
        self.root = root
        self.expanding: list[str] = []      # the $refs being written in place (a cycle leaves its group open)

    def target(self, ref: Any) -> dict | None:
        """A local $ref's target, when it can be written in place (not remote, not on its own path)."""
        if not isinstance(ref, str) or not ref.startswith("#") or ref in self.expanding:
            return None
        found = _resolve(self.root, ref)
        return found if isinstance(found, dict) else None

    def declared(self, node: Any, seen: frozenset = frozenset()) -> tuple[frozenset, frozenset] | None:
        """Every key ``node`` may give an object (its own, its parts' and branches'), or None when a part
        cannot be read."""
        if not isinstance(node, dict):
            return _EMPTY
        keys = [_own_keys(node)]
        ref = node.get("$ref")
        if ref is not None:
            found = self.target(ref)
            if found is None or ref in seen:
                return None
            inner = self.declared(found, seen | {ref})
            if inner is None:
                return None
            keys.append(inner)
        for part in (*_list(node.get("allOf")), *_list(node.get("anyOf")), *_list(node.get("oneOf"))):
            inner = self.declared(part, seen)
            if inner is None:
                return None
            keys.append(inner)
        return _union(*keys)

    def close(self, node: Any, admit: tuple[frozenset, frozenset]) -> Any:
        """``node`` with its objects closed; ``admit``: the keys its own closure must allow besides its own
        (those of the schemas it is intersected with)."""
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if ref is not None and admit != _EMPTY and not _declares_object(node):
            return self.inline(node, ref, admit)
        node = dict(node)
        if ref is not None and _declares_object(node):      # a $ref beside properties is one more allOf part
            node["allOf"] = [*_list(node.get("allOf")), {"$ref": node.pop("$ref")}]
        parts, branches = _list(node.get("allOf")), _list(node.get("anyOf")) + _list(node.get("oneOf"))
        # every key this object or its group may hold (None: a part cannot be read, so the group stays open)
        everything = self.declared(node) if parts or _declares_object(node) else None
        if everything is not None:
            everything = _union(everything, admit)
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _LEFT_AS_IS or key == "$ref":
                out[key] = value
            elif key == "allOf" and isinstance(value, list):
                out[key] = value if everything is None else [self.close(p, everything) for p in value]
            elif key in ("anyOf", "oneOf") and isinstance(value, list):
                around = _union(_own_keys(node), admit, *(self.declared(p) or _EMPTY for p in parts)) \
                    if _declares_object(node) or parts else admit
                out[key] = [self.close(b, around) for b in value]
            elif key in _MAPS + ("patternProperties",) and isinstance(value, dict):
                out[key] = {k: self.close(v, _EMPTY) for k, v in value.items()}
            elif key in _MANY or (key == "items" and isinstance(value, list)):
                out[key] = [self.close(v, _EMPTY) for v in _list(value)]
            elif key in _ONE:
                out[key] = self.close(value, _EMPTY)
            else:
                out[key] = value
        if _declares_object(node) and "additionalProperties" not in node and everything is not None:
            names, patterns = everything if parts or branches else _union(_own_keys(node), admit)
            _admit(out, names, patterns)
        return out

    def inline(self, node: dict, ref: str, admit: tuple[frozenset, frozenset]) -> Any:
        """A ``$ref`` intersected with other schemas, written in place so that its copy admits their keys
        (the shared definition stays closed over its own); left as it is where it cannot be read."""
        found = self.target(ref)
        if found is None:
            return node
        self.expanding.append(ref)
        try:
            return self.close({**found, **{k: v for k, v in node.items() if k != "$ref"}}, admit)
        finally:
            self.expanding.pop()


def _admit(out: dict, names: frozenset, patterns: frozenset) -> None:
    """Close ``out`` over ``names`` and ``patterns``: the ones it does not declare join it as ``{}``."""
    props = out.get("properties") if isinstance(out.get("properties"), dict) else {}
    missing = [n for n in sorted(names) if n not in props]
    if missing:
        out["properties"] = {**props, **{n: {} for n in missing}}
    pattern_props = out.get("patternProperties") if isinstance(out.get("patternProperties"), dict) else {}
    missing = [p for p in sorted(patterns) if p not in pattern_props]
    if missing:
        out["patternProperties"] = {**pattern_props, **{p: {} for p in missing}}
    out["additionalProperties"] = False
