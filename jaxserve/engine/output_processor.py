"""The output processor: a step's sampled tokens → request state and RequestOutputs, and the one place that
decides a request is finished and why (``OutputProcessor.process_outputs``).

For each request the step sampled for, token by token (a multi-step dispatch brings several):
- fill the request's placeholder with the token;
- stop on EOS (unless ignore_eos) or a stop token id, from min_tokens on (stop_reason: None for EOS, else the
  id); a stop on the token that also reaches the length limit wins (the model did stop);
- else finish by length when the outputs reach ``max_output_tokens`` (max_tokens, or what max_model_len
  leaves);
- record its logprobs; detokenize incrementally, which matches stop strings (a stop string wins over
  length: stop_reason is the string);
- after a stop, drop the tokens the device computed past it (async scheduling and multi-step dispatch the
  next step before this one is read).
Then assemble the RequestOutput in the request's output kind (DELTA: only what is new; CUMULATIVE; FINAL_ONLY:
nothing until it finishes). The engine frees what this returns as finished (``Scheduler.finish_requests``).

This is the hot loop of the host (once per request per step): attribute lookups are hoisted and the common
case (no stop, no logprobs, FINAL_ONLY output while running) does no more than it must.

Structured outputs: a constrained request's grammar matcher accepts each token right after it is filled in,
and a grammar that reaches its end finishes the request there (status stop), like a stop token.

With the engine core in its own process the work splits in two: the core's processor (``core_outputs=True``)
makes every decision that needs no text (EOS, stop ids, length, grammar) and returns compact
``EngineCoreOutput``s; the front end's ``FrontendOutputProcessor`` detokenizes, matches stop strings (a stop
string found there finishes the request at once and the front end aborts it in the core, which may have
computed one more token: it is dropped), decodes logprobs and assembles the same RequestOutputs.
"""
from __future__ import annotations

import time
from typing import Any, Iterable

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.messages import EngineCoreOutput
from jaxserve.engine.request import Request, RequestStatus, finish_reason
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput, decode_logprobs
from jaxserve.sampling_params import RequestOutputKind

_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY
_DELTA = RequestOutputKind.DELTA
# In the engine core of a split engine, a request's detokenizer slot holds this when its front end shows
# nothing before the end (FINAL_ONLY, no stop strings, no logprobs): its tokens are sent once, when it finishes.
_DEFERRED = "deferred"



def _step_tokens(token_ids: dict[str, Any], logprobs: dict[str, Any] | None, rid: str) -> tuple:
    """(tokens, logprobs or None) a step sampled for ``rid``, as sequences (a multi-step dispatch gives lists)."""
    toks = token_ids[rid]
    lps = logprobs.get(rid) if logprobs else None
    if type(toks) is int:
        return (toks,), ((lps,) if lps is not None else None)
    return toks, lps


def token_verdict(req: Request, num_output: int, tok: int, eos_ids, accept) -> tuple:
    """(status, stop reason) after ``req``'s ``num_output``-th output token ``tok``, or (None, None): EOS or
    a stop id from ``min_tokens`` on (a stop on the token that also reaches the limit wins), else the length
    limit; a structured-output grammar that ended (``accept``) stops like EOS. Stop strings, which need the
    text, are the detokenizer's (in a split engine the front end's)."""
    status = reason = None
    if num_output >= req.min_tokens and (tok in eos_ids or tok in req.stop_token_ids):
        status, reason = _STOPPED, (None if tok in eos_ids else tok)
    elif num_output >= req.max_output_tokens:
        status = _LENGTH_CAPPED
    if accept is not None and accept(req.request_id, tok) and status is not _STOPPED:
        status, reason = _STOPPED, None
    return status, reason

