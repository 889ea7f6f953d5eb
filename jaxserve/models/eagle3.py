"""EAGLE-3 draft heads (vLLM's ``Eagle3LlamaForCausalLM``), for ``--speculative-config '{"method": "eagle3",
"model": PATH}'``.

The target's step returns, for every token, the residual streams entering three of its layers side by side
(``[T, 3 * hidden]``; the auxiliary layers: the head config's ``eagle_aux_hidden_state_layer_ids``, else
vLLM's ``(2, num_layers // 2, num_layers - 3)``). The head's ``fc`` maps them to ``hidden``; its first decoder
layer attends over ``concat(input_layernorm(embed(token)), hidden_norm(h))`` (q/k/v ``2 * hidden`` wide), its
residual stream starting at ``h`` (``norm_before_residual``: at ``hidden_norm(h)``); later layers are Llama's.
Its output: its final ``norm`` over the last residual stream, through its own ``lm_head`` over a draft
vocabulary (``draft_vocab_size``), times the config's ``logit_scale`` (if any, as vLLM's ``LogitsProcessor``),
whose id ``i`` is the target's ``i + d2t[i]`` (the ``t2d`` buffer is not read). Further into a proposal the head is fed its own last residual stream (before its norm) as ``h``, not
through ``fc``: in the head's steps those rows are marked (``hidden_own``) and sit in the first ``hidden``
columns of a ``3 * hidden`` row.

Checkpoint (a safetensors folder): ``fc.weight``, ``midlayer.*`` or ``layers.<i>.*`` in Llama's names with
``hidden_norm.weight`` beside them, ``norm.weight``, ``lm_head.weight`` (absent: the target's, when the draft
vocabulary is the target's), ``d2t`` (absent: the identity), ``t2d``, ``embed_tokens.weight`` (absent: the
target's, as usual).
Loading: ``eagle_loader.load_eagle3_head``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import checkpoint_names, llama
from jaxserve.models.eagle import EagleFamily, head_decoder_spec
from jaxserve.models.layers.decoder import COLUMN, REPLICATED, VOCAB, DecoderLayer, _param, _to_internal, _w
from jaxserve.models.layers.linear import linear, row_parallel_linear
from jaxserve.models.layers.norms import NORMS

ARCHITECTURE = "Eagle3LlamaForCausalLM"
# the names EAGLE-3 checkpoints' config.json give the head
ARCHITECTURES = (ARCHITECTURE, "LlamaForCausalLMEagle3")
NUM_AUX_LAYERS = 3


class Eagle3Head(nnx.Module):
    """The head's weights and forward (``embed``: its own or the target's, filled at load; ``lm_head``: its own
    or the target's, ``tie_word_embeddings`` then the target's)."""

    def __init__(self, cfg: ModelConfig, spec):
        h, x = cfg.hidden_size, cfg.extra_dict
        self.cfg, self.spec = cfg, spec
        self.norm = NORMS[spec.norm]
        self.embed = _param((cfg.vocab_size, h), VOCAB)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param((h, x["draft_vocab_size"]), COLUMN)
        self.fc = _param((NUM_AUX_LAYERS * h, h), REPLICATED)
        self.hidden_norm = _param((h,), REPLICATED, "ones")
        self.final_norm = _param((h,), REPLICATED, "ones")
        self.layers = nnx.List([DecoderLayer(cfg, spec, i) for i in range(cfg.num_layers)])
        first, q_out, kv_out = self.layers[0], cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        first.q, first.k, first.v = (_param((2 * h, q_out), COLUMN), _param((2 * h, kv_out), COLUMN),
                                     _param((2 * h, kv_out), COLUMN))

    def __call__(self, kv_caches: list, input_ids: jax.Array, positions: jax.Array, md, backend: str,
                 hidden_in: jax.Array, hidden_own: jax.Array):
        """The last residual stream (the logits' are its final norm's) and the new caches. ``hidden_in``
        ``[T, 3 * hidden]``: the target's auxiliary hidden states, or where ``hidden_own`` the head's own
        output in the first ``hidden`` columns."""
        eps, h = self.cfg.rms_norm_eps, self.cfg.hidden_size
        e = jnp.take(_w(self.embed), input_ids, axis=0)
        hidden_in = hidden_in.astype(e.dtype)
        fed = jnp.where(hidden_own[:, None], hidden_in[:, :h], linear(hidden_in, _w(self.fc)))
        cos_sin = [r.cos_sin(positions, e.dtype) for r in self.spec.rotaries]
        new_caches, residual, mlp = [], None, None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if i == 0:
                normed = self.norm(fed, _w(self.hidden_norm), eps)
                residual = normed if self.cfg.extra_dict["norm_before_residual"] else fed
                x = jnp.concatenate([self.norm(e, _w(layer.attn_norm), eps), normed], axis=-1)
            else:
                residual = residual + mlp
                x = self.norm(residual, _w(layer.attn_norm), eps)
            attn, kv_cache = layer.attention(x, cos_sin, kv_cache, md, backend)
            new_caches.append(kv_cache)
            residual = residual + row_parallel_linear(attn, _w(layer.o))
            mlp = row_parallel_linear(layer.gated(self.norm(residual, _w(layer.mlp_norm), eps)), _w(layer.down))
        return residual + mlp, new_caches, None


class Eagle3Family(EagleFamily):
    """The head as the runner sees a family: its input hidden states are ``3 * hidden`` wide and mark the
    head's own rows (``marks_own_hidden``); its logits are over the target's vocabulary (``d2t`` applied)."""
    marks_own_hidden = True

    @functools.lru_cache(maxsize=16)  # noqa: B019  (the family object lives as long as its module)
    def abstract(self, cfg: ModelConfig):
        return nnx.split(nnx.eval_shape(lambda: Eagle3Head(cfg, self.decoder_spec(cfg))))

    def hidden_width(self, cfg: ModelConfig) -> int:
        return NUM_AUX_LAYERS * cfg.hidden_size

    def weight_plan(self, cfg: ModelConfig) -> list:
        """The checkpoint's tensors (an embedding or lm_head it lacks is the target's)."""
        first = cfg.extra_dict["first_layer"]         # "midlayer." or "layers.0."
        top = {"embed": ("same", ["embed_tokens.weight"]), "fc": ("t", ["fc.weight"]),
               "hidden_norm": ("same", [first + "hidden_norm.weight"]), "final_norm": ("same", ["norm.weight"]),
               "lm_head": ("t", ["lm_head.weight"])}
        plan = checkpoint_names.weight_plan(self.param_shapes(cfg), llama.LAYER_NAMES, top=top, prefix="layers.")
        return [(path, [n.replace("layers.0.", first, 1) for n in names], build) for path, names, build in plan
                if path[0] not in ("embed", "lm_head") or cfg.extra_dict["own_" + path[0]]]

    def forward_with_expert_load(self, params, kv_caches, input_ids, positions, md, cfg, *,
                                 attn_backend="reference", hidden_in=None, hidden_own=None, **unused):
        weights = {k: v for k, v in params.items() if k != "draft_to_target"}
        model = nnx.merge(self.abstract(cfg)[0], _to_internal(weights))
        return model(kv_caches, input_ids, positions, md, attn_backend, hidden_in, hidden_own)

    def compute_logits(self, params: dict, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
        """The draft vocabulary's logits placed at their target ids (``params["draft_to_target"]``: ``i + d2t[i]``,
        absent when the draft vocabulary is the target's), -inf at the others."""
        hidden = NORMS[self.decoder_spec(cfg).norm](hidden, params["final_norm"], cfg.rms_norm_eps)
        logits = super().compute_logits(params, hidden, cfg)
        if "draft_to_target" not in params:
            return logits
        full = jnp.full((logits.shape[0], cfg.vocab_size), -jnp.inf, logits.dtype)
        return full.at[:, params["draft_to_target"]].set(logits)


def check_config(cfg: ModelConfig) -> None:
    """Refuse a head loaded as the served model (it has no embedding of its own)."""
    if "draft_vocab_size" not in cfg.extra_dict:
        raise ModelLoadError(f"{ARCHITECTURE} is an EAGLE-3 draft head: serve its target model with "
                             "--speculative-config '{\"method\": \"eagle3\", \"model\": <the head's folder>}'")
    llama.check_config(cfg)


FAMILY = Eagle3Family(head_decoder_spec, check_config, llama.LAYER_NAMES, architectures=ARCHITECTURES,
                      model_types={})
