"""A completion request's outputs as its answer: the whole CompletionResponse, or SSE chunks as outputs arrive
(echo, text, logprobs with their text offsets, the prompt's scored tokens, usage)."""
from __future__ import annotations

from typing import Any, AsyncIterator

from .engine_runs import Accumulated, Prompt
from .logprobs import completion_logprobs, prompt_logprobs_out, prompt_then_completion
from .request_types import CompletionRequest
from .response_types import CompletionChoice, CompletionResponse, Usage, now
from .serving import Serving
from .streaming import TextFrame, sse


class CompletionRenderer:
    """Renders one completion request's outputs (``stream`` or ``response``). ``echo_only``: max_tokens 0 with
    echo, whose one sampled token is not returned."""

    def __init__(self, serving: Serving, req: CompletionRequest, prompts: list[Prompt], request_id: str,
                 echo_only: bool):
        self.req = req
        self.prompts = prompts
        self.request_id = request_id
        self.echo_only = echo_only
        self.tokenizer = serving.tokenizer
        self.model = req.model or serving.model_name
        self.num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        self.top_k = req.logprobs or 0
        self.name = serving.token_names.namer(req)
        self.token_str = serving.token_names.token_str
        self.token_ids = bool(req.return_token_ids)
        self.created = now()

    def echo_text(self, p: Prompt) -> str:
        return p.text if p.text is not None else self.tokenizer.decode(p.token_ids)

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        return sse(CompletionResponse(id=self.request_id, model=self.model, choices=choices, usage=usage,
                                      created=self.created))

    def _text_frame(self, index: int) -> TextFrame:
        return TextFrame(lambda text: CompletionResponse(id=self.request_id, model=self.model, choices=[
            CompletionChoice(index, text, None, None)], usage=None, created=self.created))

    async def stream(self, outputs: AsyncIterator) -> AsyncIterator[bytes]:
        req, prompts, chunk, name = self.req, self.prompts, self._chunk, self.name
        top_k, token_ids, num_prompt_tokens = self.top_k, self.token_ids, self.num_prompt_tokens
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)  # vLLM's extra
        offsets = {c.index: 0 for p in prompts for c in p.choices}
        prompt_ids_of = {c.index: p.token_ids for p in prompts for c in p.choices} if token_ids else {}
        text_frames: dict[int, TextFrame] = {}     # per choice: its chunk of new text alone
        if req.echo:
            for p in prompts:
                for c in p.choices:
                    yield chunk([CompletionChoice(c.index, self.echo_text(p), None, None,
                                                  prompt_token_ids=prompt_ids_of.pop(c.index, None))])
        completion_tokens = 0
        async for c, comp, _ in outputs:
            completion_tokens += len(comp.token_ids)
            if not comp.text and comp.finish_reason is None and not comp.logprobs:
                continue
            if comp.finish_reason is None and not comp.logprobs and not continuous and not token_ids:
                frame = text_frames.get(c.index)
                if frame is None:
                    frame = text_frames[c.index] = self._text_frame(c.index)
                offsets[c.index] += len(comp.text)
                yield frame(comp.text)
                continue
            logprobs = None
            if req.logprobs is not None and comp.logprobs:
                logprobs = completion_logprobs(comp.token_ids, comp.logprobs, top_k, offsets[c.index], name)
            offsets[c.index] += len(comp.text)
            usage = (Usage(num_prompt_tokens, completion_tokens, num_prompt_tokens + completion_tokens)
                     if continuous else None)
            yield chunk([CompletionChoice(c.index, comp.text, logprobs, comp.finish_reason, comp.stop_reason,
                                          prompt_token_ids=prompt_ids_of.pop(c.index, None),
                                          token_ids=list(comp.token_ids) if token_ids else None)], usage)
        if include_usage:
            yield chunk([], Usage(num_prompt_tokens, completion_tokens, num_prompt_tokens + completion_tokens))

    def response(self, accs: list[Accumulated]) -> CompletionResponse:
        req, name, top_k, token_ids = self.req, self.name, self.top_k, self.token_ids
        choices = []
        prompt_of = {c.index: p for p in self.prompts for c in p.choices}
        for idx, acc in enumerate(accs):
            if self.echo_only:
                acc.text, acc.token_ids, acc.logprobs, acc.finish_reason = [], [], [], "length"
            text = "".join(acc.text)
            prefix = self.echo_text(prompt_of[idx]) if req.echo else ""
            logprobs: Any = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(acc.token_ids, acc.logprobs, top_k, len(prefix), name)
                if req.scores_prompt():
                    logprobs = prompt_then_completion(prompt_of[idx].token_ids, acc.prompt_logprobs or [], top_k,
                                                      logprobs, name)
            choices.append(CompletionChoice(
                idx, prefix + text, logprobs, acc.finish_reason, acc.stop_reason,
                prompt_logprobs=prompt_logprobs_out(acc.prompt_logprobs, self.token_str)
                if req.prompt_logprobs is not None else None,
                prompt_token_ids=prompt_of[idx].token_ids if token_ids else None,
                token_ids=acc.token_ids if token_ids else None))
        completion_tokens = sum(len(a.token_ids) for a in accs)
        num_prompt_tokens = self.num_prompt_tokens
        return CompletionResponse(id=self.request_id, model=self.model, choices=choices,
                                  usage=Usage(num_prompt_tokens, completion_tokens,
                                              num_prompt_tokens + completion_tokens))
