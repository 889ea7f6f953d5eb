"""BERT-family encoders (BertModel, BertForMaskedLM, sentence-transformers' MiniLM, ...) as pure functions.

Weights are a nested dict of ``jax.Array`` (linear weights stored ``[in, out]``, Q/K/V fused into one
matrix); ``forward`` maps right-padded token ids to the last hidden state. Post-LN layers, absolute
position + token-type embeddings and exact-erf GELU, as HF ``BertModel``. Layers are unrolled in Python.

``load(path, dtype)`` reads a plain HF folder (``config.json``, ``model.safetensors``, tokenizer files, and
the sentence-transformers pooling files when present) and returns a ``LoadedEncoder``.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError

from .pooling import PoolingConfig, read_pooling_config

# the HF architectures this family serves (the module is the registry's record of the family)
architectures = ("BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForPreTraining")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass
class LoadedEncoder:
    """What ``load`` returns and ``Embedder`` consumes."""
    config: ModelConfig
    params: dict
    tokenizer: Any                  # HF tokenizer
    pooling: PoolingConfig
    max_length: int                 # longest input in tokens (special tokens included)
    dtype: Any                      # compute / weight dtype
    source: str                     # the folder loaded
    family: Any = None              # this module (so callers can call family.forward)
    # the decoder LoadedModel's remaining fields, so engine code that reads them works for both
    chat_template: str | None = None
    generation_config: dict = field(default_factory=dict)
    load_format: str = "safetensors"

    def __post_init__(self):
        if self.family is None:
            self.family = sys.modules[__name__]

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def max_model_len(self) -> int:
        return self.max_length


# ------------------------------------------------------------------------------------------------ model
def _layer_norm(x, scale, bias, eps):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _encoder_layer(p, x, lengths, cfg: ModelConfig, eps: float, attn_impl: str | None):
    B, S, H = x.shape
    qkv = x @ p["qkv_w"] + p["qkv_b"]                                 # [B, S, 3H]
    q, k, v = jnp.split(qkv.reshape(B, S, 3 * cfg.num_heads, cfg.head_dim), 3, axis=2)
    # keys past each row's length are masked; softmax runs in float32 inside
    attn = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation=attn_impl)
    attn = attn.reshape(B, S, H) @ p["o_w"] + p["o_b"]
    x = _layer_norm(x + attn, p["attn_ln_scale"], p["attn_ln_bias"], eps)
    h = jax.nn.gelu(x @ p["up_w"] + p["up_b"], approximate=False)      # HF "gelu" is the exact erf form
    h = h @ p["down_w"] + p["down_b"]
    return _layer_norm(x + h, p["mlp_ln_scale"], p["mlp_ln_bias"], eps)


def forward(params: dict, input_ids: jax.Array, lengths: jax.Array, cfg: ModelConfig,
            token_type_ids: jax.Array | None = None, attn_impl: str | None = None) -> jax.Array:
    """Right-padded ``input_ids [B, S]`` with real ``lengths [B]`` -> last hidden state ``[B, S, H]``.

    Positions are ``0..S-1`` (as HF BERT); padded keys are masked, padded query rows are junk the caller
    ignores. ``token_type_ids`` default to zeros (single-segment input, as sentence-transformers sends).
    ``attn_impl``: ``jax.nn.dot_product_attention``'s implementation (None = XLA; "cudnn" on NVIDIA GPUs
    for bfloat16/float16).
    """
    eps = cfg.extra_dict["layer_norm_eps"]
    e = params["embed"]
    S = input_ids.shape[1]
    if token_type_ids is None:
        token_type_ids = jnp.zeros_like(input_ids)
    x = e["word"][input_ids] + e["position"][:S][None] + e["token_type"][token_type_ids]
    x = _layer_norm(x, e["ln_scale"], e["ln_bias"], eps)
    lengths = jnp.maximum(lengths, 1).astype(jnp.int32)   # padding rows: avoid an all-masked softmax
    for layer in params["layers"]:
        x = _encoder_layer(layer, x, lengths, cfg, eps, attn_impl)
    return x


# ----------------------------------------------------------------------------------------------- config
def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """HF BERT ``config.json`` dict -> ``ModelConfig`` (BERT-only values under ``extra``)."""
    arch = (hf.get("architectures") or ["BertModel"])[0]
    if hf.get("model_type", "bert") != "bert":
        raise ModelLoadError(f"{source}: model_type {hf.get('model_type')!r} is not a BERT encoder "
                             "(jaxserve.models.bert supports model_type 'bert')")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ModelLoadError(f"{source}: position_embedding_type {hf['position_embedding_type']!r} is not "
                             "supported (only 'absolute')")
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (only 'gelu')")
    try:
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        if hidden % heads:
            raise ModelLoadError(f"{source}: hidden_size {hidden} is not divisible by "
                                 f"num_attention_heads {heads}")
        return ModelConfig(
            architecture=arch, vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
            max_position_embeddings=int(hf.get("max_position_embeddings", 512)),
            hidden_act=act, model_type="bert",
            extra=(("layer_norm_eps", float(hf.get("layer_norm_eps", 1e-12))),
                   ("type_vocab_size", int(hf.get("type_vocab_size", 2))),
                   ("pad_token_id", int(hf.get("pad_token_id") or 0))))
    except KeyError as e:
        raise ModelLoadError(f"{source} lacks the key {e.args[0]!r} a BERT config needs") from e


# ----------------------------------------------------------------------------------------------- loader
def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor names (no ``bert.`` prefix) -> shape, as stored (linear weights ``[out, in]``)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    shapes = {
        "embeddings.word_embeddings.weight": (cfg.vocab_size, H),
        "embeddings.position_embeddings.weight": (cfg.max_position_embeddings, H),
        "embeddings.token_type_embeddings.weight": (cfg.extra_dict["type_vocab_size"], H),
        "embeddings.LayerNorm.weight": (H,), "embeddings.LayerNorm.bias": (H,),
    }
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            shapes[p + f"attention.self.{name}.weight"] = (H, H)
            shapes[p + f"attention.self.{name}.bias"] = (H,)
        shapes.update({
            p + "attention.output.dense.weight": (H, H), p + "attention.output.dense.bias": (H,),
            p + "attention.output.LayerNorm.weight": (H,), p + "attention.output.LayerNorm.bias": (H,),
            p + "intermediate.dense.weight": (I, H), p + "intermediate.dense.bias": (I,),
            p + "output.dense.weight": (H, I), p + "output.dense.bias": (H,),
            p + "output.LayerNorm.weight": (H,), p + "output.LayerNorm.bias": (H,),
        })
    return shapes


def _canonical_name(name: str) -> str:
    """Strip the ``bert.`` prefix of *ForMaskedLM-style checkpoints; old TF names gamma/beta -> weight/bias."""
    if name.startswith("bert."):
        name = name[len("bert."):]
    if name.endswith("LayerNorm.gamma"):
        name = name[: -len("gamma")] + "weight"
    elif name.endswith("LayerNorm.beta"):
        name = name[: -len("beta")] + "bias"
    return name


def read_hf_weights(weights_path: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The encoder's tensors from a safetensors file, checked against the config (host numpy arrays)."""
    from safetensors import safe_open

    expected = _expected_shapes(cfg)
    found: dict[str, np.ndarray] = {}
    try:
        with safe_open(weights_path, framework="numpy") as f:
            for name in f.keys():
                canon = _canonical_name(name)
                if canon not in expected:
                    continue          # pooler, MLM head, position_ids buffer: not used for embeddings
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[canon]:
                    raise ModelLoadError(f"{weights_path}: tensor {name} has shape {list(shape)}, config.json "
                                         f"implies {list(expected[canon])}")
                found[canon] = f.get_tensor(name)
    except ModelLoadError:
        raise
    except Exception as e:  # corrupt header, truncated file
        raise ModelLoadError(f"cannot read {weights_path}: {e}") from e
    missing = [k for k in expected if k not in found]
    if missing:
        raise ModelLoadError(f"{weights_path} lacks {len(missing)} encoder tensors, e.g. {missing[:3]}")
    return found


