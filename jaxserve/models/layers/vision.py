"""Vision transformers as ``flax.nnx`` modules: the ViT blocks CLIP and SigLIP share, and the MLP projector
that maps their features into a text model's embedding space (Qwen's tower: ``qwen_vision``).

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

from jaxserve import envs

from .decoder import COLUMN, COLUMN_BIAS, REPLICATED, ROW, _param, _w

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


def attention_implementation(q: jax.Array | None = None) -> str | None:
    """``"cudnn"`` where the towers attend through cuDNN's fused attention (``JAXSERVE_VISION_ATTENTION`` auto or
    cudnn, on a GPU: no ``N x N`` float32 scores and softmax in device memory; at 6,144 patches and 16 heads
    those are 2.4 GB written and read back per full-attention block); ``"xla"`` where asked for (the same
    call's XLA path, on any backend); else None (dense scores). Given the queries ``q [..., heads, head_dim]``,
    None where cuDNN's kernel cannot take them (it takes 16-bit inputs and head sizes that are multiples of 8
    up to 128)."""
    chosen = envs.JAXSERVE_VISION_ATTENTION
    if chosen == "xla":
        return "xla"
    if chosen not in ("auto", "cudnn") or jax.default_backend() != "gpu":
        return None
    if q is not None and (q.dtype not in (jnp.bfloat16, jnp.float16) or q.shape[-1] % 8 or q.shape[-1] > 128):
        return None
    return "cudnn"


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None,
            implementation: str | None = None) -> jax.Array:
    """Bidirectional attention ``[B, N, heads * head_dim]``: scores and softmax in float32 (as HF's eager
    path); ``mask [B, N, N]``: which keys each query sees (every query at least itself). ``implementation``
    ``attention_implementation(q)``'s: ``jax.nn.dot_product_attention``, the mask as the kernel's bias, the
    softmax in float32 inside the kernel."""
    b, n, heads, hd = q.shape
    if implementation is not None:
        out = jax.nn.dot_product_attention(q, k, v, mask=None if mask is None else mask[:, None],
                                           implementation=implementation)
        return out.reshape(b, n, heads * hd)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * hd ** -0.5
    if mask is not None:
        scores = jnp.where(mask[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, heads * hd)


def _fc_mlp(layer, h: jax.Array, activation: str) -> jax.Array:
    """``fc2(act(fc1(h)))`` with biases: a module's ``fc1`` / ``fc2`` weights."""
    h = VISION_ACTIVATIONS[activation](h @ _w(layer.fc1) + _w(layer.fc1_bias))
    return h @ _w(layer.fc2) + _w(layer.fc2_bias)


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
        x = x + _attend(q, k, v, implementation=attention_implementation(q)) @ _w(self.wo) + _w(self.wo_bias)
        h = layer_norm(x, _w(self.norm2), _w(self.norm2_bias), spec.eps)
        return x + _fc_mlp(self, h, spec.activation)


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
