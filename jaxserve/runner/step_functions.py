"""The functions a step's executables trace (``step_variants`` compiles them, one variant per key): the
model forward over the flat ragged token list (the whole model, or one pipeline stage's layers) and the
on-device sampler."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve import envs
from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.parallel import gather_logits
from jaxserve.runner import packing, sampler as sampler_mod
from jaxserve.runner.spec_shift import shift_back


def forward_fn(family, cfg, backend, expert_load, params, kv_caches, ints, prev_tokens, mm_slab=None,
               mm_index=None, prev_rejected=None, hidden_src=None, prev_drafts=None, *, layout, decode_only=False,
               max_seq_len=None, stage=None, block_size=0, hidden_rows=0, hidden_width=0, aux_layers=()):
    """The step's forward: ``(kv_caches, logits[, hidden][, expert load])``; ``expert_load``: the expert load's
    shape ``(MoE layers, experts)`` when the step returns it (``stats.moe_layers``), else None. ``stage`` (first
    layer, end): one pipeline stage's part (``runner.pipeline``); after the first, ``prev_tokens`` is the
    residual stream it takes, and before the last it returns that stream instead of logits. ``hidden_rows``:
    also every row's hidden state (the logits'; ``aux_layers``: the residual streams entering those layers, side
    by side, an EAGLE-3 target's), padded to that many rows and ``hidden_width`` columns; ``hidden_src``: an
    EAGLE head's step, each token's input hidden state is ``hidden_src[hidden_index]`` (a previous step's
    ``hidden``; ``engine.eagle_proposer``; an EAGLE-3 head's own rows are marked by ``~row``). ``prev_drafts``:
    the previous step's proposals on the device (``ngram_device``), which the draft slots take
    (``draft_index``)."""
    # The step's int32 inputs arrive packed in one buffer (one host-to-device copy; ``packing``).
    if stage is not None:
        return _stage_forward(family, cfg, backend, params, kv_caches, packing.unpack(ints, None, layout),
                              prev_tokens, decode_only, max_seq_len, stage)
    rows = next(piece.shape[0] for piece in layout if piece.name == "logits_idx")
    out_specs = [((rows, cfg.vocab_size), jnp.float32)] + ([(tuple(expert_load), jnp.int32)] if expert_load else [])
    zero_outs, ints = _per_call_buffers_apart(ints, out_specs)
    x = packing.unpack(ints, None, layout)
    # LoRA on: the adapter slots ride beside the weights, each token's slot in the inputs
    lora = {} if "lora" not in params else {"lora": (params["lora"], x["lora_slot"])}
    params = {k: v for k, v in params.items() if k != "lora"} if lora else params
    md = AttentionMetadata(**packing.take(x, "md."), decode_only=decode_only, max_seq_len=max_seq_len)
    input_ids, positions, logits_indices, prev_index = x["input_ids"], x["positions"], x["logits_idx"], \
        x["prev_index"]
    # Tokens sampled by the previous step never visit the host before this step runs: the host marks them
    # PLACEHOLDER and ``prev_index`` says which row of the previous step's (padded) output holds each one.
    input_ids = jnp.where(prev_index >= 0, prev_tokens[jnp.maximum(prev_index, 0)], input_ids)
    if prev_drafts is not None:
        input_ids = jnp.where(x["draft_index"] >= 0, prev_drafts[jnp.maximum(x["draft_index"], 0)], input_ids)
    if prev_rejected is not None:       # a speculative step after one still in flight (``shift_back``)
        positions, md = shift_back(x["shift_row"], block_size, prev_rejected, positions, md)
    # a multimodal step (its own executables): image embeddings from the encoder cache's slab over their
    # token rows (``mm_index``: [token rows, slab rows(, each token's attend limit)],
    # ``encoder_cache.EncoderCache.gather``; the third row: a family whose image tokens attend both ways)
    if getattr(family, "cross_attention", False):
        # cross-attention (Mllama): the slab is the K/V pool, the index each token's [slot, keys, row on]
        extra = lora if mm_slab is None else {"cross": (mm_slab, mm_index), **lora}
    else:
        extra = lora if mm_slab is None else {"mm_embeds": mm_slab[mm_index[1]], "mm_rows": mm_index[0], **lora}
    if hidden_src is not None:
        index = x["hidden_index"]
        if getattr(family, "marks_own_hidden", False):
            extra = {**extra, "hidden_own": index < 0}
            index = jnp.where(index < 0, ~index, index)
        extra = {**extra, "hidden_in": hidden_src[index]}
    if mm_index is not None and mm_index.shape[0] == 3 and "cross" not in extra:
        md = dataclasses.replace(md, attend_limit=mm_index[2])
    fed = None
    if aux_layers:
        hidden, kv_caches, load, fed = family.forward_with_expert_load(
            params, kv_caches, input_ids, positions, md, cfg, attn_backend=backend, aux_layers=aux_layers, **extra)
    else:
        hidden, kv_caches, load = family.forward_with_expert_load(
            params, kv_caches, input_ids, positions, md, cfg, attn_backend=backend, **extra) if expert_load else \
            (*family.forward(params, kv_caches, input_ids, positions, md, cfg, attn_backend=backend, **extra), None)
    # under a tp mesh: vocab-sharded logits gathered once ([R, vocab]) for the sampler
    logits = zero_outs[0] + gather_logits(family.compute_logits(params, hidden[logits_indices], cfg))
    out = (kv_caches, logits)
    if hidden_rows:
        fed = hidden if fed is None else fed
        out += (jnp.pad(fed, ((0, hidden_rows - fed.shape[0]), (0, hidden_width - fed.shape[1]))),)
    return (*out, zero_outs[1] + load) if expert_load else out


def _per_call_buffers_apart(ints, out_specs):
    """(a zero buffer for each output in ``out_specs`` [(shape, dtype)], the packed inputs ``ints``) arranged
    so that few commands of the step's CUDA graph use a buffer that is new on every call.

    NOTE: on each call XLA updates the graph's commands that use a buffer whose address changed since the last
    call (openxla/xla ``CommandExecutor::RecordUpdate``; ``benchmarks/cmdbuf_updates.py`` counts them). A
    step's inputs and its outputs other than the donated KV cache are new buffers on every call. Left alone,
    XLA spreads them over most commands: it places temporaries of every layer in an output's buffer while that
    output is not yet live, and fuses slices of the packed inputs into each layer's kernels (the slot mapping
    into every KV write). So each output is a zero buffer made before the layers run and added to at the end
    (its buffer is busy the whole step and holds nothing else), and the inputs are copied once into a
    temporary behind an optimization barrier, which XLA neither fuses through nor forwards."""
    outs = tuple(jnp.zeros(shape, dtype) for shape, dtype in out_specs)
    if not envs.JAXSERVE_STEP_BUFFERS_APART:
        return outs, ints
    outs, zeros = jax.lax.optimization_barrier((outs, jnp.zeros_like(ints)))
    return outs, jax.lax.optimization_barrier(ints | zeros)


def _stage_forward(family, cfg, backend, params, kv_caches, x, carry, decode_only, max_seq_len, stage):
    md = AttentionMetadata(**packing.take(x, "md."), decode_only=decode_only, max_seq_len=max_seq_len)
    first, last = stage[0] == 0, stage[1] == cfg.num_layers
    input_ids = x["input_ids"]
    if first:     # as in forward_fn: the previous step's tokens resolve the placeholders on the device
        input_ids = jnp.where(x["prev_index"] >= 0, carry[jnp.maximum(x["prev_index"], 0)], input_ids)
    hidden, kv_caches, _ = family.forward_with_expert_load(params, kv_caches, input_ids, x["positions"], md, cfg,
                                                           attn_backend=backend, stage=stage,
                                                           hidden_in=None if first else carry)
    if not last:
        return kv_caches, hidden
    return kv_caches, gather_logits(family.compute_logits(params, hidden[x["logits_idx"]], cfg))


def sample_fn(num_logprobs, max_rows, filtering, logits, ints, floats, bitmask=None, *, layout):
    sampling_meta = sampler_mod.SamplingMetadata(**packing.unpack(ints, floats, layout))
    out = sampler_mod.sample(logits, sampling_meta, num_logprobs=num_logprobs, filtering=filtering,
                             bitmask=bitmask)
    # the sampled ids padded to a fixed length, so the next step's forward sees one shape whatever this bucket
    padded = jnp.zeros(max_rows, jnp.int32).at[:out.token_ids.shape[0]].set(out.token_ids)
    return out, padded
