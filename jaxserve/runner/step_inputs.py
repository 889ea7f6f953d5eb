"""A scheduler decision as a step's padded host inputs: pure functions of the scheduled entries
(``step_contract.ScheduledEntry``) and the persistent per-request rows (``InputBatch``), callable without a
model or a device.

A step of N tokens pads to a token bucket T (a compiled shape) with R = min(T, max_num_seqs) request rows.
Its forward reads the flat ragged token list (prefill chunks and decode tokens together, decodes first), each
token's position and KV slot, each request's block-table row, sequence length and query start, and the index
of each request's last token (whose logits it returns). A token the step in flight samples is a PLACEHOLDER
on the host: ``prev_index`` names the row of that step's output that holds it, read on the device.

Vectorised: one pass over the requests gathers Python lists (tokens, starts, counts), the block tables come
from the persistent rows (only new block ids are copied), numpy does the per-token arithmetic. The arrays
travel packed (``packing``): one int32 buffer for the forward, an int32 and a float32 one for the sampler.
"""
from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import NamedTuple

import numpy as np

from jaxserve.kernels.metadata import PAD_SLOT, AttentionMetadata
from jaxserve.runner import packing, sampler as sampler_mod
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.step_contract import PLACEHOLDER

# The smallest default token bucket: a batch-1 decode step pads to it. Smaller buckets decoded faster on the
# H200 down to 4; a bucket of 1 was far slower: with one token row XLA turns some of the step's matmuls into
# multiply + reduce fusions. Below 4 warns on GPU.
MIN_TOKEN_BUCKET = 4


def token_buckets(max_num_batched_tokens: int, smallest: int = MIN_TOKEN_BUCKET) -> list[int]:
    """``smallest``, 2×, 4×, ... below the budget, then the budget itself (the last bucket is exactly it).
    The runner's token buckets and the embedder's batch and length buckets."""
    out, b = [], smallest
    while b < max_num_batched_tokens:
        out.append(b)
        b *= 2
    out.append(max_num_batched_tokens)
    return out


class StepShapes:
    """The token buckets a step pads to and the request rows of each; ``uniform_decode``: a step whose
    requests all decode one token gets its own (decode-only) variant."""
    __slots__ = ("sizes", "max_num_seqs", "uniform_decode")

    def __init__(self, sizes: list[int], max_num_seqs: int, uniform_decode: bool = False):
        self.sizes, self.max_num_seqs, self.uniform_decode = sizes, max_num_seqs, uniform_decode

    def bucket_for(self, num_tokens: int) -> int:
        for b in self.sizes:
            if num_tokens <= b:
                return b
        raise ValueError(f"step has {num_tokens} tokens, above max_num_batched_tokens={self.sizes[-1]}")

    def num_reqs_for(self, token_bucket: int) -> int:
        return min(token_bucket, self.max_num_seqs)

    def own(self, num_tokens: int, all_decode: bool) -> tuple[int, int, bool]:
        """A step's own shape: (token bucket, request rows, decode-only)."""
        T = self.bucket_for(num_tokens)
        return T, min(T, self.max_num_seqs), self.uniform_decode and all_decode


class ForwardInputs(NamedTuple):
    T: int
    R: int
    input_ids: np.ndarray            # [T]
    positions: np.ndarray            # [T]; [3, T] for an M-RoPE model
    md: AttentionMetadata            # slots [T], block tables [R, max_blocks_per_seq], lens [R], starts [R + 1]
    logits_idx: np.ndarray           # [R]: each request's last token
    prev_index: np.ndarray           # [T]: the row of the step in flight's output holding the token, else -1


def _empty(T: int, R: int, max_blocks_per_seq: int) -> tuple[np.ndarray, ...]:
    """A step's arrays with no request in them: padding tokens write the null block, padding rows are empty."""
    i32 = np.int32
    return (np.zeros(T, i32), np.zeros(T, i32), np.full(T, PAD_SLOT, i32), np.zeros((R, max_blocks_per_seq), i32),
            np.zeros(R, i32), np.zeros(R + 1, i32), np.zeros(R, i32), np.full(T, -1, i32))


def padding(T: int, R: int, max_blocks_per_seq: int, mrope: bool = False) -> ForwardInputs:
    """A step of bucket ``T`` with no request (the warm-up's inputs); ``mrope``: 3-D positions."""
    input_ids, positions, slots, tables, seq_lens, qsl, logits_idx, prev_index = _empty(T, R, max_blocks_per_seq)
    if mrope:
        positions = np.zeros((3, T), np.int32)
    md = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl,
                           num_seqs=np.int32(0))
    return ForwardInputs(T, R, input_ids, positions, md, logits_idx, prev_index)


