"""Llama 3.2 Vision (``MllamaForConditionalGeneration``): a tiled ViT (``layers.mllama_vision``), a linear
projector, and a Llama text model some of whose layers (``cross_attention_layers``) are gated cross-attention
layers over the image's states instead of self-attention layers.

The prompt keeps one ``<|image|>`` token per image (its embedding is an ordinary row of ``embed_tokens``, which
has ``vocab_size + 8`` rows); nothing is written over token rows. The image instead becomes each cross layer's
keys and values (``encode_cross_kv``: the tower, the projector, that layer's k projection with its RMSNorm
and v projection), computed once per image into a slot of the runner's cross-attention cache
(``runner.cross_attention_cache``), never into the paged self-attention cache: only the self-attention layers
have paged K/V (``ModelConfig.num_layers`` counts those; ``extra["cross_attention_layers"]`` places the rest).

A cross layer, per token (HF's ``MllamaCrossAttentionDecoderLayer`` with its masks):
``x += tanh(attn_gate) * o(attend(q_norm(q(norm(x))), K, V))``, then
``x += tanh(mlp_gate) * row_on * mlp(norm(x))``. The step gives each token a mode and, per image of its
prompt, the image's slot and the keys it sees (``cross_index_rows``; ``runner.cross_attention_cache.gather``):
a token from an image's placeholder on sees the real tiles' keys (``num_tiles * num_patches``) of that image
(and of the images right after it: HF's consecutive images share the text after them), until the next
image's placeholder (mode 1); a token before the first image is HF's fully masked row: its mask is zeroed, so
it sees every key of every image, padding tiles included, and only its MLP is dropped (mode 0); a request
without an image (mode -1) skips the layer, as HF skips cross layers without cross-attention states. A step
with no image request runs the plain forward: the cross layers cost nothing there.

Config: ``config.json`` wraps a ``text_config`` (``mllama_text_model``) and a ``vision_config``
(``mllama_vision_model``) with ``image_token_index``; checkpoint names: the text model's under
``language_model.model.`` / ``model.language_model.`` (HF layer indices: self and cross layers counted
together), ``vision_model.`` and ``multi_modal_projector.`` (or under ``model.``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import llama
from jaxserve.models.layers.decoder import COLUMN, REPLICATED, ROW, TP, VOCAB, DecoderFamily, DecoderModel, \
    DecoderSpec, _param, _to_internal, _w
from jaxserve.models.layers.linear import linear, row_parallel_linear
from jaxserve.models.layers.mllama_vision import MllamaVisionSpec, MllamaVisionTower, tower_weight_plan
from jaxserve.models.layers.norms import rms_norm
from jaxserve.models.layers.vision import VISION_ACTIVATIONS

ARCHITECTURES = ("MllamaForConditionalGeneration",)
MODEL_TYPES = {"mllama": "MllamaForConditionalGeneration"}
WRAPPER_FIELDS = ("architectures", "torch_dtype", "dtype")
IMAGE_TOKEN = "<|image|>"
EXTRA_EMBEDDINGS = 8                 # embed_tokens rows past the vocab (<|image|> is the first)
MAX_IMAGES = 4                       # images a prompt may hold (the step's cross-attention index has a row pair each)
VISION_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_global_layers", "attention_heads",
               "image_size", "patch_size", "max_num_tiles", "supported_aspect_ratios", "intermediate_layers_indices",
               "num_channels", "norm_eps", "hidden_act", "vision_output_dim")
OPENAI_CLIP_MEAN, OPENAI_CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
CROSS_NAMES = {
    "attn_norm": ("same", ["input_layernorm.weight"]), "mlp_norm": ("same", ["post_attention_layernorm.weight"]),
    "q": ("t", ["cross_attn.q_proj.weight"]), "k": ("t", ["cross_attn.k_proj.weight"]),
    "v": ("t", ["cross_attn.v_proj.weight"]), "o": ("t", ["cross_attn.o_proj.weight"]),
    "q_norm": ("same", ["cross_attn.q_norm.weight"]), "k_norm": ("same", ["cross_attn.k_norm.weight"]),
    "attn_gate": ("same", ["cross_attn_attn_gate"]), "mlp_gate": ("same", ["cross_attn_mlp_gate"]),
    "gate_up": ("stack_t", ["mlp.gate_proj.weight", "mlp.up_proj.weight"]), "down": ("t", ["mlp.down_proj.weight"]),
}


def unwrap_hf(hf: dict) -> dict:
    """The text config (transformers' defaults filled in) with the vision facts under ``"_mllama"``."""
    if hf.get("model_type") != "mllama":
        return hf
    from transformers import AutoConfig  # noqa: PLC0415

    text = dict(hf.get("text_config") or {})
    text.pop("model_type", None)
    vision = dict(hf.get("vision_config") or {})
    vision.pop("model_type", None)
    text = AutoConfig.for_model("mllama_text_model", **text).to_dict()
    vision = AutoConfig.for_model("mllama_vision_model", **vision).to_dict()
    facts = {"vision": {k: vision[k] for k in VISION_KEYS},
             "cross_attention_layers": [int(i) for i in text["cross_attention_layers"]],
             "image_token_id": int(hf.get("image_token_index", hf.get("image_token_id", text["vocab_size"])))}
    return text | {k: hf[k] for k in WRAPPER_FIELDS if k in hf} | {"model_type": "mllama", "_mllama": facts}


def read_hf(hf: dict, fields: dict) -> dict:
    facts = hf.get("_mllama")
    if facts is None:
        raise ModelLoadError("a MllamaForConditionalGeneration config needs text_config and vision_config")
    v = facts["vision"]
    size = int(v["image_size"])
    # the hub's preprocessor_config.json: what dummy weights get
    processor = {"image_processor_type": "MllamaImageProcessor", "size": {"height": size, "width": size},
                 "max_image_tiles": int(v["max_num_tiles"]), "resample": 2, "image_mean": OPENAI_CLIP_MEAN,
                 "image_std": OPENAI_CLIP_STD}
    fields = dict(fields, num_layers=fields["num_layers"] - len(facts["cross_attention_layers"]))
    fields["extra"] = dict(fields["extra"]) | facts | {
        "image_processor": processor, "image_token": IMAGE_TOKEN, "image_tokens_per_image": 1,
        "max_images_per_prompt": MAX_IMAGES, "num_hidden_layers": int(hf["num_hidden_layers"]),
        "input_vocab_size": fields["vocab_size"] + EXTRA_EMBEDDINGS}
    return fields


def check_config(cfg: ModelConfig) -> None:
    llama.check_config(cfg)
    extra = cfg.extra_dict
    v = dict(extra["vision"])
    if v["hidden_act"] not in VISION_ACTIVATIONS:
        raise ModelLoadError(f"vision hidden_act {v['hidden_act']!r} is not supported")
    total, cross = extra["num_hidden_layers"], list(extra["cross_attention_layers"])
    if not cross or any(not 0 <= i < total for i in cross) or len(set(cross)) != len(cross):
        raise ModelLoadError(f"cross_attention_layers {cross} must be distinct layers of {total}")
    spec = vision_spec(cfg)
    if spec.output_dim != int(v["vision_output_dim"]):
        raise ModelLoadError(f"vision_output_dim {v['vision_output_dim']} is not hidden_size * (1 + "
                             f"{len(spec.intermediate_layers)} intermediate layers) = {spec.output_dim}")


@functools.lru_cache(maxsize=16)
def vision_spec(cfg: ModelConfig) -> MllamaVisionSpec:
    return MllamaVisionSpec.from_hf(dict(cfg.extra_dict["vision"]))


def layer_order(cfg: ModelConfig) -> tuple[bool, ...]:
    """Per HF layer: a cross-attention layer (True) or a self-attention one."""
    cross = set(cfg.extra_dict["cross_attention_layers"])
    return tuple(i in cross for i in range(cfg.extra_dict["num_hidden_layers"]))


def cross_index_rows(cfg: ModelConfig) -> int:
    """Rows of a step's cross-attention index: the mode, then per image of a prompt its slot and keys seen."""
    return 1 + 2 * int(cfg.extra_dict["max_images_per_prompt"])


def cross_attend(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, slots: jax.Array,
                 visible: jax.Array) -> jax.Array:
    """Each token's attention over the keys of its images: ``q [T, hq, d]``, pools ``[slots, N, kvh, d]``,
    ``slots`` / ``visible`` ``[images, T]`` (each image's slot, and how many of its keys the token sees: 0
    none) → ``[T, hq, d]`` (zeros for a row that sees none). One slot at a time with an online softmax, so the
    scores stay ``[T, hq, N]`` whatever the pool's size; an image a prompt holds twice counts twice (its keys'
    weights doubled, as HF's concatenated states have them)."""
    t, hq, d = q.shape
    n, hkv = k_pool.shape[1], k_pool.shape[2]
    qg = q.reshape(t, hkv, hq // hkv, d)
    pos = jnp.arange(n)

    def one(s, carry):
        m, total, acc = carry
        match = (slots == s) & (visible > 0)
        seen = jnp.max(jnp.where(match, visible, 0), axis=0)                              # [T]
        copies = jnp.maximum(match.sum(axis=0), 1).astype(jnp.float32)
        scores = jnp.einsum("tkgd,nkd->tkgn", qg, k_pool[s], preferred_element_type=jnp.float32) * d ** -0.5
        scores = jnp.where((pos[None, :] < seen[:, None])[:, None, None], scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(scores - base[..., None]) * copies[:, None, None, None]
        scale = jnp.exp(m - base)
        acc = acc * scale[..., None] + jnp.einsum("tkgn,nkd->tkgd", p, v_pool[s].astype(jnp.float32))
        return m_new, total * scale + p.sum(axis=-1), acc
    shape = (t, hkv, hq // hkv)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, d), jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, k_pool.shape[0], one, init)
    return (acc / jnp.where(total > 0, total, 1.0)[..., None]).reshape(t, hq, d).astype(q.dtype)


class CrossAttentionLayer(nnx.Module):
    """HF's ``MllamaCrossAttentionDecoderLayer``: q/k RMSNorm, no RoPE, tanh gates on attention and MLP."""

    def __init__(self, cfg: ModelConfig):
        h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        self.cfg = cfg
        self.attn_norm, self.mlp_norm = _param((h,), REPLICATED, "ones"), _param((h,), REPLICATED, "ones")
        self.q = _param((h, cfg.num_heads * d), COLUMN)
        self.k, self.v = _param((h, cfg.num_kv_heads * d), COLUMN), _param((h, cfg.num_kv_heads * d), COLUMN)
        self.o = _param((cfg.num_heads * d, h), ROW)
        self.q_norm, self.k_norm = _param((d,), REPLICATED, "ones"), _param((d,), REPLICATED, "ones")
        self.attn_gate, self.mlp_gate = _param((1,), REPLICATED), _param((1,), REPLICATED)
        self.gate_up = _param((h, 2, i), (None, None, TP))
        self.down = _param((i, h), ROW)

    def keys_values(self, states: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The image states ``[B, N, hidden]`` → this layer's K and V ``[B, N, kv_heads, head_dim]``."""
        cfg = self.cfg
        b, n, _ = states.shape
        k = (states @ _w(self.k)).reshape(b, n, cfg.num_kv_heads, cfg.head_dim)
        v = (states @ _w(self.v)).reshape(b, n, cfg.num_kv_heads, cfg.head_dim)
        return rms_norm(k, _w(self.k_norm), cfg.rms_norm_eps), v

    def __call__(self, x: jax.Array, k_pool: jax.Array, v_pool: jax.Array, index: jax.Array) -> jax.Array:
        cfg = self.cfg
        eps, t = cfg.rms_norm_eps, x.shape[0]
        h = rms_norm(x, _w(self.attn_norm), eps)
        q = rms_norm((h @ _w(self.q)).reshape(t, cfg.num_heads, cfg.head_dim), _w(self.q_norm), eps)
        m = (index.shape[0] - 1) // 2
        attn = cross_attend(q, k_pool, v_pool, index[1:1 + m], index[1 + m:])
        attn = row_parallel_linear(attn.reshape(t, -1), _w(self.o))
        active = (index[0] >= 0)[:, None]
        x = jnp.where(active, x + jnp.tanh(_w(self.attn_gate)).astype(x.dtype) * attn, x)
        h = rms_norm(x, _w(self.mlp_norm), eps)
        gate_up = linear(h, _w(self.gate_up))
        mlp = row_parallel_linear(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], _w(self.down))
        mlp = mlp * (index[0] == 1)[:, None].astype(mlp.dtype)
        return jnp.where(active, x + jnp.tanh(_w(self.mlp_gate)).astype(x.dtype) * mlp, x)


class MllamaModel(DecoderModel):
    """Llama's self-attention layers (``layers``), the cross-attention layers, the tower and the projector."""

    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, vspec: MllamaVisionSpec):
        super().__init__(cfg, spec)
        self.embed = _param((cfg.vocab_size + EXTRA_EMBEDDINGS, cfg.hidden_size), VOCAB)
        self.order = layer_order(cfg)
        self.cross_layers = nnx.List([CrossAttentionLayer(cfg) for _ in range(sum(self.order))])
        self.vision = MllamaVisionTower(vspec)
        self.projector = _param((vspec.output_dim, cfg.hidden_size), REPLICATED)
        self.projector_bias = _param((cfg.hidden_size,), REPLICATED, "zeros")

    def encode_cross_kv(self, pixel_values, ar_ids, ar_mask) -> tuple[jax.Array, jax.Array]:
        """Images → every cross layer's K and V ``[cross layers, B, tiles * num_patches, kv_heads, head_dim]``."""
        states = self.vision(pixel_values, ar_ids, ar_mask)
        states = states @ _w(self.projector) + _w(self.projector_bias)
        ks, vs = zip(*(layer.keys_values(states) for layer in self.cross_layers))
        return jnp.stack(ks), jnp.stack(vs)

    def __call__(self, kv_caches: list, input_ids: jax.Array, positions: jax.Array, md, backend: str,
                 cross: tuple | None = None):
        eps = self.cfg.rms_norm_eps
        x = jnp.take(_w(self.embed), input_ids, axis=0)
        cos_sin = [r.cos_sin(positions, x.dtype) for r in self.spec.rotaries]
        layers, cross_layers = iter(self.layers), iter(enumerate(self.cross_layers))
        new_caches = []
        for is_cross in self.order:
            if is_cross:
                j, layer = next(cross_layers)
                if cross is not None:
                    (k_pool, v_pool), index = cross
                    x = layer(x, k_pool[j], v_pool[j], index)
                continue
            layer = next(layers)
            h = rms_norm(x, _w(layer.attn_norm), eps)
            attn, kv = layer.attention(h, cos_sin, kv_caches[len(new_caches)], md, backend)
            new_caches.append(kv)
            x = x + row_parallel_linear(attn, _w(layer.o))
            h = rms_norm(x, _w(layer.mlp_norm), eps)
            x = x + row_parallel_linear(layer.gated(h), _w(layer.down))
        return rms_norm(x, _w(self.final_norm), eps), new_caches, None


class MllamaFamily(DecoderFamily):
    """Llama's decoder with cross-attention layers over an image: ``encode_cross_kv`` is the runner's encoder
    step (into the cross-attention cache), ``forward(..., cross=...)`` the decoder step of a batch with
    image requests."""

    cross_attention = True

    def supports_lora(self, cfg) -> bool:
        return False      # the cross-attention forward takes no adapter inputs

    @functools.lru_cache(maxsize=16)  # noqa: B019  (one family object, as long as its module)
    def abstract(self, cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
        return nnx.split(nnx.eval_shape(lambda: MllamaModel(cfg, self.decoder_spec(cfg), vision_spec(cfg))))

    def weight_plan(self, cfg: ModelConfig) -> list:
        shapes = self.param_shapes(cfg)
        plan = [(("embed",), ["model.embed_tokens.weight"], "same"), (("final_norm",), ["model.norm.weight"], "same"),
                (("lm_head",), ["lm_head.weight"], "t")]
        order = layer_order(cfg)
        self_layers = [i for i, c in enumerate(order) if not c]
        cross_layers = [i for i, c in enumerate(order) if c]
        for group, hf_index, names in (("layers", self_layers, llama.LAYER_NAMES),
                                       ("cross_layers", cross_layers, CROSS_NAMES)):
            for k, i in enumerate(hf_index):
                plan += [((group, k, w), [f"model.layers.{i}.{n}" for n in hf], build)
                         for w, (build, hf) in names.items() if w in shapes[group][k]]
        return plan + tower_weight_plan(vision_spec(cfg), "vision_model.") + [
            (("projector",), ["multi_modal_projector.weight"], "t"),
            (("projector_bias",), ["multi_modal_projector.bias"], "same")]

    def cross_kv_shape(self, cfg: ModelConfig) -> tuple[int, int, int, int]:
        """(cross layers, keys per image, kv heads, head dim): one slot of the cross-attention cache."""
        return sum(layer_order(cfg)), vision_spec(cfg).tokens_per_image, cfg.num_kv_heads, cfg.head_dim

    def cross_index_rows(self, cfg: ModelConfig) -> int:
        return cross_index_rows(cfg)

    def encode_cross_kv(self, params: dict, pixel_values, ar_ids, ar_mask, cfg: ModelConfig):
        graphdef, _ = self.abstract(cfg)
        return nnx.merge(graphdef, _to_internal(params)).encode_cross_kv(pixel_values, ar_ids, ar_mask)

    def forward_with_expert_load(self, params: dict, kv_caches: list, input_ids: jax.Array, positions: jax.Array,
                                 md, cfg: ModelConfig, *, attn_backend: str = "reference", mm_embeds=None,
                                 mm_rows=None, cross=None):
        """The step; ``cross``: ``((K pool, V pool), index [cross_index_rows, T])`` when some request of it
        has an image."""
        graphdef, _ = self.abstract(cfg)
        return nnx.merge(graphdef, _to_internal(params))(kv_caches, input_ids, positions, md, attn_backend, cross)

    def forward(self, params: dict, kv_caches: list, input_ids: jax.Array, positions: jax.Array, md,
                cfg: ModelConfig, *, attn_backend: str = "reference", mm_embeds=None, mm_rows=None, cross=None):
        hidden, kv_caches, _ = self.forward_with_expert_load(params, kv_caches, input_ids, positions, md, cfg,
                                                             attn_backend=attn_backend, cross=cross)
        return hidden, kv_caches


FAMILY = MllamaFamily(llama.decoder_spec, check_config, llama.LAYER_NAMES, architectures=ARCHITECTURES,
                      model_types=MODEL_TYPES, read_hf=read_hf, unwrap_hf=unwrap_hf)
