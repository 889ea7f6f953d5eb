"""The limits on a constraint, checked before any compile (pure Python, no llguidance): real-world schemas
pass, each shape that would exhaust a compiler thread's stack or hold a worker for long is refused with a
message naming the limit, the value and the --structured-outputs-config key, and a schema with no finite
instance is refused."""
from __future__ import annotations

import dataclasses
import json
import time
from types import SimpleNamespace
from typing import Literal, Optional

import pytest
from pydantic import BaseModel, Field, create_model

from jaxserve.engine.structured_output import StructuredOutputsLimits, check_constraint, check_json_schema, \
    check_tools
from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import StructuredOutputsParams

LIMITS = StructuredOutputsLimits()


def refusal(params_or_schema, limits=LIMITS, **kw) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        if isinstance(params_or_schema, StructuredOutputsParams):
            check_constraint(params_or_schema, limits)
        else:
            check_json_schema(params_or_schema, limits, **kw)
    return e.value


def names_key(error: InvalidRequestError, key: str) -> None:
    """The message names the limit with its value and the config key that raises it."""
    assert f"{key}={getattr(LIMITS, key)}" in error.message, error.message
    assert "--structured-outputs-config" in error.message and f'"{key}"' in error.message, error.message


def nested(depth: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def defs_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def chain_grammar(n: int) -> str:
    return "\n".join(["start: r0", *(f'r{i}: "a" r{i + 1}' for i in range(n)), f'r{n}: "b"'])


# ---------------------------------------------------------------------------------------------- the dataclass
def test_limits_are_a_frozen_dataclass_read_from_a_config():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LIMITS.max_tools = 1
    cfg = SimpleNamespace(max_tools=7, disable_any_whitespace=True, unrelated=1)
    assert StructuredOutputsLimits.from_config(cfg) == StructuredOutputsLimits(max_tools=7)
    with pytest.raises(ValueError, match="max_json_schema_depth"):
        StructuredOutputsLimits(max_json_schema_depth=0)


# ---------------------------------------------------------------------------------------------- real schemas
class Address(BaseModel):
    street: str
    city: str = Field(max_length=40)
    country: Literal["FR", "DE", "US", "JP"]


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=150)
    addresses: list[Address]
    manager: Optional["Person"] = None          # recursive, with a base case
    tags: dict[str, str] = {}


class Tree(BaseModel):
    value: int
    children: list["Tree"] = []


def deep_models(levels: int) -> dict:
    """A chain of pydantic models nested ``levels`` deep through $defs (OpenAI allows 10)."""
    model = create_model("M0", x=(int, ...))
    for i in range(1, levels + 1):
        model = create_model(f"M{i}", child=(model, ...), items=(list[model], []))
    return model.model_json_schema()


@pytest.mark.parametrize("schema", [
    Person.model_json_schema(), Tree.model_json_schema(), deep_models(10), deep_models(20),
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)},
     "required": [f"p{i}" for i in range(5000)], "additionalProperties": False},
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}},
    {"type": "object", "properties": {"k": {"enum": [f"v{i}" for i in range(10_000)]}}},
    {"anyOf": [{"type": "string"}, {"type": "array", "items": {"$ref": "#"}}]},
    {"$ref": "#/definitions/a", "definitions": {"a": {"type": ["object", "null"], "properties": {
        "next": {"$ref": "#/definitions/a"}}, "required": ["next"]}}},
    True, {},
], ids=["person", "tree", "10-levels", "20-levels", "5000-required", "300-optional", "10000-enum", "json-array",
        "nullable-list", "true", "empty"])
def test_real_world_schemas_pass(schema):
    check_json_schema(schema, LIMITS)
    check_constraint(StructuredOutputsParams(json=schema), LIMITS)


# ---------------------------------------------------------------------------------------------- depth
def test_a_schema_nested_past_the_depth_is_refused():
    check_json_schema(nested(60), LIMITS)                  # 2 containers a level: 121 deep
    e = refusal(nested(70))
    names_key(e, "max_json_schema_depth")
    assert e.param == "json_schema"


def test_a_2000_deep_defs_chain_is_refused_through_its_refs():
    schema = defs_chain(2000)
    t = time.perf_counter()
    e = refusal(schema)
    assert time.perf_counter() - t < 10.0        # linear in the chain (an exponential walk would not return)
    names_key(e, "max_json_schema_depth")
    assert "$ref" in e.message
    check_json_schema(schema, StructuredOutputsLimits(max_json_schema_depth=10_000))   # iterative: no recursion


def test_recursion_counts_once_and_a_shared_definition_is_measured_once():
    wide = {"$defs": {"leaf": nested(20)}, "type": "object",
            "properties": {f"p{i}": {"$ref": "#/$defs/leaf"} for i in range(2000)},
            "required": [f"p{i}" for i in range(2000)]}
    t = time.perf_counter()
    check_json_schema(wide, LIMITS)
    assert time.perf_counter() - t < 1.0
    # the definition (125 deep) fits where it is written, not where an array's items refer to it
    deep = {"$defs": {"leaf": nested(62)}, "type": "object",
            "properties": {"a": {"type": "array", "items": {"$ref": "#/$defs/leaf"}}}}
    e = refusal(deep)
    names_key(e, "max_json_schema_depth")
    assert "through $ref" in e.message


