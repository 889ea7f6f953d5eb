"""The per-request state a step reads every time, in preallocated numpy arrays (vLLM's persistent batch).

A request gets a row the first time it is scheduled. Its sampling parameters, fixed for its life, are
written into the row's columns once; its block-table row mirrors the KV cache manager's list of block ids
(``ScheduledRequest.block_ids`` is that live list), copying only the ids appended since the last step (a
decode adds one every block_size tokens). A step then takes its requests' rows with one numpy gather per
array instead of rebuilding them from Python objects every step.

The runner is not told when a request ends, so rows are not handed back one by one: when a step would run
out of rows (twice max_num_seqs requests seen), every row is dropped and the step's requests get rows
afresh — one rebuild per max_num_seqs new requests. A row belongs to one ``Request`` object: a request id
used again (a new Request) gets a new row.
"""
from __future__ import annotations

import numpy as np

from jaxserve.runner import sampler as sampler_mod


class InputBatch:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, vocab_size: int):
        cap = self.capacity = 2 * max_num_seqs
        self.vocab_size = vocab_size
        self._row_of: dict[str, tuple[object, int]] = {}    # request id -> (its Request, row)
        self._next_row = 0
        self._last: tuple[object, np.ndarray] | None = None   # (scheduled list, its rows): asked twice a step
        # block tables: the rows' block ids, how many are copied, and the list object they mirror
        self.block_table = np.zeros((cap, max_blocks_per_seq), np.int32)
        self.num_blocks = np.zeros(cap, np.int32)
        self._copied = [0] * cap
        self._mirrors: list[list[int] | None] = [None] * cap
        # sampling parameters, as sampler.make_sampling_metadata writes them into a row
        f32 = np.float32
        self.temperature = np.zeros(cap, f32)
        self.top_p = np.ones(cap, f32)
        self.top_k = np.zeros(cap, np.int32)
        self.min_p = np.zeros(cap, f32)
        self.presence_penalty = np.zeros(cap, f32)
        self.frequency_penalty = np.zeros(cap, f32)
        self.repetition_penalty = np.ones(cap, f32)
        self.seed_key_data = np.zeros((cap, 2), np.uint32)
        self.seeded = np.zeros(cap, bool)
        self.request_hash = np.zeros(cap, np.uint32)
        self.min_tokens = np.zeros(cap, np.int64)
        self.blocks_ids = np.zeros(cap, bool)       # min_tokens would block a stop / eos id below vocab_size
        self.general = np.zeros(cap, bool)          # a penalty or a token restriction: the general path always
        self.filters = np.zeros(cap, bool)          # top-k or top-p filters the row
        self.num_logprobs = np.full(cap, -1, np.int32)   # -1: no logprobs asked

    # ------------------------------------------------------------------ rows
    def rows_for(self, scheduled) -> np.ndarray:
        """The rows of the scheduled requests, in order (int64), giving new requests their rows."""
        last = self._last
        if last is not None and last[0] is scheduled:
            return last[1]
        if self._next_row + len(scheduled) > self.capacity:
            self._row_of.clear()
            self._next_row = 0
            self._mirrors = [None] * self.capacity
        row_of = self._row_of
        rows = []
        for s in scheduled:
            req = s.request
            hit = row_of.get(req.request_id)
            if hit is None or hit[0] is not req:
                hit = row_of[req.request_id] = (req, self._add(req))
            rows.append(hit[1])
        out = np.array(rows, np.int64)
        self._last = (scheduled, out)
        return out

    def _add(self, req) -> int:
        row = self._next_row
        self._next_row += 1
        p, seed = req.sampling_params, req.sampling_seed
        vocab = self.vocab_size
        self.temperature[row] = p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = p.top_k if 0 < p.top_k < vocab else 0
        self.min_p[row] = p.min_p
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.repetition_penalty[row] = p.repetition_penalty
        seed = p.seed if p.seed is not None else seed
        self.seeded[row] = seed is not None
        self.seed_key_data[row] = sampler_mod.seed_key_data(seed) if seed is not None else 0
        self.request_hash[row] = 0 if seed is not None else sampler_mod.request_hash(req.request_id)
        self.min_tokens[row] = p.min_tokens
        self.blocks_ids[row] = any(t < vocab for t in p.all_stop_token_ids)
        self.general[row] = p.uses_penalties or p.restricts_tokens
        self.filters[row] = 0 < p.top_k < vocab or p.top_p < 1.0
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self._mirrors[row] = None
        return row

    # ------------------------------------------------------------------ block tables
    def sync_block_tables(self, scheduled, rows: np.ndarray) -> np.ndarray:
        """Bring the rows' block tables up to the scheduled requests' block ids (copying what was appended;
        all of a list the row did not mirror); returns each row's number of blocks."""
        mirrors, copied, table, num_blocks = self._mirrors, self._copied, self.block_table, self.num_blocks
        for s, r in zip(scheduled, rows.tolist()):
            ids = s.block_ids
            c, m = copied[r], len(ids)
            if ids is not mirrors[r] or m < c:     # a new table (a list is only ever extended)
                mirrors[r] = ids
                if c:
                    table[r, :c] = 0                # the padded table holds zeros past a row's blocks
                c = copied[r] = num_blocks[r] = 0
            if m != c:
                table[r, c:m] = ids[c:]
                copied[r] = num_blocks[r] = m
        return num_blocks[rows]

    # ------------------------------------------------------------------ sampling
    def needs_general_path(self, rows: np.ndarray, num_output_tokens: np.ndarray) -> bool:
        """Whether some row needs ``sampler.make_sampling_metadata``: a penalty (the token histories), a
        token restriction (logit_bias, allowed_token_ids, bad_words) or stop ids min_tokens still blocks."""
        return bool(self.general[rows].any()
                    or (self.blocks_ids[rows] & (num_output_tokens < self.min_tokens[rows])).any())

    def sampling_metadata(self, rows: np.ndarray, num_output_tokens: np.ndarray, pad_to: int, *, step: int,
                          engine_seed: int) -> sampler_mod.SamplingMetadata:
        """``sampler.make_sampling_metadata``'s arrays for rows that need no general path (the same values,
        gathered from the rows); rows past ``len(rows)`` are padding (greedy, nothing filtered)."""
        n = len(rows)
        if n > pad_to:
            raise ValueError(f"{n} requests do not fit the request bucket pad_to={pad_to}")
        (temperature, top_p, top_k, min_p, presence, frequency, repetition, seed_keys, seeded, hashes,
         counters) = sampler_mod.padding_rows(pad_to)
        if n:
            temperature[:n] = self.temperature[rows]
            top_p[:n] = self.top_p[rows]
            top_k[:n] = self.top_k[rows]
            min_p[:n] = self.min_p[rows]
            presence[:n] = self.presence_penalty[rows]
            frequency[:n] = self.frequency_penalty[rows]
            repetition[:n] = self.repetition_penalty[rows]
            seed_keys[:n] = self.seed_key_data[rows]
            s = seeded[:n] = self.seeded[rows]
            hashes[:n] = self.request_hash[rows]
            counters[:n] = np.where(s, num_output_tokens, step % (1 << 32))
        return sampler_mod.SamplingMetadata(
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
            seed_key_data=seed_keys, seeded=seeded, request_hash=hashes, key_counter=counters,
            engine_key_data=sampler_mod.seed_key_data(engine_seed),
            output_token_ids=np.full((pad_to, 0), 0, np.int32),
            prompt_token_ids=np.full((pad_to, 0), 0, np.int32),
            blocked_token_ids=np.full((pad_to, 8), self.vocab_size, np.int32),
        )
