"""The Llama family (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, SmolLM2) as pure functions over a weight pytree.

Why pure functions over a nested dict rather than ``flax.nnx`` modules:
- Sharding is data. ``param_partition_specs(cfg)`` is a second pytree of the same structure; the loader
  places each weight with ``NamedSharding(mesh, spec)`` and the jitted step needs no module surgery or
  ``nnx.split``/``merge`` round trip to see the arrays it is given.
- Donation is simple. The jitted step takes ``(params, kv_caches, ...)`` as plain pytrees and donates the
  caches (``donate_argnums``); there is no module state that could alias or be captured by a closure.
- No scan. Layers are a Python list unrolled at trace time: a ``lax.scan`` over stacked layers with a
  scan-carried cache cost 2.2x per decode step on the H200 (../shared/ARCHITECTURE.md), and a list of
  per-layer dicts is also what the loader streams tensor by tensor.
nnx would buy parameter bookkeeping we do not need for inference-only code with one family per file.

Weight layout (``param_shapes``): matmul weights are ``[in, out]`` so the step never transposes;
``gate_up`` is the fused MLP input projection ``[hidden, 2, intermediate]`` (gate then up), fused along a
separate axis so tensor parallelism can still shard ``intermediate``; q/k/v stay separate because they
have different widths under GQA and a fused column split would not line up with head shards.

Numerics follow HF transformers: compute in the parameter dtype; RMSNorm statistics, RoPE angles and the
attention softmax in float32; logits in float32.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve import parallel
# kernels.ops's write_kv_and_attend, wrapped in shard_map over "tp" when the step runs under a mesh
# (jaxserve.parallel.bind_mesh); identical to kernels.ops otherwise.
from jaxserve.parallel import attention as tp_attention

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
TP_AXIS = "tp"


def check_config(cfg: ModelConfig) -> None:
    """Refuse the configs this implementation would silently get wrong."""
    if cfg.hidden_act != "silu":
        raise ModelLoadError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
    if cfg.mlp_bias:
        raise ModelLoadError("mlp_bias=true is not supported")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelLoadError(f"num_attention_heads {cfg.num_heads} is not a multiple of "
                             f"num_key_value_heads {cfg.num_kv_heads}")


# ---------------------------------------------------------------------------------------------- weights
def param_shapes(cfg: ModelConfig) -> dict:
    """The weight pytree's structure with a shape tuple at each leaf."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    layer = {"attn_norm": (h,), "q": (h, q_out), "k": (h, kv_out), "v": (h, kv_out), "o": (q_out, h),
             "mlp_norm": (h,), "gate_up": (h, 2, i), "down": (i, h)}
    if cfg.attention_bias:
        layer |= {"q_bias": (q_out,), "k_bias": (kv_out,), "v_bias": (kv_out,)}
    params = {"embed": (cfg.vocab_size, h), "layers": [dict(layer) for _ in range(cfg.num_layers)],
              "final_norm": (h,)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = (h, cfg.vocab_size)
    return params


_LAYER_SPECS = {
    "attn_norm": P(), "mlp_norm": P(),
    "q": P(None, TP_AXIS), "k": P(None, TP_AXIS), "v": P(None, TP_AXIS),            # column-parallel
    "q_bias": P(TP_AXIS), "k_bias": P(TP_AXIS), "v_bias": P(TP_AXIS),
    "gate_up": P(None, None, TP_AXIS),                                                # column-parallel
    "o": P(TP_AXIS, None), "down": P(TP_AXIS, None),                                  # row-parallel
}


def param_partition_specs(cfg: ModelConfig) -> dict:
    """Megatron tensor-parallel ``PartitionSpec`` of each weight over the mesh axis ``"tp"``, same tree as
    ``param_shapes``: q/k/v/gate/up column-parallel, o/down row-parallel, embedding and lm_head
    vocab-parallel, norms replicated."""
    shapes = param_shapes(cfg)
    specs = {"embed": P(TP_AXIS, None), "final_norm": P(),
             "layers": [{name: _LAYER_SPECS[name] for name in layer} for layer in shapes["layers"]]}
    if "lm_head" in shapes:
        specs["lm_head"] = P(None, TP_AXIS)
    return specs


def init_dummy_params(cfg: ModelConfig, dtype, *, seed: int = 0, mesh=None) -> dict:
    """Random weights (normal, std 0.02; norms = 1) of the right shapes, generated on device."""
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    leaves, _ = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=is_shape)
    if mesh is not None:
        from jaxserve.parallel import param_shardings  # noqa: PLC0415  (whole kv heads when tp > kv heads)
        sharding_leaves = jax.tree.leaves(param_shardings(param_partition_specs(cfg), mesh, cfg))
    else:
        sharding_leaves = [None] * len(leaves)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for (path, shape), sharding, key in zip(leaves, sharding_leaves, keys):
        kind = "ones" if str(path[-1].key).endswith("norm") else "normal"
        out.append(_dummy_init_fn(kind, shape, jnp.dtype(dtype), sharding)(key))
    return jax.tree.unflatten(jax.tree.structure(param_shapes(cfg), is_leaf=is_shape), out)


