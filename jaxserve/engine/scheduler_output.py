"""What a step computes: the scheduler's decision that the runner turns into device inputs
(``runner.step_inputs``) and the engine core applies its tokens to."""
from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.engine.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """This step computes tokens all_token_ids[start_pos : start_pos + num_new_tokens] of `request`."""
    request: Request
    num_new_tokens: int
    start_pos: int                  # == request.num_computed_tokens when scheduled
    # the whole block table after allocation: the KV cache manager's own list (read it in this step; it only
    # grows, and the runner's persistent rows copy just what it gained)
    block_ids: list[int]
    samples: bool = True            # the chunk ends at the last known token: the step yields a token
    # multi-step decoding: a decode run for num_steps iterations in one dispatch computes positions
    # start_pos .. start_pos + num_steps - 1 and samples num_steps tokens (slots are allocated for all of them)
    num_steps: int = 1
    # the images (multimodal.ImageFeature) whose encoder outputs this step computes for this chunk
    encoder_inputs: list | None = None
    # speculative decoding: the draft tokens this step verifies after the request's last known token (counted
    # in num_new_tokens; the step samples up to len + 1 tokens for it), or None
    spec_token_ids: list[int] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class SchedulerOutput:
    # Entries with one new token (decodes) first, then multi-token prefill chunks.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_steps: int = 1              # > 1: a multi-step decode (every entry decodes, for up to this many steps)
    # requests with images whose prompt chunks this step computes (their images released once computed), or None
    mm_requests: list[Request] | None = None
    num_draft_tokens: int = 0       # draft tokens the step verifies, all entries together (0: no speculation)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
