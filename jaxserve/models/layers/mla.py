"""Multi-head latent attention (DeepSeek V2 / V3): one more attention kind of ``layers.decoder``; a layer whose
``DecoderSpec.mla`` is set declares these weights instead of q/k/v.

Per token the layer caches one latent row, ``c_kv`` (``kv_lora_rank`` values, after ``kv_a_layernorm``) and the
rotated shared key ``k_rope`` (``qk_rope_head_dim``), in a paged cache of its own
(``kernels.mla_ref``: ``[num_blocks, block_size, R + P]``, the family's ``kv_cache_shapes``).

Every step runs absorbed (prefill chunks and decodes alike): ``kv_b_proj`` is split at load into its key half
``uk [heads, qk_nope_head_dim, R]`` and value half ``uv [heads, R, v_head_dim]``, head-major so that both
absorptions are batched matmuls over whole weights (slicing one ``kv_b`` per step copied both halves every
step); the queries' no-rope part is projected into the latent space (``q_nope · W_UK``), the
attention runs over the latent pages (``kernels.ops.mla_attention``; a prefill chunk in tiles of a few tokens
that share each page load), and its latent output is projected back with ``W_UV`` before ``o_proj``. The
alternative for prefill, decompressing K/V per chunk for the GQA prefill kernel, would have to decompress every
cached page a chunk attends to (the prefix and the earlier chunks live in the cache as latents) and pad V to the
key width.

Weights (``[in, out]``): ``q`` (no q LoRA) or ``q_a`` → ``q_a_norm`` → ``q_b``; ``kv_a`` (``kv_a_proj_with_mqa``),
``kv_a_norm``, ``uk`` / ``uv`` (``kv_b_proj``'s halves); ``o``. With a q LoRA, ``q_a`` and ``kv_a`` read the
same input and are loaded side by side as one ``fused_qkv_a [hidden, q_lora_rank + R + P]`` (vLLM's
``fused_qkv_a_proj``; ``MLASpec.fused_qkv_a``): one GEMM per layer instead of two, its output split after it.
Under tensor parallelism ``q``/``q_b``/``uk``/``uv`` are split by heads (whole heads per device), ``o``
row-parallel, ``q_a``/``kv_a`` (or ``fused_qkv_a``) and the norms replicated, and so is the latent cache
(``parallel.attention.write_latent_and_attend`` says why).

Numerics as HF transformers: q/kv LoRA norms with eps 1e-6 (their modules' default, not ``rms_norm_eps``); the
rotary part interleaved or not as the config says; the softmax scale ``qk_head_dim ** -0.5`` times YaRN's
``mscale(factor, mscale_all_dim) ** 2``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve import envs, parallel
from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.parallel import attention as tp_attention

from .linear import linear
from .norms import rms_norm
from .rotary import Rotary

TP = "tp"
COLUMN, ROW, HEADS = (None, TP), (TP, None), (TP, None, None)
LORA_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class MLASpec:
    """The latent attention's shapes (hashable: part of ``DecoderSpec``)."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    fused_qkv_a: bool = False       # q_a and kv_a as one weight (a q LoRA, and a checkpoint whose form allows it)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Values cached per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def declare_params(layer, hidden: int, num_heads: int, spec: MLASpec, param: Callable) -> None:
    """The attention weights of one decoder layer, declared on it (flat, like the layer's other weights)."""
    if spec.fused_qkv_a:
        layer.fused_qkv_a = param((hidden, spec.q_lora_rank + spec.latent_width), ())
    elif spec.q_lora_rank:
        layer.q_a = param((hidden, spec.q_lora_rank), ())
    if spec.q_lora_rank:
        layer.q_a_norm = param((spec.q_lora_rank,), (), "ones")
        layer.q_b = param((spec.q_lora_rank, num_heads * spec.qk_head_dim), COLUMN)
    else:
        layer.q = param((hidden, num_heads * spec.qk_head_dim), COLUMN)
    if not spec.fused_qkv_a:
        layer.kv_a = param((hidden, spec.latent_width), ())
    layer.kv_a_norm = param((spec.kv_lora_rank,), (), "ones")
    layer.uk = param((num_heads, spec.qk_nope_head_dim, spec.kv_lora_rank), HEADS)
    layer.uv = param((num_heads, spec.kv_lora_rank, spec.v_head_dim), HEADS)
    layer.o = param((num_heads * spec.v_head_dim, hidden), ROW)


def readers(w: dict, spec: MLASpec) -> tuple:
    """The projections that read the attention norm's output."""
    if spec.fused_qkv_a:
        return (w["fused_qkv_a"],)
    return (w["q_a"] if spec.q_lora_rank else w["q"], w["kv_a"])


def attention(h: jax.Array, w: dict, spec: MLASpec, num_heads: int, rotary: Rotary, cos_sin, cache: tuple,
              md: AttentionMetadata, *, sm_scale: float, backend: str) -> tuple[jax.Array, tuple]:
    """MLA of the normed input ``h [T, hidden]`` up to (not including) ``o``: ``(attn [T, heads * v_head_dim],
    (latent_cache,))``; ``w`` the layer's weights by name."""
    t, heads, r, dn = h.shape[0], num_heads, spec.kv_lora_rank, spec.qk_nope_head_dim
    cos, sin = cos_sin
    if spec.fused_qkv_a:         # [q_a | c_kv | k_rope]: each part sliced from it once
        kv = linear(h, w["fused_qkv_a"])
        q_a, c = kv[:, :spec.q_lora_rank], spec.q_lora_rank
    else:
        q_a = linear(h, w["q_a"]) if spec.q_lora_rank else None
        kv, c = linear(h, w["kv_a"]), 0
    if spec.q_lora_rank:
        q = linear(rms_norm(q_a, w["q_a_norm"], LORA_NORM_EPS), w["q_b"])
    else:
        q = linear(h, w["q"])
    q = q.reshape(t, heads, spec.qk_head_dim)
    c_kv = rms_norm(kv[:, c:c + r], w["kv_a_norm"], LORA_NORM_EPS)
    if parallel.current_tp_mesh() is None:
        # the shared key as head ``heads`` beside the queries: one rotation for both. Under a mesh q is split
        # on heads and the join would reshard it, so each is rotated alone.
        rope = rotary.apply(jnp.concatenate([q[..., dn:], kv[:, None, c + r:]], axis=1), cos, sin)
        q_rope, k_rope = rope[:, :heads], rope[:, heads]
    else:
        q_rope, k_rope = rotary.apply(q[..., dn:], cos, sin), rotary.apply(kv[:, None, c + r:], cos, sin)[:, 0]
    q_latent = jnp.einsum("thd,hdr->thr", q[..., :dn], w["uk"])
    latent = jnp.concatenate([c_kv, k_rope], axis=-1)
    out, latent_cache = tp_attention.write_latent_and_attend(q_latent, q_rope, latent, cache[0], md,
                                                             sm_scale=sm_scale, kv_lora_rank=r, backend=backend,
                                                             prefill=envs.JAXSERVE_MLA_PREFILL,
                                                             decode=envs.JAXSERVE_MLA_DECODE)
    attn = jnp.einsum("thr,hrv->thv", out, w["uv"])
    return attn.reshape(t, heads * spec.v_head_dim), (latent_cache,)