# ---------------------------------------------------------------------------------------------- counts
def test_property_enum_and_optional_property_counts():
    props = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5001)},
             "required": [f"p{i}" for i in range(5001)]}
    names_key(refusal(props), "max_json_schema_properties")
    enums = {"anyOf": [{"enum": list(range(6000))}, {"enum": list(range(6000))}]}
    names_key(refusal(enums), "max_json_enum_values")
    ok = LIMITS.max_optional_properties
    check_json_schema({"type": "object", "properties": {f"p{i}": {} for i in range(ok)}}, LIMITS)
    too_many = {"type": "object", "properties": {"args": {
        "type": "object", "properties": {f"p{i}": {} for i in range(ok + 1)}}}}
    e = refusal(too_many)
    assert f"{ok + 1} optional properties" in e.message and "max_parser_row_items" in e.message
    check_json_schema(too_many, StructuredOutputsLimits(max_parser_row_items=4000))


def test_a_60000_option_choice_is_refused_before_anything_else():
    params = StructuredOutputsParams(choice=[f"option {i}" for i in range(60_000)])
    t = time.perf_counter()
    e = refusal(params)
    assert time.perf_counter() - t < 0.5
    names_key(e, "max_choice_options")
    assert e.param == "choice" and "60000" in e.message


def test_the_constraint_size_counts_utf8_bytes():
    names_key(refusal(StructuredOutputsParams(regex="a" * (LIMITS.max_constraint_bytes + 1))), "max_constraint_bytes")
    check_constraint(StructuredOutputsParams(regex="é" * (LIMITS.max_constraint_bytes // 4)), LIMITS)
    e = refusal(StructuredOutputsParams(regex="é" * (LIMITS.max_constraint_bytes // 2 + 1)))
    assert str(LIMITS.max_constraint_bytes + 2) in e.message


def test_grammar_rules_are_counted_in_lark_and_gbnf():
    check_constraint(StructuredOutputsParams(grammar=chain_grammar(3000)), LIMITS)
    e = refusal(StructuredOutputsParams(grammar=chain_grammar(6000)))
    names_key(e, "max_grammar_rules")
    assert e.param == "grammar" and "6002" in e.message
    gbnf = "\n".join(["root ::= r0", *(f'r{i} ::= "a" r{i + 1}' for i in range(6000)), 'r6000 ::= "b"'])
    names_key(refusal(StructuredOutputsParams(grammar=gbnf)), "max_grammar_rules")


def test_a_json_schema_embedded_in_a_lark_grammar_is_checked():
    grammar = "start: obj\nobj: %json " + json.dumps(defs_chain(500))
    e = refusal(StructuredOutputsParams(grammar=grammar))
    names_key(e, "max_json_schema_depth")
    assert e.param == "grammar"
    check_constraint(StructuredOutputsParams(grammar="start: obj\nobj: %json " + json.dumps(Tree.model_json_schema())),
                     LIMITS)


# ---------------------------------------------------------------------------------------------- finiteness
@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"$defs": {"A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]},
               "B": {"type": "array", "items": {"$ref": "#/$defs/A"}, "minItems": 1}}, "$ref": "#/$defs/A"},
    {"allOf": [{"$ref": "#"}], "type": "object"},
    {"anyOf": [{"$ref": "#"}, {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}]},
    False,
], ids=["ref-root", "required-self", "mutual-min-items", "all-of-self", "any-of-all-infinite", "false"])
def test_a_schema_with_no_finite_instance_is_refused(schema):
    e = refusal(schema)
    assert "has no finite instance" in e.message


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},
    {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}]},
    {"type": "array", "items": {"$ref": "#"}},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]},
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},        # no type: a number satisfies it
], ids=["optional-self", "nullable", "array-may-be-empty", "unresolved-ref", "untyped"])
def test_a_recursive_schema_with_a_way_out_passes(schema):
    check_json_schema(schema, LIMITS)


# ---------------------------------------------------------------------------------------------- tools
def tool(name: str, n_params: int, as_dict: bool = True):
    fn = {"name": name, "parameters": {"type": "object",
                                       "properties": {f"p{i}": {"type": "string"} for i in range(n_params)}}}
    if as_dict:
        return {"type": "function", "function": fn}
    return SimpleNamespace(type="function", function=SimpleNamespace(**fn))


def test_tool_count_and_parameter_count():
    check_tools(None, LIMITS)
    check_tools([tool(f"t{i}", 20) for i in range(128)], LIMITS)
    e = refusal_of_tools([tool(f"t{i}", 1) for i in range(129)])
    names_key(e, "max_tools")
    assert e.param == "tools"
    e = refusal_of_tools([tool("small", 2), tool("huge", 600, as_dict=False)])
    names_key(e, "max_tool_parameters")
    assert e.param == "tools[1].function.parameters" and "'huge'" in e.message and "600" in e.message


def refusal_of_tools(tools) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as e:
        check_tools(tools, LIMITS)
    return e.value


def test_checks_of_a_megabyte_schema_take_well_under_a_second():
    schema = {"type": "object", "properties": {
        f"p{i}": {"type": "object", "properties": {"a": {"type": "string", "description": "x" * 200},
                                                   "b": {"enum": ["u", "v", "w"]}}, "required": ["a", "b"]}
        for i in range(1600)}, "required": [f"p{i}" for i in range(1600)]}
    params = StructuredOutputsParams(json=schema)
    assert 0.25 * LIMITS.max_constraint_bytes < len(params.spec) < LIMITS.max_constraint_bytes
    t = time.perf_counter()
    check_constraint(params, LIMITS)
    assert time.perf_counter() - t < 1.0


def test_a_schema_nested_past_the_json_encoder_is_a_depth_refusal():
    from jaxserve.engine.structured_output.limits import constraint_spec
    schema: dict = {}
    for _ in range(5000):
        schema = {"a": schema}
    e = refusal(StructuredOutputsParams(json=schema))
    assert "max_json_schema_depth" in e.message
    with pytest.raises(InvalidRequestError, match="max_json_schema_depth"):
        constraint_spec(StructuredOutputsParams(json=schema))