def forward_inputs(scheduled, batch: InputBatch, block_size: int,
                   shape: Callable[[int, bool], tuple[int, int, bool]],
                   prev_rows: dict[str, int] | None = None, mrope: Callable | None = None,
                   spec_width: int = 0) -> ForwardInputs:
    """The forward's host arrays for ``scheduled`` (decodes first). ``shape(num_tokens, all_decode)`` gives
    (T, R, decode-only): ``StepShapes.own``, or the runner's compiled shape. ``prev_rows``: request id -> row
    of the step in flight's output, for the requests whose last token it samples (PLACEHOLDER here).
    ``mrope``: an M-RoPE family's ``mrope_positions(positions, features)``: positions become ``[3, T]``.
    ``spec_width``: a speculative step of K + 1 positions per request: each entry's ``spec_token_ids`` follow
    its tokens, and ``logits_idx`` is ``[R * (K + 1)]`` (``spec_logits_rows``)."""
    n = len(scheduled)
    counts_list = [s.num_new_tokens for s in scheduled]
    n_tok = sum(counts_list)
    T, R, decode_only = shape(n_tok, 0 < n == n_tok)
    if n > R:
        raise ValueError(f"{n} requests in a step of {T} tokens ({R} request rows)")
    input_ids, positions, slots, tables, seq_lens, qsl, logits_idx, prev_index = \
        _empty(T, R, batch.block_table.shape[1])
    if n:
        i32 = np.int32
        starts = np.fromiter([s.start_pos for s in scheduled], i32, n)
        counts = np.fromiter(counts_list, i32, n)
        ends = np.cumsum(counts, dtype=i32)
        if n_tok == n:              # decodes only: one token each, no per-token expansion
            toks = [s.request.all_token_ids[s.start_pos] for s in scheduled]
            pos = starts
            tok_row = np.arange(n, dtype=i32)
        else:
            toks = list(chain.from_iterable(_with_drafts(s) for s in scheduled)) if spec_width else \
                list(chain.from_iterable(s.request.all_token_ids[s.start_pos:s.start_pos + s.num_new_tokens]
                                         for s in scheduled))
            tok_row = np.repeat(np.arange(n, dtype=i32), counts)
            pos = (starts - (ends - counts))[tok_row] + np.arange(n_tok, dtype=i32)
        input_ids[:n_tok] = toks
        positions[:n_tok] = pos
        # block tables: the requests' persistent rows (brought up to date), gathered into the padded table
        rows = batch.rows_for(scheduled)
        lens = batch.sync_block_tables(scheduled, rows)
        tables[:n] = batch.block_table[rows]
        blk = pos // block_size
        if np.any(blk >= lens[tok_row]):
            bad = int(np.flatnonzero(blk >= lens[tok_row])[0])
            raise IndexError(f"request {scheduled[int(tok_row[bad])].request.request_id}: position "
                             f"{int(pos[bad])} is past its block table")
        slots[:n_tok] = tables[tok_row, blk] * block_size + pos % block_size
        seq_lens[:n] = starts + counts
        qsl[1:n + 1] = ends
        qsl[n + 1:] = n_tok
        logits_idx[:n] = ends - 1
        last_known = ends - 1
        if spec_width:
            d = np.fromiter([len(s.spec_token_ids or ()) for s in scheduled], i32, n)
            last_known = ends - 1 - d
            logits_idx = spec_logits_rows(d, last_known, R, spec_width)
        # placeholders: the last known token of a chunk (its drafts follow it), sampled by the step in flight
        waiting = np.flatnonzero(input_ids[last_known] == PLACEHOLDER)
        if waiting.size:
            try:
                src = [(prev_rows or {})[scheduled[i].request.request_id] for i in waiting.tolist()]
            except KeyError as e:
                raise RuntimeError(f"request {e.args[0]}: its last token is still on the device but "
                                   "no step in flight sampled it") from None
            last = last_known[waiting]
            prev_index[last] = src
            input_ids[last] = 0
    if mrope is not None:
        positions = _mrope_rows(positions, scheduled, counts_list, mrope)
    md = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens, query_start_loc=qsl,
                           num_seqs=np.int32(n), decode_only=decode_only)
    return ForwardInputs(T, R, input_ids, positions, md, logits_idx, prev_index)


def _with_drafts(s) -> list[int]:
    """An entry's tokens: its known ones, then its draft tokens (``spec_token_ids``)."""
    drafts = s.spec_token_ids or ()
    return s.request.all_token_ids[s.start_pos:s.start_pos + s.num_new_tokens - len(drafts)] + list(drafts)


def spec_logits_rows(d: np.ndarray, last_known: np.ndarray, R: int, width: int) -> np.ndarray:
    """``[R * width]``: row r's logits positions j = 0 .. width - 1: its last known token (``last_known``), then
    each of its ``d`` drafts; the positions past them repeat its last token (padding rows: token 0)."""
    out = np.zeros((R, width), np.int32)
    n = d.shape[0]
    out[:n] = last_known[:, None] + np.minimum(np.arange(width, dtype=np.int32)[None, :], d[:, None])
    return out.reshape(-1)


def shift_rows(scheduled, R: int, prev_rows: dict[str, int] | None, prev_drafts: dict[str, int] | None
               ) -> np.ndarray:
    """A speculative step's ``[R]`` shift sources (async scheduling): for each request whose previous step,
    still in flight, verified drafts, that step's output row (its rejected count moves this step's tokens back
    on the device: the host placed them as if every draft were accepted), else -1."""
    out = np.full(R, -1, np.int32)
    if prev_drafts:
        for i, s in enumerate(scheduled):
            rid = s.request.request_id
            if rid in prev_drafts:
                out[i] = prev_rows[rid]
    return out


