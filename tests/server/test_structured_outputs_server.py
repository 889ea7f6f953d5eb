"""Structured outputs through the real server (embedded SmolLM2, CPU): the openai SDK's ``parse()``,
LangChain's ``with_structured_output``, vLLM's extra-body fields, streaming, and the 400s."""
from __future__ import annotations

import json
import re

import pytest
from pydantic import BaseModel, Field

from support.api_errors import api_error
from support.servers import smol

KEY = "so-key"


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=50)


SERVER = smol("--api-key", KEY)


ASK = [{"role": "user", "content": "Name a large city as JSON."}]
# the SDK's parse() sends a strict schema (no extra keys); a plain pydantic schema allows them
STRICT_CITY = {**City.model_json_schema(), "additionalProperties": False}


def test_openai_sdk_parse_returns_the_pydantic_object(client):
    r = client.chat.completions.parse(model="smol", messages=ASK, response_format=City, max_tokens=64,
                                      temperature=0)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name and r.choices[0].finish_reason == "stop"


def test_langchain_with_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(model="smol", base_url=server.url + "/v1", api_key=KEY, temperature=0,
                                        max_tokens=64, max_retries=0)
    city = model.with_structured_output(City, method="json_schema").invoke("Name a large city.")
    assert isinstance(city, City) and city.name


def test_streaming_with_a_json_schema(client):
    schema = STRICT_CITY
    kw = dict(model="smol", messages=ASK, max_tokens=64, temperature=0,
              response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    City.model_validate_json(full)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_vllm_extra_body_fields(client):
    r = client.completions.create(model="smol", prompt="My phone number is", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text)
    r = client.completions.create(model="smol", prompt="The sky is", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["blue", "green"]})
    assert r.choices[0].text in ("blue", "green")
    r = client.chat.completions.create(model="smol", messages=ASK, max_tokens=64, temperature=0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model="smol", messages=ASK, max_tokens=64, temperature=0,
                                       extra_body={"guided_json": STRICT_CITY})
    City.model_validate_json(r.choices[0].message.content)
    # a structural tag: free text until the trigger (the model's own answer starts "The city"), then the rest of
    # the structure's begin, a JSON string of at most 12 characters and its end; then free text again
    tag = {"type": "structural_tag", "triggers": ["The city"], "structures": [
        {"begin": "The city of ", "schema": {"type": "string", "maxLength": 12}, "end": "."}]}
    for fmt in ({"response_format": tag}, {"structured_outputs": {"structural_tag": json.dumps(tag)}}):
        r = client.chat.completions.create(model="smol", messages=ASK, max_tokens=40, temperature=0, extra_body=fmt)
        assert re.match(r'The city of "[^"]{0,12}"\.', r.choices[0].message.content), r.choices[0].message.content


@pytest.mark.parametrize("body, param, message", [
    ({"structured_outputs": {"regex": "a(b"}}, "regex", "regex does not compile"),
    ({"guided_json": {"type": "object", "if": {}}}, "json_schema", "cannot enforce"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "json_schema", "invalid JSON schema"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regexp": "a"}}, None, "regexp"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<b>"],
                          "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}]}},
     "structural_tag", "starts with none of the triggers"),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"structured_outputs": {"structural_tag": {"triggers": ["<a>"], "structures": [
        {"begin": "<a>", "schema": {"type": "nope"}, "end": "</a>"}]}}}, "structural_tag", "does not compile"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_answer_400_naming_the_problem(http, body, param, message, stream):
    r = http.post("/v1/chat/completions", json={"model": "smol", "messages": ASK, "max_tokens": 8,
                                                "stream": stream, **body})
    err = api_error(r, 400)
    assert message in err["message"] and (param is None or err["param"] == param), err


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip: str = Field(pattern=r"^\d{5}$")


class Person(BaseModel):
    name: str = Field(max_length=20)
    address: Address
    tags: list[Address] = Field(max_length=2)


@pytest.mark.parametrize("field", ["response_format", "guided_json"])
def test_a_plain_pydantic_schema_gets_only_its_declared_keys(client, field):
    """model_json_schema() leaves additionalProperties unset at every level ($defs included): the server's
    strict default closes them all: the reply validates and holds no key the models do not declare."""
    schema = Person.model_json_schema()
    assert "additionalProperties" not in json.dumps(schema)
    body = ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}}
            if field == "response_format" else {"extra_body": {"guided_json": schema}})
    for seed in range(2):
        r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "A person as JSON."}],
                                           max_tokens=128, temperature=1.0, seed=seed, **body)
        assert r.choices[0].finish_reason == "stop"
        person = json.loads(r.choices[0].message.content)
        Person.model_validate(person)
        assert set(person) <= set(Person.model_fields)
        for address in [person["address"], *person.get("tags", [])]:
            assert set(address) <= set(Address.model_fields)
