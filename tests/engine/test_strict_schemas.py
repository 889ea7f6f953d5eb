"""Strict JSON schemas (vLLM's xgrammar strict mode, here the default): an object schema that declares keys and
leaves ``additionalProperties`` unset allows no others, through nesting, ``allOf`` / ``anyOf`` / ``$ref``; the
``--structured-outputs-config`` key ``disable_additional_properties`` and a request's ``strict: true``; the
required-tool grammar's ``$ref``s. Each rule is checked against llguidance's matcher on the embedded tokenizer."""
from __future__ import annotations

import json

import pytest

from jaxserve.engine.structured_output.grammar import GrammarBuilder
from jaxserve.engine.structured_output.json_schema import close_objects, relocate_refs
from jaxserve.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def tok():
    from jaxserve.models.tokenizers import embedded_tokenizer
    return embedded_tokenizer()


def builder(tok, strict: bool = True) -> GrammarBuilder:
    return GrammarBuilder(tok, len(tok), [tok.eos_token_id], disable_additional_properties=strict)


@pytest.fixture(scope="module")
def strict(tok):
    return builder(tok)


def admits(b: GrammarBuilder, params: StructuredOutputsParams, text: str) -> bool:
    """Whether the compiled constraint accepts ``text`` whole."""
    matcher = b.compile(params).matcher.deep_copy()
    ids = b.hf_tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def accepts(b, schema, text) -> bool:
    return admits(b, StructuredOutputsParams(json=schema), text)


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
           "required": ["city"]}


def test_an_object_allows_only_its_declared_keys_unless_it_says_otherwise(strict):
    assert accepts(strict, WEATHER, '{"city":"Paris"}') and accepts(strict, WEATHER, '{"city":"Paris","unit":"C"}')
    assert not accepts(strict, WEATHER, '{"city":"Paris","country":"FRANCE"}')
    assert accepts(strict, {**WEATHER, "additionalProperties": True}, '{"city":"Paris","country":"FRANCE"}')
    typed = {**WEATHER, "additionalProperties": {"type": "integer"}}
    assert accepts(strict, typed, '{"city":"Paris","n":1}') and not accepts(strict, typed, '{"city":"P","n":"x"}')
    assert accepts(strict, {"type": "object"}, '{"any":1}')        # declares nothing: any object
    # a required name the properties lack is still allowed (and required)
    assert accepts(strict, {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, '{"a":1,"b":2}')


def test_nested_objects_items_and_prefix_items_are_closed(strict):
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "l": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "t": {"type": "array", "prefixItems": [{"type": "object", "properties": {"y": {"type": "integer"}}}]}}}
    assert accepts(strict, schema, '{"a":{"b":1},"l":[{"x":1}],"t":[{"y":2}]}')
    for extra in ('{"a":{"b":1,"c":2}}', '{"l":[{"x":1,"z":1}]}', '{"t":[{"y":1,"z":1}]}', '{"q":1}'):
        assert not accepts(strict, schema, extra), extra


def test_all_of_parts_share_their_keys_and_refs_keep_their_definitions_closed(strict):
    both = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                      {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    assert accepts(strict, both, '{"a":1,"b":2}') and not accepts(strict, both, '{"a":1,"b":2,"c":3}')
    inherits = {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
                          "Pet": {"allOf": [{"$ref": "#/$defs/Base"},
                                            {"properties": {"name": {"type": "string"}}, "required": ["name"]}]}},
                "type": "object", "properties": {"base": {"$ref": "#/$defs/Base"}, "pet": {"$ref": "#/$defs/Pet"}}}
    assert accepts(strict, inherits, '{"base":{"id":1},"pet":{"id":2,"name":"x"}}')
    assert not accepts(strict, inherits, '{"base":{"id":1,"name":"x"}}')       # Base alone stays closed
    assert not accepts(strict, inherits, '{"pet":{"id":2,"name":"x","z":1}}')
    beside = {"$ref": "#/$defs/A", "$defs": {"A": {"type": "object", "properties": {"a": {"type": "integer"}}}},
              "properties": {"b": {"type": "integer"}}}
    assert accepts(strict, beside, '{"b":2,"a":1}') and not accepts(strict, beside, '{"b":2,"c":1}')


def test_any_of_branches_beside_properties_admit_the_shared_keys_and_only_their_own(strict):
    schema = {"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
              "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]}, {"$ref": "#/$defs/Y"}],
              "$defs": {"Y": {"properties": {"y": {"type": "integer"}}, "required": ["y"]}}}
    assert accepts(strict, schema, '{"kind":"a","x":1}') and accepts(strict, schema, '{"kind":"a","y":1}')
    assert not accepts(strict, schema, '{"kind":"a","x":1,"y":2}')
    assert not accepts(strict, schema, '{"kind":"a","x":1,"q":2}')
    union = {"oneOf": [{"type": "object", "properties": {"cat": {"type": "string"}}, "required": ["cat"]},
                       {"type": "object", "properties": {"dog": {"type": "string"}}, "required": ["dog"]}]}
    assert accepts(strict, union, '{"cat":"x"}') and not accepts(strict, union, '{"cat":"x","dog":"y"}')


