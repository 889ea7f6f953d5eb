"""EAGLE draft heads (EAGLE-1; vLLM's ``EagleLlamaForCausalLM``), for ``--speculative-config '{"method": "eagle",
"model": PATH}'``: Llama decoder layers over ``fc(concat(embed(token), hidden))``, where ``hidden`` is the
target's hidden state at the previous position (what its logits are computed from, after its final norm, as
vLLM passes it) or, further into a proposal, the head's own output there.

The head shares the target's embedding and lm_head (the checkpoint has ``fc.weight`` (``fc.bias``: config
``bias`` or the tensor present), ``layers.<i>.*`` in Llama's names, maybe an ``embed_tokens.weight`` that is
not read). Layer 0 has no input norm (the residual stream is ``fc``'s output); the head's output is the last
residual stream, with no final norm, and feeds both the lm_head and the next draft step. Its config.json is
a Llama one (hidden size and vocabulary the target's); its ``logit_scale``, if any, multiplies the head's
logits (vLLM's ``LogitsProcessor(scale=logit_scale)``; EAGLE-3 heads' too).

Loading: ``eagle_loader``. The engine side (which rows, the proposal round) is ``engine.eagle_proposer``; the
runner passes hidden states from step to step on the device (``runner.step_functions.forward_fn``).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import checkpoint_names, deepseek, llama
from jaxserve.models.layers.decoder import (COLUMN, REPLICATED, VOCAB, DecoderFamily, DecoderLayer, _param,
                                            _to_internal, _w)
from jaxserve.models.layers.linear import linear, row_parallel_linear
from jaxserve.kernels.metadata import PAD_SLOT
from jaxserve.models.layers import moe
from jaxserve.models.layers.norms import NORMS

ARCHITECTURE = "EagleLlamaForCausalLM"


class EagleHead(nnx.Module):
    """The head's weights and forward: ``embed`` / ``lm_head`` are the target's (filled at load). A DeepSeek MTP
    head (``extra["mtp"]``): ``fc`` is ``eh_proj``, over ``enorm`` of the embedding (zero at position 0, as
    vLLM) and ``hnorm`` of the hidden state; its layer has its input norm (MLA, MoE as the config says); its
    logits are over ``head_norm`` (``shared_head.norm``) of its output."""

    def __init__(self, cfg: ModelConfig, spec):
        h = cfg.hidden_size
        self.cfg, self.spec = cfg, spec
        self.norm = NORMS[spec.norm]
        self.mtp = bool(cfg.extra_dict.get("mtp"))
        self.embed = _param((cfg.vocab_size, h), VOCAB)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param((h, cfg.vocab_size), COLUMN)
        self.fc = _param((2 * h, h), REPLICATED)
        if cfg.extra_dict.get("fc_bias"):
            self.fc_bias = _param((h,), REPLICATED, "zeros")
        if self.mtp:
            self.enorm, self.hnorm = _param((h,), REPLICATED, "ones"), _param((h,), REPLICATED, "ones")
            self.head_norm = _param((h,), REPLICATED, "ones")
        self.layers = nnx.List([DecoderLayer(cfg, spec, i) for i in range(cfg.num_layers)])

    def __call__(self, kv_caches: list, input_ids: jax.Array, positions: jax.Array, md, backend: str,
                 hidden_in: jax.Array):
        eps = self.cfg.rms_norm_eps
        e = jnp.take(_w(self.embed), input_ids, axis=0)
        hidden_in = hidden_in.astype(e.dtype)
        if self.mtp:
            e = self.norm(jnp.where((positions == 0)[:, None], jnp.zeros_like(e), e), _w(self.enorm), eps)
            hidden_in = self.norm(hidden_in, _w(self.hnorm), eps)
        x = linear(jnp.concatenate([e, hidden_in], axis=-1), _w(self.fc))
        if hasattr(self, "fc_bias"):
            x = x + _w(self.fc_bias)
        cos_sin = [r.cos_sin(positions, x.dtype) for r in self.spec.rotaries]
        new_caches, routed = [], []
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            h = x if i == 0 and not self.mtp else self.norm(x, _w(layer.attn_norm), eps)
            attn, kv_cache = layer.attention(h, cos_sin, kv_cache, md, backend)
            new_caches.append(kv_cache)
            x = x + row_parallel_linear(attn, _w(layer.o))
            h = self.norm(x, _w(layer.mlp_norm), eps)
            if layer.is_moe:
                mlp, ids = layer.moe_mlp(h, md.slot_mapping != PAD_SLOT)
                routed.append(ids)
            else:
                mlp = row_parallel_linear(layer.gated(h), _w(layer.down))
            x = x + mlp
        load = moe.expert_load(jnp.stack(routed), self.spec.moe.num_experts) if routed else None
        return x, new_caches, load


class EagleFamily(DecoderFamily):
    """The head as the runner sees a family: ``forward`` takes each token's input hidden state
    (``takes_hidden``), and its logits are the target's lm_head over the head's output."""
    takes_hidden = True

    @functools.lru_cache(maxsize=16)  # noqa: B019  (the family object lives as long as its module)
    def abstract(self, cfg: ModelConfig):
        return nnx.split(nnx.eval_shape(lambda: EagleHead(cfg, self.decoder_spec(cfg))))

    def weight_plan(self, cfg: ModelConfig) -> list:
        """The checkpoint's tensors: ``fc`` and the layers (layer 0's input norm and the shared embedding and
        lm_head are not in it)."""
        top = {"fc": ("t", ["fc.weight"]), "fc_bias": ("same", ["fc.bias"])}
        shapes = self.param_shapes(cfg)
        plan = checkpoint_names.weight_plan(shapes, llama.LAYER_NAMES, top=top, prefix="layers.")
        return [e for e in plan if e[0] != ("layers", 0, "attn_norm")]

    def supports_lora(self, cfg: ModelConfig) -> bool:
        return False

    def hidden_width(self, cfg: ModelConfig) -> int:
        """The width of the hidden states it reads (the target's hidden size)."""
        return cfg.hidden_size

    def forward(self, *args, **kwargs):
        return self.forward_with_expert_load(*args, **kwargs)[:2]

    def forward_with_expert_load(self, params, kv_caches, input_ids, positions, md, cfg, *,
                                 attn_backend="reference", hidden_in=None, **unused):
        model = nnx.merge(self.abstract(cfg)[0], _to_internal(params))
        return model(kv_caches, input_ids, positions, md, attn_backend, hidden_in)

    def compute_logits(self, params: dict, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
        if cfg.extra_dict.get("mtp"):
            hidden = NORMS[self.decoder_spec(cfg).norm](hidden, params["head_norm"], cfg.rms_norm_eps)
        return super().compute_logits(params, hidden, cfg)


def check_config(cfg: ModelConfig) -> None:
    """Refuse a head loaded as the served model (it has no embedding of its own): it is a speculative config's."""
    if "fc_bias" not in cfg.extra_dict:
        raise ModelLoadError(f"{ARCHITECTURE} is an EAGLE draft head: serve its target model with "
                             "--speculative-config '{\"method\": \"eagle\", \"model\": <the head's folder>}'")
    llama.check_config(cfg)


def head_decoder_spec(cfg: ModelConfig):
    """Llama's, with the head config's ``logit_scale`` on its logits (an EAGLE or EAGLE-3 head's)."""
    return dataclasses.replace(llama.decoder_spec(cfg), logit_scale=cfg.extra_dict.get("logit_scale"))


FAMILY = EagleFamily(head_decoder_spec, check_config, llama.LAYER_NAMES, architectures=(ARCHITECTURE,),
                     model_types={})


MTP_ARCHITECTURE = "DeepSeekMTPModel"


class MTPFamily(EagleFamily):
    """DeepSeek's multi-token-prediction layer (``num_hidden_layers``, vLLM's ``DeepSeekMTP``) as a head."""

    def weight_plan(self, cfg: ModelConfig) -> list:
        """The target checkpoint's ``model.layers.<num_hidden_layers>.*``: ``eh_proj``, ``enorm``, ``hnorm``,
        ``shared_head.norm`` and the decoder layer (its ``embed_tokens`` and ``shared_head.head`` are the
        target's embedding and lm_head)."""
        pre = f"model.layers.{cfg.extra_dict['mtp_layer']}."
        top = {"fc": ("t", [pre + "eh_proj.weight"]), "enorm": ("same", [pre + "enorm.weight"]),
               "hnorm": ("same", [pre + "hnorm.weight"]), "head_norm": ("same", [pre + "shared_head.norm.weight"])}
        plan = checkpoint_names.weight_plan(self.param_shapes(cfg), deepseek.layer_names(cfg), top=top)
        return [(path, [n.replace("model.layers.0.", pre, 1) for n in names] if path[0] == "layers" else names, b)
                for path, names, b in plan]


def check_mtp_config(cfg: ModelConfig) -> None:
    if "mtp_layer" not in cfg.extra_dict:
        raise ModelLoadError(f"{MTP_ARCHITECTURE} is DeepSeek's multi-token-prediction layer: serve its model with "
                             "--speculative-config '{\"method\": \"deepseek_mtp\", \"num_speculative_tokens\": 1}'")
    deepseek.check_config(cfg)


MTP_FAMILY = MTPFamily(deepseek.decoder_spec, check_mtp_config, deepseek.layer_names,
                       architectures=(MTP_ARCHITECTURE,), model_types={})
