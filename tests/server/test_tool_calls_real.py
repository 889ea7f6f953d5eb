"""Tool calling against the real SmolLM2 server (embedded, on CPU): auto, the openai SDK's agent loop and parse(),
required and named choices constrained by structured outputs, strict schemas, and LangChain."""
from __future__ import annotations

import json

import openai
import pytest

from support.servers import smol
from support.tool_calls import DATE_TOOL, NAMED, TIME_TOOL, TOOLS_TEMPLATE, WEATHER_TOOL, ask


# -- the real server (embedded SmolLM2 on CPU) ----------------------------------------------------------

REAL_SERVER = smol("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                   "--trust-request-chat-template")   # the tests send their own tools template


def check_calls_valid(calls, tools=(WEATHER_TOOL,)) -> None:
    """Every call names a given tool and its arguments are a JSON object with the required fields."""
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for c in calls:
        args = json.loads(c.function.arguments)
        assert c.function.name in by_name and isinstance(args, dict)
        assert set(by_name[c.function.name].get("required", [])) <= set(args)
        for key, spec in by_name[c.function.name].get("properties", {}).items():
            if key in args and spec.get("type") == "string":
                assert isinstance(args[key], str)
            if key in args and "enum" in spec:
                assert args[key] in spec["enum"]


def test_real_auto_reaches_the_prompt_and_answers(real_client):
    kw = dict(model="smol", messages=ask("What is the weather in Paris?"), max_tokens=24, temperature=0,
              extra_body={"chat_template": TOOLS_TEMPLATE})
    bare = real_client.chat.completions.create(**kw)
    r = real_client.chat.completions.create(tools=[WEATHER_TOOL], **kw)
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens     # the template rendered the tools
    msg = r.choices[0].message
    if msg.tool_calls:           # the model may call the tool; then the call is well-formed
        check_calls_valid(msg.tool_calls)
        assert r.choices[0].finish_reason == "tool_calls"
    else:
        assert msg.content and r.choices[0].finish_reason in ("stop", "length")
    streamed = list(real_client.chat.completions.create(tools=[WEATHER_TOOL], stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices).strip() == (msg.content or "").strip()


def test_real_second_turn_with_tool_results(real_client):
    history = ask("What is the weather in Paris?") + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18 degrees and sunny"}]
    r = real_client.chat.completions.create(model="smol", messages=history, tools=[WEATHER_TOOL], max_tokens=24,
                                            temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


def weather(city: str, unit: str = "C") -> str:
    return f"18 {unit} and sunny in {city}"


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_real_openai_tool_loop(real_client, choice):
    """The openai SDK's agent loop: forced call -> run the tool -> send the result -> an answer."""
    messages = ask("What is the weather in Paris?")
    first = real_client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                                tool_choice=choice, max_tokens=128, temperature=0)
    msg = first.choices[0].message
    assert msg.tool_calls and first.choices[0].finish_reason == "tool_calls"
    check_calls_valid(msg.tool_calls, (WEATHER_TOOL, TIME_TOOL))
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls:
        args = json.loads(call.function.arguments)
        result = weather(**args) if call.function.name == "get_weather" else "12:00"
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    second = real_client.chat.completions.create(model="smol", messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                                 tool_choice="none", max_tokens=24, temperature=0)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_real_sdk_parse_with_a_pydantic_tool(real_client):
    """The SDK's parse() with pydantic_function_tool (strict: true): the arguments come back as the model."""
    from pydantic import BaseModel

    class GetWeather(BaseModel):
        city: str

    tool = openai.pydantic_function_tool(GetWeather)
    r = real_client.chat.completions.parse(model="smol", messages=ask("What is the weather in Paris?"), tools=[tool],
                                           tool_choice={"type": "function", "function": {"name": "GetWeather"}},
                                           max_tokens=64, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_real_required_without_parallel_calls_makes_one_call(real_client):
    for seed in range(3):
        r = real_client.chat.completions.create(model="smol", messages=ask("What time and date is it?"),
                                                tools=[TIME_TOOL, DATE_TOOL], tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=64, temperature=1.0, seed=seed)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name in ("get_time", "get_date") and json.loads(call.function.arguments) == {}
        assert r.choices[0].finish_reason == "tool_calls"


def test_real_required_cut_off_reports_the_partial_call(real_client):
    r = real_client.chat.completions.create(model="smol", messages=ask("What is the weather in Paris?"),
                                            tools=[WEATHER_TOOL], tool_choice="required", max_tokens=12,
                                            temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "length"
    assert '{"city":"'.startswith(call.function.arguments[:9]) and not r.choices[0].message.content


def test_real_required_sampled_calls_validate(real_client):
    for seed in range(3):
        r = real_client.chat.completions.create(model="smol", messages=ask("Weather?"), tools=[WEATHER_TOOL],
                                                tool_choice="required", max_tokens=128, temperature=1.0, seed=seed)
        check_calls_valid(r.choices[0].message.tool_calls)


def get_weather(city: str) -> str:
    """Current weather of a city."""
    return weather(city)


def test_real_langchain_bind_tools_invoke(real):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    from langchain_core.messages import AIMessage
    llm = langchain_openai.ChatOpenAI(base_url=real.url + "/v1", api_key="x", model="smol", max_tokens=24,
                                      temperature=0, max_retries=0)
    reply = llm.bind_tools([get_weather]).invoke("What is the weather in Paris?")
    assert isinstance(reply, AIMessage)
    for call in reply.tool_calls:          # parsed by LangChain from our tool_calls
        assert call["name"] == "get_weather" and isinstance(call["args"], dict)
    assert reply.tool_calls or reply.content


def test_real_langchain_with_structured_output_function_calling(real):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        degrees: int

    llm = langchain_openai.ChatOpenAI(base_url=real.url + "/v1", api_key="x", model="smol", max_tokens=64,
                                      temperature=0, max_retries=0)
    out = llm.with_structured_output(Weather, method="function_calling").invoke("Paris is 18 degrees today.")
    assert isinstance(out, Weather)


# -- strict schemas (the server's default): the tools below leave additionalProperties unset -----------------

OPEN_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
OPEN_TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
OPEN_DATE = {"type": "function", "function": {"name": "get_date", "parameters": {"type": "object", "properties": {}}}}
DECLARED = {"get_weather": {"city", "unit"}, "get_time": set(), "get_date": set()}


@pytest.mark.parametrize("choice, tools, parallel", [
    (NAMED, [OPEN_WEATHER], True),
    ("required", [OPEN_WEATHER, OPEN_TIME], True),
    ("required", [OPEN_TIME, OPEN_DATE], False),        # the case: keys repeated until max_tokens
])
def test_real_constrained_calls_hold_only_declared_keys(real_client, choice, tools, parallel):
    for seed in range(3):
        r = real_client.chat.completions.create(
            model="smol", messages=ask("What is the weather in Paris, and the time and date?"), tools=tools,
            tool_choice=choice, parallel_tool_calls=parallel, max_tokens=96, temperature=1.0, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].finish_reason == "tool_calls" and (parallel or len(calls) == 1)
        for call in calls:
            assert set(json.loads(call.function.arguments)) <= DECLARED[call.function.name], call


@pytest.mark.parametrize("strict", [True, None])
def test_real_langchain_agent_loop_of_two_tool_turns(real, strict):
    """bind_tools -> call the Python function with the arguments -> ToolMessage -> invoke, twice: an undeclared
    argument would be an unexpected keyword."""
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    from langchain_core.messages import HumanMessage, ToolMessage

    def get_weather(city: str, unit: str = "C") -> str:
        """Current weather of a city."""
        return weather(city, unit)

    llm = langchain_openai.ChatOpenAI(base_url=real.url + "/v1", api_key="x", model="smol", max_tokens=64,
                                      temperature=1.0, max_retries=0, seed=1)
    agent = llm.bind_tools([get_weather], tool_choice="get_weather", strict=strict)
    messages = [HumanMessage("What is the weather in Paris, then in Rome?")]
    for _ in range(2):
        reply = agent.invoke(messages)
        assert reply.tool_calls
        messages.append(reply)
        for call in reply.tool_calls:
            messages.append(ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"]))
    assert isinstance(llm.invoke(messages).content, str)
