"""Continuous batching: which tokens of which requests the next step computes.

One token budget per step (max_num_batched_tokens) and a cap on running sequences (max_num_seqs).
Running requests go first (a decode token each, or the next chunk of a prompt still prefilling), then
waiting requests in FCFS order (``--scheduling-policy priority``: by priority, then arrival), chunked to the
budget that is left (chunked prefill). There are no separate prefill and decode phases: the step is one
ragged batch.

Fair prefill (long prompts sharing the step with the others) and the share of prompts being scored:
``prefill_shares``.

A request's next tokens are ``all_token_ids[num_computed_tokens:num_tokens]``. The step samples a token
for it only when its chunk reaches num_tokens (``ScheduledRequest.samples``): a prefill chunk that
stops short yields no token. When the pool runs dry for a running request, the last running request is
preempted (blocks freed, requeued, recomputed later from its prompt + outputs so far): the newest under FCFS;
under the priority policy the running list is kept in priority order, so the last is the lowest priority
(latest arrival among equals), vLLM's victim.

Speculative decoding (``engine.speculator``): a running request whose ``spec_token_ids`` the speculator set
before this schedule is scheduled with as many of them as the budget leaves room for after its own token
(``ScheduledRequest.spec_token_ids``, KV slots for all of them); ``update_from_output`` counts a placeholder
for each token the step may emit (drafts + 1; the drafts' hold the drafts) and ``apply_sampled_tokens`` rolls
back the drafts it rejected. With async scheduling the next step is placed as if all were accepted (its forward
moves it back on the device, ``spec_shift.shift_back``): a request whose placed tokens reach its limit is
capped until the read rolls them back (``uncap``), and a preempted one is not readmitted before its drafts
are read.

The scheduler never decides that a request is finished: ``update_from_output`` counts the tokens a
dispatched step samples as placeholders, and a request whose placeholders reach its length limit gets no
more steps (it waits, holding its blocks, in ``capped``); ``core_outputs.apply_sampled_tokens`` reads the
tokens, decides (EOS, stop ids, length) and the engine core frees what it names with ``finish_requests``
(a stop string, found by the front end, comes as an abort).
Admission (prompt length, queue limits) is the engine's, checked before ``add_request``.
Pipeline stages' batch queue (``num_batches`` > 1 steps in flight): a step takes no request with a token in
flight and at most its share of the requests, so the steps in flight hold disjoint requests.

A request that asks for prompt logprobs is scheduled like any other, its chunks costed and shared as
``scoring_budget`` says; such a request waits, in place, while the scorer's executables compile in the
background (``scoring_ready``). ``num_scoring`` lets the engine skip that look on the steps without one.
"""
from __future__ import annotations

import bisect
import time
from typing import Iterable

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.engine.encoder_cache_manager import EncoderCacheManager
from jaxserve.engine.kv_cache_manager import KVCacheManager
from jaxserve.engine.multi_step_plan import plan_steps
from jaxserve.engine.prefill_shares import PrefillShares
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.request_queue import priority_key, waiting_queue
from jaxserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.engine.scoring_budget import chunk_cost, fit_chunk, scores_prompt
from jaxserve.runner.step_contract import PLACEHOLDER



