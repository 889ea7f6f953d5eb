"""The engine core's half of output processing, and the one place that decides a request is finished and why:
``apply_sampled_tokens`` applies a step's sampled tokens to its requests and returns each request's news as an
``EngineCoreOutput`` for the front end (``output_processor``), which holds the text.

For each request the step sampled for, token by token (a multi-step dispatch brings several):
- fill the request's placeholder with the token;
- stop on EOS (unless ignore_eos) or a stop token id, from min_tokens on (stop_reason: None for EOS, else the
  id); a stop on the token that also reaches the length limit wins (the model did stop);
- else finish by length when the outputs reach ``max_output_tokens`` (max_tokens, or what max_model_len
  leaves);
- a structured-output grammar that reaches its end finishes the request there (status stop), like a stop
  token (its matcher accepts each token as it is filled in); a matcher that failed (a grammar past the
  parser's limits) finishes it with an error (status error, stop_reason the message), never as a stop, and
  without the token it failed on;
- after a stop, drop the tokens the device computed past it (async scheduling and multi-step dispatch the
  next step before this one is read);
- a speculative step brings the accepted drafts and one more token: its placeholders past them are dropped
  and the request's computed tokens rolled back by as many (the rejected drafts' K/V are overwritten
  later; the prefix cache only ever takes blocks of known, computed tokens); the engine core moves the
  indices of the step in flight after it back too.
Stop strings need the text: the front end matches them and aborts the request in the core. The engine core
frees what this returns as finished (``Scheduler.finish_requests``).

A request's output carries the tokens known since its previous output (never a placeholder: those are the
next step's, still on the device), their raw logprobs, and with its first output what only the core knows
(the prompt tokens served from the prefix cache, when it was scheduled and sampled first, the prompt's
logprobs). A request whose front end shows nothing before the end (``Request.defer_outputs``: FINAL_ONLY,
no stop strings, no logprobs) gets one output, when it finishes.

This is the hot loop of the host (once per request per step): the common step (one token, no logprobs)
fills the token inline and asks ``token_verdict`` only about a token the request could end on.
"""
from __future__ import annotations

import time
from typing import Any, Iterable

from jaxserve.engine.messages import EngineCoreOutput
from jaxserve.engine.request import Request, RequestStatus

_PREEMPTED = RequestStatus.PREEMPTED
_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
_ERROR = RequestStatus.FINISHED_ERROR


def token_verdict(req: Request, num_output: int, tok: int, eos_ids, grammars) -> tuple:
    """(status, stop reason) after ``req``'s ``num_output``-th output token ``tok``, or (None, None): EOS or
    a stop id from ``min_tokens`` on (a stop on the token that also reaches the limit wins), else the length
    limit; a structured-output grammar that ended (``grammars.accept``) stops like EOS, one whose matcher
    failed (``grammars.take_failure``) ends with an error."""
    status = reason = None
    if num_output >= req.min_tokens and (tok in eos_ids or tok in req.stop_token_ids):
        status, reason = _STOPPED, (None if tok in eos_ids else tok)
    elif num_output >= req.max_output_tokens:
        status = _LENGTH_CAPPED
    if grammars is not None and grammars.accept(req.request_id, tok):
        failure = grammars.take_failure(req.request_id)
        if failure is not None:
            status, reason = _ERROR, failure
        elif status is not _STOPPED:
            status, reason = _STOPPED, None
    return status, reason


def _step_tokens(toks, lps) -> tuple:
    """A request's tokens and logprobs (or None) of one step as sequences (a multi-step dispatch gives lists)."""
    if type(toks) is int:
        return (toks,), ((lps,) if lps is not None else None)
    return toks, lps


