"""Structured outputs: compile a request's constraint with llguidance, keep its matcher, fill its token mask.

The engine touches this module at three places:

- ``validate`` / ``compile``: the constraint is compiled before the request is accepted (the server awaits
  ``compile`` on a worker thread before it answers, offline ``add_request`` compiles in place), so a bad
  schema, regex or grammar is a 400 / ``ValueError`` and a request enters the scheduler with its grammar
  ready. Compiled grammars are cached by (kind, spec): a repeated schema costs one ``deep_copy``.
- ``advance`` / ``accept``: after a step's tokens are read, each constrained request's matcher consumes its
  token (``advance``: all of them in one pass, before the output processor runs; ``accept`` answers the
  output processor from that pass, or consumes the token itself when no pass ran); a grammar that has ended
  finishes the request (``stop``, as EOS would).
- ``constrained_rows`` / ``start_fill``: a step with constrained rows gets a ``[rows, ceil(vocab/32)]``
  int32 bitmask (bit ``t % 32`` of word ``t // 32`` = token ``t`` allowed), filled by llguidance's thread
  pool; the sampler sets the logits of disallowed tokens to -inf. A step with no constrained row sees
  ``None`` and runs the unmasked program.

NOTE: the mask of step N+1 depends on the token of step N. With async scheduling the engine therefore
dispatches step N+1's forward, reads step N's tokens, advances the matchers by them, starts the mask fill
on a worker thread (llguidance computes without the GIL), lets the output processor read step N
(detokenization, stop checks, outputs) meanwhile, and dispatches step N+1's sampler with the finished mask:
the forward overlaps all of the host's work, the fill overlaps the output processing, and only the sampler
waits for the mask.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time

import numpy as np

from jaxserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently used dropped first); a template matcher is small next to its
# tokenizer, which all of them share.
GRAMMAR_CACHE_SIZE = 512


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class StructuredOutputManager:
    """Per-engine: the llguidance tokenizer (built on first use: ~1 s), the compiled-grammar cache, one
    matcher per running constrained request, and the time spent filling masks.

    ``vocab_size``: max(the model's vocab_size, len(tokenizer)) (some tokenizers are one longer than the
    config; llguidance needs every id the model can emit). ``disable_any_whitespace`` (vLLM's name): JSON
    uses compact separators and no free whitespace, so a model cannot loop on whitespace until max_tokens;
    False allows any JSON whitespace between tokens."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, *, disable_any_whitespace: bool = True):
        self.hf_tokenizer = tokenizer
        self.vocab_size = max(int(vocab_size), len(tokenizer))
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.disable_any_whitespace = disable_any_whitespace
        self.unsupported_reason: str | None = None  # set by the engine where the mask cannot reach the device
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._executor = self._llnp = None
        self._cache: collections.OrderedDict[tuple[str, str], object] = collections.OrderedDict()
        self._matchers: dict[str, object] = {}     # request id -> llguidance.LLMatcher
        # request id -> (token, must finish) from the last ``advance``, for the output processor's ``accept``
        self._advanced: dict[str, tuple[int, bool]] = {}
        self._filler: concurrent.futures.ThreadPoolExecutor | None = None   # runs ``start_fill``'s fills
        self.mask_steps = 0
        self.mask_rows = 0
        self.mask_ms = 0.0          # filling (on the worker thread when started by ``start_fill``)
        self.mask_wait_ms = 0.0     # the engine's wait for a started fill (what the step pays for it)

    # ---------------------------------------------------------------- compile
    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance
                # llguidance takes EOS ids from the tokenizer's own range only (dummy weights served with
                # another model's tokenizer have the config's EOS past it: the tokenizer's EOS stands in)
                eos = [t for t in self.eos_token_ids if t < len(self.hf_tokenizer)] \
                    or self.hf_tokenizer.eos_token_id
                self._ll_tokenizer = llguidance.LLTokenizer(
                    llguidance_tokenizer_json(self.hf_tokenizer), n_vocab=self.vocab_size, eos_token=eos)
                self._executor = llguidance.LLExecutor()
                import llguidance.numpy
                self._llnp = llguidance.numpy
            return self._ll_tokenizer

    def _grammar(self, params) -> str:
        """llguidance's grammar text for a StructuredOutputsParams."""
        import llguidance
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            options = {"whitespace_flexible": not self.disable_any_whitespace}
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            except ValueError as e:
                raise InvalidRequestError(f"invalid JSON schema: {e}", param="json_schema") from None
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", params.choice)
        try:
            return llguidance.grammar_from("grammar", params.grammar)
        except ValueError as e:
            raise InvalidRequestError(f"invalid grammar: {e}", param="grammar") from None

    def compile(self, params):
        """The compiled template matcher of a constraint (cached by kind and spec; thread-safe). Raises
        InvalidRequestError naming the problem: an invalid schema, a schema keyword llguidance cannot
        enforce, a regex or grammar that does not compile."""
        if self.unsupported_reason is not None:
            raise InvalidRequestError(f"structured outputs are not available: {self.unsupported_reason}",
                                      param="structured_outputs")
        key = (params.kind, params.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        import llguidance
        tokenizer = self._tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, self._grammar(params), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(_describe_error(params.kind, matcher.get_error()),
                                      param=_PARAM_OF_KIND[params.kind])
        with self._lock:
            self._cache[key] = matcher
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    # ---------------------------------------------------------------- requests
    def add_request(self, request) -> None:
        """Give a constrained request its own matcher (a copy of the compiled template)."""
        params = request.sampling_params.structured_outputs
        if params is not None:
            template = self.compile(params)
            with self._lock:
                self._matchers[request.request_id] = template.deep_copy()

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    @property
    def has_requests(self) -> bool:
        return bool(self._matchers)

    def advance(self, sampled, token_ids) -> None:
        """Advance the matchers of a read step's constrained requests by their tokens, all in one pass before
        the output processor reads the step (so the next mask can fill while it does). ``sampled`` and
        ``token_ids`` are what ``core_outputs.apply_sampled_tokens`` gets; its ``accept`` calls then answer
        from this pass. A finished or aborted request is skipped, as the output processor skips it."""
        from jaxserve.engine.request import RequestStatus
        preempted = RequestStatus.PREEMPTED
        matchers, advanced = self._matchers, {}
        for req, _ in sampled:
            m = matchers.get(req.request_id)
            if m is None or req.status > preempted:
                continue
            tok = token_ids[req.request_id]
            if type(tok) is not int:    # a multi-step dispatch never holds a constrained row: ``accept`` copes
                continue
            advanced[req.request_id] = (tok, self._consume(req.request_id, m, tok))
        self._advanced = advanced

    def accept(self, request_id: str, token_id: int) -> bool:
        """Whether a constrained request must finish now that its matcher has the sampled token: its grammar
        has ended (only EOS could follow) or the token was not allowed (which the mask prevents; a token
        outside the grammar can only come from a caller that bypassed it). The token was consumed by the
        last ``advance``, else it is consumed now."""
        hit = self._advanced.pop(request_id, None)
        if hit is not None and hit[0] == token_id:
            return hit[1]
        m = self._matchers.get(request_id)
        return m is not None and self._consume(request_id, m, token_id)

    @staticmethod
    def _consume(request_id: str, m, token_id: int) -> bool:
        if not m.consume_token(token_id):
            logger.warning("request %s: token %d is outside its grammar (%s); finishing it", request_id, token_id,
                           m.get_error())
            return True
        return m.is_stopped()

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
        """(matcher, row) of the rows whose request still has one (a request finished meanwhile has none)."""
        matchers = self._matchers
        return [(m, i) for i, rid in rows if (m := matchers.get(rid)) is not None]

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
        its own work (totals, and per masked step)."""
        n = max(self.mask_steps, 1)
        return {"structured_steps": self.mask_steps, "structured_mask_ms": self.mask_ms,
                "structured_rows_per_step": self.mask_rows / n, "structured_mask_ms_per_step": self.mask_ms / n,
                "structured_mask_wait_ms": self.mask_wait_ms,
                "structured_mask_wait_ms_per_step": self.mask_wait_ms / n}


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


def llguidance_tokenizer_json(tokenizer) -> str:
    """The HF fast tokenizer's ``tokenizer.json`` as llguidance reads it (what ``llguidance.hf.from_tokenizer``
    passes, without padding or truncation), with one repair: a byte-level BPE (ByteLevel pre-tokenizer) whose
    decoder is a Sequence that also holds sentencepiece steps (ByteFallback, Replace "▁": what GGUF
    conversions write) gets the plain ByteLevel decoder. llguidance reads the token bytes from the decoder's
    shape, and took such a vocabulary's "Ġ" as a literal character instead of a space."""
    import copy
    import json

    backend = copy.copy(getattr(tokenizer, "backend_tokenizer", None))
    if backend is None:
        raise InvalidRequestError("structured outputs need a fast (Rust) Hugging Face tokenizer",
                                  param="structured_outputs")
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())

    def byte_level(node) -> dict | None:
        if not isinstance(node, dict):
            return None
        if node.get("type") == "ByteLevel":
            return node
        for child in node.get("pretokenizers", node.get("decoders", [])) or []:
            found = byte_level(child)
            if found is not None:
                return found
        return None

    decoder = spec.get("decoder")
    if byte_level(spec.get("pre_tokenizer")) is not None and isinstance(decoder, dict) \
            and decoder.get("type") == "Sequence":
        level = byte_level(decoder)
        if level is not None:
            spec["decoder"] = level
    return json.dumps(spec)


_PARAM_OF_KIND = {"json": "json_schema", "json_object": "response_format", "regex": "regex", "choice": "choice",
                  "grammar": "grammar"}


def _describe_error(kind: str, error: str) -> str:
    """llguidance's compile error as a message that says which constraint it is about."""
    error = error.strip()
    if kind in ("json", "json_object"):
        if "Unimplemented" in error or "unsupported" in error.lower():
            return f"the JSON schema uses a feature structured outputs cannot enforce: {error}"
        return f"invalid JSON schema: {error}"
    if kind == "regex":
        return f"the regex does not compile: {error}"
    if kind == "choice":
        return f"invalid choice list: {error}"
    return f"the grammar does not compile: {error}"
