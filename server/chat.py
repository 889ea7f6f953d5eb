"""POST /v1/chat/completions: render the chat template, run n choices, answer or stream."""
from __future__ import annotations

from typing import Any, AsyncIterator

from .errors import bad_request
from .protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatLogprobToken, ChatLogprobTop,
                       ChatResponseMessage, Usage, now, random_id)
from .serving import Choice, Prompt, Serving, race_disconnect
from .streaming import open_stream, sse

MIN_LOGPROB = -9999.0  # JSON has no -inf


def chat_logprobs(serving: Serving, token_ids: list[int], positions: list[dict], top_k: int) -> ChatLogprobs:
    content = []
    for tid, pos in zip(token_ids, positions):
        chosen = pos.get(tid)
        tok = serving.token_str(tid, chosen.decoded_token if chosen else None)
        tops = sorted(pos.items(), key=lambda kv: -kv[1].logprob)[:top_k]
        content.append(ChatLogprobToken(
            token=tok, logprob=max(chosen.logprob, MIN_LOGPROB) if chosen else MIN_LOGPROB,
            bytes=list(tok.encode("utf-8")),
            top_logprobs=[ChatLogprobTop(t := serving.token_str(i, lp.decoded_token), max(lp.logprob, MIN_LOGPROB),
                                         list(t.encode("utf-8"))) for i, lp in tops]))
    return ChatLogprobs(content=content)


async def create_chat_completion(serving: Serving, req: ChatCompletionRequest, receive) -> Any:
    serving.check_model(req.model)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    serving.check_capacity()
    text = await serving.render_chat(req.messages, add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message,
                                     chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs)
    # the template already holds BOS and friends: vLLM encodes it without adding special tokens again
    ids = await serving.encode(text, add_special_tokens=False)
    if not ids:
        raise bad_request("the messages rendered to an empty prompt", "messages")
    max_tokens = serving.resolve_max_tokens(len(ids), req.requested_max_tokens(), "messages")
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    rid = random_id("chatcmpl")
    prompt = Prompt(ids, text)
    for i in range(req.n):
        params = serving.sampling_params(req, max_tokens=max_tokens, choice_index=i, logprobs=num_logprobs)
        prompt.choices.append(Choice(i, f"{rid}-{i}", params, serving.metrics.tracker(len(ids))))
    await serving.compile_structured_outputs([prompt])
    model = req.model or serving.model_name
    top_k = req.top_logprobs or 0

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # vLLM's continuous_usage_stats: every chunk carries the usage so far
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
        created = now()

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
            return sse(ChatCompletionChunk(id=rid, model=model, choices=choices, created=created, usage=usage))

        async def render(outputs: AsyncIterator) -> AsyncIterator[bytes]:
            role = serving.args.response_role
            yield chunk([ChatChunkChoice(i, ChatDelta(role=role, content=""), None, None) for i in range(req.n)])
            completion_tokens = 0
            async for c, comp, _ in outputs:
                completion_tokens += len(comp.token_ids)
                if not comp.text and comp.finish_reason is None and not comp.logprobs:
                    continue  # tokens held back while a stop string may still match
                logprobs = (chat_logprobs(serving, comp.token_ids, comp.logprobs, top_k)
                            if num_logprobs is not None and comp.logprobs else None)
                usage = Usage(len(ids), completion_tokens, len(ids) + completion_tokens) if continuous else None
                yield chunk([ChatChunkChoice(c.index, ChatDelta(content=comp.text), logprobs, comp.finish_reason,
                                             comp.stop_reason)], usage)
            if include_usage:
                yield chunk([], Usage(len(ids), completion_tokens, len(ids) + completion_tokens))

        return await open_stream(serving, [prompt], receive, render)

    accs = await race_disconnect(receive, serving.collect([prompt]))
    choices = []
    for i, acc in enumerate(accs):
        logprobs = (chat_logprobs(serving, acc.token_ids, acc.logprobs, top_k)
                    if num_logprobs is not None else None)
        choices.append(ChatChoice(i, ChatResponseMessage(serving.args.response_role, "".join(acc.text)), logprobs,
                                  acc.finish_reason, acc.stop_reason))
    completion_tokens = sum(len(a.token_ids) for a in accs)
    return ChatCompletionResponse(id=rid, model=model, choices=choices,
                                  usage=Usage(len(ids), completion_tokens, len(ids) + completion_tokens))