def params_from_hf(t: dict[str, np.ndarray], cfg: ModelConfig, dtype) -> dict:
    """HF-named numpy tensors -> our pytree on the default device in ``dtype`` (weights transposed to
    ``[in, out]``, Q/K/V fused). LayerNorm parameters stay float32 (they are tiny and used in float32)."""
    def put(a, dt=dtype):
        return jax.device_put(np.asarray(a, dtype=np.float32).astype(dt))

    params = {"embed": {
        "word": put(t["embeddings.word_embeddings.weight"]),
        "position": put(t["embeddings.position_embeddings.weight"]),
        "token_type": put(t["embeddings.token_type_embeddings.weight"]),
        "ln_scale": put(t["embeddings.LayerNorm.weight"], np.float32),
        "ln_bias": put(t["embeddings.LayerNorm.bias"], np.float32),
    }, "layers": []}
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."
        a = p + "attention."
        qkv_w = np.concatenate([t[a + f"self.{n}.weight"].T for n in ("query", "key", "value")], axis=1)
        qkv_b = np.concatenate([t[a + f"self.{n}.bias"] for n in ("query", "key", "value")])
        params["layers"].append({
            "qkv_w": put(qkv_w), "qkv_b": put(qkv_b),
            "o_w": put(t[a + "output.dense.weight"].T), "o_b": put(t[a + "output.dense.bias"]),
            "attn_ln_scale": put(t[a + "output.LayerNorm.weight"], np.float32),
            "attn_ln_bias": put(t[a + "output.LayerNorm.bias"], np.float32),
            "up_w": put(t[p + "intermediate.dense.weight"].T), "up_b": put(t[p + "intermediate.dense.bias"]),
            "down_w": put(t[p + "output.dense.weight"].T), "down_b": put(t[p + "output.dense.bias"]),
            "mlp_ln_scale": put(t[p + "output.LayerNorm.weight"], np.float32),
            "mlp_ln_bias": put(t[p + "output.LayerNorm.bias"], np.float32),
        })
    return params


