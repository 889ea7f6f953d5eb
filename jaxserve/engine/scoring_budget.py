"""What a prompt chunk scored for prompt logprobs costs a step, and the share of the step such chunks take.

A request that asks for prompt logprobs is scheduled like any other (chunked, budgeted, preemptible,
abortable); the engine scores each of its prompt chunks after the step that computes it
(``runner.prompt_logprobs``). It takes no prefix-cache hits, as in vLLM: every prompt position must be
computed to be scored. Scoring a position is a second forward over it, so a chunk's positions still to be
scored count twice against the budget (``chunk_cost``). While a request that does not score is unfinished,
the chunks being scored take at most ``1 / SCORING_SHARE`` of a step's budget together
(``Scheduler._scoring_share``; a waiting scoring request that finds no share left keeps its place and the
others pass it): long prompts scored (twice a prefill's work each) never hold back the others' prefills and
decodes for steps on end; scoring requests alone run at full width.
"""
from __future__ import annotations

from jaxserve.engine.request import Request

# The prompt chunks being scored take at most this fraction (1/N) of a step's token budget, together, while a
# request that does not score is unfinished (see the module docstring).
SCORING_SHARE = 4


def scores_prompt(req: Request) -> bool:
    return getattr(req.sampling_params, "prompt_logprobs", None) is not None


def chunk_cost(req: Request, num_new: int) -> int:
    """Budget tokens of a chunk of ``num_new`` tokens from ``req.num_computed_tokens`` on: its tokens, and
    once more each prompt position in it still to be scored (position p scores prompt token p + 1, so the
    last prompt position scores nothing; positions scored before a preemption are not scored again)."""
    if not scores_prompt(req):
        return num_new
    start = req.num_computed_tokens
    first = max(start, req.num_prompt_positions_scored)
    end = min(start + num_new, req.num_prompt_tokens - 1)
    return num_new + max(0, end - first)


def fit_chunk(req: Request, num_new: int, budget: int) -> tuple[int, int]:
    """The longest chunk of at most ``num_new`` tokens whose cost fits ``budget``, and its cost (a scored
    chunk costs up to twice its length: the cost grows with the length, so a bisection finds it)."""
    n = min(num_new, budget)
    if not scores_prompt(req):
        return n, n
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chunk_cost(req, mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo, chunk_cost(req, lo)
