"""Llama 3.2 Vision's tower (HF ``MllamaVisionModel``) as ``flax.nnx`` modules.

An image arrives as ``max_num_tiles`` tiles of ``image_size`` pixels (the processor pads an image of fewer
tiles with zero tiles; ``aspect_ratio_mask`` says which are real) and an aspect-ratio id. Each tile: a
stride-``patch`` convolution (a matmul over patches, no bias), the aspect ratio's tanh-gated tile embedding,
a class token, the gated positional embedding (``(1 - tanh g)`` times the patch positions plus ``tanh g``
times the aspect ratio's per-tile positions), a LayerNorm; then every tile's ``num_patches`` positions padded
to a multiple of 8 and all tiles attend together: the local transformer (CLIP-style blocks, no attention
bias), a LayerNorm, the post-tile embedding, the global transformer (blocks with tanh gates on attention
and MLP). The output per position: the global transformer's state, then the local transformer's states
after ``intermediate_layers_indices`` interleaved (HF stacks them on a last axis and flattens it):
``[tiles * num_patches, hidden * (1 + len(intermediate))]`` per image.

Attention mask, exactly HF's ``_prepare_aspect_ratio_attention_mask``: a key is hidden from a query only when
both are padding (a padding patch or a padding tile), so real positions see padding too.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from .decoder import COLUMN, COLUMN_BIAS, REPLICATED, ROW, _param, _w
from .vision import _attend, _fc_mlp, attention_implementation, layer_norm

EDGE_NORM_EPS = 1e-5                 # layernorm_pre / layernorm_post: torch's LayerNorm default


@dataclasses.dataclass(frozen=True)
class MllamaVisionSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_global_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    max_num_tiles: int
    max_aspect_ratio_id: int
    intermediate_layers: tuple[int, ...]
    num_channels: int = 3
    eps: float = 1e-5
    activation: str = "gelu"

    @classmethod
    def from_hf(cls, v: dict) -> "MllamaVisionSpec":
        return cls(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                   num_layers=v["num_hidden_layers"], num_global_layers=v["num_global_layers"],
                   num_heads=v["attention_heads"], image_size=v["image_size"], patch_size=v["patch_size"],
                   max_num_tiles=v["max_num_tiles"], max_aspect_ratio_id=len(v["supported_aspect_ratios"]),
                   intermediate_layers=tuple(v["intermediate_layers_indices"]), num_channels=v["num_channels"],
                   eps=v["norm_eps"], activation=v["hidden_act"])

    @property
    def num_patches(self) -> int:
        """Positions per tile: the patches and the class token."""
        return (self.image_size // self.patch_size) ** 2 + 1

    @property
    def padded_patches(self) -> int:
        return -(-self.num_patches // 8) * 8

    @property
    def output_dim(self) -> int:
        return self.hidden_size * (1 + len(self.intermediate_layers))

    @property
    def tokens_per_image(self) -> int:
        """Cross-attention keys per image: every tile's positions, padding tiles included."""
        return self.max_num_tiles * self.num_patches


