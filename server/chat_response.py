"""A chat request's outputs as its answer: the whole ChatCompletionResponse, or SSE chunks as outputs arrive
(the thinking part a --reasoning-parser splits off, content, the tool calls the tool plan's parser reads from
the content, logprobs, usage)."""
from __future__ import annotations

from typing import AsyncIterator

from .engine_runs import Accumulated, Prompt
from .logprobs import chat_logprobs, prompt_logprobs_out
from .reasoning import ThinkingParser, answer_thinking
from .request_types import ChatCompletionRequest
from .response_types import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, ChatDelta,
                             ChatResponseMessage, DeltaFunctionCall, DeltaToolCall, FunctionCallOut, ToolCallOut,
                             Usage, now)
from .serving import Serving
from .streaming import TextFrame, sse
from .tool_parsers import ToolCallDelta
from .tool_parsers.choice import ToolPlan


def delta_tool_call(d: ToolCallDelta) -> DeltaToolCall:
    if d.id is not None:  # a call's first delta
        return DeltaToolCall(d.index, d.id, "function", DeltaFunctionCall(d.name, d.arguments))
    return DeltaToolCall(d.index, function=DeltaFunctionCall(arguments=d.arguments))


def tool_finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" when the model stopped after calling tools (a cut-off "length" stays)."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def echoed_content(req: ChatCompletionRequest, response_role: str) -> str | None:
    """With ``echo`` (vLLM's rule): the content the reply starts with, the last message's, when that message
    has the reply's role (the response role, or with add_generation_prompt false the last message's own);
    None without echo."""
    if not req.echo:
        return None
    last = req.messages[-1]
    role = response_role if req.add_generation_prompt else last.role
    return last.text() if last.role == role else ""


