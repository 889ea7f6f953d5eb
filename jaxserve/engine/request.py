"""One sequence being generated: its tokens, its progress through the KV cache, its status, its output state.

A `Request` is one sequence (the front ends fan a SamplingParams with n > 1 out into n requests) and the one
object that holds what one half of the engine knows about it. The engine core's holds the scheduler's view
(tokens, computed tokens, placeholders, status) and what it has sent to the front end; the front end's (built
at the engine boundary, ``LLMEngine.make_request``) holds the output tokens the core sent, the detokenizer,
logprobs and what was already returned.

The scheduler/runner/processor contract for tokens the host has not seen yet: when a step is dispatched the
scheduler appends one ``PLACEHOLDER`` per token the step will sample (``num_placeholders`` counts them); the
runner feeds a placeholder to the next step from the device; the output processor overwrites each one with
the real id when the step's results are read (``set_output_token``).

The sampling parameters are duck-typed (jaxserve.sampling_params.SamplingParams in practice): the
stopping parameters are read once, at construction, so the per-token path never goes through getattr.
"""
from __future__ import annotations

import enum
import time
from typing import Any, Iterable

from jaxserve.outputs import PositionLogprobs, RequestMetrics
from jaxserve.runner.step_contract import PLACEHOLDER
from jaxserve.sampling_params import RequestOutputKind


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_FSM = 1      # structured output: its grammar is still compiling (the engine core holds it apart)
    RUNNING = 2
    PREEMPTED = 3            # back in the waiting queue, will recompute its prompt + outputs so far
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = 4     # EOS, a stop token id, or a stop string
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7       # its constraint was refused or failed (stop_reason: the message)

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def finish_reason(status: RequestStatus) -> str | None:
    """"stop" | "length" | "abort" | "error" for a finished status, else None (OpenAI's and vLLM's names)."""
    return _FINISH_REASONS.get(status)


class Request:
    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "arrival_time", "priority",
        "cache_salt", "prompt", "max_tokens", "max_output_tokens", "min_tokens", "ignore_eos", "stop_token_ids",
        "status", "stop_reason", "output_token_ids", "_all_token_ids", "num_placeholders", "num_computed_tokens",
        "num_cached_tokens", "num_preemptions", "block_hashes", "metrics", "sampling_seed", "uses_penalties",
        "num_prompt_positions_scored", "defer_outputs", "mm_features", "lora_request", "lora_slot", "spec_token_ids",
        "num_drafts_in_flight",
        # output state (the front end's; the core's sends prompt_logprobs and counts num_sent_tokens)
        "detokenizer", "cumulative_logprob", "logprobs", "prompt_logprobs", "num_sent_tokens", "num_sent_chars",
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
        priority: int = 0,
        mm_features: list | None = None,
        lora_request: Any = None,
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
        self.priority = priority              # --scheduling-policy priority: lower values are scheduled first
        self.prompt = prompt
        # the prompt's images (multimodal.ImageFeature, in prompt order), None for a text prompt
        self.mm_features = mm_features or None
        # its LoRA adapter (jaxserve.lora.LoRARequest; None: the base model) and the device slot that holds it
        # while the request runs (0: none; the engine's LoRAManager sets it)
        self.lora_request = lora_request
        self.lora_slot = 0
        self.max_tokens: int | None = getattr(sampling_params, "max_tokens", None)
        # The output length at which the request is finished by length: max_tokens, and the room max_model_len
        # leaves (the scheduler lowers it to that when the request is queued).
        self.max_output_tokens: int = self.max_tokens if self.max_tokens is not None else 1 << 62
        self.min_tokens: int = getattr(sampling_params, "min_tokens", 0) or 0
        self.ignore_eos: bool = bool(getattr(sampling_params, "ignore_eos", False))
        self.stop_token_ids = frozenset(getattr(sampling_params, "stop_token_ids", None) or ())
        # penalties and multi-token bad words: sampling needs the real token history on the host
        self.uses_penalties = bool(getattr(sampling_params, "needs_token_history", False))

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        # Trailing output tokens that are still PLACEHOLDER (dispatched, not read back yet; a verified draft's
        # holds the draft).
        self.num_placeholders = 0
        # Tokens whose K/V are in the cache (prefix-cache hits included); reset to 0 on preemption.
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache when first scheduled (RequestOutput.num_cached_tokens).
        self.num_cached_tokens = 0
        # speculative decoding: the tokens proposed to follow its last token this step (the engine's speculator
        # sets them before each schedule; the scheduler takes what the budget allows), or None
        self.spec_token_ids: list[int] | None = None
        # draft tokens of its dispatched steps not read yet: placeholders (holding the drafts) that may be
        # rolled back (async scheduling places its next step as if they were all accepted)
        self.num_drafts_in_flight = 0
        self.num_preemptions = 0
        # prompt_logprobs: prompt positions whose scoring is dispatched (kept across preemptions: a recomputed
        # prompt is not scored twice)
        self.num_prompt_positions_scored = 0
        # Chained hashes of this request's full blocks of tokens (filled by the KV cache manager; tokens
        # never change once known, so they stay valid across preemptions).
        self.block_hashes: list = []
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        # The seed the runner folds into this request's PRNG key (the engine fills it: the request's
        # own seed, or one drawn from the engine's generator).
        self.sampling_seed = sampling_seed
        # The core sends this request's tokens only when it finishes: its front end shows nothing before
        # (FINAL_ONLY output, no stop strings to match, no logprobs).
        self.defer_outputs = (getattr(sampling_params, "output_kind", None) is RequestOutputKind.FINAL_ONLY
                              and not getattr(sampling_params, "stop", None)
                              and getattr(sampling_params, "logprobs", None) is None)

        # The output state: the incremental detokenizer (None until the front end's processor adopts the
        # request), the sampled tokens' logprobs and their sum, the prompt's logprobs when asked, and how much
        # of the tokens (in the core: sent to the front end) and text a DELTA output has already returned.
        self.detokenizer = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[PositionLogprobs] | None = \
            [] if getattr(sampling_params, "logprobs", None) is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.num_sent_tokens = 0
        self.num_sent_chars = 0

    # -- tokens -------------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens known so far (placeholders included)."""
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + outputs (the live list: read it, do not mutate it)."""
        return self._all_token_ids

    def append_placeholders(self, count: int) -> None:
        """The step just dispatched samples ``count`` tokens for this request (their ids come later)."""
        self.output_token_ids.extend((PLACEHOLDER,) * count)
        self._all_token_ids.extend((PLACEHOLDER,) * count)
        self.num_placeholders += count

    def set_output_token(self, index: int, token_id: int) -> None:
        """Fill in the output token at ``index``, a placeholder until now (placeholders fill in order)."""
        self.output_token_ids[index] = token_id
        self._all_token_ids[len(self.prompt_token_ids) + index] = token_id
        self.num_placeholders -= 1

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop output tokens past ``num_output_tokens`` (computed after a stop the host saw late)."""
        self.drop_outputs(num_output_tokens, len(self.output_token_ids))

    def drop_outputs(self, start: int, end: int) -> None:
        """Drop output tokens ``[start, end)``: placeholders past a stop, or drafts a speculative step
        rejected (a later step's placeholders may follow them)."""
        p = self.num_prompt_tokens
        del self.output_token_ids[start:end]
        del self._all_token_ids[p + start:p + end]
        self.num_placeholders = max(0, self.num_placeholders - (end - start))

    # -- status -------------------------------------------------------------------------------------
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> str | None:
        """"stop" | "length" | "abort" | "error", or None while the request is not finished."""
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens})")
