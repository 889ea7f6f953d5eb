"""Speculative decoding's engine side: which requests speculate, their draft tokens before each schedule, and
the acceptance counters (vLLM's ``spec_decode_*``).

NOTE (the design): before each ``schedule()`` the speculator proposes up to K tokens to follow each running
request's last token (``Request.spec_token_ids``; the ``ngram`` proposer looks them up in the request's own
prompt + outputs on the host, ``draft_model`` runs a smaller model K steps greedily); the scheduler verifies
as many as the token budget leaves room for in the same ragged step (1 + d tokens, KV slots for all of
them); the runner's rejection sampler returns the accepted drafts and one more token; the one function that
applies sampled tokens rolls back the rejected ones. Speculating steps run synchronously: each is read
before the next is scheduled (the proposer needs the tokens), except n-gram ones under async scheduling
(``JAXSERVE_SPEC_ASYNC``, by default on a GPU): each step is then placed as if the one in flight accepted all its drafts (moved
back on the device by what it rejected), and the drafts are proposed on the device after every step from
the tokens it accepted (``runner.ngram_device``): the host places K draft slots (placeholders) for a request
that was in the step before and whose last proposal count read was > 0, the step reads the drafts there.

Under tensor parallelism a draft model or head runs on the target's mesh (its weights and KV cache sharded
over "tp" as the target's; it must divide as the target does; a head reads the target's hidden states,
replicated as every step output is). With LoRA the draft proposes from its base weights and
the target verifies with each request's adapter: greedy output is the adapter's.

A request speculates when its next token follows from the logits alone, the same at every position:
no penalties or bad words (their history would include the drafts), no logprobs, no pending ``min_tokens``,
no structured output (its grammar would have to follow each draft: such a request decodes one token a step,
as without speculation), and room left under its length limit.
"""
from __future__ import annotations

import time

import numpy as np

from jaxserve.config_decoding import HIDDEN_STATE_METHODS, SpeculativeConfig
from jaxserve.engine.request import Request
from jaxserve.runner.ngram_proposer import propose_ngram
from jaxserve.runner.step_contract import PLACEHOLDER