def draft_arrays(scheduled, R: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A speculative step's drafts ``[R, k]`` (0-padded) and their counts ``[R]``."""
    drafts, counts = np.zeros((R, k), np.int32), np.zeros(R, np.int32)
    for i, s in enumerate(scheduled):
        spec = s.spec_token_ids
        if spec:
            drafts[i, :len(spec)] = spec
            counts[i] = len(spec)
    return drafts, counts


def _mrope_rows(positions: np.ndarray, scheduled, counts: list[int], mrope: Callable) -> np.ndarray:
    """``[3, T]`` positions: three equal rows, except the tokens of requests with images (their own rows)."""
    out = np.broadcast_to(positions, (3, positions.shape[0])).copy()
    start = 0
    for s, count in zip(scheduled, counts):
        if s.request.mm_features:
            out[:, start:start + count] = mrope(positions[start:start + count], s.request.mm_features)
        start += count
    return out


def forward_pack(input_ids, positions, md: AttentionMetadata, logits_idx, prev_index, step_limit=None,
                 lora_slot=None, shift: dict | None = None, hidden_index=None):
    """The forward's host inputs as one int32 buffer and its (static) layout; ``step_limit`` [R] (each row's
    iterations) for the multi-step decode loop; ``lora_slot`` [T] (each token's adapter slot) with LoRA on;
    ``shift``: a speculative step's ``{"shift_row": [R]}`` (``shift_rows``); ``hidden_index`` [T]: an EAGLE
    head's step, the row of its hidden-state source each token takes."""
    extra = {} if step_limit is None else {"step_limit": step_limit}
    if lora_slot is not None:
        extra["lora_slot"] = lora_slot
    if shift is not None:
        extra.update(shift)
    if hidden_index is not None:
        extra["hidden_index"] = hidden_index
    ints, _, layout = packing.pack({
        "input_ids": input_ids, "positions": positions, "logits_idx": logits_idx, "prev_index": prev_index,
        **extra, **packing.prefixed("md.", packing.fields(md))})
    return ints, layout


def lora_slots(scheduled, T: int) -> np.ndarray:
    """Each token's adapter slot ``[T]`` (0: the base model, and padding), from its request's ``lora_slot``."""
    out = np.zeros(T, np.int32)
    slots = [s.request.lora_slot for s in scheduled]
    if any(slots):
        n_tok = sum(s.num_new_tokens for s in scheduled)
        out[:n_tok] = np.repeat(np.asarray(slots, np.int32), [s.num_new_tokens for s in scheduled])
    return out


def step_limits(scheduled, R: int) -> np.ndarray:
    """A multi-step decode's iterations per request row (1 on padding rows)."""
    limit = np.ones(R, np.int32)
    limit[:len(scheduled)] = [s.num_steps for s in scheduled]
    return limit


def sampling_inputs(scheduled, batch: InputBatch, R: int, *, vocab_size: int, penalty_width: int, step: int,
                    engine_seed: int) -> sampler_mod.SamplingMetadata:
    """The step's sampling arrays: gathered from the persistent rows, unless some request needs the
    general path (a penalty's token histories, logit_bias / allowed_token_ids / bad_words, stop ids
    min_tokens still blocks)."""
    reqs = [s.request for s in scheduled]
    num_out = np.fromiter([len(r.output_token_ids) for r in reqs], np.int64, len(reqs))
    rows = batch.rows_for(scheduled)
    if not batch.needs_general_path(rows, num_out):
        return batch.sampling_metadata(rows, num_out, R, step=step, engine_seed=engine_seed)
    return sampler_mod.make_sampling_metadata(
        [r.sampling_params for r in reqs],
        [r.output_token_ids for r in reqs],
        [r.prompt_token_ids for r in reqs],
        num_out.tolist(),
        vocab_size, pad_to=R,
        request_ids=[r.request_id for r in reqs],
        request_seeds=[r.sampling_seed for r in reqs],
        step=step, engine_seed=engine_seed,
        penalty_width=penalty_width)


def sampled_rows(scheduled, batch: InputBatch, static_sampling: bool) -> tuple[dict[str, int], dict[str, int],
                                                                                bool | None]:
    """The sampling requests' output rows (request id -> row), the top logprobs each wants (request id ->
    k, for those that want some), and, when the sampler is compiled per filter mode, whether any row filters
    with top-k/top-p (else None): all from their persistent rows."""
    rows = {s.request.request_id: i for i, s in enumerate(scheduled) if s.samples}
    b_rows = batch.rows_for(scheduled)
    if len(rows) != len(scheduled):
        b_rows = b_rows[np.fromiter([s.samples for s in scheduled], bool, len(scheduled))]
    wanted, logprobs_k = batch.num_logprobs[b_rows], {}
    if (wanted >= 0).any():
        logprobs_k = {rid: int(k) for rid, k in zip(rows, wanted.tolist()) if k >= 0}
    filtering = bool(batch.filters[b_rows].any()) if static_sampling else None
    return rows, logprobs_k, filtering
