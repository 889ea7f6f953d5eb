"""Async scheduling with speculation, on the device: a speculative step placed while the step before it was
still in flight moves each request's tokens back by the drafts that step rejected."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxserve.kernels.metadata import AttentionMetadata


def row_shift(shift_row, prev_rejected):
    """Each row's shift: the drafts its previous step (in flight when this one was placed) rejected."""
    return jnp.where(shift_row >= 0, prev_rejected[jnp.maximum(shift_row, 0)], 0)


def shift_back(shift_row, block_size, prev_rejected, positions, md: AttentionMetadata):
    """Async scheduling with speculation: the host placed a request's tokens as if every draft of its previous
    step were accepted; they move back by the drafts that step rejected (``row_shift``), with their sequence
    length and KV slots (the block table is the request's: the slots stay inside its blocks)."""
    shift = row_shift(shift_row, prev_rejected)
    R, T = shift.shape[0], positions.shape[0]
    qsl = md.query_start_loc
    t = jnp.arange(T, dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(qsl[1:], t, side="right"), R - 1)
    tok_shift = jnp.where(t < qsl[-1], shift[row], 0)
    pos = positions - tok_shift
    slots = md.block_tables[row, pos // block_size] * block_size + pos % block_size
    md = dataclasses.replace(md, seq_lens=md.seq_lens - shift,
                             slot_mapping=jnp.where(tok_shift > 0, slots, md.slot_mapping))
    return pos, md
