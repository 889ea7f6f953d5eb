"""One sequence being generated: its tokens, its progress through the KV cache, its status.

A `Request` is one sequence: the engine fans a SamplingParams with n > 1 out into n requests. The
sampling parameters are duck-typed (jaxserve.sampling_params.SamplingParams in practice): only
max_tokens, min_tokens, ignore_eos and stop_token_ids are read here, once, at construction.
"""
from __future__ import annotations

import enum
import time
from typing import Any, Iterable

from jaxserve.outputs import RequestMetrics


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2            # back in the waiting queue, will recompute its prompt + outputs so far
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = 3     # EOS, a stop token id, or a stop string (engine: finish_request)
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6     # rejected without running (reported like vLLM: finish_reason "length")

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}


class Request:
    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "arrival_time",
        "cache_salt", "prompt", "max_tokens", "min_tokens", "ignore_eos", "stop_token_ids",
        "status", "stop_reason", "output_token_ids", "_all_token_ids", "num_computed_tokens",
        "num_cached_tokens", "num_preemptions", "block_hashes", "metrics", "sampling_seed",
        "uses_penalties",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any = None,
        eos_token_ids: Iterable[int] | int | None = (),
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        prompt: str | None = None,
        sampling_seed: int | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        if eos_token_ids is None:
            eos_token_ids = ()
        elif isinstance(eos_token_ids, int):
            eos_token_ids = (eos_token_ids,)
        # The model's eos ids, plus the one SamplingParams.update_from_generation_config recorded (if any).
        sp_eos = getattr(sampling_params, "eos_token_id", None)
        self.eos_token_ids = frozenset(eos_token_ids) | ({sp_eos} if isinstance(sp_eos, int) else set())
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt          # separates prefix-cache namespaces (e.g. per tenant)
        self.prompt = prompt
        # Read the stopping parameters once (the hot path must not go through getattr).
        self.max_tokens: int | None = getattr(sampling_params, "max_tokens", None)
        self.min_tokens: int = getattr(sampling_params, "min_tokens", 0) or 0
        self.ignore_eos: bool = bool(getattr(sampling_params, "ignore_eos", False))
        self.stop_token_ids = frozenset(getattr(sampling_params, "stop_token_ids", None) or ())
        # presence/frequency/repetition penalties: sampling needs the real token history on the host
        self.uses_penalties = bool(getattr(sampling_params, "uses_penalties", False))

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        # Tokens whose K/V are in the cache (prefix-cache hits included); reset to 0 on preemption.
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache when first scheduled (RequestOutput.num_cached_tokens).
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # Chained hashes of this request's full blocks of tokens (filled by the KV cache manager; tokens
        # never change once known, so they stay valid across preemptions).
        self.block_hashes: list = []
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        # The seed the runner folds into this request's PRNG key (the engine fills it: the request's
        # own seed, or one drawn from the engine's generator).
        self.sampling_seed = sampling_seed

    # -- tokens -------------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens known so far."""
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + outputs (the live list: read it, do not mutate it)."""
        return self._all_token_ids

    def set_output_token(self, index: int, token_id: int) -> None:
        """Fill in an output token the engine appended as a placeholder (async scheduling)."""
        self.output_token_ids[index] = token_id
        self._all_token_ids[self.num_prompt_tokens + index] = token_id

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past ``num_output_tokens`` (computed after a stop the host saw late)."""
        del self.output_token_ids[num_output_tokens:]
        del self._all_token_ids[self.num_prompt_tokens + num_output_tokens:]

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            self._all_token_ids.append(token_id)

    # -- status -------------------------------------------------------------------------------------
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> str | None:
        """"stop" | "length" | "abort", or None while the request is not finished."""
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens})")


def check_stop(request: Request, max_model_len: int) -> bool:
    """After a token was appended: decide whether the request is done; if so set its status.

    Order: below min_tokens only the length limits can stop it; EOS (unless ignore_eos) and
    stop_token_ids win over max_tokens when both happen on the same token (the model did stop).
    Stop strings are the detokenizer's business (engine -> Scheduler.finish_request).
    """
    num_output = request.num_output_tokens
    length_capped = (request.num_tokens >= max_model_len
                     or (request.max_tokens is not None and num_output >= request.max_tokens))
    if num_output >= request.min_tokens and num_output > 0:
        last = request.output_token_ids[-1]
        if not request.ignore_eos and last in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None
            return True
        if last in request.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if length_capped:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