def speculates(req: Request) -> bool:
    """Whether ``req`` may take draft tokens at all (see the module's NOTE; length and min_tokens aside)."""
    p = req.sampling_params
    return not (req.uses_penalties or p.restricts_tokens or p.logprobs is not None
                or p.structured_outputs is not None)


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft=None):
        self.config = config
        self.k = config.num_speculative_tokens
        self.draft = draft                    # a draft-model proposer (``method: draft_model``), else None
        self.num_drafts = 0                   # requests' verified drafts (one per request and step with drafts)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k  # drafts accepted at each position 0 .. K - 1
        self.propose_ms = 0.0                 # host time spent proposing
        # drafts proposed on the device (``runner.ngram_device``; set by the engine core): request id -> the
        # count proposed after the latest step read that sampled it
        self.on_device = False
        self.device_counts: dict[str, int] = {}
        # ngram: each proposing request's tokens as a numpy array, extended by the tokens it gained since
        # (converting the whole list every step cost ten times the lookup): request id -> (request, buffer,
        # tokens in it), of the requests that proposed last round
        self._arrays: dict[str, tuple[Request, np.ndarray, int]] = {}

    def propose(self, running: list[Request], device_rows: dict[str, int] | None = None) -> None:
        """Set each running request's ``spec_token_ids`` for the next schedule (None where it takes none).
        ``device_rows``: drafts on the device, of the requests in the latest step (``propose_on_device``)."""
        t0 = time.perf_counter()
        if self.on_device:
            self.propose_on_device(running, device_rows or {})
            self.propose_ms += (time.perf_counter() - t0) * 1e3
            return
        wanted: list[tuple[Request, int]] = []
        for req in running:
            req.spec_token_ids = None
            room = self._room(req)
            # drafts only from verified tokens: under async scheduling a request whose drafts are still in
            # flight takes none this round (drafts continuing unverified ones are wrong whenever those are
            # rejected, and are rejected in turn); synchronous steps never have drafts in flight here
            if room <= 0 or req.num_drafts_in_flight:
                continue
            wanted.append((req, room))
        if wanted or (self.draft is not None and self.draft.every_step):
            if self.draft is not None:
                for (req, room), drafts in zip(wanted, self.draft.propose(wanted)):
                    req.spec_token_ids = drafts[:room] or None
            else:
                c, arrays = self.config, {}
                for req, room in wanted:
                    tokens = self._tokens(req, arrays)
                    if req.num_placeholders:    # its last token is on the device: guessed, then the drafts
                        drafts = propose_ngram(tokens[:-1], c.prompt_lookup_min, c.prompt_lookup_max, room + 1)[1:]
                    else:
                        drafts = propose_ngram(tokens, c.prompt_lookup_min, c.prompt_lookup_max, room)
                    req.spec_token_ids = drafts or None
                self._arrays = arrays       # (the requests that did not propose now drop theirs)
        self.propose_ms += (time.perf_counter() - t0) * 1e3

    def _room(self, req: Request) -> int:
        """The drafts ``req`` may take now (0: none): its length limit's room, none before its prompt is done,
        below ``min_tokens`` or where it must not speculate (``speculates``)."""
        num_out = len(req.output_token_ids)
        if req.num_computed_tokens != len(req._all_token_ids) - 1 or num_out < req.min_tokens \
                or not speculates(req):
            return 0
        return min(self.k, req.max_output_tokens - num_out - 1)

    def propose_on_device(self, running: list[Request], device_rows: dict[str, int]) -> None:
        """Drafts proposed on the device: K draft slots (placeholders: the step reads the drafts there) for
        each request that was in the latest step (its drafts exist) and whose last count read was > 0 (one
        step late: a request whose text offers no match decodes a plain token a step)."""
        counts = self.device_counts
        if len(counts) > 2 * len(running) + 64:     # (forget finished requests)
            self.device_counts = counts = {r.request_id: counts[r.request_id] for r in running
                                           if r.request_id in counts}
        for req in running:
            req.spec_token_ids = None
            rid = req.request_id
            if rid in device_rows and counts.get(rid, 0) > 0:
                room = self._room(req)
                if room > 0:
                    req.spec_token_ids = [PLACEHOLDER] * room

    def read_proposals(self, proposed: dict[str, int]) -> None:
        """A read step's device proposal counts (``propose_on_device`` gates on them)."""
        self.device_counts.update(proposed)

    def _tokens(self, req: Request, arrays: dict) -> np.ndarray:
        """``req``'s tokens as a numpy array (with async scheduling its drafts in flight stand where they
        would be accepted, its last token a placeholder), its buffer extended from the previous round's known
        tokens (placeholders change when read) and kept in ``arrays``."""
        tokens, n = req._all_token_ids, len(req._all_token_ids)
        entry = self._arrays.get(req.request_id)
        if entry is None or entry[0] is not req or entry[2] > n:
            buf, m = np.empty(max(64, 2 * n), np.int64), 0
        else:
            _, buf, m = entry
            if n > buf.shape[0]:
                buf = np.concatenate([buf[:m], np.empty(max(n, 2 * m), np.int64)])
        buf[m:n] = tokens[m:n]
        arrays[req.request_id] = (req, buf, n - req.num_placeholders)
        return buf[:n]

    def record(self, spec: dict[str, tuple[int, int, int]] | None) -> None:
        """Count a read step's verified drafts: request id -> (draft slots, accepted, drafts verified)."""
        if not spec:
            return
        per_pos = self.accepted_per_pos
        for _, num_accepted, num_drafts in spec.values():
            if not num_drafts:      # (draft slots the device proposed nothing for)
                continue
            self.num_drafts += 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted
            for j in range(num_accepted):
                per_pos[j] += 1

    def stats(self) -> dict:
        """vLLM's counter names (totals since start), and the host milliseconds spent proposing."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "spec_decode_propose_ms": self.propose_ms}


def load_draft(executor, config):
    """A ``draft_model``, ``eagle``, ``eagle3`` or ``deepseek_mtp`` speculator's proposer (its weights and KV
    cache: made before the target's KV cache is sized from the memory left), else None."""
    spec = config.speculative_config
    if spec is None or spec.method not in ("draft_model", *HIDDEN_STATE_METHODS):
        return None
    if spec.method in HIDDEN_STATE_METHODS:
        from jaxserve.engine.eagle_proposer import EagleProposer  # noqa: PLC0415
        return EagleProposer(executor, config)
    from jaxserve.engine.draft_proposer import DraftProposer  # noqa: PLC0415
    return DraftProposer(executor, config)


def make_speculator(core, config, draft=None) -> Speculator:
    """The engine core's speculator for ``config.speculative_config`` (``draft``: ``load_draft``'s); a
    combination it cannot serve exactly is refused here, with what to change."""
    spec = config.speculative_config
    unsupported = [why for bad, why in (
        (core.multi_process, "a model spread over several processes"),
        (config.scheduler.num_scheduler_steps > 1, "--num-scheduler-steps > 1"),
        (core.runner.encoder is not None, "a vision model"),
        (getattr(core.runner, "mrope", None) is not None, "M-RoPE positions"),
    ) if bad]
    if unsupported:
        raise ValueError(f"--speculative-config is not supported with {unsupported[0]}; drop one of the two")
    return Speculator(spec, draft)
