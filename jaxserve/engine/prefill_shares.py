"""How much of a step the scheduler's long prefill chunks and its scored prompt chunks may take (a mixin of
``scheduler.Scheduler``, whose state it reads).

A prompt with more than ``long_prefill_token_threshold`` tokens left to compute is a long
prefill. While a request that is not one wants the step (a decode, a shorter prompt), the long prefills'
chunks take at most that many tokens of the step together (``_long_share``; a waiting long prompt that finds
no share left keeps its place and the others pass it), and after the waiting requests had their turn the
chunks that share cut get what budget is left (``_top_up``): a long prompt never holds back the others for
more than a step or two, and the step stays full. Long prompts alone run at full width.

Prompts being scored (prompt logprobs) take at most a ``1 / SCORING_SHARE`` of the step while another request
is unfinished (``_scoring_share``; ``scoring_budget`` costs their chunks).
"""
from __future__ import annotations

from jaxserve.engine.scheduler_output import ScheduledRequest
from jaxserve.engine.scoring_budget import SCORING_SHARE, scores_prompt


class PrefillShares:
    """The step-budget shares of ``Scheduler`` (it supplies ``running``, ``waiting``, ``requests``,
    ``kv_cache_manager`` and the budget settings)."""

    def _scoring_share(self) -> int:
        """The budget this step's chunks being scored may take together: a ``1 / SCORING_SHARE`` of the step
        while a request that does not score is unfinished, else all of it (with chunked prefill off nothing
        is chunked, so nothing is held back)."""
        if not self.enable_chunked_prefill or self.num_scoring >= len(self.requests):
            return self.max_num_batched_tokens
        return max(2, self.max_num_batched_tokens // SCORING_SHARE)     # 2: one position, scored

    def _long_share(self) -> int:
        """The tokens this step's long prefill chunks may take together: ``long_prefill_threshold`` while a
        request that is not a long prefill wants the step (a decode, a shorter prompt), else all of it.
        Looked at once per step that has a long prefill (a step of hundreds of tokens at least)."""
        threshold = self.long_prefill_threshold
        if any(len(r._all_token_ids) - r.num_computed_tokens <= threshold for r in self.running) \
                or any(len(r._all_token_ids) <= threshold for r in self.waiting):
            return threshold
        return self.max_num_batched_tokens

    def _top_up(self, cut: list[ScheduledRequest], budget: int) -> None:
        """Give the budget the step left to the long prefill chunks the long share cut short, oldest first
        (the others had their turn; a chunk being scored keeps its size). Preempts nothing: a chunk the pool
        cannot extend keeps its size."""
        kv = self.kv_cache_manager
        for s in cut:
            req = s.request
            extra = min(len(req._all_token_ids) - s.start_pos - s.num_new_tokens, budget)
            # (a prompt with images keeps its chunk: a longer one may reach an image not scheduled to encode)
            if extra <= 0 or scores_prompt(req) or req.mm_features is not None \
                    or kv.allocate_slots(req, s.num_new_tokens + extra) is None:
                continue
            s.num_new_tokens += extra
            s.block_ids = kv.live_block_ids(req.request_id)
            s.samples = s.start_pos + s.num_new_tokens == len(req._all_token_ids)
            budget -= extra
            if budget <= 0:
                return

    def _may_chunk(self, num_new: int) -> bool:
        # With chunked prefill off, a sequence that could never fit a whole step (a preempted request
        # recomputing prompt + outputs) is still chunked rather than left waiting forever.
        return self.enable_chunked_prefill or num_new > self.max_num_batched_tokens
