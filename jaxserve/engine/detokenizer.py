"""Incremental detokenization with stop strings (the text of logprobs: ``jaxserve.outputs.decode_logprobs``).

The text a stream emits, concatenated, equals `tokenizer.decode(output_ids, skip_special_tokens=...)`:
each step decodes only a short window of ids (from the start of the previously emitted chunk) and emits
what the window adds beyond the part already emitted. Two things are held back until they are settled:
- the tail while the window decodes to a trailing U+FFFD (a multi-byte character split across tokens);
- the last max(len(stop)) - 1 characters when stop strings are set, so no emitted text is later cut.
`update(..., finished=True)` releases everything still held.

Cost: the output processor calls `update` once per request per step, so it is on the hot path (256 requests = 512
window decodes a step). transformers' `tokenizer.decode` spends ~10 us in Python per call around a ~1 us
Rust decode; `fast_decoder` calls the Rust `tokenizers.Tokenizer.decode` directly whenever that gives the
same string (a transformers fast tokenizer that does not post-process the text), and the text of the
window's settled prefix is kept between calls instead of being decoded again. A FINAL_ONLY request (what
`LLM.generate` asks for) without stop strings shows no text until it finishes, so its ids are decoded once,
then (``_deferred``).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from jaxserve.sampling_params import RequestOutputKind, SamplingParams

_REPLACEMENT_CHAR = "\ufffd"


def _plain_backend(tokenizer: Any):
    """The `tokenizers.Tokenizer` whose `decode` is exactly what `tokenizer.decode` returns, or None.

    True for transformers' TokenizersBackend (v5 fast tokenizers) when neither `decode` nor `_decode` is
    overridden and no clean-up post-processing applies (off, or skipped as transformers skips it for BPE
    models); `spaces_between_special_tokens` is ignored by that backend."""
    try:
        import tokenizers
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if not (isinstance(tokenizer, TokenizersBackend) and isinstance(backend, tokenizers.Tokenizer)
            and cls._decode is TokenizersBackend._decode and cls.decode is PreTrainedTokenizerBase.decode):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        skipped_for_bpe = (type(backend.model).__name__ == "BPE" and not getattr(
            tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        if not skipped_for_bpe:
            return None
    return backend


def fast_decoder(tokenizer: Any, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> Callable[[Sequence[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=..., spaces_between_special_tokens=...)`, through
    the Rust tokenizer directly when that is the same function (see `_plain_backend`)."""
    backend = _plain_backend(tokenizer)
    if backend is not None:
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens,
                             spaces_between_special_tokens=spaces_between_special_tokens)


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas and watches for its stop strings.

    `prompt_token_ids` is accepted for vLLM's shape but not used as decode context: the output text is
    defined as the decode of the output ids alone (what a client would get by decoding them).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] | None, params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None   # the stop string that ended the request, if one did
        self._text = ""                      # decoded so far (cut at the stop string once one is found)
        self._num_emitted = 0                # characters of _text already returned by update()
        self._prefix_offset = 0              # window start: the start of the last emitted chunk
        self._read_offset = 0                # ids before this are in _text
        self._prefix_text = ""               # decode(token_ids[_prefix_offset:_read_offset])
        self._stop_buffer = params.output_text_buffer_length
        self._detokenize = params.detokenize
        # a FINAL_ONLY request without stop strings shows its text once, at the end: decode it then, in one
        # call, instead of a window per step (the same string: the stream's concatenation is the full decode)
        self._deferred = (params.detokenize and not params.stop
                          and params.output_kind is RequestOutputKind.FINAL_ONLY)
        self._decode_fn = self._single = None
        if params.detokenize:
            # the decode function, and a cache of single-token decodes shared by every request using it
            self._decode_fn, self._single = _cached_decoder(tokenizer, params.skip_special_tokens,
                                                            params.spaces_between_special_tokens)

    @property
    def output_text(self) -> str:
        """Everything emitted so far (what a CUMULATIVE output shows)."""
        if self._deferred and self._read_offset < len(self.token_ids):
            self._catch_up()
        return self._text[:self._num_emitted]

    def _catch_up(self) -> None:
        """Deferred ids read before the end: settle them as ``update`` would have, one at a time."""
        pending = self.token_ids[self._read_offset:]
        del self.token_ids[self._read_offset:]
        for token_id in pending:
            self.token_ids.append(token_id)
            self._decode_settled()
        self._num_emitted = max(self._num_emitted, len(self._text) - self._stop_buffer)

    def emitted_since(self, start: int) -> str:
        """The emitted text from character ``start`` on (a DELTA output's new text, without copying what
        was sent before)."""
        if self._deferred and self._read_offset < len(self.token_ids):
            self._catch_up()
        return self._text[start:self._num_emitted]

    @property
    def num_emitted(self) -> int:
        return self._num_emitted

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> str:
        """Add newly sampled ids; return the text to emit now ("" if nothing is settled yet). After a stop
        string is found (`stop_reason` set) the request should finish; later calls return ""."""
        if self.stop_reason is not None or not self._detokenize:
            self.token_ids.extend(new_token_ids)
            return ""
        if self._deferred:
            self.token_ids.extend(new_token_ids)
            if not finished:
                return ""
            emitted = self._num_emitted
            self._decode_all_pending()              # one decode of the ids since the last settled chunk
            self._num_emitted = len(self._text)
            return self._text[emitted:]
        text = self._text
        num_chars_before = len(text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self._decode_settled()
        if finished:
            self._decode_all_pending()
        text = self._text
        num_new_chars = len(text) - num_chars_before
        if num_new_chars and self.params.stop and len(self.token_ids) > self.params.min_tokens:
            self._check_stop_strings(num_new_chars)
            text = self._text
        emitted = self._num_emitted
        if finished or self.stop_reason is not None:
            end = len(text)
        else:
            end = max(emitted, len(text) - self._stop_buffer)
        self._num_emitted = end
        return text[emitted:end] if end > emitted else ""

    # ---- decoding ------------------------------------------------------------------------------------
    def _decode(self, ids: Sequence[int]) -> str:
        return self._decode_fn(ids) if ids else ""

    def _decode_settled(self) -> None:
        """Extend _text by what the ids since _read_offset add, unless it ends in a split character."""
        prefix_text = self._prefix_text      # the window's first _read_offset - _prefix_offset ids, decoded
        new_text = self._decode_fn(self.token_ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
            self._text += new_text[len(prefix_text):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
            if self._read_offset - self._prefix_offset == 1:    # the usual case: one token, decoded once
                token_id = self.token_ids[-1]
                text = self._single.get(token_id)
                if text is None:
                    text = self._single[token_id] = self._decode_fn((token_id,))
                self._prefix_text = text
            else:
                self._prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])

    def _decode_all_pending(self) -> None:
        """At the end nothing more can complete a split character: take the window as it decodes."""
        self._text += self._decode(self.token_ids[self._prefix_offset:])[len(self._prefix_text):]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self._prefix_text = ""

    # ---- stop strings --------------------------------------------------------------------------------
    def _check_stop_strings(self, num_new_chars: int) -> None:
        """Find the earliest stop string that ends in the new text; cut _text there."""
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            # a match must overlap the new characters: start at most len(stop) - 1 before them
            start = max(0, len(self._text) - num_new_chars - len(stop) + 1)
            index = self._text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return
        index, stop = best
        self.stop_reason = stop
        self._text = self._text[:index + len(stop) if self.params.include_stop_str_in_output else index]
        self._num_emitted = min(self._num_emitted, len(self._text))


@functools.lru_cache(maxsize=64)
def _cached_decoder(tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool):
    """(decode function, {token id: its decode alone}) per tokenizer and decode options. (One call per
    window, not the Rust ``decode_batch``: that one releases the GIL and runs on rayon's pool, which at 256
    two-token windows a step cost the front end more CPU and handed the GIL to the event loop mid-step.)"""
    return fast_decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens), {}
