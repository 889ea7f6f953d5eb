"""POST /v1/completions: one or many prompts (text or token ids), n choices each, answer or stream."""
from __future__ import annotations

from typing import Any, AsyncIterator

from .errors import bad_request
from .protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, Usage, now,
                       random_id)
from .serving import Choice, Prompt, Serving, race_disconnect
from .streaming import TextFrame, open_stream, sse

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
MIN_LOGPROB = -9999.0


def completion_logprobs(serving: Serving, token_ids: list[int], positions: list[dict], top_k: int,
                        offset: int, name=None) -> CompletionLogprobs:
    """``name(token id, decoded text)``: how a token is written (``Serving.token_namer``)."""
    name = name or serving.token_str
    out = CompletionLogprobs()
    for tid, pos in zip(token_ids, positions):
        chosen = pos.get(tid)
        tok = name(tid, chosen.decoded_token if chosen else None)
        out.tokens.append(tok)
        out.token_logprobs.append(max(chosen.logprob, MIN_LOGPROB) if chosen else MIN_LOGPROB)
        tops = sorted(pos.items(), key=lambda kv: -kv[1].logprob)[:top_k]
        out.top_logprobs.append({name(i, lp.decoded_token): max(lp.logprob, MIN_LOGPROB)
                                 for i, lp in tops} if top_k else None)
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def prompt_then_completion(serving: Serving, prompt_ids: list[int], prompt_lps: list, top_k: int,
                           completion: CompletionLogprobs, name=None) -> CompletionLogprobs:
    """echo + logprobs: the prompt's tokens first (the first one has no logprob: nothing precedes it), then
    the completion's, with text offsets running through both (OpenAI's legacy completions format)."""
    name = name or serving.token_str
    out = CompletionLogprobs()
    offset = 0
    for i, tid in enumerate(prompt_ids):
        pos = prompt_lps[i] if i < len(prompt_lps) else None
        chosen = pos.get(tid) if pos else None
        tok = name(tid, chosen.decoded_token if chosen else None)
        out.tokens.append(tok)
        out.token_logprobs.append(max(chosen.logprob, MIN_LOGPROB) if chosen else None)
        tops = sorted(pos.items(), key=lambda kv: -kv[1].logprob)[:top_k] if pos else []
        out.top_logprobs.append({name(t, lp.decoded_token): max(lp.logprob, MIN_LOGPROB)
                                 for t, lp in tops} if pos and top_k else None)
        out.text_offset.append(offset)
        offset += len(tok)
    out.tokens += completion.tokens
    out.token_logprobs += completion.token_logprobs
    out.top_logprobs += completion.top_logprobs
    out.text_offset += completion.text_offset
    return out


