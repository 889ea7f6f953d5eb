"""What the runner reads of a scheduler decision: the request/step contract between engine/ and runner/.

The engine's ``ScheduledRequest`` and ``Request`` satisfy these protocols; the runner (``step_inputs``,
``input_batch``, ``prompt_logprobs``) reads nothing else of them, so a test can drive it with any object
that has these attributes.

Tokens the host has not seen yet: when a step is dispatched the scheduler appends one ``PLACEHOLDER`` per
token the step will sample; the runner feeds a placeholder to the next step from the device (it marks the
row of the step in flight that holds it), and the output processor overwrites each one with the real id
when the step's results are read.
"""
from __future__ import annotations

from typing import Protocol

from jaxserve.outputs import PositionLogprobs
from jaxserve.sampling_params import SamplingParams

# An output token the host has not seen yet (it is still on the device, feeding the next step).
PLACEHOLDER = -1


class StepRequest(Protocol):
    """A request as a step reads it: its tokens (PLACEHOLDER where the device holds one) and its sampling."""
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    sampling_seed: int | None        # folded into the request's PRNG key when its params carry no seed
    lora_slot: int                   # the device slot of its LoRA adapter (0: none); read with LoRA on

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + outputs, one live list (the runner only reads it)."""


class ScoringRequest(StepRequest, Protocol):
    """A request that asked for prompt logprobs, as the prompt scorer reads and fills it."""
    num_prompt_positions_scored: int
    prompt_logprobs: list[PositionLogprobs | None] | None

    @property
    def num_prompt_tokens(self) -> int: ...


class ScheduledEntry(Protocol):
    """One request's share of a step: tokens ``all_token_ids[start_pos : start_pos + num_new_tokens]``."""
    request: StepRequest
    num_new_tokens: int
    start_pos: int
    block_ids: list[int]             # the whole block table: a live list that only grows while the request runs
    samples: bool                    # the chunk reaches the last known token: the step samples one for it
    num_steps: int                   # > 1: a multi-step decode that samples this many tokens in one dispatch
    spec_token_ids: list[int] | None  # draft tokens after its known ones (a speculative step), or None
