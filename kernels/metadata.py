"""The attention metadata of one ragged step: what every attention backend reads.

A step carries a flat list of T new tokens from R requests (decode tokens and prefill chunks together).
Request r owns the tokens ``query_start_loc[r] : query_start_loc[r+1]``; its context after this step is
``seq_lens[r]`` tokens, so its new tokens sit at positions ``seq_lens[r] - q_len_r .. seq_lens[r]-1`` and
attend causally to every earlier position of the same request through ``block_tables[r]``.

Shapes are padded to buckets: padding tokens have ``slot_mapping == PAD_SLOT`` (block 0, the null block
the KV manager never hands out, so their writes land nowhere that is read); padding requests have
``seq_lens == 0`` and an empty query range at the end of the used tokens.
"""
from __future__ import annotations

import dataclasses

import jax

# Block 0 is the null block: padding tokens write their K/V there and no request ever reads it.
NULL_BLOCK = 0
PAD_SLOT = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array      # [T] int32: flat cache slot (block * block_size + offset) of each new token
    block_tables: jax.Array      # [R, max_blocks_per_seq] int32: physical block ids, padded with NULL_BLOCK
    seq_lens: jax.Array          # [R] int32: context length of each request after this step (0 = padding)
    query_start_loc: jax.Array   # [R + 1] int32: cumulative new-token offsets into the flat token axis
    num_seqs: jax.Array          # [] int32: number of real requests (<= R)
    # [T] int32, or None (causal only, and no such input in the step's program): a token also attends to its
    # request's keys up to this position where it is past the token's own (bidirectional attention among one
    # image's tokens, Gemma 3: the image span's last position; -1 elsewhere). Sliding windows still apply.
    attend_limit: jax.Array | None = None
    # Static (part of the jit cache key, not an array): every real request has exactly one new token. The
    # Pallas backend then launches its decode kernel alone (vLLM's uniform-decode case); the reference
    # ignores it. The caller must be right: a prefill token in such a step is left unwritten.
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # Static: an upper bound on every request's seq_len in this step, known on the host (None: the block
    # tables' span). A launch-shape hint only: the Pallas decode sizes its flash-decoding splits from it (a
    # short-context step runs one GQA decode launch, no splits and no combine; the MLA kernel splits one of a
    # few tokens into splits of 128 keys, fewer than at max_model_len); any seq_len is still attended
    # exactly, so a step may run a variant compiled without it. The runner sets it to SHORT_SEQ_LEN or None.
    max_seq_len: int | None = dataclasses.field(default=None, metadata=dict(static=True))


# The runner's bound for short-context decode steps (``AttentionMetadata.max_seq_len``): up to here the decode
# kernel's own rule (each split at least 512 keys) gives a single split at any batch size.
SHORT_SEQ_LEN = 512
