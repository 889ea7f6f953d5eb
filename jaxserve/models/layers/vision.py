"""Vision transformers as ``flax.nnx`` modules: the ViT blocks CLIP and SigLIP share, and the MLP projector
that maps their features into a text model's embedding space; Qwen2.5-VL's blocks (RMSNorm, SwiGLU, 2-D
rotary, attention within windows or the whole image) and its 2x2 patch merger.

A ``VisionSpec`` (hashable, from a family's vision config) says what differs: CLIP has a class token and a
LayerNorm before the blocks and quick-GELU MLPs; SigLIP has neither, a tanh-GELU and a LayerNorm after the
blocks. ``num_layers_run`` stops after the layer whose output the family reads (LLaVA's
``vision_feature_layer = -2``: the last block never runs).

Weights follow the decoder's rules (``layers.decoder``): each declared once with its tensor-parallel layout
(q/k/v and fc1 column-parallel, o and fc2 row-parallel, embeddings and norms replicated), matmul weights
``[in, out]``; the patch embedding (a stride-``patch`` convolution in HF) is a ``[channels * patch * patch,
hidden]`` matmul over patches flattened channel-major. Under a mesh the encoder is one jitted function of
sharded weights: XLA partitions it (heads split over ``"tp"``, one all-reduce after o and after fc2).
Numerics as HF: compute in the parameter dtype, LayerNorm statistics and the softmax in float32.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

import numpy as np

from .decoder import COLUMN, COLUMN_BIAS, REPLICATED, ROW, _param, _w
from .norms import rms_norm

# what a family keeps of an HF CLIP / SigLIP vision config (``VisionSpec.from_hf``)
VISION_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
               "patch_size", "num_channels", "layer_norm_eps", "hidden_act")
VISION_ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


@dataclasses.dataclass(frozen=True)
class VisionSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int                  # the checkpoint's blocks (all are loaded)
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    eps: float = 1e-5
    activation: str = "quick_gelu"
    class_token: bool = True         # CLIP: a class embedding before the patches
    patch_bias: bool = False         # SigLIP: the patch convolution has a bias
    pre_norm: bool = True            # CLIP's ``pre_layrnorm``
    post_norm: bool = False          # SigLIP's ``post_layernorm`` on the features
    num_layers_run: int | None = None   # blocks run (the feature layer's); None: all

    @classmethod
    def from_hf(cls, v: dict, **kw) -> "VisionSpec":
        """Of an HF CLIP / SigLIP vision config (``VISION_KEYS`` of it); ``kw``: what the family sets."""
        return cls(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                   num_layers=int(v["num_hidden_layers"]), num_heads=v["num_attention_heads"],
                   image_size=v["image_size"], patch_size=v["patch_size"], num_channels=v["num_channels"],
                   eps=v["layer_norm_eps"], activation=v["hidden_act"], **kw)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        return self.num_patches + (1 if self.class_token else 0)


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def _qkv(layer, h: jax.Array, heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A layer's q, k, v ``[B, N, heads, head_dim]`` of ``h [B, N, hidden]`` (its wq/wk/wv and biases)."""
    b, n, d = h.shape
    return tuple((h @ _w(getattr(layer, w)) + _w(getattr(layer, w + "_bias"))).reshape(b, n, heads, d // heads)
                 for w in ("wq", "wk", "wv"))


def _attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Bidirectional attention ``[B, N, heads * head_dim]``: scores and softmax in float32 (as HF's eager
    path)."""
    b, n, heads, hd = q.shape
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * hd ** -0.5
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, heads * hd)


def _attend_windows(q: jax.Array, k: jax.Array, v: jax.Array, windows: tuple) -> jax.Array:
    """Attention within windows of consecutive rows: ``windows`` = (``gather [W, S]``: each window's rows,
    padded with N; ``valid [W, S]``; ``back [N]``: each row's place in the flattened windows). Costs
    ``N * S``, not ``N * N``."""
    gather, valid, back = windows
    b, n, heads, hd = q.shape

    def blocks(t):
        return jnp.concatenate([t, jnp.zeros((b, 1, heads, hd), t.dtype)], axis=1)[:, gather]

    qw, kw, vw = blocks(q), blocks(k), blocks(v)                    # [B, W, S, heads, hd]
    scores = jnp.einsum("bwqhd,bwkhd->bwhqk", qw, kw, preferred_element_type=jnp.float32) * hd ** -0.5
    scores = jnp.where(jnp.asarray(valid)[None, :, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bwhqk,bwkhd->bwqhd", probs, vw).reshape(b, -1, heads * hd)
    return out[:, back]


class VisionLayer(nnx.Module):
    def __init__(self, spec: VisionSpec):
        d, i = spec.hidden_size, spec.intermediate_size
        self.spec = spec
        self.norm1, self.norm1_bias = _param((d,), REPLICATED, "ones"), _param((d,), REPLICATED, "zeros")
        # (not "q"/"k"/"v": those names are the decoder's, whose kv heads tensor parallelism may replicate)
        self.wq, self.wk, self.wv = (_param((d, d), COLUMN) for _ in range(3))
        self.wq_bias, self.wk_bias, self.wv_bias = (_param((d,), COLUMN_BIAS, "zeros") for _ in range(3))
        self.wo, self.wo_bias = _param((d, d), ROW), _param((d,), REPLICATED, "zeros")
        self.norm2, self.norm2_bias = _param((d,), REPLICATED, "ones"), _param((d,), REPLICATED, "zeros")
        self.fc1, self.fc1_bias = _param((d, i), COLUMN), _param((i,), COLUMN_BIAS, "zeros")
        self.fc2, self.fc2_bias = _param((i, d), ROW), _param((d,), REPLICATED, "zeros")

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [B, N, hidden]``: bidirectional self-attention over each image's patches, then the MLP."""
        spec = self.spec
        h = layer_norm(x, _w(self.norm1), _w(self.norm1_bias), spec.eps)
        q, k, v = _qkv(self, h, spec.num_heads)
        x = x + _attend(q, k, v) @ _w(self.wo) + _w(self.wo_bias)
        h = layer_norm(x, _w(self.norm2), _w(self.norm2_bias), spec.eps)
        h = VISION_ACTIVATIONS[spec.activation](h @ _w(self.fc1) + _w(self.fc1_bias))
        return x + h @ _w(self.fc2) + _w(self.fc2_bias)


class VisionTransformer(nnx.Module):
    def __init__(self, spec: VisionSpec):
        d, p = spec.hidden_size, spec.patch_size
        self.spec = spec
        self.patch_embed = _param((spec.num_channels * p * p, d), REPLICATED)
        if spec.patch_bias:
            self.patch_bias = _param((d,), REPLICATED, "zeros")
        if spec.class_token:
            self.class_embed = _param((d,), REPLICATED)
        self.pos_embed = _param((spec.num_positions, d), REPLICATED)
        if spec.pre_norm:
            self.pre_norm, self.pre_norm_bias = _param((d,), REPLICATED, "ones"), _param((d,), REPLICATED, "zeros")
        self.layers = nnx.List([VisionLayer(spec) for _ in range(spec.num_layers)])
        if spec.post_norm:
            self.post_norm, self.post_norm_bias = (_param((d,), REPLICATED, "ones"),
                                                   _param((d,), REPLICATED, "zeros"))

    def __call__(self, pixel_values: jax.Array) -> jax.Array:
        """``pixel_values [B, C, H, W]`` → features ``[B, positions, hidden]`` after ``num_layers_run`` blocks."""
        spec = self.spec
        w = _w(self.patch_embed)
        b, c, hgt, wid = pixel_values.shape
        p = spec.patch_size
        patches = pixel_values.astype(w.dtype).reshape(b, c, hgt // p, p, wid // p, p)
        patches = patches.transpose(0, 2, 4, 1, 3, 5).reshape(b, (hgt // p) * (wid // p), c * p * p)
        x = patches @ w
        if spec.patch_bias:
            x = x + _w(self.patch_bias)
        if spec.class_token:
            cls = jnp.broadcast_to(_w(self.class_embed).astype(x.dtype), (b, 1, x.shape[-1]))
            x = jnp.concatenate([cls, x], axis=1)
        x = x + _w(self.pos_embed)[None, :x.shape[1]].astype(x.dtype)
        if spec.pre_norm:
            x = layer_norm(x, _w(self.pre_norm), _w(self.pre_norm_bias), spec.eps)
        run = spec.num_layers if spec.num_layers_run is None else spec.num_layers_run
        for layer in list(self.layers)[:run]:
            x = layer(x)
        if spec.post_norm:
            x = layer_norm(x, _w(self.post_norm), _w(self.post_norm_bias), spec.eps)
        return x


class Projector(nnx.Module):
    """LLaVA's multi-modal projector: ``linear_2(act(linear_1(features)))`` into the text hidden size."""

    def __init__(self, vision_size: int, text_size: int, activation: str):
        self.activation = activation
        self.linear_1, self.linear_1_bias = _param((vision_size, text_size), COLUMN), \
            _param((text_size,), COLUMN_BIAS, "zeros")
        self.linear_2, self.linear_2_bias = _param((text_size, text_size), ROW), \
            _param((text_size,), REPLICATED, "zeros")

    def __call__(self, x: jax.Array) -> jax.Array:
        h = VISION_ACTIVATIONS[self.activation](x @ _w(self.linear_1) + _w(self.linear_1_bias))
        return h @ _w(self.linear_2) + _w(self.linear_2_bias)


def axial_rotary(grid_h: int, grid_w: int, head_dim: int, theta: float, merge: int) -> tuple[np.ndarray, ...]:
    """Qwen2-VL's 2-D rotary of a ``grid_h x grid_w`` patch grid, patches in ``merge x merge`` block order (the
    patch merger's): cos/sin ``[N, head_dim]`` float32, the first quarter of the frequencies turned by the
    patch's row, the second by its column, the halves repeated (rotate-half style)."""
    dim = head_dim // 2
    inv = (1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))).astype(np.float32)
    hpos, wpos = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    block = (grid_h // merge, merge, grid_w // merge, merge)
    hpos, wpos = (p.reshape(block).transpose(0, 2, 1, 3).reshape(-1) for p in (hpos, wpos))
    freqs = np.concatenate([hpos[:, None] * inv, wpos[:, None] * inv], axis=-1).astype(np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE in float32 (HF's vision rotary), cast back to ``x``'s dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


class GatedVisionLayer(nnx.Module):
    """Qwen2.5-VL's ViT block: RMSNorm, attention with the 2-D rotary (the whole image, or within the
    ``windows`` of ``_attend_windows``), RMSNorm, a SwiGLU MLP with biases."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_heads: int, eps: float = 1e-6):
        d, i = hidden_size, intermediate_size
        self.num_heads, self.eps = num_heads, eps
        self.norm1, self.norm2 = _param((d,), REPLICATED, "ones"), _param((d,), REPLICATED, "ones")
        self.wq, self.wk, self.wv = (_param((d, d), COLUMN) for _ in range(3))
        self.wq_bias, self.wk_bias, self.wv_bias = (_param((d,), COLUMN_BIAS, "zeros") for _ in range(3))
        self.wo, self.wo_bias = _param((d, d), ROW), _param((d,), REPLICATED, "zeros")
        self.gate, self.up = _param((d, i), COLUMN), _param((d, i), COLUMN)
        self.gate_bias, self.up_bias = _param((i,), COLUMN_BIAS, "zeros"), _param((i,), COLUMN_BIAS, "zeros")
        self.down, self.down_bias = _param((i, d), ROW), _param((d,), REPLICATED, "zeros")

    def __call__(self, x: jax.Array, cos: np.ndarray, sin: np.ndarray, windows: tuple | None) -> jax.Array:
        h = rms_norm(x, _w(self.norm1), self.eps)
        q, k, v = _qkv(self, h, self.num_heads)
        cos, sin = jnp.asarray(cos), jnp.asarray(sin)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attn = _attend(q, k, v) if windows is None else _attend_windows(q, k, v, windows)
        x = x + attn @ _w(self.wo) + _w(self.wo_bias)
        h = rms_norm(x, _w(self.norm2), self.eps)
        h = jax.nn.silu(h @ _w(self.gate) + _w(self.gate_bias)) * (h @ _w(self.up) + _w(self.up_bias))
        return x + h @ _w(self.down) + _w(self.down_bias)


class PatchMerger(nnx.Module):
    """Qwen2.5-VL's merger: RMSNorm, then each ``merge x merge`` block of patch features (consecutive rows)
    concatenated through ``fc2(gelu(fc1(.)))`` into one token of the text model's width."""

    def __init__(self, vision_size: int, text_size: int, merge: int, eps: float = 1e-6):
        m = vision_size * merge * merge
        self.merge, self.eps = merge, eps
        self.norm = _param((vision_size,), REPLICATED, "ones")
        self.fc1, self.fc1_bias = _param((m, m), COLUMN), _param((m,), COLUMN_BIAS, "zeros")
        self.fc2, self.fc2_bias = _param((m, text_size), ROW), _param((text_size,), REPLICATED, "zeros")

    def __call__(self, x: jax.Array) -> jax.Array:
        b, n, d = x.shape
        h = rms_norm(x, _w(self.norm), self.eps).reshape(b, n // self.merge ** 2, d * self.merge ** 2)
        h = VISION_ACTIVATIONS["gelu"](h @ _w(self.fc1) + _w(self.fc1_bias))
        return h @ _w(self.fc2) + _w(self.fc2_bias)


def tower_weight_plan(spec: VisionSpec, prefix: str) -> list:
    """The ``weight_plan`` entries of a ``VisionTransformer`` at ``("vision", ...)`` from HF CLIP / SigLIP
    tensor names under ``prefix`` (its ``embeddings.`` / ``encoder.`` / norms)."""
    names = [("patch_embed", "embeddings.patch_embedding.weight", "patch_t"),
             ("pos_embed", "embeddings.position_embedding.weight", "same")]
    if spec.patch_bias:
        names.append(("patch_bias", "embeddings.patch_embedding.bias", "same"))
    if spec.class_token:
        names.append(("class_embed", "embeddings.class_embedding", "same"))
    if spec.pre_norm:
        names += [("pre_norm", "pre_layrnorm.weight", "same"), ("pre_norm_bias", "pre_layrnorm.bias", "same")]
    if spec.post_norm:
        names += [("post_norm", "post_layernorm.weight", "same"), ("post_norm_bias", "post_layernorm.bias", "same")]
    plan = [(("vision", ours), [prefix + theirs], build) for ours, theirs, build in names]
    for i in range(spec.num_layers):
        layer = vision_layer_names(f"{prefix}encoder.layers.{i}.")
        plan += [(("vision", "layers", i, w), hf, build) for w, (build, hf) in layer.items()]
    return plan


def vision_layer_names(prefix: str) -> dict:
    """HF CLIP/SigLIP tensor names of one ``VisionLayer``'s weights, relative to ``prefix`` (its layer)."""
    names = {"norm1": "layer_norm1.weight", "norm1_bias": "layer_norm1.bias",
             "norm2": "layer_norm2.weight", "norm2_bias": "layer_norm2.bias"}
    for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "out_proj")):
        names[ours] = f"self_attn.{theirs}.weight"
        names[f"{ours}_bias"] = f"self_attn.{theirs}.bias"
    for fc in ("fc1", "fc2"):
        names[fc], names[f"{fc}_bias"] = f"mlp.{fc}.weight", f"mlp.{fc}.bias"
    return {k: ("t" if not (k.endswith("bias") or k.startswith("norm")) else "same", [prefix + v])
            for k, v in names.items()}