class OutputProcessor:
    def __init__(self, tokenizer: Any, structured_output: Any = None, *, core_outputs: bool = False):
        self.tokenizer = tokenizer
        self.structured_output = structured_output     # the StructuredOutputManager, or None
        # the engine core of a split engine: no text; EngineCoreOutputs for the front end
        self.core_outputs = core_outputs

    def add_request(self, req: Request) -> None:
        """Give a new request its output state (the detokenizer; the rest starts empty on the Request)."""
        p = req.sampling_params
        if not self.core_outputs:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p)
        elif p.output_kind is _FINAL_ONLY and not p.stop and p.logprobs is None:
            req.detokenizer = _DEFERRED

    def process_outputs(self, sampled: Iterable[tuple[Request, int]], token_ids: dict[str, Any],
                        logprobs: dict[str, Any] | None
                        ) -> tuple[list[RequestOutput], dict[RequestStatus, list[str]]]:
        """Read one step's results. ``sampled``: (request, index of its first placeholder of this step) for
        each request the step sampled for; ``token_ids[request_id]``: the token it sampled (a list after a
        multi-step dispatch), ``logprobs[request_id]``: (logprob, rank, top ids, top logprobs) (a list of
        them after multi-step) for requests that asked for logprobs.

        Returns the outputs to hand back and the requests that finished now, by status (their
        ``stop_reason`` is set); requests already finished or aborted are skipped."""
        if self.core_outputs:
            return self._process_core_outputs(sampled, token_ids, logprobs)
        now = time.time()
        outputs: list[RequestOutput] = []
        finished: dict[RequestStatus, list[str]] = {}
        preempted = RequestStatus.PREEMPTED
        so = self.structured_output
        accept = so.accept if so is not None and so.has_requests else None
        for req, first in sampled:
            if req.status > preempted:          # aborted, or finished by an earlier step's token
                continue
            rid = req.request_id
            toks, lps = _step_tokens(token_ids, logprobs, rid)
            detok = req.detokenizer
            eos_ids = () if req.ignore_eos else req.eos_token_ids
            status = reason = None
            for j, tok in enumerate(toks):
                idx = first + j
                req.set_output_token(idx, tok)
                status, reason = token_verdict(req, idx + 1, tok, eos_ids, accept)
                if lps is not None and lps[j] is not None:
                    self._record_logprobs(req, tok, lps[j])
                detok.update((tok,), status is not None)    # finished releases held-back text
                if detok.stop_reason is not None and status is not _STOPPED:
                    status, reason = _STOPPED, detok.stop_reason    # a stop string, also on the capped token
                if status is not None:
                    break
            metrics = req.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if status is not None:
                if len(req.output_token_ids) > idx + 1:
                    req.truncate_output(idx + 1)            # drop tokens computed after the stop
                req.stop_reason = reason
                metrics.finished_time = now
                finished.setdefault(status, []).append(rid)
                outputs.append(self.make_output(req, finish_reason(status)))
            elif req.sampling_params.output_kind is not _FINAL_ONLY:
                outputs.append(self.make_output(req, None))
        return outputs, finished

    def _process_core_outputs(self, sampled, token_ids, logprobs):
        """``process_outputs`` in the engine core of a split engine: the same decisions, minus stop strings
        (the front end's), and EngineCoreOutputs instead of RequestOutputs. A request whose front end shows
        nothing before the end (FINAL_ONLY, no stop strings, no logprobs) gets one output, when it finishes."""
        outputs: list[EngineCoreOutput] = []
        finished: dict[RequestStatus, list[str]] = {}
        preempted = RequestStatus.PREEMPTED
        so = self.structured_output
        accept = so.accept if so is not None and so.has_requests else None
        for req, first in sampled:
            if req.status > preempted:
                continue
            rid = req.request_id
            toks = token_ids[rid]
            eos_ids = () if req.ignore_eos else req.eos_token_ids
            status = reason = None
            if type(toks) is int and not logprobs:
                # one token, no logprobs (the common step): set_output_token inlined, and token_verdict
                # only for a token it could end on (a stop id, the length limit, a grammar)
                idx, j = first, 0
                req.output_token_ids[idx] = toks
                req._all_token_ids[len(req.prompt_token_ids) + idx] = toks
                req.num_placeholders -= 1
                lps = None
                if (toks in eos_ids or toks in req.stop_token_ids or idx + 1 >= req.max_output_tokens
                        or accept is not None):
                    status, reason = token_verdict(req, idx + 1, toks, eos_ids, accept)
            else:
                toks, lps = _step_tokens(token_ids, logprobs, rid)
                for j, tok in enumerate(toks):
                    idx = first + j
                    req.set_output_token(idx, tok)
                    status, reason = token_verdict(req, idx + 1, tok, eos_ids, accept)
                    if status is not None:
                        break
            if status is not None:
                if len(req.output_token_ids) > idx + 1:
                    req.truncate_output(idx + 1)
                req.stop_reason = reason
                finished.setdefault(status, []).append(rid)
            elif req.detokenizer is _DEFERRED:
                continue
            sent = req.num_sent_tokens
            known = len(req.output_token_ids) - req.num_placeholders
            out = EngineCoreOutput(rid, req.output_token_ids[sent:known], int(status or 0), reason,
                                   list(lps[:j + 1]) if lps is not None else None)
            if sent == 0:
                out.num_cached_tokens = req.num_cached_tokens
                out.first_scheduled_time = req.metrics.first_scheduled_time
                if req.prompt_logprobs is not None:
                    out.prompt_logprobs = [None if pos is None else
                                           {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in pos.items()}
                                           for pos in req.prompt_logprobs]
                    req.prompt_logprobs = None
            req.num_sent_tokens = known
            outputs.append(out)
        return outputs, finished

    def _record_logprobs(self, req: Request, token: int, lp: tuple) -> None:
        logprob, rank, top_ids, top_lps = lp
        req.cumulative_logprob += logprob
        req.logprobs.append(decode_logprobs(self.tokenizer, token, logprob, rank, top_ids, top_lps))

    @staticmethod
    def make_output(req: Request, reason: str | None) -> RequestOutput:
        """The request's output now; ``reason``: its finish reason if it just finished, else None."""
        params = req.sampling_params
        detok = req.detokenizer
        lps = req.logprobs
        prompt_lps = req.prompt_logprobs
        known = len(req.output_token_ids) - req.num_placeholders    # not the next step's, still in flight
        if params.output_kind is _DELTA:        # only the new part is copied
            n_tok = req.num_sent_tokens
            toks = req.output_token_ids[n_tok:known]
            text = detok.emitted_since(req.num_sent_chars)
            req.num_sent_tokens, req.num_sent_chars = known, detok.num_emitted
            lps = lps[n_tok:] if lps is not None else None
            req.prompt_logprobs = None          # sent once, with the first delta
        else:
            text = detok.output_text
            toks = req.output_token_ids[:known]
        cum = req.cumulative_logprob if params.logprobs is not None else None
        comp = CompletionOutput(index=0, text=text, token_ids=toks, cumulative_logprob=cum, logprobs=lps,
                                finish_reason=reason, stop_reason=req.stop_reason if reason is not None else None)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_token_ids, prompt_logprobs=prompt_lps, outputs=[comp],
                             finished=reason is not None, metrics=req.metrics,
                             num_cached_tokens=req.num_cached_tokens)


