"""POST /v1/chat/completions: render the chat template, run n choices, answer or stream."""
from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator

from jaxserve.sampling_params import SamplingParams

from .errors import bad_request
from .protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatLogprobToken, ChatLogprobTop,
                       ChatResponseMessage, DeltaFunctionCall, DeltaToolCall, FunctionCallOut, ToolCallOut, Usage,
                       now, random_id)
from .serving import Choice, Prompt, Serving, race_disconnect
from .streaming import TextFrame, open_stream, sse
from .tool_parsers import ToolCallDelta
from .tool_parsers.choice import ToolPlan, ToolRequestError, plan_tools

MIN_LOGPROB = -9999.0  # JSON has no -inf


def chat_logprobs(serving: Serving, token_ids: list[int], positions: list[dict], top_k: int,
                  name=None) -> ChatLogprobs:
    """``name(token id, decoded text)``: how a token is written (``Serving.token_namer``)."""
    name = name or serving.token_str
    content = []
    for tid, pos in zip(token_ids, positions):
        chosen = pos.get(tid)
        tok = name(tid, chosen.decoded_token if chosen else None)
        tops = sorted(pos.items(), key=lambda kv: -kv[1].logprob)[:top_k]
        content.append(ChatLogprobToken(
            token=tok, logprob=max(chosen.logprob, MIN_LOGPROB) if chosen else MIN_LOGPROB,
            bytes=list(tok.encode("utf-8")),
            top_logprobs=[ChatLogprobTop(t := name(i, lp.decoded_token), max(lp.logprob, MIN_LOGPROB),
                                         list(t.encode("utf-8"))) for i, lp in tops]))
    return ChatLogprobs(content=content)


def tool_plan(serving: Serving, req: ChatCompletionRequest) -> tuple[ToolPlan, Any]:
    """The request's use of tools, and the structured-output constraint a named / required choice needs."""
    try:
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                          enable_auto_tool_choice=serving.args.enable_auto_tool_choice,
                          parser_cls=serving.tool_parser_cls)
        return plan, plan.structured_outputs()
    except ToolRequestError as e:
        raise bad_request(str(e), e.param) from None


def apply_tool_plan(params: SamplingParams, plan: ToolPlan, constraint: Any) -> SamplingParams:
    if plan.needs_special_tokens:  # markers such as [TOOL_CALLS] are special tokens
        params.skip_special_tokens = False
    if constraint is None:
        return params
    if getattr(params, "structured_outputs", None) is not None:
        raise bad_request(f"tool_choice {plan.mode!r} constrains the output to tool calls; it cannot be combined "
                          "with another output constraint (response_format / structured_outputs)", "tool_choice")
    return dataclasses.replace(params, structured_outputs=constraint)


def delta_tool_call(d: ToolCallDelta) -> DeltaToolCall:
    if d.id is not None:  # a call's first delta
        return DeltaToolCall(d.index, d.id, "function", DeltaFunctionCall(d.name, d.arguments))
    return DeltaToolCall(d.index, function=DeltaFunctionCall(arguments=d.arguments))


def tool_finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" when the model stopped after calling tools (a cut-off "length" stays)."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


