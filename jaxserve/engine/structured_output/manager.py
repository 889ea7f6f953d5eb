"""The structured-output manager: one matcher per constrained request, the per-step token mask, and the
verdict of each sampled token.

The engine touches it at three places:

- ``submit`` / ``validate``: the constraint is compiled by the manager's ``GrammarCompiler`` (worker threads,
  once per distinct constraint, cached): the front end awaits ``submit``'s future before it accepts the
  request, so a bad or over-limit schema, regex or grammar is a 400 / ``ValueError``. The engine core's
  ``start_request`` gives a queued request its own copy of the compiled template, or leaves it waiting
  (``take_compiled`` hands it back, ready or refused; ``remove`` drops an aborted one's interest).
- ``advance`` / ``accept``: after a step's tokens are read, each constrained request's matcher consumes its
  token (``advance``: all of them in one pass, before the output processor runs; ``accept`` answers the
  output processor from that pass, or consumes the token itself when no pass ran); a grammar that has ended
  finishes the request (``stop``, as EOS would); a matcher that failed (a grammar past the parser's limits)
  finishes it too, and ``take_failure`` says why.
- ``constrained_rows`` / ``start_fill``: a step with constrained rows gets a ``[rows, ceil(vocab/32)]``
  int32 bitmask (bit ``t % 32`` of word ``t // 32`` = token ``t`` allowed), filled by llguidance's thread
  pool; the sampler sets the logits of disallowed tokens to -inf. A step with no constrained row sees
  ``None`` and runs the unmasked program.
- a thinking model's request (``reasoning_end_token_ids``): its matcher starts after the output holds the
  end-of-thinking marker; until then its tokens are neither consumed nor masked (its row stays a
  constrained row, all allowed: the token that completes the marker may be the one still in flight).

NOTE: the mask of step N+1 depends on the token of step N. With async scheduling the engine therefore
dispatches step N+1's forward, reads step N's tokens, advances the matchers by them, starts the mask fill
on a worker thread (llguidance computes without the GIL), lets the output processor read step N
(detokenization, stop checks, outputs) meanwhile, and dispatches step N+1's sampler with the finished mask:
the forward overlaps all of the host's work, the fill overlaps the output processing, and only the sampler
waits for the mask.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import numpy as np

from jaxserve.errors import InvalidRequestError

from .compiler import WORKER_PREFIX, GrammarCompiler
from .grammar import CompiledGrammar, GrammarBuilder, describe_runtime_error
from .limits import StructuredOutputsLimits, check_constraint_size, constraint_spec

logger = logging.getLogger(__name__)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class StructuredOutputManager:
    """Per-engine: the grammar compiler (its llguidance tokenizer, workers and cache), one matcher per
    running constrained request, the failures of matchers, and the time spent filling masks.

    ``vocab_size``: max(the model's vocab_size, len(tokenizer)) (some tokenizers are one longer than the
    config; llguidance needs every id the model can emit). ``disable_any_whitespace`` (vLLM's name): JSON
    uses compact separators and no free whitespace, so a model cannot loop on whitespace until max_tokens;
    False allows any JSON whitespace between tokens. ``disable_additional_properties`` (vLLM's name): a JSON
    schema's objects allow no undeclared keys unless they say so (off: only where the request asks).
    ``limits``: what a constraint may ask of the compiler (``StructuredOutputsLimits``). ``retain=False``: the
    compiler keeps verdicts only (a front end that validates constraints for an engine core in another
    process)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, *, disable_any_whitespace: bool = True,
                 disable_additional_properties: bool = True, limits: StructuredOutputsLimits | None = None,
                 compile_workers: int = 2, retain: bool = True):
        self.builder = GrammarBuilder(tokenizer, vocab_size, eos_token_ids,
                                      disable_any_whitespace=disable_any_whitespace,
                                      disable_additional_properties=disable_additional_properties, limits=limits)
        self.limits = self.builder.limits
        self.compiler = GrammarCompiler(self.builder.compile, self.limits, prepare=self.builder.tokenizer,
                                        workers=compile_workers, retain=retain)
        self.vocab_size = self.builder.vocab_size
        self.unsupported_reason: str | None = None  # set by the engine where the mask cannot reach the device
        self._lock = threading.Lock()
        self._executor = self._llnp = None
        self._matchers: dict[str, object] = {}     # request id -> llguidance.LLMatcher
        self._grammars: dict[str, CompiledGrammar] = {}     # request id -> its compiled template
        self._failures: dict[str, str] = {}        # request id -> why its matcher failed
        self._thinking: dict[str, ThinkingGate] = {}    # request id -> its marker, until the output holds it
        # request id -> (request, future of its grammar), for requests waiting for their compile
        self._waiting: dict[str, tuple[object, concurrent.futures.Future]] = {}
        # request id -> (token, must finish) from the last ``advance``, for the output processor's ``accept``
        self._advanced: dict[str, tuple[int, bool]] = {}
        self._filler: concurrent.futures.ThreadPoolExecutor | None = None   # runs ``start_fill``'s fills
        self.mask_steps = 0
        self.mask_rows = 0
        self.mask_ms = 0.0          # filling (on the worker thread when started by ``start_fill``)
        self.mask_wait_ms = 0.0     # the engine's wait for a started fill (what the step pays for it)

    # ---------------------------------------------------------------- compile
    def submit(self, params) -> concurrent.futures.Future:
        """A future of the constraint's ``CompiledGrammar``, compiled on the compiler's workers (cached;
        concurrent askers share one compile; cancelling the future drops this asker's interest). Fails with
        InvalidRequestError naming the problem: a limit exceeded, an invalid schema, a schema keyword
        llguidance cannot enforce, a regex or grammar that does not compile, the compile's time budget."""
        if self.unsupported_reason is not None:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_exception(InvalidRequestError(
                f"structured outputs are not available: {self.unsupported_reason}", param="structured_outputs"))
            return future
        return self.compiler.submit(params)

    def compile(self, params):
        """The compiled template matcher of a constraint (waits for ``submit``'s future; thread-safe). Raises
        InvalidRequestError as ``submit``'s future does."""
        return self.submit(params).result().matcher

    def validate(self, params, *, wait: bool) -> None:
        """A constraint's verdict before its request is queued, raising InvalidRequestError. ``wait``: the
        whole verdict (compiled on the workers while this thread waits: a synchronous caller's); else only
        what needs no compile (structured outputs available here, the constraint's size): a caller that
        awaited ``submit`` already, or lets the engine core refuse the request."""
        if wait:
            self.submit(params).result()
            return
        if self.unsupported_reason is not None:
            raise InvalidRequestError(f"structured outputs are not available: {self.unsupported_reason}",
                                      param="structured_outputs")
        check_constraint_size(params.kind, constraint_spec(params), params.choice, self.limits)

    # ---------------------------------------------------------------- requests
    def add_request(self, request, grammar: CompiledGrammar | None = None) -> None:
        """Give a constrained request its own matcher, a copy of its compiled template: ``grammar`` (what its
        ``submit`` future gave), else the constraint is compiled now and waited for."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        if grammar is None:
            grammar = self.submit(params).result()
        if self._executor is None:
            import llguidance
            import llguidance.numpy
            self._executor, self._llnp = llguidance.LLExecutor(), llguidance.numpy
        matcher = grammar.matcher.deep_copy()
        with self._lock:
            self._matchers[request.request_id] = matcher
            self._grammars[request.request_id] = grammar
            if params.reasoning_end_token_ids:
                self._thinking[request.request_id] = ThinkingGate(params.reasoning_end_token_ids)

    def start_request(self, request) -> bool:
        """The engine core's enqueue of a constrained request: submit its constraint and, when the grammar is
        compiled already, give it its matcher (True: it can be scheduled now). False: it waits (the engine
        marks it WAITING_FOR_FSM, outside the scheduler's queue) until ``take_compiled`` hands it back; the
        step loop never waits for a compile."""
        future = self.submit(request.sampling_params.structured_outputs)
        if future.done() and future.exception() is None:
            self.add_request(request, future.result())
            return True
        self._waiting[request.request_id] = (request, future)
        return False

    def take_compiled(self) -> tuple[list, list]:
        """The waiting requests whose compile has finished, in the order they came: (those now holding their
        matchers, ready to schedule; (request, message) of those refused, to finish with an error)."""
        if not self._waiting:
            return [], []
        ready, refused = [], []
        for rid, (request, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[rid]
            error = future.exception()
            if error is None:
                self.add_request(request, future.result())
                ready.append(request)
            else:
                refused.append((request, getattr(error, "message", str(error))))
        return ready, refused

    @property
    def num_waiting(self) -> int:
        """Requests waiting for their grammar (``start_request`` answered False)."""
        return len(self._waiting)

    def is_waiting(self, request_id: str) -> bool:
        return request_id in self._waiting

    def wait_for_compile(self, timeout: float) -> None:
        """Block until a waiting request's compile finishes, at most ``timeout`` seconds: what an engine core
        with nothing else to run does instead of spinning."""
        if self._waiting:
            concurrent.futures.wait([f for _, f in self._waiting.values()], timeout,
                                    concurrent.futures.FIRST_COMPLETED)

    def remove(self, request_id: str) -> None:
        """Drop a finished or aborted request's matcher (and its failure: read ``take_failure`` first); a
        request still waiting for its grammar gives up its interest in the compile, which is dropped if no
        other request waits for it and it has not started."""
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None:
            waiting[1].cancel()
        self._matchers.pop(request_id, None)
        self._grammars.pop(request_id, None)
        self._failures.pop(request_id, None)
        self._thinking.pop(request_id, None)

    def take_failure(self, request_id: str) -> str | None:
        """Why the request's matcher failed, once (a message for the client), or None: ``accept`` answered
        "finish" because its grammar ended. A failed request ends with an error, never as "stop"."""
        return self._failures.pop(request_id, None)

    @property
    def has_requests(self) -> bool:
        """Whether any request holds a matcher or waits for its grammar (``remove`` has work to do)."""
        return bool(self._matchers) or bool(self._waiting)

    def advance(self, sampled, token_ids) -> None:
        """Advance the matchers of a read step's constrained requests by their tokens, all in one pass before
        the output processor reads the step (so the next mask can fill while it does). ``sampled`` and
        ``token_ids`` are what ``core_outputs.apply_sampled_tokens`` gets; its ``accept`` calls then answer
        from this pass. A finished or aborted request is skipped, as the output processor skips it."""
        from jaxserve.engine.request import RequestStatus
        preempted = RequestStatus.PREEMPTED
        matchers, thinking, advanced = self._matchers, self._thinking, {}
        for req, _ in sampled:
            m = matchers.get(req.request_id)
            if m is None or req.status > preempted:
                continue
            tok = token_ids[req.request_id]
            if type(tok) is not int:    # a multi-step dispatch never holds a constrained row: ``accept`` copes
                continue
            if thinking and req.request_id in thinking:
                self._think(req.request_id, tok)
                advanced[req.request_id] = (tok, False)
                continue
            advanced[req.request_id] = (tok, self._consume(req.request_id, m, tok))
        self._advanced = advanced

    def accept(self, request_id: str, token_id: int) -> bool:
        """Whether a constrained request must finish now that its matcher has the sampled token: its grammar
        has ended (only EOS could follow) or the token was not allowed (which the mask prevents; a token
        outside the grammar can only come from a caller that bypassed it). The token was consumed by the
        last ``advance``, else it is consumed now; a request still thinking consumes none."""
        hit = self._advanced.pop(request_id, None)
        if hit is not None and hit[0] == token_id:
            return hit[1]
        m = self._matchers.get(request_id)
        if m is None:
            return False
        if self._thinking and request_id in self._thinking:
            self._think(request_id, token_id)
            return False
        return self._consume(request_id, m, token_id)

    def _think(self, request_id: str, token_id: int) -> None:
        """A thinking request's token: its matcher starts after the one that completes the marker."""
        if self._thinking[request_id].completed_by(token_id):
            del self._thinking[request_id]

    def _consume(self, request_id: str, m, token_id: int) -> bool:
        if m.consume_token(token_id):
            if not m.is_stopped():
                return False
            if not m.is_error():
                return True
        self._fail(request_id, m, token_id)
        return True

    def _fail(self, request_id: str, m, token_id: int) -> None:
        """Record and log (one line, the grammar cut short) a matcher that failed: a token outside the
        grammar, or a grammar past the parser's limits (after which the mask allows only EOS)."""
        limit, message = describe_runtime_error(m.get_error())
        self._failures[request_id] = message
        grammar = self._grammars.get(request_id)
        logger.warning("request %s: structured output failed at token %d (%s): %s; its constraint: %r",
                       request_id, token_id, limit, message, grammar.excerpt if grammar is not None else None)

    # ---------------------------------------------------------------- masks
    def constrained_rows(self, scheduled) -> list[tuple[int, str]] | None:
        """(row, request id) of the step's sampling rows that have a matcher; None when there are none
        (the step then runs the unmasked sampler)."""
        matchers = self._matchers
        if not matchers:
            return None
        rows = [(i, s.request.request_id) for i, s in enumerate(scheduled)
                if s.samples and s.request.request_id in matchers]
        return rows or None

    def fill_bitmask(self, rows: list[tuple[int, str]], num_rows: int) -> np.ndarray:
        """The step's [num_rows, ceil(vocab/32)] int32 mask: constrained rows from their matchers (in
        parallel, on llguidance's threads), every other row all ones (allowed). A fresh array each step:
        on CPU jit reads numpy buffers in place while the step runs."""
        mask, pairs = self._open_mask(num_rows), self._pairs(rows)
        self._fill(pairs, mask)
        return mask

    def start_fill(self, rows: list[tuple[int, str]], num_rows: int) -> "PendingMask":
        """``fill_bitmask`` on a worker thread, so that the engine's thread goes on with the output
        processing while llguidance computes (without the GIL); ``PendingMask.result`` hands the mask over.
        No matcher may be advanced until then (llguidance holds each one while it fills).

        The call waits until the worker holds the matchers: a thread woken while this one runs Python would
        otherwise get the GIL only when this one next blocks (measured: the fill then started after the
        output processing, not beside it)."""
        mask, pairs = self._open_mask(num_rows), self._pairs(rows)
        if not pairs:                       # every constrained request of the step finished meanwhile
            self._fill(pairs, mask)
            return PendingMask(self, None, mask)
        if self._filler is None:
            self._filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxserve-bitmask")
        t0 = time.perf_counter()
        started = threading.Event()
        future = self._filler.submit(self._fill, pairs, mask, started)
        started.wait()
        self.mask_wait_ms += (time.perf_counter() - t0) * 1e3
        return PendingMask(self, future, mask)

    def _open_mask(self, num_rows: int) -> np.ndarray:
        return np.full((num_rows, bitmask_width(self.vocab_size)), -1, np.int32)

    def _pairs(self, rows: list[tuple[int, str]]) -> list[tuple[object, int]]:
        """(matcher, row) of the rows whose request still has one (a request finished meanwhile has none) and
        is past its thinking part (a thinking row stays all allowed)."""
        matchers, thinking = self._matchers, self._thinking
        return [(m, i) for i, rid in rows if (m := matchers.get(rid)) is not None and rid not in thinking]

    def _fill(self, pairs: list[tuple[object, int]], mask: np.ndarray, started: threading.Event | None = None):
        t0 = time.perf_counter()
        if started is not None:
            started.set()
        if pairs:
            self._llnp.fill_next_token_bitmask_par(self._executor, pairs, mask)
        self.mask_steps += 1
        self.mask_rows += len(pairs)
        self.mask_ms += (time.perf_counter() - t0) * 1e3

    def stats(self) -> dict:
        """Steps that filled a mask, rows, host ms spent filling and ms the engine waited for a fill after
        its own work (totals, and per masked step); grammars compiled, those compiled on a thread other
        than a grammar worker (none, ever), the compiled-grammar cache's bytes."""
        n = max(self.mask_steps, 1)
        compiler = self.compiler
        return {"structured_compilations": compiler.compilations,
                "structured_compilations_off_workers": sum(
                    count for name, count in list(compiler.compile_threads.items())
                    if not name.startswith(WORKER_PREFIX)),
                "structured_grammar_cache_bytes": compiler.cache_bytes,
                "structured_steps": self.mask_steps, "structured_mask_ms": self.mask_ms,
                "structured_rows_per_step": self.mask_rows / n, "structured_mask_ms_per_step": self.mask_ms / n,
                "structured_mask_wait_ms": self.mask_wait_ms,
                "structured_mask_wait_ms_per_step": self.mask_wait_ms / n}


class ThinkingGate:
    """The end-of-thinking marker (token ids) a request's output has not held yet, and its last tokens."""

    __slots__ = ("marker", "tail")

    def __init__(self, marker) -> None:
        self.marker = tuple(marker)
        self.tail: tuple[int, ...] = ()

    def completed_by(self, token_id: int) -> bool:
        """Whether this next output token completes the marker."""
        self.tail = (*self.tail, token_id)[-len(self.marker):]
        return self.tail == self.marker


class PendingMask:
    """A mask being filled on the manager's worker thread (``StructuredOutputManager.start_fill``)."""

    __slots__ = ("_manager", "_future", "_mask")

    def __init__(self, manager: StructuredOutputManager, future: concurrent.futures.Future | None,
                 mask: np.ndarray):
        self._manager, self._future, self._mask = manager, future, mask

    def result(self) -> np.ndarray:
        """The filled mask (waits for the fill; re-raises its error)."""
        if self._future is not None:
            t0 = time.perf_counter()
            self._future.result()
            self._manager.mask_wait_ms += (time.perf_counter() - t0) * 1e3
            self._future = None
        return self._mask