class FrontendOutputProcessor:
    """The front end's half of a split engine: the core's EngineCoreOutputs → RequestOutputs.

    Holds a front-end ``Request`` per request (the same class as the core's: its confirmed output tokens,
    detokenizer, logprobs, what was sent), so ``OutputProcessor.make_output`` builds exactly the outputs the
    in-process engine builds."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.requests: dict[str, Request] = {}

    def add_request(self, req: Request) -> None:
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.sampling_params)
        req.status = RequestStatus.RUNNING
        self.requests[req.request_id] = req

    def remove(self, request_id: str) -> Request | None:
        return self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs and the ids of the requests a stop string finished here, which the
        core has not finished: the caller aborts them in the core."""
        now = time.time()
        outputs: list[RequestOutput] = []
        stopped_here: list[str] = []
        requests = self.requests
        for out in core_outputs:
            req = requests.get(out.request_id)
            if req is None:                     # aborted, or finished by a stop string a step ago
                continue
            if out.first_scheduled_time is not None:
                req.metrics.first_scheduled_time = out.first_scheduled_time
                req.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                req.prompt_logprobs = [None if pos is None else {t: Logprob(*v) for t, v in pos.items()}
                                       for pos in out.prompt_logprobs]
            core_status = RequestStatus(out.finish_status) if out.finish_status else None
            toks = out.new_token_ids
            lps = out.logprobs
            detok = req.detokenizer
            last = len(toks) - 1
            # no new tokens: the core ended it without one (a request it could not queue)
            status, reason = (core_status if last < 0 else None), out.stop_reason
            output_ids = req.output_token_ids
            for j, tok in enumerate(toks):
                output_ids.append(tok)
                if j == last:
                    status = core_status
                if lps is not None:
                    self._record_logprobs(req, tok, lps[j])
                detok.update((tok,), status is not None)
                if detok.stop_reason is not None and status is not _STOPPED:
                    status, reason = _STOPPED, detok.stop_reason
                    if core_status is None:         # the core still runs it
                        stopped_here.append(req.request_id)
                    break
            metrics = req.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if status is not None:
                req.status = status
                req.stop_reason = reason
                metrics.finished_time = now
                requests.pop(req.request_id, None)      # (an abort on another thread may have popped it)
                outputs.append(OutputProcessor.make_output(req, finish_reason(status)))
            elif req.sampling_params.output_kind is not _FINAL_ONLY:
                outputs.append(OutputProcessor.make_output(req, None))
        return outputs, stopped_here

    def _record_logprobs(self, req: Request, token: int, lp) -> None:
        logprob, rank, top_ids, top_lps = lp
        req.cumulative_logprob += logprob
        req.logprobs.append(decode_logprobs(self.tokenizer, token, logprob, rank, top_ids, top_lps))
