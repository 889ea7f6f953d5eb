"""The front end's half of output processing: the engine core's ``EngineCoreOutput``s → RequestOutputs.

The core decided everything that needs no text (``core_outputs.apply_sampled_tokens``: EOS, stop ids, length,
grammar end). Here, for each output, token by token:
- append the token to the front end's ``Request`` and record its logprobs (decoded to text);
- detokenize incrementally, which matches stop strings: a stop string wins over length (stop_reason is the
  string) and finishes the request at once; the caller aborts it in the core, which has computed one more
  token by then (up to num_steps with multi-step): never shown.
Then assemble the RequestOutput in the request's output kind (DELTA: only what is new; CUMULATIVE; FINAL_ONLY:
nothing until it finishes).

The engine, in this process or split (the core in its own process), renders every output here: the
in-process engine hands its core's outputs over directly, the split one decodes them from the core's socket.
This runs once per request per step (FINAL_ONLY requests without stop strings or logprobs: once, at the end).
"""
from __future__ import annotations

import time
from typing import Any

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.messages import EngineCoreOutput
from jaxserve.engine.request import Request, RequestStatus, finish_reason
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput, decode_logprobs
from jaxserve.sampling_params import RequestOutputKind

_STOPPED = RequestStatus.FINISHED_STOPPED
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY
_DELTA = RequestOutputKind.DELTA


class OutputProcessor:
    """Holds the front end's ``Request`` of each unfinished request (its confirmed output tokens,
    detokenizer, logprobs, what was sent) and renders the core's outputs for them."""

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
            if out.first_token_time is not None:
                _read_first_output(req, out)
            params = req.sampling_params
            core_status = out.finish_status
            status = RequestStatus(core_status) if core_status else None
            reason = out.stop_reason
            toks = out.new_token_ids
            if out.logprobs is None and not params.stop:
                # nothing to decide token by token: the tokens in one go (finished releases held-back text)
                req.output_token_ids += toks
                req.detokenizer.update(toks, status is not None)
            elif self._one_by_one(req, toks, out.logprobs, status):      # a stop string ended it
                status, reason = _STOPPED, req.detokenizer.stop_reason
                if core_status == 0:            # the core still runs it
                    stopped_here.append(req.request_id)
            metrics = req.metrics
            metrics.last_token_time = now
            if status is not None:
                req.status = status
                req.stop_reason = reason
                metrics.finished_time = now
                requests.pop(req.request_id, None)      # (an abort on another thread may have popped it)
                outputs.append(make_output(req, finish_reason(status)))
            elif params.output_kind is not _FINAL_ONLY:
                outputs.append(make_output(req, None))
        return outputs, stopped_here

    def _one_by_one(self, req: Request, toks: list[int], lps, status) -> bool:
        """Take the tokens one at a time (recording their logprobs) up to a stop string; whether one ended
        the request. ``status``: the core's verdict on the last token; a stop string wins over it, unless the
        core stopped on that same token (EOS, a stop id)."""
        detok, last = req.detokenizer, len(toks) - 1
        for j, tok in enumerate(toks):
            req.output_token_ids.append(tok)
            if lps is not None:
                self._record_logprobs(req, tok, lps[j])
            detok.update((tok,), j == last and status is not None)
            if detok.stop_reason is not None:
                return j < last or status is not _STOPPED
        return False

    def _record_logprobs(self, req: Request, token: int, lp) -> None:
        logprob, rank, top_ids, top_lps = lp
        req.cumulative_logprob += logprob
        req.logprobs.append(decode_logprobs(self.tokenizer, token, logprob, rank, top_ids, top_lps))


def _read_first_output(req: Request, out: EngineCoreOutput) -> None:
    """What a request's first output carries besides its tokens."""
    metrics = req.metrics
    metrics.first_scheduled_time = out.first_scheduled_time
    metrics.first_token_time = out.first_token_time
    req.num_cached_tokens = out.num_cached_tokens
    if out.prompt_logprobs is not None:
        req.prompt_logprobs = [None if pos is None else {t: Logprob(*v) for t, v in pos.items()}
                               for pos in out.prompt_logprobs]


def make_output(req: Request, reason: str | None) -> RequestOutput:
    """The request's output now; ``reason``: its finish reason if it just finished, else None."""
    params = req.sampling_params
    detok = req.detokenizer
    lps = req.logprobs
    prompt_lps = req.prompt_logprobs
    known = len(req.output_token_ids)
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