def apply_sampled_tokens(sampled: Iterable[tuple[Request, int]], token_ids: dict[str, Any],
                         logprobs: dict[str, Any] | None, grammars=None, spec: dict | None = None
                         ) -> tuple[list[EngineCoreOutput], dict[RequestStatus, list[str]]]:
    """Apply one read step. ``sampled``: (request, index of its first placeholder of this step) for each
    request the step sampled for; ``token_ids[request_id]``: the token it sampled (a list after a multi-step
    dispatch); ``logprobs[request_id]``: (logprob, rank, top ids, top logprobs) (a list of them after
    multi-step) for requests that asked for logprobs; ``grammars``: the ``StructuredOutputManager`` whose
    matchers judge the constrained requests' tokens (None when no request is constrained). A request that
    verified drafts (``spec``: request id -> (drafts, accepted); its token_ids are then a list: the accepted
    drafts and one more) has its rejected drafts rolled back.

    Returns the outputs for the front end and the requests that finished now, by status (their
    ``stop_reason`` is set); requests already finished or aborted are skipped."""
    now = time.time()
    outputs: list[EngineCoreOutput] = []
    finished: dict[RequestStatus, list[str]] = {}
    for req, first in sampled:
        if req.status > _PREEMPTED:            # aborted, or finished by an earlier step's token
            continue
        rid = req.request_id
        toks = token_ids[rid]
        eos_ids = () if req.ignore_eos else req.eos_token_ids
        status = reason = lps = None
        if type(toks) is int and not logprobs:
            # the common step: set_output_token inlined, and token_verdict only for a token it could end on
            idx = first
            req.output_token_ids[idx] = toks
            req._all_token_ids[len(req.prompt_token_ids) + idx] = toks
            req.num_placeholders -= 1
            if (toks in eos_ids or toks in req.stop_token_ids or idx + 1 >= req.max_output_tokens
                    or grammars is not None):
                status, reason = token_verdict(req, idx + 1, toks, eos_ids, grammars)
        else:
            toks, lps = _step_tokens(toks, logprobs.get(rid) if logprobs else None)
            for j, tok in enumerate(toks):
                idx = first + j
                req.set_output_token(idx, tok)
                status, reason = token_verdict(req, idx + 1, tok, eos_ids, grammars)
                if status is not None:
                    break
            if lps is not None:
                lps = list(lps[:j + 1])
            if spec is not None and rid in spec:
                _roll_back(req, first + len(toks), first + spec[rid][0] + 1, spec[rid][0])
        if first == 0:
            req.metrics.first_token_time = now
        if status is not None:
            keep = idx if status is _ERROR else idx + 1     # (not the token a failed matcher could not take)
            if len(req.output_token_ids) > keep:
                req.truncate_output(keep)               # drop tokens computed after the stop
            req.stop_reason = reason
            finished.setdefault(status, []).append(rid)
        elif req.defer_outputs:
            continue
        sent = req.num_sent_tokens
        known = len(req.output_token_ids) - req.num_placeholders
        out = EngineCoreOutput(rid, req.output_token_ids[sent:known], 0 if status is None else int(status),
                               reason, lps)
        if sent == 0:
            _first_output(req, out)
        req.num_sent_tokens = known
        outputs.append(out)
    return outputs, finished


def _roll_back(req: Request, end: int, placed: int, num_drafts: int) -> None:
    """A speculative step that placed ``req``'s outputs up to index ``placed`` gave it its tokens up to
    ``end``: drop the placeholders between (the drafts it rejected; a later step in flight, placed after them,
    moved back on the device by as many) and the computed positions they held."""
    req.num_drafts_in_flight -= num_drafts
    rejected = placed - end
    if rejected:
        req.drop_outputs(end, placed)
        if req.status is RequestStatus.RUNNING:     # (a preempted one computes from 0 again)
            req.num_computed_tokens -= rejected


def _first_output(req: Request, out: EngineCoreOutput) -> None:
    """What a request's first output carries besides its tokens (sent once)."""
    metrics = req.metrics
    out.num_cached_tokens = req.num_cached_tokens
    out.first_scheduled_time = metrics.first_scheduled_time
    out.first_token_time = metrics.first_token_time
    if req.prompt_logprobs is not None:
        out.prompt_logprobs = [None if pos is None else
                               {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in pos.items()}
                               for pos in req.prompt_logprobs]
        req.prompt_logprobs = None