async def create_completion(serving: Serving, req: CompletionRequest, receive) -> Any:
    serving.check_model(req.model)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is not supported (only best_of == n)", "best_of")
    # echo + logprobs scores the prompt too (prompt logprobs: what lm-eval's loglikelihood tasks send, often
    # with max_tokens=0 = score only); answered whole, not streamed
    score_prompt = bool(req.echo and req.logprobs is not None)
    if score_prompt and req.stream:
        raise bad_request("echo with logprobs is supported without stream only", "stream")
    serving.check_unstreamed(req)
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be at least 1 (0 only with echo, to score the prompt)", "max_tokens")
    try:
        batch = req.prompt_batch()
    except ValueError as e:
        raise bad_request(str(e), "prompt") from e
    serving.check_capacity(len(batch) * req.n)
    requested = req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS
    echo_only = req.echo and requested == 0      # the engine still samples one token; it is not returned
    if echo_only:
        requested = 1
    rid = random_id("cmpl")
    prompts: list[Prompt] = []
    for p_idx, p in enumerate(batch):
        if isinstance(p, str):
            ids = await serving.encode(p, add_special_tokens=req.add_special_tokens)
            text = p
        else:
            serving.check_token_ids(p, "prompt")
            ids, text = p, None
        if not ids:
            raise bad_request("the prompt is empty: give at least one token", "prompt")
        max_tokens = serving.resolve_max_tokens(len(ids), requested, "prompt")
        prompt = Prompt(ids, text)
        for i in range(req.n):
            idx = p_idx * req.n + i
            params = serving.sampling_params(req, max_tokens=max_tokens, choice_index=i, logprobs=req.logprobs)
            if score_prompt and params.prompt_logprobs != -1:
                params.prompt_logprobs = max(req.logprobs, params.prompt_logprobs or 0)
            prompt.choices.append(Choice(idx, f"{rid}-{idx}", params, serving.metrics.tracker(len(ids), max_tokens)))
        prompts.append(prompt)
    await serving.compile_structured_outputs(prompts)
    model = req.model or serving.model_name
    num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
    top_k = req.logprobs or 0
    name = serving.token_namer(req)
    token_ids = bool(req.return_token_ids)

    def echo_text(p: Prompt) -> str:
        return p.text if p.text is not None else serving.tokenizer.decode(p.token_ids)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)  # vLLM's extra
        created = now()
        offsets = {c.index: 0 for p in prompts for c in p.choices}
        prompt_ids_of = {c.index: p.token_ids for p in prompts for c in p.choices} if token_ids else {}

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
            return sse(CompletionResponse(id=rid, model=model, choices=choices, usage=usage, created=created))
        text_frames: dict[int, TextFrame] = {}     # per choice: its chunk of new text alone

        def text_frame(index: int) -> TextFrame:
            return TextFrame(lambda text: CompletionResponse(id=rid, model=model, choices=[
                CompletionChoice(index, text, None, None)], usage=None, created=created))

        async def render(outputs: AsyncIterator) -> AsyncIterator[bytes]:
            if req.echo:
                for p in prompts:
                    for c in p.choices:
                        yield chunk([CompletionChoice(c.index, echo_text(p), None, None,
                                                      prompt_token_ids=prompt_ids_of.pop(c.index, None))])
            completion_tokens = 0
            async for c, comp, _ in outputs:
                completion_tokens += len(comp.token_ids)
                if not comp.text and comp.finish_reason is None and not comp.logprobs:
                    continue
                if comp.finish_reason is None and not comp.logprobs and not continuous and not token_ids:
                    frame = text_frames.get(c.index)
                    if frame is None:
                        frame = text_frames[c.index] = text_frame(c.index)
                    offsets[c.index] += len(comp.text)
                    yield frame(comp.text)
                    continue
                logprobs = None
                if req.logprobs is not None and comp.logprobs:
                    logprobs = completion_logprobs(serving, comp.token_ids, comp.logprobs, top_k, offsets[c.index],
                                                   name)
                offsets[c.index] += len(comp.text)
                usage = (Usage(num_prompt_tokens, completion_tokens, num_prompt_tokens + completion_tokens)
                         if continuous else None)
                yield chunk([CompletionChoice(c.index, comp.text, logprobs, comp.finish_reason, comp.stop_reason,
                                              prompt_token_ids=prompt_ids_of.pop(c.index, None),
                                              token_ids=list(comp.token_ids) if token_ids else None)], usage)
            if include_usage:
                yield chunk([], Usage(num_prompt_tokens, completion_tokens, num_prompt_tokens + completion_tokens))

        return await open_stream(serving, prompts, receive, render)

    accs = await race_disconnect(receive, serving.collect(prompts))
    choices = []
    prompt_of = {c.index: p for p in prompts for c in p.choices}
    for idx, acc in enumerate(accs):
        if echo_only:
            acc.text, acc.token_ids, acc.logprobs, acc.finish_reason = [], [], [], "length"
        text = "".join(acc.text)
        prefix = echo_text(prompt_of[idx]) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(serving, acc.token_ids, acc.logprobs, top_k, len(prefix), name)
            if score_prompt:
                logprobs = prompt_then_completion(serving, prompt_of[idx].token_ids, acc.prompt_logprobs or [],
                                                  top_k, logprobs, name)
        choices.append(CompletionChoice(
            idx, prefix + text, logprobs, acc.finish_reason, acc.stop_reason,
            prompt_logprobs=serving.prompt_logprobs_out(acc.prompt_logprobs) if req.prompt_logprobs is not None
            else None,
            prompt_token_ids=prompt_of[idx].token_ids if token_ids else None,
            token_ids=acc.token_ids if token_ids else None))
    completion_tokens = sum(len(a.token_ids) for a in accs)
    return CompletionResponse(id=rid, model=model, choices=choices,
                              usage=Usage(num_prompt_tokens, completion_tokens, num_prompt_tokens + completion_tokens))
