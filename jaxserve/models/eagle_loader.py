"""Loading a draft head (``models.eagle``, ``models.eagle3``): an EAGLE or EAGLE-3 head's folder (its Llama
config.json checked against the target's) or a DeepSeek target's MTP layer, from safetensors or as random
weights of the config, the target's embedding (and lm_head, but an EAGLE-3 head's own) shared. With the target's
mesh each weight is placed sharded over "tp" as the head's family declares it (the target's layers' layout)."""
from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import configs as model_configs, deepseek, eagle3, llama
from jaxserve.models.config_fields import freeze
from jaxserve.models.eagle import ARCHITECTURE, FAMILY, MTP_ARCHITECTURE, MTP_FAMILY
from jaxserve.models.hf_weights import load_weights
from jaxserve.models.layers.decoder import DecoderFamily
from jaxserve.models.layers.moe import EXPERT_PARALLEL, with_expert_parallel
from jaxserve.models.loaded_model import LoadedModel
from jaxserve.models.safetensors_loader import safetensors_getter
from jaxserve.parallel import replicated, tp_size


def _llama_head_config(hf: dict, target_cfg: ModelConfig, kind: str) -> ModelConfig:
    """A head's Llama config.json read (its ``logit_scale`` kept), refused unless its hidden size and vocabulary
    are the target's."""
    cfg = model_configs.model_config_from_hf({**hf, "architectures": ["LlamaForCausalLM"]})
    for field in ("hidden_size", "vocab_size"):
        if getattr(cfg, field) != getattr(target_cfg, field):
            raise ModelLoadError(f"{kind} head's {field} is {getattr(cfg, field)} and the target's "
                                 f"{getattr(target_cfg, field)}: the head must be trained for this target")
    llama.check_config(cfg)
    scale = hf.get("logit_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ModelLoadError(f"{kind} head's logit_scale {scale!r} must be a number")
    if scale != 1.0:        # the head's logits times it (vLLM's LogitsProcessor(scale=logit_scale))
        cfg = dataclasses.replace(cfg, extra=cfg.extra + (("logit_scale", float(scale)),))
    return cfg


def head_config(hf: dict, target_cfg: ModelConfig, fc_bias: bool) -> ModelConfig:
    """The head's ``ModelConfig`` from its Llama config.json, refused where it cannot share the target's
    embedding and lm_head."""
    if hf.get("add_para_norm"):
        raise ModelLoadError("EAGLE head with add_para_norm (HASS: norms of the embedding and hidden state before "
                             "fc) is not supported")
    cfg = _llama_head_config(hf, target_cfg, "EAGLE")
    return dataclasses.replace(cfg, architecture=ARCHITECTURE, tie_word_embeddings=target_cfg.tie_word_embeddings,
                               extra=cfg.extra + (("fc_bias", bool(fc_bias)),))


def load_eagle_head(path: str, target: LoadedModel, *, load_format: str = "auto", seed: int = 0,
                    mesh=None) -> LoadedModel:
    """The EAGLE head in the folder ``path`` (config.json and safetensors; ``load_format="dummy"``: random
    weights of its config), on the target's device(s) (``mesh``: the target's) and in its dtype, sharing its
    embedding and lm_head."""
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise ModelLoadError(f"EAGLE head {path!r}: not a folder (an EAGLE checkpoint's config.json and "
                             "safetensors)")
    hf = model_configs.read_json(os.path.join(path, "config.json"))
    dtype = target.dtype
    if load_format == "dummy":
        cfg = head_config(hf, target.config, hf.get("bias", False))
        params = FAMILY.init_dummy_params(cfg, dtype, seed=seed, mesh=mesh)
    else:
        get, file_of = safetensors_getter(path)
        cfg = head_config(hf, target.config, hf.get("bias", False) or get.has("fc.bias"))
        params = load_weights(cfg, FAMILY, get, dtype, mesh=mesh, file_of=file_of, desc="Loading the EAGLE head")
        params["layers"][0]["attn_norm"] = _replicated(jnp.ones((cfg.hidden_size,), dtype), mesh)  # (not read)
    return _head_model(cfg, FAMILY, params, target, path, load_format)


def aux_layer_ids(head_path: str, target_cfg: ModelConfig) -> tuple[int, ...]:
    """The target layers whose input residual streams the head reads, in layer order (vLLM's numbering: 0 the
    embedding, ``num_layers`` the stream leaving the last layer): the head config's
    ``eagle_aux_hidden_state_layer_ids``, else vLLM's default for the target's depth."""
    hf = model_configs.read_json(os.path.join(os.path.expanduser(head_path), "config.json"))
    n = target_cfg.num_layers
    ids = hf.get("eagle_aux_hidden_state_layer_ids")
    given = "" if ids else " (vLLM's default for the target's depth: set them in the head's config.json)"
    ids = ids or (2, n // 2, n - 3)
    if not (isinstance(ids, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
            and len(set(ids)) == eagle3.NUM_AUX_LAYERS and all(0 <= i <= n for i in ids)):
        raise ModelLoadError(f"EAGLE-3 head: eagle_aux_hidden_state_layer_ids {ids!r}{given} must be "
                             f"{eagle3.NUM_AUX_LAYERS} distinct layer indices from 0 to the target's {n} layers")
    return tuple(sorted(ids))


def eagle3_config(hf: dict, target_cfg: ModelConfig, *, first_layer: str = "midlayer.",
                  has_lm_head: bool = True, has_embed: bool = False) -> ModelConfig:
    """An EAGLE-3 head's ``ModelConfig`` from its Llama config.json (``first_layer``: its checkpoint's prefix
    of layer 0; ``has_*``: which of its own it has), refused where it cannot read the target's hidden states."""
    if "transformer_layer_config" in hf or "speculators_config" in hf:
        raise ModelLoadError("EAGLE-3 head in the speculators format (transformer_layer_config) is not supported: "
                             "give the head's original checkpoint (a Llama config.json with draft_vocab_size)")
    eagle_config = hf.get("eagle_config") or {}
    if not eagle_config.get("use_aux_hidden_state", True):
        raise ModelLoadError("EAGLE-3 head with use_aux_hidden_state false (no fc over the target's auxiliary "
                             "hidden states) is not supported")
    cfg = _llama_head_config(hf, target_cfg, "EAGLE-3")
    if hf.get("target_hidden_size", cfg.hidden_size) != cfg.hidden_size:
        raise ModelLoadError(f"EAGLE-3 head's target_hidden_size {hf['target_hidden_size']} is not its hidden_size "
                             f"{cfg.hidden_size}: heads narrower than their target are not supported")
    draft_vocab = hf.get("draft_vocab_size") or cfg.vocab_size
    if not isinstance(draft_vocab, int) or not 0 < draft_vocab <= cfg.vocab_size:
        raise ModelLoadError(f"EAGLE-3 head's draft_vocab_size {draft_vocab!r} must be a positive integer up to "
                             f"the target's vocab_size {cfg.vocab_size}")
    if not has_lm_head and draft_vocab != cfg.vocab_size:
        raise ModelLoadError(f"EAGLE-3 head has no lm_head.weight and a draft vocabulary of {draft_vocab} tokens: "
                             f"only a head over the target's {cfg.vocab_size} may share its lm_head")
    extra = {"draft_vocab_size": draft_vocab, "first_layer": first_layer, "own_lm_head": has_lm_head,
             "own_embed": has_embed,
             "norm_before_residual": bool(hf.get("norm_before_residual", False))}
    return dataclasses.replace(cfg, architecture=eagle3.ARCHITECTURE,
                               tie_word_embeddings=target_cfg.tie_word_embeddings and not has_lm_head,
                               extra=cfg.extra + tuple(extra.items()))


def draft_to_target(d2t: np.ndarray | None, draft_vocab: int, vocab: int) -> np.ndarray | None:
    """Each draft id's target id (``i + d2t[i]``, vLLM's reading), checked; None for the identity."""
    if d2t is None:
        return None
    d2t = np.asarray(d2t)
    if d2t.shape != (draft_vocab,) or not np.issubdtype(d2t.dtype, np.integer):
        raise ModelLoadError(f"EAGLE-3 head's d2t is {d2t.dtype} {d2t.shape}: expected integers of shape "
                             f"({draft_vocab},) (draft_vocab_size)")
    ids = np.arange(draft_vocab, dtype=np.int64) + d2t
    if ids.min(initial=0) < 0 or ids.max(initial=0) >= vocab or len(np.unique(ids)) != draft_vocab:
        raise ModelLoadError(f"EAGLE-3 head's d2t maps draft ids outside the target's {vocab} tokens, or two "
                             "draft ids to one target id")
    return None if draft_vocab == vocab and (ids == np.arange(vocab)).all() else ids.astype(np.int32)


def load_eagle3_head(path: str, target: LoadedModel, *, load_format: str = "auto", seed: int = 0,
                     mesh=None) -> LoadedModel:
    """The EAGLE-3 head in the folder ``path`` (config.json and safetensors; ``load_format="dummy"``: random
    weights of its config and an identity draft vocabulary), on the target's device(s) (``mesh``: the target's)
    and in its dtype, sharing its embedding; the target's auxiliary layers (``aux_layer_ids``) are checked here."""
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise ModelLoadError(f"EAGLE-3 head {path!r}: not a folder (an EAGLE-3 checkpoint's config.json and "
                             "safetensors)")
    family = type(target.family)
    if family.abstract is not DecoderFamily.abstract or \
            family.forward_with_expert_load is not DecoderFamily.forward_with_expert_load:
        raise ModelLoadError(f"eagle3 reads its target's layers' hidden states, which {target.config.architecture} "
                             "does not return (a decoder of its own): use eagle, ngram or draft_model")
    aux_layer_ids(path, target.config)
    hf = model_configs.read_json(os.path.join(path, "config.json"))
    if load_format == "dummy":
        cfg = eagle3_config(hf, target.config)
        _check_draft_vocab_splits(cfg, mesh)
        params = eagle3.FAMILY.init_dummy_params(cfg, target.dtype, seed=seed, mesh=mesh)
        draft_vocab = cfg.extra_dict["draft_vocab_size"]
        ids = np.arange(draft_vocab, dtype=np.int32) if draft_vocab != cfg.vocab_size else None
    else:
        get, file_of = safetensors_getter(path)
        first = "midlayer." if get.has("midlayer.self_attn.q_proj.weight") else "layers.0."
        cfg = eagle3_config(hf, target.config, first_layer=first, has_lm_head=get.has("lm_head.weight"),
                            has_embed=get.has("embed_tokens.weight"))
        ids = draft_to_target(get("d2t") if get.has("d2t") else None, cfg.extra_dict["draft_vocab_size"],
                              cfg.vocab_size)
        if ids is None and cfg.extra_dict["draft_vocab_size"] != cfg.vocab_size:
            raise ModelLoadError("EAGLE-3 head has a draft vocabulary smaller than the target's and no d2t map")
        _check_draft_vocab_splits(cfg, mesh)
        params = load_weights(cfg, eagle3.FAMILY, get, target.dtype, mesh=mesh, file_of=file_of,
                              desc="Loading the EAGLE-3 head")
    head = _head_model(cfg, eagle3.FAMILY, params, target, path, load_format,
                       share_lm_head=not cfg.extra_dict["own_lm_head"], share_embed=not cfg.extra_dict["own_embed"])
    if ids is not None:
        head.params["draft_to_target"] = _replicated(jnp.asarray(ids), mesh)
    return head


def _check_draft_vocab_splits(cfg: ModelConfig, mesh) -> None:
    """Refuse an EAGLE-3 head whose own lm_head (vocab-parallel, as the target's) cannot split over ``mesh``."""
    tp, draft_vocab = tp_size(mesh), cfg.extra_dict["draft_vocab_size"]
    if cfg.extra_dict["own_lm_head"] and draft_vocab % tp:
        raise ModelLoadError(f"EAGLE-3 head's draft_vocab_size {draft_vocab} is not divisible by "
                             f"tensor_parallel_size={tp} (its lm_head is split over the draft vocabulary)")


def _replicated(x, mesh):
    """``x`` on every device of ``mesh`` (as it is without one)."""
    if mesh is None:
        return x
    return jax.device_put(x, replicated(mesh))


def mtp_config(hf: dict) -> ModelConfig:
    """DeepSeek's first multi-token-prediction layer (layer ``num_hidden_layers`` of its checkpoint) as a
    one-layer model: MoE where the target's layer of that index would be."""
    cfg = model_configs.model_config_from_hf(hf)
    extra = cfg.extra_dict
    if cfg.model_type not in deepseek.MODEL_TYPES:
        raise ModelLoadError(f"deepseek_mtp needs a DeepSeek V2 / V3 model, not model_type {cfg.model_type!r}")
    if not int(extra.get("num_nextn_predict_layers") or 0):
        raise ModelLoadError("deepseek_mtp: this checkpoint has no multi-token-prediction layers "
                             "(num_nextn_predict_layers is 0)")
    layer = cfg.num_layers
    first_dense, freq = int(extra["first_k_dense_replace"] or 0), int(extra["moe_layer_freq"] or 1)
    is_moe = layer >= first_dense and layer % freq == 0
    extra = {**extra, "first_k_dense_replace": 0 if is_moe else 1, "moe_layer_freq": 1, "mtp": True,
             "mtp_layer": layer}
    return dataclasses.replace(cfg, architecture=MTP_ARCHITECTURE, num_layers=1, extra=freeze(extra))


def load_mtp_head(path: str, target: LoadedModel, *, load_format: str = "auto", seed: int = 0,
                  mesh=None) -> LoadedModel:
    """DeepSeek's MTP layer from the target's folder ``path`` (``load_format="dummy"``: random weights), on the
    target's device(s) (``mesh``: the target's; its experts split as the target's are) and in its dtype, sharing
    its embedding and lm_head (``shared_head.head`` holds the same)."""
    path = os.path.expanduser(path or "")
    if not os.path.isdir(path):
        raise ModelLoadError(f"deepseek_mtp: {path!r} is not a model folder (its MTP layers are read from the "
                             "target's safetensors)")
    cfg = mtp_config(model_configs.read_json(os.path.join(path, "config.json")))
    cfg = with_expert_parallel(cfg, bool(target.config.extra_dict.get(EXPERT_PARALLEL)))
    if load_format == "dummy":
        params = MTP_FAMILY.init_dummy_params(cfg, target.dtype, seed=seed, mesh=mesh)
    else:
        get, file_of = safetensors_getter(path)
        params = load_weights(cfg, MTP_FAMILY, get, target.dtype, mesh=mesh, file_of=file_of,
                              desc="Loading the MTP layer")
    return _head_model(cfg, MTP_FAMILY, params, target, path, load_format)


def _head_model(cfg: ModelConfig, family, params: dict, target: LoadedModel, path: str,
                load_format: str, share_lm_head: bool = True, share_embed: bool = True) -> LoadedModel:
    """The head with the target's embedding and lm_head arrays (shared, not copied), each unless it has its own."""
    if share_embed:
        params["embed"] = target.params["embed"]
    if share_lm_head and "lm_head" in target.params:
        params["lm_head"] = target.params["lm_head"]
    return LoadedModel(config=cfg, params=params, family=family, tokenizer=target.tokenizer,
                       chat_template=None, generation_config={}, source=path, dtype=target.dtype,
                       max_model_len=target.max_model_len, load_format="dummy" if load_format == "dummy"
                       else "safetensors")
