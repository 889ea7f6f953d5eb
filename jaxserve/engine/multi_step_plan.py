"""Multi-step decoding's plan (``--num-scheduler-steps``): how many iterations an all-decode step runs, and
the KV slots for them, allocated ahead."""
from __future__ import annotations

from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.scheduler_output import ScheduledRequest


def plan_steps(scheduled: list[ScheduledRequest], kv: KVCacheManager, n: int) -> int:
    """Multi-step decoding for an all-decode step: give each entry up to num_scheduler_steps steps
    (fewer where max_tokens or max_model_len comes first) and allocate their slots now. Returns the
    step count (1 when some request needs the host between tokens: penalties read the history,
    min_tokens still masks stop ids, a structured output's mask follows each token; logprobs come back
    per iteration).

    A request that cannot get the extra blocks runs one step; nothing is preempted for lookahead. A
    request that stops early (EOS, stop string) wastes the rest of its steps; the output processor drops
    their tokens."""
    for s in scheduled:
        req = s.request
        if not s.samples or req.uses_penalties or len(req.output_token_ids) < req.min_tokens \
                or getattr(req.sampling_params, "structured_outputs", None) is not None:
            # (a one-token prompt chunk that stops short of the end samples nothing; a structured
            # output's mask needs each previous token on the host)
            return 1
    ks = [min(n, s.request.max_output_tokens - len(s.request.output_token_ids)) for s in scheduled]
    # The loop always runs n iterations (a device-computed trip count would sync the host every
    # iteration): when no entry can use them all (every request near its end), single steps waste nothing.
    if max(ks) < n:
        return 1
    longest = 1
    for s, k in zip(scheduled, ks):
        if k > 1 and kv.allocate_slots(s.request, k) is not None:
            s.num_steps = k
            s.block_ids = kv.live_block_ids(s.request.request_id)
            longest = max(longest, k)
    if longest < n:     # the pool gave no entry all n: single steps (the blocks stay for those steps)
        for s in scheduled:
            s.num_steps = 1
        return 1
    return n