def resolve_dtype(dtype, hf: dict):
    """``"auto"`` -> the checkpoint's dtype (float32 when unstated); names or jnp dtypes pass through."""
    if dtype in (None, "auto"):
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not supported; choose one of {list(_DTYPES)} or 'auto'")
        return _DTYPES[dtype]
    return jnp.dtype(dtype).type


def _max_length(path: str, cfg: ModelConfig, tokenizer) -> int:
    """sentence-transformers' ``max_seq_length`` when present (it truncates there), else the position table."""
    limit = cfg.max_position_embeddings
    st = os.path.join(path, "sentence_bert_config.json")
    if os.path.isfile(st):
        with open(st) as f:
            limit = min(limit, int(json.load(f).get("max_seq_length") or limit))
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < limit:
        limit = tok_max
    return limit


def load(path: str, dtype="auto", *, pooling: PoolingConfig | None = None,
         is_matryoshka: bool | None = None) -> LoadedEncoder:
    """Load a BERT encoder from an HF folder. ``pooling`` overrides the recipe read from the folder;
    ``is_matryoshka`` overrides whether ``dimensions`` may truncate its embeddings."""
    config_path = os.path.join(path, "config.json")
    weights_path = os.path.join(path, "model.safetensors")
    for needed in (config_path, weights_path):
        if not os.path.isfile(needed):
            raise ModelLoadError(f"{needed} not found: an encoder folder needs config.json and model.safetensors")
    with open(config_path) as f:
        hf = json.load(f)
    cfg = config_from_hf(hf, config_path)
    jdtype = resolve_dtype(dtype, hf)
    params = params_from_hf(read_hf_weights(weights_path, cfg), cfg, jdtype)

    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {e}") from e

    if pooling is None:
        pooling = read_pooling_config(path, default_pooling="mean", default_normalize=True, hf_config=hf)
    if is_matryoshka is not None:
        import dataclasses
        pooling = dataclasses.replace(pooling, is_matryoshka=is_matryoshka)
    return LoadedEncoder(config=cfg, params=params, tokenizer=tokenizer, pooling=pooling,
                         max_length=_max_length(path, cfg, tokenizer), dtype=jdtype, source=path)