class Scheduler(PrefillShares):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 kv_cache_manager: KVCacheManager, max_model_len: int,
                 encoder_cache: EncoderCacheManager | None = None, lora=None):
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
        # a vision model's encoder budget and cache (None: a text model; see encoder_cache_manager's NOTE)
        self.encoder_cache = encoder_cache
        # LoRA: the adapter slots (engine.lora_manager.LoRAManager; None: LoRA off)
        self.lora = lora
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.num_scheduler_steps = scheduler_config.num_scheduler_steps
        # a long prefill has more tokens than this left to compute (0: none is; see the module's NOTE)
        threshold = scheduler_config.long_prefill_token_threshold
        self.long_prefill_threshold = 0 if not self.enable_chunked_prefill else (
            self.max_num_batched_tokens // 2 if threshold is None else threshold)

        # async scheduling with speculation: a request whose placed drafts reach its limit is capped until
        # the read rolls them back (``uncap``) or finishes it
        self.async_drafts = False
        self.requests: dict[str, Request] = {}       # every unfinished request, by id
        # FCFS (preempted requests re-enter at the front), or by priority under that policy
        self.waiting = waiting_queue(scheduler_config.scheduling_policy)
        # admission order (the last one is the newest), or priority order under that policy: the last one is
        # the victim of a preemption
        self.running: list[Request] = []
        self.by_priority = scheduler_config.scheduling_policy == "priority"
        # Running requests whose last token (by length) is dispatched: no more steps, and never preempted;
        # they keep their blocks until the output processor has read that token and the engine finishes them.
        self.capped: dict[str, Request] = {}
        self.num_scoring = 0                         # unfinished requests that asked for prompt logprobs
        self.scoring_ready = True                    # False while the engine's prompt scorer compiles
        self.num_penalized = 0                       # unfinished requests with a presence/frequency/repetition penalty
        self.num_preemptions = 0                     # total, for stats
        self.num_batches = 1                         # steps of disjoint requests in flight (pipeline stages)

    # -- queue ----------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request the engine has admitted (its length and the queue limits are checked there)."""
        assert request.request_id not in self.requests, f"request id {request.request_id!r} is already queued"
        assert 0 < request.num_prompt_tokens <= self.max_model_len, request
        # the output length at which it stops by length: max_tokens, or what max_model_len leaves
        request.max_output_tokens = min(request.max_output_tokens, self.max_model_len - request.num_prompt_tokens)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if scores_prompt(request):
            self.num_scoring += 1
        if request.uses_penalties:
            self.num_penalized += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.capped)

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
        preempted = False
        share = self._scoring_share() if self.num_scoring else budget   # left to the chunks being scored
        long_threshold = self.long_prefill_threshold
        long_share = None               # left to the long prefills' chunks (computed when one comes)
        cut: list[ScheduledRequest] = []     # long prefill chunks the long share cut short
        now = time.time()
        enc = self.encoder_cache
        enc_budget = enc.budget if enc is not None else 0
        mm_requests: list[Request] | None = None
        num_drafts = 0

        # 1. Running requests, oldest first. A victim is always popped from the end, which is never a
        #    request already scheduled in this step (those sit before index i).
        i = 0
        req_to_blocks, req_to_block_ids, bs = kv.req_to_blocks, kv.req_to_block_ids, kv.block_size
        seats = -(-(len(self.running) + len(self.waiting)) // self.num_batches) if self.num_batches > 1 else 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if seats and (req.num_placeholders or len(scheduled) >= seats):     # in flight, or another batch's
                i += 1
                continue
            num_new = len(req._all_token_ids) - req.num_computed_tokens
            if num_new <= 0:            # nothing to compute (cannot happen via update_from_output)
                i += 1
                continue
            if num_new == 1 and not self.num_scoring and not req.spec_token_ids and (
                    enc is None or req.mm_features is None or req.num_computed_tokens >= req.num_prompt_tokens):
                # a decode inside its last block (15 of 16 steps): allocate_slots' and _scheduled's
                # common case inlined, once per running request per step
                blocks = req_to_blocks.get(req.request_id)
                if blocks is not None and req.num_computed_tokens < len(blocks) * bs:
                    start = req.num_computed_tokens
                    scheduled.append(ScheduledRequest(req, 1, start, req_to_block_ids[req.request_id],
                                                      start + 1 == len(req._all_token_ids)))
                    budget -= 1
                    i += 1
                    continue
            cost = chunk_cost(req, num_new) if self.num_scoring else num_new
            room = min(budget, share) if cost > num_new else budget
            is_long = num_new > long_threshold > 0
            if is_long:
                if long_share is None:
                    long_share = self._long_share()
                room = min(room, long_share)
                if req.mm_features is not None:     # (an image taken whole may pass the long share)
                    room = min(budget, max(room, enc.whole_image_room(req, req.num_computed_tokens)))
            if cost > room:
                if not self._may_chunk(cost):
                    i += 1              # chunked prefill off: wait for a step with room for all of it
                    continue
                num_new, cost = fit_chunk(req, num_new, room)
                if num_new == 0:        # a scored chunk's first token alone costs 2
                    i += 1
                    continue
            encode = None
            if req.mm_features is not None and req.num_computed_tokens < req.num_prompt_tokens:
                num_new, encode, enc_budget = enc.schedule(req, req.num_computed_tokens, num_new, enc_budget)
                if num_new <= 0:        # its next image waits for encoder budget or cache room
                    i += 1
                    continue
                cost = chunk_cost(req, num_new) if self.num_scoring else num_new
                mm_requests = (mm_requests or []) + [req]
            drafts = req.spec_token_ids
            if drafts:                  # speculation: the draft tokens the budget leaves room for, verified too
                drafts = drafts[:budget - cost]
                num_new += len(drafts)
                cost += len(drafts)
            while kv.allocate_slots(req, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append(self._scheduled(req, num_new, encode, drafts or None))
                num_drafts += len(drafts) if drafts else 0
                budget -= cost
                share -= cost if cost > num_new else 0
                if is_long:
                    long_share = max(long_share - num_new, 0)
                    cut.append(scheduled[-1])
                i += 1
                continue
            break                       # req preempted itself: nothing after it is left running

        # 2. Waiting requests, FCFS, unless this step had to preempt (no room to admit anyone). (A request whose
        #    grammar is still compiling is not here yet: the engine core holds it apart, WAITING_FOR_FSM.)
        skipped: list[Request] = []
        lora_blocked = False
        # (a request capped on drafts in flight may run again, ``uncap``: it keeps its seat)
        seated = len(self.running) + (len(self.capped) if self.async_drafts else 0)
        while self.waiting and budget > 0 and seated < self.max_num_seqs and not preempted and \
                (not seats or len(scheduled) < seats):
            req = self.waiting[0]
            scores = self.num_scoring and scores_prompt(req)
            # (preempted in flight: under the batch queue, or with drafts it may roll back)
            if (scores and not self.scoring_ready) or (seats and req.num_placeholders) or req.num_drafts_in_flight:
                skipped.append(self.waiting.popleft())
                continue
            computed_blocks, num_hit_tokens = kv.get_computed_blocks(req) if not scores else ([], 0)
            num_new = req.num_tokens - num_hit_tokens
            cost = chunk_cost(req, num_new) if scores else num_new
            room = min(budget, share) if cost > num_new else budget
            is_long = num_new > long_threshold > 0
            if is_long:
                if long_share is None:
                    long_share = self._long_share()
                room = min(room, long_share)
                if req.mm_features is not None:
                    room = min(budget, max(room, enc.whole_image_room(req, num_hit_tokens)))
            if cost > room:
                if not self._may_chunk(cost):
                    break
                num_new, cost = fit_chunk(req, num_new, room)
                if num_new == 0 and room < budget:   # no scoring or long share left: it keeps its place
                    skipped.append(self.waiting.popleft())
                    continue
                if num_new == 0:
                    break
            encode = None
            if req.mm_features is not None:
                num_new, encode, enc_budget = enc.schedule(req, num_hit_tokens, num_new, enc_budget)
                if num_new <= 0:        # its first image waits for encoder budget or cache room
                    enc.release_all(req)
                    break
                cost = chunk_cost(req, num_new) if scores else num_new
                mm_requests = (mm_requests or []) + [req]     # (harmless if it does not run: nothing computed)
            # no adapter slot: it waits, and so do the adapter requests behind it (FCFS: they would keep their
            # adapters' slots pinned and it might never get one)
            if req.lora_request is not None and (lora_blocked or not self.lora.acquire(req)):
                lora_blocked = True
                if encode is not None:
                    enc.cancel(req, encode)
                skipped.append(self.waiting.popleft())
                continue
            if kv.allocate_slots(req, num_new, computed_blocks) is None:
                if encode is not None:
                    enc.cancel(req, encode)
                if req.lora_slot:
                    self.lora.release(req)
                break
            self.waiting.popleft()
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit_tokens
            req.num_computed_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            if self.by_priority:
                bisect.insort(self.running, req, key=priority_key)
            else:
                self.running.append(req)
            seated += 1
            scheduled.append(self._scheduled(req, num_new, encode))
            budget -= cost
            share -= cost if cost > num_new else 0
            if is_long:
                long_share = max(long_share - num_new, 0)
                cut.append(scheduled[-1])
        if skipped:
            self.waiting.extendleft(reversed(skipped))
        if cut and budget > 0:
            self._top_up(cut, budget)

        # Decodes first, then prefill chunks (stable: FCFS within each group).
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        if len(decodes) != len(scheduled):
            scheduled = decodes + [s for s in scheduled if s.num_new_tokens != 1]
        num_steps = 1
        if self.num_scheduler_steps > 1 and scheduled and len(decodes) == len(scheduled):
            num_steps = plan_steps(scheduled, self.kv_cache_manager, self.num_scheduler_steps)
        return SchedulerOutput(scheduled=scheduled, num_steps=num_steps, mm_requests=mm_requests,
                               num_draft_tokens=num_drafts)

    def _scheduled(self, req: Request, num_new: int, encode: list | None = None,
                   drafts: list[int] | None = None) -> ScheduledRequest:
        start = req.num_computed_tokens
        known = num_new - len(drafts) if drafts else num_new
        return ScheduledRequest(req, num_new, start, self.kv_cache_manager.live_block_ids(req.request_id),
                                start + known == len(req._all_token_ids), encoder_inputs=encode or None,
                                spec_token_ids=drafts)

    def _preempt(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        if req.lora_slot:
            self.lora.release(req)
        if req.mm_features is not None and self.encoder_cache is not None:
            self.encoder_cache.release_all(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- results --------------------------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput) -> None:
        """The step was dispatched: advance each entry's computed tokens and append a PLACEHOLDER for each
        token it samples (``num_steps`` of them for a multi-step entry, whose K/V positions start_pos ..
        start_pos + num_steps - 1 are computed). A request whose placeholders reach its length limit moves to
        ``capped``. Entries whose request finished since schedule() are skipped.
        """
        requests, running_status = self.requests, RequestStatus.RUNNING
        kv = self.kv_cache_manager
        cache_blocks = kv.cache_blocks if kv.enable_prefix_caching else None
        num_cached, bs = kv.num_cached_blocks, kv.block_size
        capped = None
        for entry in scheduler_output.scheduled:
            req = entry.request
            if req.status != running_status or requests.get(req.request_id) is not req:
                continue
            if req.num_computed_tokens != entry.start_pos:
                raise RuntimeError(f"stale scheduler output for {req.request_id}: it starts at "
                                   f"{entry.start_pos}, the request has {req.num_computed_tokens} computed "
                                   "tokens (call update_from_output once per schedule, in order)")
            end = entry.start_pos + entry.num_new_tokens
            if entry.samples:
                n = entry.num_steps
                drafts = entry.spec_token_ids
                if drafts is not None:
                    # up to len(drafts) + 1 tokens; the ones not accepted are rolled back when the step is read
                    # (``core_outputs.apply_sampled_tokens``); the drafts stand in for them meanwhile (the
                    # proposer's history for the next step, placed as if all were accepted)
                    req.output_token_ids += drafts
                    req._all_token_ids += drafts
                    req.append_placeholders(1)
                    req.num_placeholders += len(drafts)
                    req.num_drafts_in_flight += len(drafts)
                    # (steps read before the next schedule need no cap: the read rolls back or finishes it)
                    if self.async_drafts and len(req.output_token_ids) >= req.max_output_tokens:
                        if capped is None:
                            capped = []
                        capped.append(req)      # (``uncap``: rolled back below its limit)
                else:
                    if n == 1:          # req.append_placeholders(1), inlined: once per decode per step
                        req.output_token_ids.append(PLACEHOLDER)
                        req._all_token_ids.append(PLACEHOLDER)
                        req.num_placeholders += 1
                    else:
                        req.append_placeholders(n)
                        end += n - 1    # the loop computed one more position per token after the first
                    if len(req.output_token_ids) >= req.max_output_tokens:
                        if capped is None:
                            capped = []
                        capped.append(req)
            req.num_computed_tokens = end
            if cache_blocks is not None:
                # only blocks of known tokens: placeholders are filled when the output processor reads them;
                # a decode inside a block fills none (checked here: once per request per step)
                known = len(req._all_token_ids) - req.num_placeholders
                if end < known:
                    known = end
                if known // bs > num_cached.get(req.request_id, 0):
                    cache_blocks(req, known)
        if capped:
            for req in capped:
                self.capped[req.request_id] = req
            self.running = [r for r in self.running if r.request_id not in self.capped]
        if scheduler_output.mm_requests:
            for req in scheduler_output.mm_requests:
                self.encoder_cache.release_computed(req)

    def uncap(self, req: Request) -> None:
        """``req``, capped on drafts a read step rolled back, runs again (its placeholders are below its
        limit now)."""
        if self.capped.pop(req.request_id, None) is not None:
            if self.by_priority:
                bisect.insort(self.running, req, key=priority_key)
            else:
                self.running.append(req)

    # -- finishing ------------------------------------------------------------------------------------
    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests wherever they are (waiting, running, capped) with a finished ``status`` and
        free their blocks; unknown or already finished ids are ignored. Returns the requests finished."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"{status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        now = time.time()
        finished, leave_running = [], False
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None:
                continue
            if self.capped.pop(request_id, None) is None:
                if req.status == RequestStatus.RUNNING:
                    leave_running = True
                else:
                    self.waiting.remove(req)
            req.status = status
            self._retire(req, now)
            finished.append(req)
        if leave_running:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return finished

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[Request]:
        """Abort requests wherever they are; unknown ids are ignored. Frees their blocks."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def _retire(self, req: Request, now: float) -> None:
        # Computed full blocks stay in the prefix cache after the free (until evicted); the last ones whose
        # tokens were placeholders at the last update are known now.
        kv = self.kv_cache_manager
        if kv.enable_prefix_caching and req.num_computed_tokens:
            kv.cache_blocks(req, min(req.num_computed_tokens, len(req._all_token_ids) - req.num_placeholders))
        kv.free(req)
        if req.mm_features is not None and self.encoder_cache is not None:
            self.encoder_cache.release_all(req)
        if req.lora_slot:
            self.lora.release(req)
        del self.requests[req.request_id]
        if scores_prompt(req):
            self.num_scoring -= 1
        if req.uses_penalties:
            self.num_penalized -= 1
        req.metrics.finished_time = now

    # -- stats ----------------------------------------------------------------------------------------
    def get_stats(self) -> dict[str, float | int]:
        kv = self.kv_cache_manager
        pc = kv.prefix_cache_stats
        return {
            "num_running": self.num_running,
            "num_waiting": len(self.waiting),
            "kv_cache_usage": kv.usage,
            "num_free_blocks": kv.num_free_blocks,
            "prefix_cache_queries": pc.queries,
            "prefix_cache_hits": pc.hits,
            "prefix_cache_hit_rate": pc.hit_rate,
            "num_preemptions": self.num_preemptions,
        }