def test_pattern_properties_recursion_and_data_keywords(strict):
    patterns = {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}}
    assert accepts(strict, patterns, '{"x_a":1}') and not accepts(strict, patterns, '{"y":1}')
    tree = {"$defs": {"N": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/N"}}}}}, "$ref": "#/$defs/N"}
    assert accepts(strict, tree, '{"v":1,"kids":[{"v":2,"kids":[]}]}')
    assert not accepts(strict, tree, '{"v":1,"kids":[{"v":2,"w":3}]}')
    data = {"type": "object", "properties": {"c": {"const": {"properties": 1}}, "e": {"enum": [{"properties": {}}]}}}
    closed = close_objects(data)
    assert closed["properties"]["c"] == data["properties"]["c"] and closed["properties"]["e"] == data["properties"]["e"]
    assert close_objects(data) is not data and "additionalProperties" not in data      # a copy


def test_the_config_key_opens_objects_and_a_request_closes_its_own(tok):
    lenient = builder(tok, strict=False)
    assert accepts(lenient, WEATHER, '{"city":"Paris","country":"FRANCE"}')
    closed = StructuredOutputsParams(json=WEATHER, disable_additional_properties=True)
    assert not admits(lenient, closed, '{"city":"Paris","country":"FRANCE"}')
    assert admits(lenient, closed, '{"city":"P"}')
    # the two are cached apart
    assert lenient.compile(closed) is not None and lenient.compile(StructuredOutputsParams(json=WEATHER)) is not None
    from jaxserve.engine.structured_output.limits import constraint_key
    assert constraint_key(closed) != constraint_key(StructuredOutputsParams(json=WEATHER))


def test_the_required_tool_grammar_points_each_tools_refs_at_its_own_definitions(strict):
    from jaxserve.server.tool_parsers.choice import ToolPlan
    with_refs = {"type": "function", "function": {"name": "book", "parameters": {
        "$defs": {"Seat": {"type": "object", "properties": {"row": {"type": "integer"}}, "required": ["row"]}},
        "type": "object", "properties": {"seat": {"$ref": "#/$defs/Seat"}, "again": {"$ref": "#"}}}}}
    plain = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    for tools in ([with_refs], [plain, with_refs]):
        plan = ToolPlan("required", tools, parallel=False)
        params = plan.structured_outputs()
        assert admits(strict, params, '[{"name":"book","parameters":{"seat":{"row":3}}}]')
        assert admits(strict, params, '[{"name":"book","parameters":{"again":{"seat":{"row":1}}}}]')
        assert not admits(strict, params, '[{"name":"book","parameters":{"seat":{"row":3,"col":1}}}]')
    named = ToolPlan("named", [with_refs], function_name="book").structured_outputs()
    assert admits(strict, named, '{"seat":{"row":3}}')


def test_strict_true_on_a_tool_or_a_json_schema_reaches_the_constraint():
    from jaxserve.server.request_types import ChatCompletionRequest
    from jaxserve.server.sampling import structured_outputs_from_request
    from jaxserve.server.tool_parsers.choice import ToolPlan
    strict_tool = {"type": "function", "function": {"name": "f", "parameters": WEATHER, "strict": True}}
    loose_tool = {"type": "function", "function": {"name": "g", "parameters": WEATHER}}
    tools = [strict_tool, loose_tool]
    assert ToolPlan("named", tools, function_name="f").structured_outputs().disable_additional_properties
    assert not ToolPlan("named", tools, function_name="g").structured_outputs().disable_additional_properties
    assert ToolPlan("required", tools).structured_outputs().disable_additional_properties
    import msgspec
    for strict, body in ((True, {"response_format": {"type": "json_schema", "json_schema": {
            "name": "w", "schema": WEATHER, "strict": True}}}),
                         (False, {"response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "w", "schema": WEATHER}}}),
                         (True, {"structured_outputs": {"json": WEATHER, "disable_additional_properties": True}}),
                         (False, {"guided_json": WEATHER})):
        req = msgspec.json.decode(json.dumps({"messages": [{"role": "user", "content": "x"}], **body}),
                                  type=ChatCompletionRequest)
        assert structured_outputs_from_request(req).disable_additional_properties is strict, body


def test_relocated_refs_point_under_the_new_path():
    params = {"$defs": {"X": {"type": "integer"}}, "type": "object",
              "properties": {"x": {"$ref": "#/$defs/X"}, "self": {"$ref": "#"}, "far": {"$ref": "other.json#/a"}},
              "default": {"$ref": "#/not/a/schema"}}
    moved = relocate_refs(params, "/items/properties/parameters")
    assert moved["properties"]["x"]["$ref"] == "#/items/properties/parameters/$defs/X"
    assert moved["properties"]["self"]["$ref"] == "#/items/properties/parameters"
    assert moved["properties"]["far"] == params["properties"]["far"] and moved["default"] == params["default"]
