"""Continuous batching: which tokens of which requests the next step computes.

One token budget per step (max_num_batched_tokens) and a cap on running sequences (max_num_seqs).
Running requests go first (a decode token each, or the next chunk of a prompt still prefilling), then
waiting requests in FCFS order, chunked to the budget that is left (chunked prefill). There are no
separate prefill and decode phases: the step is one ragged batch.

A request's next tokens are ``all_token_ids[num_computed_tokens:num_tokens]``. The step samples a token
for it only when its chunk reaches num_tokens (``ScheduledRequest.samples``): a prefill chunk that
stops short yields no token. When the pool runs dry for a running request, the newest running request
is preempted (blocks freed, requeued at the front, recomputed later from its prompt + outputs so far).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.request import Request, RequestStatus, check_stop
from jaxserve.errors import InvalidRequestError, QueueFullError


def validate_prompt_length(prompt_token_ids: Sequence[int] | int, max_tokens: int | None,
                           max_model_len: int) -> None:
    """Reject, before it is queued, a prompt that is empty or longer than max_model_len, or (when
    max_tokens is given) one that leaves no room for max_tokens new tokens, as vLLM's OpenAI server does.
    Pass max_tokens=None to only check the prompt (generation then stops at max_model_len, "length")."""
    n = prompt_token_ids if isinstance(prompt_token_ids, int) else len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt is empty: send at least one token", param="prompt")
    if n > max_model_len:
        raise InvalidRequestError(f"prompt has {n} tokens, max_model_len is {max_model_len}", param="prompt")
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} tokens exceed "
            f"max_model_len {max_model_len}; lower max_tokens or shorten the prompt", param="max_tokens")


@dataclass(slots=True)
class ScheduledRequest:
    """This step computes tokens all_token_ids[start_pos : start_pos + num_new_tokens] of `request`."""
    request: Request
    num_new_tokens: int
    start_pos: int                  # == request.num_computed_tokens when scheduled
    block_ids: list[int]            # the whole block table after allocation (a snapshot)
    samples: bool = True            # the chunk ends at the last known token: the step yields a token
    # multi-step decoding: a decode run for num_steps iterations in one dispatch computes positions
    # start_pos .. start_pos + num_steps - 1 and samples num_steps tokens (slots are allocated for all of them)
    num_steps: int = 1

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class SchedulerOutput:
    # Entries with one new token (decodes) first, then multi-token prefill chunks.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)    # preempted during this schedule()
    # Requests that finished (any way: stop, length, abort) since the previous schedule() call:
    # the runner may drop its per-request state for them.
    finished_ids: list[str] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    num_decodes: int = 0            # scheduled[:num_decodes] have num_new_tokens == 1
    num_steps: int = 1              # > 1: a multi-step decode (every entry decodes, for up to this many steps)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


_STATUS_BY_REASON = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH_CAPPED,
    "abort": RequestStatus.FINISHED_ABORTED,
}


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 kv_cache_manager: KVCacheManager, max_model_len: int):
        if kv_cache_manager.block_size != cache_config.block_size:
            raise ValueError(f"block_size mismatch: cache config says {cache_config.block_size}, "
                             f"the KV cache manager has {kv_cache_manager.block_size}")
        capacity = kv_cache_manager.num_usable_blocks * kv_cache_manager.block_size
        if capacity < max_model_len:
            raise ValueError(f"the KV cache holds {capacity} tokens, fewer than max_model_len {max_model_len}: "
                             "lower max_model_len or give the KV cache more memory")
        if scheduler_config.max_num_batched_tokens <= 0 or scheduler_config.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if scheduler_config.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be at least 1, got {scheduler_config.num_scheduler_steps}")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.num_scheduler_steps = scheduler_config.num_scheduler_steps

        self.requests: dict[str, Request] = {}       # every unfinished request, by id
        self.waiting: deque[Request] = deque()       # FCFS; preempted requests re-enter at the front
        self.running: list[Request] = []             # admission order: the last one is the newest
        self._finished_ids: list[str] = []           # since the last schedule()
        self.num_preemptions = 0                     # total, for stats

    # -- queue ----------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises InvalidRequestError (bad length, duplicate id) or QueueFullError."""
        validate_prompt_length(request.num_prompt_tokens, None, self.max_model_len)
        if not self.enable_chunked_prefill and request.num_prompt_tokens > self.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt has {request.num_prompt_tokens} tokens, more than max_num_batched_tokens "
                f"{self.max_num_batched_tokens} with chunked prefill off", param="prompt")
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", param="request_id")
        limit = self.scheduler_config.max_waiting_requests
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting (max_waiting_requests is {limit}); "
                                 "retry later")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def request_ids(self) -> list[str]:
        """Ids of every unfinished request (waiting, preempted or running)."""
        return list(self.requests)

    # -- schedule -------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens and allocate their KV slots. Call update_from_output with the result
        before the next schedule(): num_computed_tokens advances there, not here."""
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted_ids: list[str] = []
        now = time.time()

        # 1. Running requests, oldest first. A victim is always popped from the end, which is never a
        #    request already scheduled in this step (those sit before index i).
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new <= 0:            # nothing to compute (cannot happen via update_from_output)
                i += 1
                continue
            if num_new > budget and not self._may_chunk(num_new):
                i += 1                  # chunked prefill off: wait for a step with room for all of it
                continue
            num_new = min(num_new, budget)
            while kv.allocate_slots(req, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted_ids.append(victim.request_id)
                if victim is req:
                    break
            else:
                scheduled.append(self._scheduled(req, num_new))
                budget -= num_new
                i += 1
                continue
            break                       # req preempted itself: nothing after it is left running

        # 2. Waiting requests, FCFS, unless this step had to preempt (no room to admit anyone).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted_ids:
            req = self.waiting[0]
            computed_blocks, num_hit_tokens = kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit_tokens
            if num_new > budget and not self._may_chunk(num_new):
                break
            num_new = min(num_new, budget)
            if kv.allocate_slots(req, num_new, computed_blocks) is None:
                break
            self.waiting.popleft()
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit_tokens
            req.num_computed_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            self.running.append(req)
            scheduled.append(self._scheduled(req, num_new))
            budget -= num_new

        # Decodes first, then prefill chunks (stable: FCFS within each group).
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        if len(decodes) != len(scheduled):
            scheduled = decodes + [s for s in scheduled if s.num_new_tokens != 1]
        num_steps = 1
        if self.num_scheduler_steps > 1 and scheduled and len(decodes) == len(scheduled):
            num_steps = self._plan_steps(scheduled)
        finished_ids, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled=scheduled, preempted_ids=preempted_ids, finished_ids=finished_ids,
                               total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
                               num_decodes=len(decodes), num_steps=num_steps)

    def _plan_steps(self, scheduled: list[ScheduledRequest]) -> int:
        """Multi-step decoding for an all-decode step: give each entry up to num_scheduler_steps steps
        (fewer where max_tokens or max_model_len comes first) and allocate their slots now. Returns the
        step count (1 when some request needs the host between tokens: penalties read the history,
        min_tokens still masks stop ids, a structured output's mask follows each token; logprobs come back
        per iteration).

        A request that cannot get the extra blocks runs one step; nothing is preempted for lookahead. A
        request that stops early (EOS, stop string) wastes the rest of its steps; the engine drops them."""
        for s in scheduled:
            req = s.request
            if not s.samples or req.uses_penalties or len(req.output_token_ids) < req.min_tokens \
                    or getattr(req.sampling_params, "structured_outputs", None) is not None:
                # (a one-token prompt chunk that stops short of the end samples nothing; a structured
                # output's mask needs each previous token on the host)
                return 1
        kv, n, max_len = self.kv_cache_manager, self.num_scheduler_steps, self.max_model_len
        ks = []
        for s in scheduled:
            req = s.request
            k = min(n, max_len - req.num_tokens)
            if req.max_tokens is not None:
                k = min(k, req.max_tokens - len(req.output_token_ids))
            ks.append(k)
        # The loop always runs n iterations (a device-computed trip count would sync the host every
        # iteration): when no entry can use them all (every request near its end), single steps waste nothing.
        if max(ks) < n:
            return 1
        longest = 1
        for s, k in zip(scheduled, ks):
            if k > 1 and kv.allocate_slots(s.request, k) is not None:
                s.num_steps = k
                s.block_ids = kv.block_ids(s.request.request_id)
                longest = max(longest, k)
        if longest < n:     # the pool gave no entry all n: single steps (the blocks stay for those steps)
            for s in scheduled:
                s.num_steps = 1
            return 1
        return n

    def _may_chunk(self, num_new: int) -> bool:
        # With chunked prefill off, a sequence that could never fit a whole step (a preempted request
        # recomputing prompt + outputs) is still chunked rather than left waiting forever.
        return self.enable_chunked_prefill or num_new > self.max_num_batched_tokens

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(request=req, num_new_tokens=num_new, start_pos=start,
                                block_ids=self.kv_cache_manager.block_ids(req.request_id),
                                samples=start + num_new == req.num_tokens)

    def _preempt(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- results --------------------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled: dict[str, list[int]]) -> list[Request]:
        """Record what the step computed and sampled; returns the requests that finished now.

        sampled[request_id] holds the token(s) sampled for each entry with samples=True: one per step the
        entry ran (``num_steps``; its K/V positions start_pos .. start_pos + num_steps - 1 are computed).
        Tokens after a stop are dropped. Entries whose request was aborted or finished in the meantime are
        skipped.
        """
        kv = self.kv_cache_manager
        now = time.time()
        newly_finished: list[Request] = []
        requests, running_status = self.requests, RequestStatus.RUNNING
        max_model_len = self.max_model_len
        cache_blocks = kv.cache_blocks if kv.enable_prefix_caching else None
        for entry in scheduler_output.scheduled:
            req = entry.request
            if requests.get(req.request_id) is not req or req.status != running_status:
                continue
            if req.num_computed_tokens != entry.start_pos:
                raise RuntimeError(f"stale scheduler output for {req.request_id}: it starts at "
                                   f"{entry.start_pos}, the request has {req.num_computed_tokens} computed "
                                   "tokens (call update_from_output once per schedule, in order)")
            req.num_computed_tokens = entry.start_pos + entry.num_new_tokens
            if entry.samples:
                tokens = sampled.get(req.request_id)
                if tokens:
                    # a multi-step entry computed one more position per token it sampled after the first
                    req.num_computed_tokens += min(len(tokens), entry.num_steps) - 1
                    metrics = req.metrics
                    if metrics.first_token_time is None:
                        metrics.first_token_time = now
                    metrics.last_token_time = now
                    for token in tokens:
                        req.output_token_ids.append(token)
                        req._all_token_ids.append(token)
                        # check_stop has nothing to do unless a length limit is reached or the token is a
                        # stop/eos id (the common case of a decode step skips the call)
                        if ((token in req.eos_token_ids or token in req.stop_token_ids
                             or len(req._all_token_ids) >= max_model_len
                             or (req.max_tokens is not None and len(req.output_token_ids) >= req.max_tokens))
                                and check_stop(req, max_model_len)):
                            break
                else:
                    # No token came back: recompute the last position next step rather than stall.
                    req.num_computed_tokens -= 1
            if cache_blocks is not None:
                # a multi-step entry's later tokens are placeholders until the engine reads them: blocks
                # holding them are cached by a later step
                cache_blocks(req, min(req.num_computed_tokens, entry.start_pos + entry.num_new_tokens))
            if req.status > RequestStatus.PREEMPTED:        # finished
                self._retire(req, now)
                newly_finished.append(req)
        if newly_finished:
            self.running = [r for r in self.running if not r.is_finished()]
        return newly_finished

    # -- finishing from outside -----------------------------------------------------------------------
    def finish_request(self, request_id: str, status: RequestStatus | str = RequestStatus.FINISHED_STOPPED,
                       stop_reason: int | str | None = None) -> Request | None:
        """Finish a request now (engine: a stop string matched; or abort). `status` is a finished
        RequestStatus or a finish reason ("stop" | "length" | "abort"). Returns the request, or None
        if it is unknown or already finished."""
        if isinstance(status, str):
            if status not in _STATUS_BY_REASON:
                raise ValueError(f"unknown finish reason {status!r}: use one of {sorted(_STATUS_BY_REASON)}")
            status = _STATUS_BY_REASON[status]
        if not RequestStatus.is_finished(status):
            raise ValueError(f"{status!r} is not a finished status")
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        if stop_reason is not None:
            req.stop_reason = stop_reason
        self._retire(req, time.time())
        return req

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[Request]:
        """Abort requests wherever they are (waiting, running, preempted); unknown ids are ignored.
        Frees their blocks. Returns the requests aborted."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        aborted = []
        for request_id in request_ids:
            req = self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
            if req is not None:
                aborted.append(req)
        return aborted

    def _retire(self, req: Request, now: float) -> None:
        # Computed full blocks stay in the prefix cache after the free (until evicted).
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
        req.metrics.finished_time = now

    # -- stats ----------------------------------------------------------------------------------------
    def get_stats(self) -> dict[str, float | int]:
        kv = self.kv_cache_manager
        pc = kv.prefix_cache_stats
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "kv_cache_usage": kv.usage,
            "num_free_blocks": kv.num_free_blocks,
            "prefix_cache_queries": pc.queries,
            "prefix_cache_hits": pc.hits,
            "prefix_cache_hit_rate": pc.hit_rate,
            "num_preemptions": self.num_preemptions,
        }
