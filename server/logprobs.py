"""Tokens and their logprobs as the responses write them: a token's name, chat's and completions' logprobs,
echo's prompt-then-completion logprobs, and vLLM's prompt_logprobs."""
from __future__ import annotations

from typing import Any, Callable

from .request_types import SamplingFields
from .response_types import ChatLogprobs, ChatLogprobToken, ChatLogprobTop, CompletionLogprobs, PromptLogprob

MIN_LOGPROB = -9999.0  # JSON has no -inf

TokenNamer = Callable[[int, "str | None"], str]     # (token id, its decoded text if known) -> how it is written


class TokenNames:
    """A token's text (decoded once per token id and kept), and how a request's logprobs name tokens."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._strs: dict[int, str] = {}

    def token_str(self, token_id: int, decoded: str | None = None) -> str:
        if decoded is not None:
            return decoded
        s = self._strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id])
            self._strs[token_id] = s
        return s

    def namer(self, req: SamplingFields) -> TokenNamer:
        """How logprobs name a token: its text, or "token_id:{id}" with return_tokens_as_token_ids (vLLM's
        extra, for tokens whose text is not valid UTF-8 on its own)."""
        if req.return_tokens_as_token_ids:
            return lambda token_id, decoded=None: f"token_id:{token_id}"
        return self.token_str


def top_logprobs_dict(pos: dict, chosen_id: int, top_k: int, name: TokenNamer) -> dict[str, float]:
    """A completions position's ``top_logprobs`` (vLLM's rule): the ``top_k`` most likely tokens, and the chosen
    one when it is not among them (a sampled token outside the top k; with ``logprobs: 0``, only it)."""
    tops = sorted(pos.items(), key=lambda kv: -kv[1].logprob)[:top_k]
    chosen = pos.get(chosen_id)
    if chosen is not None and all(t != chosen_id for t, _ in tops):
        tops.append((chosen_id, chosen))
    return {name(t, lp.decoded_token): max(lp.logprob, MIN_LOGPROB) for t, lp in tops}


def chat_logprobs(token_ids: list[int], positions: list[dict], top_k: int, name: TokenNamer) -> ChatLogprobs:
    """OpenAI's chat logprobs: each token's logprob and its ``top_k`` most likely alternatives (exactly those,
    most likely first; the chosen token is among them only when it is one of the top k)."""
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


def completion_logprobs(token_ids: list[int], positions: list[dict], top_k: int, offset: int,
                        name: TokenNamer) -> CompletionLogprobs:
    """``offset``: the text offset of the first token (what precedes it in the choice's text)."""
    out = CompletionLogprobs()
    for tid, pos in zip(token_ids, positions):
        chosen = pos.get(tid)
        tok = name(tid, chosen.decoded_token if chosen else None)
        out.tokens.append(tok)
        out.token_logprobs.append(max(chosen.logprob, MIN_LOGPROB) if chosen else MIN_LOGPROB)
        out.top_logprobs.append(top_logprobs_dict(pos, tid, top_k, name))
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def prompt_then_completion(prompt_ids: list[int], prompt_lps: list, top_k: int, completion: CompletionLogprobs,
                           name: TokenNamer) -> CompletionLogprobs:
    """echo + logprobs: the prompt's tokens first (the first one has no logprob: nothing precedes it), then
    the completion's, with text offsets running through both (OpenAI's legacy completions format)."""
    out = CompletionLogprobs()
    offset = 0
    for i, tid in enumerate(prompt_ids):
        pos = prompt_lps[i] if i < len(prompt_lps) else None
        chosen = pos.get(tid) if pos else None
        tok = name(tid, chosen.decoded_token if chosen else None)
        out.tokens.append(tok)
        out.token_logprobs.append(max(chosen.logprob, MIN_LOGPROB) if chosen else None)
        out.top_logprobs.append(top_logprobs_dict(pos, tid, top_k, name) if pos else None)
        out.text_offset.append(offset)
        offset += len(tok)
    out.tokens += completion.tokens
    out.token_logprobs += completion.token_logprobs
    out.top_logprobs += completion.top_logprobs
    out.text_offset += completion.text_offset
    return out


def prompt_logprobs_out(positions: list | None, token_str: TokenNamer) -> list | None:
    """The engine's prompt logprobs ([None, {id: Logprob}, ...]) as vLLM's server writes them."""
    if positions is None:
        return None
    return [None if pos is None else
            {tid: PromptLogprob(max(lp.logprob, MIN_LOGPROB), lp.rank, token_str(tid, lp.decoded_token))
             for tid, lp in pos.items()} for pos in positions]
