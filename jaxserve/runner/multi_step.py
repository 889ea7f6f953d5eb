"""Multi-step decoding (``--num-scheduler-steps N``): N iterations of forward → sample → feed the token back,
as one device-side loop (XLA's while loop with a known trip count: no host round trip between iterations),
for steps whose requests all decode. One executable per (decode bucket, logprobs, filter mode)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.kernels.metadata import PAD_SLOT, AttentionMetadata
from jaxserve.parallel import gather_logits
from jaxserve.runner import packing, sampler as sampler_mod


def decode_loop_fn(family, cfg, backend, max_rows, block_size, num_steps, num_logprobs, filtering, moe_layers,
                   params, kv_caches, ints, prev_tokens, s_ints, s_floats, *, layout, s_layout):
    """``num_steps`` iterations of forward → sample → feed the token back.

    Every request decodes (token row i = request row i). Row i runs ``step_limit[i]`` iterations; after
    that it repeats its last position with its K/V write sent to the null block (PAD_SLOT), so an early
    finisher never writes outside the blocks the scheduler gave it. Returns the cache, a SamplerOutput whose
    arrays have a leading [num_steps] axis (ids, and the logprobs when ``num_logprobs`` asks for them) and
    each row's last real token (padded to ``max_rows``: what the next step's placeholders read); for an MoE
    model (``moe_layers``: (layers, experts)) each iteration's expert load too, ``[num_steps, L_moe, E]``."""
    x = packing.unpack(ints, None, layout)
    md = AttentionMetadata(**packing.take(x, "md."), decode_only=True)
    prev_index = x["prev_index"]
    ids = jnp.where(prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], x["input_ids"])
    meta = sampler_mod.SamplingMetadata(**packing.unpack(s_ints, s_floats, s_layout))
    T, R = ids.shape[0], md.seq_lens.shape[0]
    limit = x["step_limit"]                                   # [R], 1 on padding rows
    tok_row = jnp.minimum(jnp.arange(T), R - 1)
    real = jnp.arange(T) < md.num_seqs
    positions0, logits_idx = x["positions"], x["logits_idx"]

    def body(i, carry):
        kv, ids, outs, loads = carry
        advance = jnp.minimum(i, limit - 1)                  # [R]
        pos = positions0 + advance[tok_row]
        # an M-RoPE model's rows [3, T] are rotary positions: the KV slot goes by the sequence index
        seq_pos = pos if pos.ndim == 1 else md.seq_lens[tok_row] - 1 + advance[tok_row]
        slot = md.block_tables[tok_row, seq_pos // block_size] * block_size + seq_pos % block_size
        slot = jnp.where(real & (i < limit[tok_row]), slot, PAD_SLOT)
        step_md = dataclasses.replace(md, slot_mapping=slot, seq_lens=md.seq_lens + advance)  # padding: +0
        hidden, kv, load = family.forward_with_expert_load(params, kv, ids, pos, step_md, cfg,
                                                           attn_backend=backend) if moe_layers else \
            (*family.forward(params, kv, ids, pos, step_md, cfg, attn_backend=backend), None)
        if moe_layers:
            loads = loads.at[i].set(load)
        logits = gather_logits(family.compute_logits(params, hidden[logits_idx], cfg))
        step_meta = dataclasses.replace(meta, key_counter=meta.key_counter + i.astype(jnp.uint32))
        out = sampler_mod.sample(logits, step_meta, num_logprobs=num_logprobs, filtering=filtering)
        outs = jax.tree.map(lambda acc, x: acc.at[i].set(x), outs, out)
        return kv, ids.at[:R].set(out.token_ids), outs, loads

    k = num_logprobs
    outs0 = sampler_mod.SamplerOutput(
        jnp.zeros((num_steps, R), jnp.int32), jnp.zeros((num_steps, R), jnp.float32),
        jnp.zeros((num_steps, R), jnp.int32), jnp.zeros((num_steps, R, k), jnp.int32),
        jnp.zeros((num_steps, R, k), jnp.float32))
    loads0 = jnp.zeros((num_steps, *moe_layers), jnp.int32) if moe_layers else None
    kv_caches, _, outs, loads = jax.lax.fori_loop(0, num_steps, body, (kv_caches, ids, outs0, loads0))
    last = outs.token_ids[limit - 1, jnp.arange(R)]
    padded = jnp.zeros(max_rows, jnp.int32).at[:R].set(last)
    return (kv_caches, outs, padded, loads) if moe_layers else (kv_caches, outs, padded)
