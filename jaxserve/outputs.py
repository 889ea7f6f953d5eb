"""What the engine hands back, shaped like vLLM's outputs (same class and field names), and the text of logprobs.

Plain slotted dataclasses, no JAX: the server and the offline API read them, the engine fills them (the
runner's prompt scorer and the output processor both through ``decode_logprobs``).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """The log-probability of one token, its rank in the distribution (1 = most likely) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's candidates: token id -> Logprob (the sampled token plus the top-k), as in vLLM.
PositionLogprobs = dict[int, Logprob]


@functools.lru_cache(maxsize=1 << 16)
def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token as vLLM shows it in logprobs (`tokenizer.decode([id])`), cached."""
    return tokenizer.decode([token_id]) or ""


def decode_logprobs(tokenizer: Any | None, token_id: int, logprob: float, rank: int,
                    topk_ids: Sequence[int] = (), topk_logprobs: Sequence[float] = (),
                    num_logprobs: int | None = None) -> PositionLogprobs:
    """One position's `{token_id: Logprob}`: the sampled token (with its rank) first, then the top
    `num_logprobs` (ranks 1..k) from the sampler's top-k row, which may be wider than this request asked
    (it is the batch's max). `tokenizer=None` leaves `decoded_token` None (detokenize=False)."""
    k = len(topk_ids) if num_logprobs is None else min(num_logprobs, len(topk_ids))
    text = (lambda t: decode_token(tokenizer, t)) if tokenizer is not None else (lambda t: None)
    out = {int(token_id): Logprob(float(logprob), int(rank), text(int(token_id)))}
    for i in range(k):
        candidate = int(topk_ids[i])
        if candidate not in out:
            out[candidate] = Logprob(float(topk_logprobs[i]), i + 1, text(candidate))
    return out


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.time() seconds) of a request's life; None until the event happens."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (index i of its n)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None          # "stop" | "length" | "abort" | "error" | None while running
    # the stop token id or stop string that ended it (None for EOS); with "error", what went wrong
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: its prompt and its n completions so far (delta or cumulative)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0                # prompt tokens served from the prefix cache


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int] = field(default_factory=list)
    finished: bool = True
