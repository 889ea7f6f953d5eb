"""What the tool-calling server tests share (tests/server/test_tool_calls*.py, test_reasoning.py): a chat template
that renders tools, calls and results, the tools they offer, and a scripted engine that answers with fixed
texts behind an in-process server."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import openai

from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from support.server_fakes import FakeEngine, InProcessServer


# A Qwen-style template that renders tools, assistant tool calls (arguments as objects) and tool results.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response id=\"{{ m.tool_call_id }}\">{{ m.content }}"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"], "additionalProperties": False}}}
# no additionalProperties: false, a constrained small model may wander into made-up properties until max_tokens
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
DATE_TOOL = {"type": "function", "function": {"name": "get_date", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
# a named tool choice
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@dataclass
class ScriptedEngine(FakeEngine):
    """FakeEngine that answers with a fixed text: the reply of the first trigger found in the prompt, else
    `default_reply`; `tokens_per_output` tokens per delta (multi-step decoding delivers several)."""
    replies: list = field(default_factory=list)          # (trigger in prompt, reply text)
    default_reply: str = "Plain answer."
    tokens_per_output: int = 1
    chat_template: str = TOOLS_TEMPLATE
    max_model_len: int = 4096

    async def generate(self, prompt_token_ids, sampling_params, request_id: str, prompt=None, *, priority=0,
                       cache_salt=None):
        text = prompt or self.tokenizer.decode(prompt_token_ids)
        self.params_seen[request_id] = sampling_params
        self.prompts_seen[request_id] = text
        reply = next((r for trigger, r in self.replies if trigger in text), self.default_reply)
        ids = list(reply.encode())[:sampling_params.max_tokens]
        step = self.tokens_per_output or len(ids)
        for i in range(0, len(ids), step):
            await asyncio.sleep(0)
            chunk = ids[i:i + step]
            last = i + step >= len(ids)
            finish = ("length" if len(ids) < len(reply.encode()) else "stop") if last else None
            comp = CompletionOutput(0, bytes(chunk).decode("utf-8", "replace"), chunk, None, None, finish, None)
            yield RequestOutput(request_id, prompt, list(prompt_token_ids), None, [comp], last,
                                RequestMetrics(arrival_time=time.time()))


def make_server(engine: FakeEngine, **args) -> tuple[InProcessServer, openai.OpenAI]:
    srv = InProcessServer(engine, **args)
    return srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=30)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]