class MllamaVisionLayer(nnx.Module):
    def __init__(self, spec: MllamaVisionSpec, gated: bool):
        d, i = spec.hidden_size, spec.intermediate_size
        self.spec, self.gated = spec, gated
        self.norm1, self.norm1_bias = _param((d,), REPLICATED, "ones"), _param((d,), REPLICATED, "zeros")
        self.wq, self.wk, self.wv = (_param((d, d), COLUMN) for _ in range(3))
        self.wo = _param((d, d), ROW)
        self.norm2, self.norm2_bias = _param((d,), REPLICATED, "ones"), _param((d,), REPLICATED, "zeros")
        self.fc1, self.fc1_bias = _param((d, i), COLUMN), _param((i,), COLUMN_BIAS, "zeros")
        self.fc2, self.fc2_bias = _param((i, d), ROW), _param((d,), REPLICATED, "zeros")
        if gated:
            self.gate_attn, self.gate_ffn = _param((1,), REPLICATED), _param((1,), REPLICATED)

    def __call__(self, x: jax.Array, sees: jax.Array) -> jax.Array:
        spec = self.spec
        b, n, d = x.shape
        h = layer_norm(x, _w(self.norm1), _w(self.norm1_bias), spec.eps)
        q, k, v = ((h @ _w(w)).reshape(b, n, spec.num_heads, d // spec.num_heads) for w in (self.wq, self.wk, self.wv))
        a = _attend(q, k, v, sees, attention_implementation(q)) @ _w(self.wo)
        if self.gated:
            a = jnp.tanh(_w(self.gate_attn)).astype(a.dtype) * a
        x = x + a
        h = layer_norm(x, _w(self.norm2), _w(self.norm2_bias), spec.eps)
        m = _fc_mlp(self, h, spec.activation)
        if self.gated:
            m = jnp.tanh(_w(self.gate_ffn)).astype(m.dtype) * m
        return x + m


class MllamaVisionTower(nnx.Module):
    def __init__(self, spec: MllamaVisionSpec):
        d, p, t, n = spec.hidden_size, spec.patch_size, spec.max_num_tiles, spec.num_patches
        ids = spec.max_aspect_ratio_id + 1
        self.spec = spec
        self.patch_embed = _param((spec.num_channels * p * p, d), REPLICATED)
        self.class_embed = _param((d,), REPLICATED)
        self.pos_embed, self.pos_gate = _param((n, d), REPLICATED), _param((1,), REPLICATED)
        self.tile_pos_embed = _param((ids, t * n * d), REPLICATED)
        self.pre_tile_embed, self.pre_tile_gate = _param((ids, t * d), REPLICATED), _param((1,), REPLICATED)
        self.post_tile_embed, self.post_tile_gate = _param((ids, t * d), REPLICATED), _param((1,), REPLICATED)
        self.pre_norm, self.pre_norm_bias = _param((d,), REPLICATED, "ones"), _param((d,), REPLICATED, "zeros")
        self.post_norm, self.post_norm_bias = _param((d,), REPLICATED, "ones"), _param((d,), REPLICATED, "zeros")
        self.layers = nnx.List([MllamaVisionLayer(spec, False) for _ in range(spec.num_layers)])
        self.global_layers = nnx.List([MllamaVisionLayer(spec, True) for _ in range(spec.num_global_layers)])

    def _tile_embedding(self, table, gate, ar_ids: jax.Array, x: jax.Array) -> jax.Array:
        b, t = x.shape[:2]
        emb = _w(table)[ar_ids].reshape(b, t, 1, -1).astype(x.dtype)
        return x + emb * jnp.tanh(_w(gate)).astype(x.dtype)

    def __call__(self, pixel_values: jax.Array, ar_ids: jax.Array, ar_mask: jax.Array) -> jax.Array:
        """``pixel_values [B, tiles, C, H, W]``, ``ar_ids [B]``, ``ar_mask [B, tiles]`` → the vision states
        ``[B, tiles * num_patches, output_dim]``."""
        spec = self.spec
        w = _w(self.patch_embed)
        b, t, c, hgt, wid = pixel_values.shape
        p, d, n, npad = spec.patch_size, spec.hidden_size, spec.num_patches, spec.padded_patches
        patches = pixel_values.astype(w.dtype).reshape(b, t, c, hgt // p, p, wid // p, p)
        patches = patches.transpose(0, 1, 3, 5, 2, 4, 6).reshape(b, t, (hgt // p) * (wid // p), c * p * p)
        x = self._tile_embedding(self.pre_tile_embed, self.pre_tile_gate, ar_ids, patches @ w)
        cls = jnp.broadcast_to(_w(self.class_embed).astype(x.dtype), (b, t, 1, d))
        x = jnp.concatenate([cls, x], axis=2)
        gate = jnp.tanh(_w(self.pos_gate)).astype(x.dtype)
        x = x + (1 - gate) * _w(self.pos_embed).astype(x.dtype)
        x = x + gate * _w(self.tile_pos_embed)[ar_ids].reshape(b, t, n, d).astype(x.dtype)
        x = layer_norm(x, _w(self.pre_norm), _w(self.pre_norm_bias), EDGE_NORM_EPS)
        x = jnp.pad(x, ((0, 0), (0, 0), (0, npad - n), (0, 0)))
        pad = ~((ar_mask[:, :, None] > 0) & (jnp.arange(npad) < n)[None, None]).reshape(b, t * npad)
        sees = ~(pad[:, :, None] & pad[:, None, :])
        x = x.reshape(b, t * npad, d)
        kept = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, sees)
            kept[i] = x
        x = layer_norm(x, _w(self.post_norm), _w(self.post_norm_bias), EDGE_NORM_EPS)
        x = self._tile_embedding(self.post_tile_embed, self.post_tile_gate, ar_ids, x.reshape(b, t, npad, d))
        x = x.reshape(b, t * npad, d)
        for layer in self.global_layers:
            x = layer(x, sees)
        inter = jnp.stack([kept[i] for i in spec.intermediate_layers], axis=-1)
        out = jnp.concatenate([x.reshape(b, t, npad, d), inter.reshape(b, t, npad, -1)], axis=-1)
        return out[:, :, :n].reshape(b, t * n, spec.output_dim)


def tower_weight_plan(spec: MllamaVisionSpec, prefix: str) -> list:
    """``weight_plan`` entries of a ``MllamaVisionTower`` at ``("vision", ...)`` from HF names under ``prefix``."""
    names = [("patch_embed", "patch_embedding.weight", "patch_t"), ("class_embed", "class_embedding", "same"),
             ("pos_embed", "gated_positional_embedding.embedding", "same"),
             ("pos_gate", "gated_positional_embedding.gate", "same"),
             ("tile_pos_embed", "gated_positional_embedding.tile_embedding.weight", "same"),
             ("pre_tile_embed", "pre_tile_positional_embedding.embedding.weight", "same"),
             ("pre_tile_gate", "pre_tile_positional_embedding.gate", "same"),
             ("post_tile_embed", "post_tile_positional_embedding.embedding.weight", "same"),
             ("post_tile_gate", "post_tile_positional_embedding.gate", "same"),
             ("pre_norm", "layernorm_pre.weight", "same"), ("pre_norm_bias", "layernorm_pre.bias", "same"),
             ("post_norm", "layernorm_post.weight", "same"), ("post_norm_bias", "layernorm_post.bias", "same")]
    plan = [(("vision", ours), [prefix + theirs], build) for ours, theirs, build in names]
    for group, hf_group, count, gated in (("layers", "transformer", spec.num_layers, False),
                                          ("global_layers", "global_transformer", spec.num_global_layers, True)):
        for i in range(count):
            layer = _layer_names(f"{prefix}{hf_group}.layers.{i}.", gated)
            plan += [(("vision", group, i, w), hf, build) for w, (build, hf) in layer.items()]
    return plan


def _layer_names(prefix: str, gated: bool) -> dict:
    names = {"norm1": ("same", "input_layernorm.weight"), "norm1_bias": ("same", "input_layernorm.bias"),
             "norm2": ("same", "post_attention_layernorm.weight"),
             "norm2_bias": ("same", "post_attention_layernorm.bias"),
             "wq": ("t", "self_attn.q_proj.weight"), "wk": ("t", "self_attn.k_proj.weight"),
             "wv": ("t", "self_attn.v_proj.weight"), "wo": ("t", "self_attn.o_proj.weight"),
             "fc1": ("t", "mlp.fc1.weight"), "fc1_bias": ("same", "mlp.fc1.bias"),
             "fc2": ("t", "mlp.fc2.weight"), "fc2_bias": ("same", "mlp.fc2.bias")}
    if gated:
        names |= {"gate_attn": ("same", "gate_attn"), "gate_ffn": ("same", "gate_ffn")}
    return {k: (build, [prefix + v]) for k, (build, v) in names.items()}