class ChatRenderer:
    """Renders one chat request's outputs (``stream`` or ``response``)."""

    def __init__(self, serving: Serving, req: ChatCompletionRequest, plan: ToolPlan, prompt: Prompt,
                 request_id: str):
        self.req = req
        self.plan = plan
        self.prompt_ids = prompt.token_ids
        self.request_id = request_id
        self.model = req.model or serving.model_name
        self.role = serving.args.response_role
        self.num_logprobs = req.requested_logprobs()
        self.top_k = req.top_logprobs or 0
        self.name = serving.token_names.namer(req)
        self.token_str = serving.token_names.token_str
        self.token_ids = bool(req.return_token_ids)
        self.created = now()
        self.include_reasoning = req.include_reasoning
        # None: no thinking part in this answer (reasoning.py says when)
        self.thinking_cls: type[ThinkingParser] | None = answer_thinking(
            serving.reasoning_parser_cls, req.chat_template_kwargs, req.reasoning_effort, prompt.text)
        self.echo = echoed_content(req, self.role)

    def new_thinking_parser(self) -> ThinkingParser | None:
        """A fresh reasoning parser for one generated choice (None: the output has no thinking part)."""
        return self.thinking_cls() if self.thinking_cls is not None else None

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None, prompt_ids=None) -> bytes:
        return sse(ChatCompletionChunk(id=self.request_id, model=self.model, choices=choices, created=self.created,
                                       usage=usage, prompt_token_ids=prompt_ids))

    def _content_frame(self, index: int) -> TextFrame:
        return TextFrame(lambda text: ChatCompletionChunk(id=self.request_id, model=self.model, choices=[
            ChatChunkChoice(index, ChatDelta(content=text), None, None)], created=self.created))

    async def stream(self, outputs: AsyncIterator) -> AsyncIterator[bytes]:
        req, plan, chunk, name = self.req, self.plan, self._chunk, self.name
        num_logprobs, top_k, token_ids = self.num_logprobs, self.top_k, self.token_ids
        num_prompt_tokens = len(self.prompt_ids)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # vLLM's continuous_usage_stats: every chunk carries the usage so far
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
        content_frames: dict[int, TextFrame] = {}  # per choice: its chunk of new content alone
        yield chunk([ChatChunkChoice(i, ChatDelta(role=self.role, content=""), None, None) for i in range(req.n)],
                    prompt_ids=self.prompt_ids if token_ids else None)
        if self.echo:
            for i in range(req.n):
                yield chunk([ChatChunkChoice(i, ChatDelta(content=self.echo), None, None)])
        completion_tokens = 0
        parsers = [plan.new_parser() for _ in range(req.n)]
        thinkers = [self.new_thinking_parser() for _ in range(req.n)]
        called = [False] * req.n
        async for c, comp, _ in outputs:
            completion_tokens += len(comp.token_ids)
            parser, thinker = parsers[c.index], thinkers[c.index]
            if (parser is None and thinker is None and comp.text and comp.finish_reason is None
                    and not comp.logprobs and not continuous and not token_ids):
                frame = content_frames.get(c.index)
                if frame is None:
                    frame = content_frames[c.index] = self._content_frame(c.index)
                yield frame(comp.text)
                continue
            text, reasoning, finish = comp.text, None, comp.finish_reason
            if thinker is not None:   # the thinking part first; the rest is content
                split = thinker.feed(text, final=finish is not None)
                text, reasoning = split.content, (split.reasoning or None) if self.include_reasoning else None
                if not thinker.thinking:
                    thinkers[c.index] = None
            calls = None
            if parser is not None:  # content and tool calls, as far as this output settles them
                parsed = parser.feed(text, final=finish is not None)
                calls = [delta_tool_call(d) for d in parsed.tool_calls if plan.parallel or d.index == 0] or None
                called[c.index] |= bool(calls)
                text = parsed.content
                finish = tool_finish_reason(finish, called[c.index])
            delta = ChatDelta(content=text or (None if calls or reasoning else ""), reasoning_content=reasoning,
                              reasoning=reasoning, tool_calls=calls)
            if not delta.content and not reasoning and not calls and finish is None and not comp.logprobs:
                continue  # tokens held back while a stop string (or a tool-call or think marker) may still match
            logprobs = (chat_logprobs(comp.token_ids, comp.logprobs, top_k, name)
                        if num_logprobs is not None and comp.logprobs else None)
            usage = (Usage(num_prompt_tokens, completion_tokens, num_prompt_tokens + completion_tokens)
                     if continuous else None)
            yield chunk([ChatChunkChoice(c.index, delta, logprobs, finish, comp.stop_reason,
                                         list(comp.token_ids) if token_ids else None)], usage)
        if include_usage:
            yield chunk([], Usage(num_prompt_tokens, completion_tokens, num_prompt_tokens + completion_tokens))

    def response(self, accs: list[Accumulated]) -> ChatCompletionResponse:
        req, plan, token_ids = self.req, self.plan, self.token_ids
        choices = []
        for i, acc in enumerate(accs):
            logprobs = (chat_logprobs(acc.token_ids, acc.logprobs, self.top_k, self.name)
                        if self.num_logprobs is not None else None)
            content: str | None = "".join(acc.text)
            reasoning = None
            thinker = self.new_thinking_parser()
            if thinker is not None:
                split = thinker.feed(content, final=True)
                content = split.content or None       # vLLM's: null when nothing follows the thinking part
                reasoning = (split.reasoning or None) if self.include_reasoning else None
            calls = []
            parser = plan.new_parser()
            if parser is not None and content is not None:
                extracted = parser.extract(content)
                content, calls = extracted.content, extracted.tool_calls[:None if plan.parallel else 1]
            if self.echo is not None:
                content = self.echo + (content or "")
            message = ChatResponseMessage(self.role, content, tool_calls=[
                ToolCallOut(call.id, FunctionCallOut(call.name, call.arguments)) for call in calls],
                reasoning_content=reasoning, reasoning=reasoning)
            choices.append(ChatChoice(i, message, logprobs, tool_finish_reason(acc.finish_reason, bool(calls)),
                                      acc.stop_reason, acc.token_ids if token_ids else None))
        num_prompt_tokens = len(self.prompt_ids)
        completion_tokens = sum(len(a.token_ids) for a in accs)
        return ChatCompletionResponse(
            id=self.request_id, model=self.model, choices=choices,
            usage=Usage(num_prompt_tokens, completion_tokens, num_prompt_tokens + completion_tokens),
            prompt_logprobs=prompt_logprobs_out(accs[0].prompt_logprobs, self.token_str)
            if req.prompt_logprobs is not None else None,
            prompt_token_ids=self.prompt_ids if token_ids else None)