@functools.lru_cache(maxsize=64)
def _dummy_init_fn(kind: str, shape: tuple, dtype, sharding):
    """One jitted generator per (kind, shape, dtype, sharding): a 32-layer model compiles ~8, not ~290."""
    if kind == "ones":
        return jax.jit(lambda key: jnp.ones(shape, dtype), out_shardings=sharding)
    return jax.jit(lambda key: jax.random.normal(key, shape, dtype) * jnp.asarray(0.02, dtype),
                   out_shardings=sharding)


# ------------------------------------------------------------------------------------------------- RoPE
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies ``[head_dim // 2]`` in float32, computed as transformers does (incl. llama3 and
    linear scaling), once at trace time."""
    d = cfg.head_dim
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d))))
    inv = inv.astype(np.float32)
    scaling = cfg.rope_scaling_dict
    if not scaling:
        return inv
    kind = scaling["rope_type"]
    if kind == "freq_factors":   # GGUF rope_freqs.weight: llama.cpp divides each frequency by its factor
        return (inv / np.asarray(scaling["factors"], np.float32)).astype(np.float32)
    if kind == "linear":
        return (inv / np.float32(scaling["factor"])).astype(np.float32)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling.get("original_max_position_embeddings", cfg.max_position_embeddings))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
        smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise ModelLoadError(f"rope type {kind!r} is not supported")


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[T, 1, head_dim]`` for the step's positions: angles in float32, cast to the compute dtype."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF's rotate-half RoPE on ``x [T, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------------- forward
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF LlamaRMSNorm: statistics in float32, normalised value cast back before the weight multiply."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def forward(params: dict, kv_caches: list, input_ids: jax.Array, positions: jax.Array,
            md: AttentionMetadata, cfg: ModelConfig, *, attn_backend: str = "reference"):
    """One ragged step: ``input_ids``/``positions`` ``[T]`` int32 → ``(hidden [T, hidden_size], kv_caches)``.

    Each layer writes the step's K/V into its paged cache, then attends through ``md``'s block tables.
    """
    t = input_ids.shape[0]
    hq, hkv, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    x = jnp.take(params["embed"], input_ids, axis=0)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(cfg), x.dtype)
    sm_scale = d ** -0.5
    new_caches = []
    layers = params["layers"]
    # each row-parallel projection is followed by the residual add and the next norm (the next layer's
    # attention norm, after the last layer the final norm): one call, so TP's all-reduce can fuse them
    next_norms = [lp["attn_norm"] for lp in layers[1:]] + [params["final_norm"]]
    h = rms_norm(x, layers[0]["attn_norm"], eps)
    for lp, next_norm, (k_cache, v_cache) in zip(layers, next_norms, kv_caches):
        q, k, v = h @ lp["q"], h @ lp["k"], h @ lp["v"]
        if cfg.attention_bias:
            q, k, v = q + lp["q_bias"], k + lp["k_bias"], v + lp["v_bias"]
        q = apply_rope(q.reshape(t, hq, d), cos, sin)
        k = apply_rope(k.reshape(t, hkv, d), cos, sin)
        v = v.reshape(t, hkv, d)
        attn, k_cache, v_cache = tp_attention.write_kv_and_attend(
            q, k, v, k_cache, v_cache, md, sm_scale=sm_scale, sliding_window=cfg.sliding_window,
            backend=attn_backend)
        new_caches.append((k_cache, v_cache))
        x, h = parallel.row_parallel_matmul_add_rms_norm(attn.reshape(t, hq * d), lp["o"], x, lp["mlp_norm"],
                                                          eps, rms_norm)
        gate_up = jnp.einsum("th,hci->tci", h, lp["gate_up"])
        act = jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]
        x, h = parallel.row_parallel_matmul_add_rms_norm(act, lp["down"], x, next_norm, eps, rms_norm)
    return h, new_caches


def compute_logits(params: dict, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
    """``hidden [N, hidden_size]`` → logits ``[N, vocab]`` in float32 (float32 accumulation)."""
    if cfg.tie_word_embeddings:
        return jnp.einsum("nh,vh->nv", hidden, params["embed"], preferred_element_type=jnp.float32)
    return jnp.dot(hidden, params["lm_head"], preferred_element_type=jnp.float32)