async def create_chat_completion(serving: Serving, req: ChatCompletionRequest, receive) -> Any:
    serving.check_model(req.model)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    serving.check_unstreamed(req)
    plan, constraint = tool_plan(serving, req)
    serving.check_capacity(req.n)
    text = await serving.render_chat(req.messages, add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message,
                                     chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs,
                                     tools=plan.tools)
    # the template already holds BOS and friends: vLLM encodes it without adding special tokens again
    ids = await serving.encode(text, add_special_tokens=False, what="messages")
    if not ids:
        raise bad_request("the messages rendered to an empty prompt", "messages")
    max_tokens = serving.resolve_max_tokens(len(ids), req.requested_max_tokens(), "messages")
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    rid = random_id("chatcmpl")
    prompt = Prompt(ids, text)
    for i in range(req.n):
        params = serving.sampling_params(req, max_tokens=max_tokens, choice_index=i, logprobs=num_logprobs)
        params = apply_tool_plan(params, plan, constraint)
        prompt.choices.append(Choice(i, f"{rid}-{i}", params, serving.metrics.tracker(len(ids), max_tokens)))
    await serving.compile_structured_outputs([prompt])
    model = req.model or serving.model_name
    top_k = req.top_logprobs or 0
    name = serving.token_namer(req)
    token_ids = bool(req.return_token_ids)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # vLLM's continuous_usage_stats: every chunk carries the usage so far
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
        created = now()

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None, prompt_ids=None) -> bytes:
            return sse(ChatCompletionChunk(id=rid, model=model, choices=choices, created=created, usage=usage,
                                           prompt_token_ids=prompt_ids))
        content_frames: dict[int, TextFrame] = {}  # per choice: its chunk of new content alone

        def content_frame(index: int) -> TextFrame:
            return TextFrame(lambda text: ChatCompletionChunk(id=rid, model=model, choices=[
                ChatChunkChoice(index, ChatDelta(content=text), None, None)], created=created))

        async def render(outputs: AsyncIterator) -> AsyncIterator[bytes]:
            role = serving.args.response_role
            yield chunk([ChatChunkChoice(i, ChatDelta(role=role, content=""), None, None) for i in range(req.n)],
                        prompt_ids=ids if token_ids else None)
            completion_tokens = 0
            parsers = [plan.new_parser() for _ in range(req.n)]
            called = [False] * req.n
            async for c, comp, _ in outputs:
                completion_tokens += len(comp.token_ids)
                parser = parsers[c.index]
                if (parser is None and comp.text and comp.finish_reason is None and not comp.logprobs
                        and not continuous and not token_ids):
                    frame = content_frames.get(c.index)
                    if frame is None:
                        frame = content_frames[c.index] = content_frame(c.index)
                    yield frame(comp.text)
                    continue
                delta, finish = ChatDelta(content=comp.text), comp.finish_reason
                if parser is not None:  # content and tool calls, as far as this output settles them
                    parsed = parser.feed(comp.text, final=finish is not None)
                    calls = [delta_tool_call(d) for d in parsed.tool_calls if plan.parallel or d.index == 0]
                    called[c.index] |= bool(calls)
                    delta = ChatDelta(content=parsed.content or (None if calls else ""), tool_calls=calls or None)
                    finish = tool_finish_reason(finish, called[c.index])
                if not delta.content and not delta.tool_calls and finish is None and not comp.logprobs:
                    continue  # tokens held back while a stop string (or a tool-call marker) may still match
                logprobs = (chat_logprobs(serving, comp.token_ids, comp.logprobs, top_k, name)
                            if num_logprobs is not None and comp.logprobs else None)
                usage = Usage(len(ids), completion_tokens, len(ids) + completion_tokens) if continuous else None
                yield chunk([ChatChunkChoice(c.index, delta, logprobs, finish, comp.stop_reason,
                                             list(comp.token_ids) if token_ids else None)], usage)
            if include_usage:
                yield chunk([], Usage(len(ids), completion_tokens, len(ids) + completion_tokens))

        return await open_stream(serving, [prompt], receive, render)

    accs = await race_disconnect(receive, serving.collect([prompt]))
    choices = []
    for i, acc in enumerate(accs):
        logprobs = (chat_logprobs(serving, acc.token_ids, acc.logprobs, top_k, name)
                    if num_logprobs is not None else None)
        content: str | None = "".join(acc.text)
        calls = []
        parser = plan.new_parser()
        if parser is not None:
            extracted = parser.extract(content)
            content, calls = extracted.content, extracted.tool_calls[:None if plan.parallel else 1]
        message = ChatResponseMessage(serving.args.response_role, content, tool_calls=[
            ToolCallOut(call.id, FunctionCallOut(call.name, call.arguments)) for call in calls])
        choices.append(ChatChoice(i, message, logprobs, tool_finish_reason(acc.finish_reason, bool(calls)),
                                  acc.stop_reason, acc.token_ids if token_ids else None))
    completion_tokens = sum(len(a.token_ids) for a in accs)
    return ChatCompletionResponse(
        id=rid, model=model, choices=choices, usage=Usage(len(ids), completion_tokens, len(ids) + completion_tokens),
        prompt_logprobs=serving.prompt_logprobs_out(accs[0].prompt_logprobs) if req.prompt_logprobs is not None
        else None,
        prompt_token_ids=ids if token_ids else None)
