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
"""
from __future__ import annotations

import time
from typing import Any, Iterable

from jaxserve.engine.detokenizer import IncrementalDetokenizer, decode_logprobs
from jaxserve.engine.request import Request, RequestStatus, finish_reason
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import RequestOutputKind

_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY
_DELTA = RequestOutputKind.DELTA


class OutputProcessor:
    def __init__(self, tokenizer: Any, structured_output: Any = None):
        self.tokenizer = tokenizer
        self.structured_output = structured_output     # the StructuredOutputManager, or None

    def add_request(self, req: Request) -> None:
        """Give a new request its output state (the detokenizer; the rest starts empty on the Request)."""
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.sampling_params)

    def process_outputs(self, sampled: Iterable[tuple[Request, int]], token_ids: dict[str, Any],
                        logprobs: dict[str, Any] | None
                        ) -> tuple[list[RequestOutput], dict[RequestStatus, list[str]]]:
        """Read one step's results. ``sampled``: (request, index of its first placeholder of this step) for
        each request the step sampled for; ``token_ids[request_id]``: the token it sampled (a list after a
        multi-step dispatch), ``logprobs[request_id]``: (logprob, rank, top ids, top logprobs) (a list of
        them after multi-step) for requests that asked for logprobs.

        Returns the outputs to hand back and the requests that finished now, by status (their
        ``stop_reason`` is set); requests already finished or aborted are skipped."""
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
            toks = token_ids[rid]
            lps = logprobs.get(rid) if logprobs else None
            if type(toks) is int:               # one step (a multi-step dispatch gives lists)
                toks, lps = (toks,), ((lps,) if lps is not None else None)
            detok = req.detokenizer
            min_tokens, limit = req.min_tokens, req.max_output_tokens
            eos_ids = () if req.ignore_eos else req.eos_token_ids
            stop_ids = req.stop_token_ids
            status = reason = None
            for j, tok in enumerate(toks):
                idx = first + j
                req.set_output_token(idx, tok)
                num_output = idx + 1
                if num_output >= min_tokens and (tok in eos_ids or tok in stop_ids):
                    status, reason = _STOPPED, (None if tok in eos_ids else tok)
                elif num_output >= limit:
                    status = _LENGTH_CAPPED
                # structured outputs: the matcher takes the token; a grammar that ended stops like EOS
                if accept is not None and accept(rid, tok) and status is not _STOPPED:
                    status, reason = _STOPPED, None
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

    def _record_logprobs(self, req: Request, token: int, lp: tuple) -> None:
        logprob, rank, top_ids, top_lps = lp
        req.cumulative_logprob += logprob
        req.logprobs.append(decode_logprobs(self.tokenizer, token, logprob, rank, top_ids, top_lps))

    @staticmethod
    def make_output(req: Request, reason: str | None) -> RequestOutput:
        """The request's output now; ``reason``: its finish reason if it just finished, else None."""
        params = req.sampling_params
        text = req.detokenizer.output_text
        lps = req.logprobs
        prompt_lps = req.prompt_logprobs
        known = len(req.output_token_ids) - req.num_placeholders    # not the next step's, still in flight
        if params.output_kind is _DELTA:        # only the new part is copied
            n_tok, n_chr = req.num_sent_tokens, req.num_sent_chars
            toks = req.output_token_ids[n_tok:known]
            req.num_sent_tokens, req.num_sent_chars = known, len(text)
            text = text[n_chr:]
            lps = lps[n_tok:] if lps is not None else None
            req.prompt_logprobs = None          # sent once, with the first delta
        else:
            toks = req.output_token_ids[:known]
        cum = req.cumulative_logprob if params.logprobs is not None else None
        comp = CompletionOutput(index=0, text=text, token_ids=toks, cumulative_logprob=cum, logprobs=lps,
                                finish_reason=reason, stop_reason=req.stop_reason if reason is not None else None)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_token_ids, prompt_logprobs=prompt_lps, outputs=[comp],
                             finished=reason is not None, metrics=req.metrics,
                             num_cached_tokens=req.num_cached_tokens)
