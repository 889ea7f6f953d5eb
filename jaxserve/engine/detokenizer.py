"""Incremental detokenization with stop strings, and the text of logprobs.

The text a stream emits, concatenated, equals `tokenizer.decode(output_ids, skip_special_tokens=...)`:
each step decodes only a short window of ids (from the start of the previously emitted chunk) and emits
what the window adds beyond the part already emitted. Two things are held back until they are settled:
- the tail while the window decodes to a trailing U+FFFD (a multi-byte character split across tokens);
- the last max(len(stop)) - 1 characters when stop strings are set, so no emitted text is later cut.
`update(..., finished=True)` releases everything still held.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from jaxserve.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"


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
        self._stop_buffer = params.output_text_buffer_length
        self._decode_kwargs = dict(skip_special_tokens=params.skip_special_tokens,
                                   spaces_between_special_tokens=params.spaces_between_special_tokens)

    @property
    def output_text(self) -> str:
        """Everything emitted so far (what a CUMULATIVE output shows)."""
        return self._text[:self._num_emitted]

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> str:
        """Add newly sampled ids; return the text to emit now ("" if nothing is settled yet). After a stop
        string is found (`stop_reason` set) the request should finish; later calls return ""."""
        if self.stop_reason is not None or not self.params.detokenize:
            self.token_ids.extend(new_token_ids)
            return ""
        num_chars_before = len(self._text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self._decode_settled()
        if finished:
            self._decode_all_pending()
        num_new_chars = len(self._text) - num_chars_before
        if num_new_chars and self.params.stop and len(self.token_ids) > self.params.min_tokens:
            self._check_stop_strings(num_new_chars)
        release_all = finished or self.stop_reason is not None
        end = len(self._text) if release_all else max(self._num_emitted, len(self._text) - self._stop_buffer)
        delta = self._text[self._num_emitted:end]
        self._num_emitted = end
        return delta

    # ---- decoding ------------------------------------------------------------------------------------
    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, **self._decode_kwargs) if ids else ""

    def _decode_settled(self) -> None:
        """Extend _text by what the ids since _read_offset add, unless it ends in a split character."""
        window = self.token_ids[self._prefix_offset:]
        prefix_text = self._decode(window[:self._read_offset - self._prefix_offset])
        new_text = self._decode(window)
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
            self._text += new_text[len(prefix_text):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)

    def _decode_all_pending(self) -> None:
        """At the end nothing more can complete a split character: take the window as it decodes."""
        window = self.token_ids[self._prefix_offset:]
        prefix_text = self._decode(window[:self._read_offset - self._prefix_offset])
        self._text += self._decode(window)[len(prefix_text):]
        self._prefix_offset = self._read_offset = len(self.token_ids)

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


# ---- logprobs --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1 << 16)
def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token as vLLM shows it in logprobs (`tokenizer.decode([id])`), cached."""
    return tokenizer.decode([token_id]) or ""


def decode_logprobs(tokenizer: Any | None, token_id: int, logprob: float, rank: int,
                    topk_ids: Sequence[int] = (), topk_logprobs: Sequence[float] = (),
                    num_logprobs: int | None = None) -> dict[int, Any]:
    """One position's `{token_id: Logprob}`: the sampled token (with its rank) first, then the top
    `num_logprobs` (ranks 1..k) from the sampler's top-k row, which may be wider than this request asked
    (it is the batch's max). `tokenizer=None` leaves `decoded_token` None (detokenize=False)."""
    from jaxserve.outputs import Logprob

    k = len(topk_ids) if num_logprobs is None else min(num_logprobs, len(topk_ids))
    text = (lambda t: decode_token(tokenizer, t)) if tokenizer is not None else (lambda t: None)
    out = {int(token_id): Logprob(float(logprob), int(rank), text(int(token_id)))}
    for i in range(k):
        candidate = int(topk_ids[i])
        if candidate not in out:
            out[candidate] = Logprob(float(topk_logprobs[i]), i + 1, text(candidate))
    return out
