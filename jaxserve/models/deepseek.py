"""DeepSeek V2 / V2-Lite / V2.5 (``DeepseekV2ForCausalLM``) and V3 / R1 (``DeepseekV3ForCausalLM``): multi-head
latent attention (``layers.mla``) and DeepSeekMoE (``layers.moe`` with ``layers.moe_routing``'s routers) on the
shared decoder.

Attention: MLA with or without a q LoRA (``q_lora_rank``), the rotary part (``qk_rope_head_dim``) interleaved
(V2 always; V3 when ``rope_interleave``, its default) or rotate-half, YaRN with DeepSeek's ``mscale`` /
``mscale_all_dim`` (the rotary's attention factor, and ``mscale(factor, mscale_all_dim) ** 2`` in the softmax
scale). The cache holds one latent row of ``kv_lora_rank + qk_rope_head_dim`` values per token and layer
(``kv_cache_shapes``); in ``ModelConfig`` that is one kv head of that width (vLLM's convention for MLA), which
is also what keeps the latent replicated under tensor parallelism.

MLP: the first ``first_k_dense_replace`` layers (and those off the ``moe_layer_freq`` stride, the original
code's rule; every released model has stride 1) are dense; the others route to ``num_experts_per_tok`` of
``n_routed_experts`` experts (V2: softmax, ``greedy`` or ``group_limited_greedy``; V3: sigmoid plus
``e_score_correction_bias``, node-limited over ``n_group`` / ``topk_group``, ``norm_topk_prob``), scaled by
``routed_scaling_factor``, plus ``n_shared_experts`` shared experts (one ungated MLP of that many widths).

Checkpoint: HF's per-expert tensors, stacked at load; with a q LoRA, ``q_a_proj`` and ``kv_a_proj_with_mqa`` joined
into one weight (``fuses_qkv_a`` says when); the multi-token-prediction layers
(``num_nextn_predict_layers``, stored as layers past ``num_hidden_layers``) are not part of the target model:
``--speculative-config '{"method": "deepseek_mtp"}'`` loads the first as its draft head (``models.eagle``).
"""
from __future__ import annotations

import dataclasses
import logging
import math

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import checkpoint_names, llama
from jaxserve.models.config_fields import family_extra
from jaxserve.models.layers import moe
from jaxserve.models.layers.decoder import DecoderFamily, DecoderSpec
from jaxserve.models.layers.mla import MLASpec
from jaxserve.models.layers.rotary import make_rotary
from jaxserve.quantization.config import FP8_BLOCK

logger = logging.getLogger(__name__)

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
MODEL_TYPES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
# transformers' defaults where a config.json may omit a field (V2's, then what V3 changes)
DEFAULTS = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": None,
            "moe_intermediate_size": 1407, "first_k_dense_replace": 0, "moe_layer_freq": 1,
            "topk_method": "greedy", "n_group": None, "topk_group": None, "norm_topk_prob": False,
            "routed_scaling_factor": 1.0, "scoring_func": "softmax", "rope_interleave": True,
            "num_nextn_predict_layers": 0}
V3_DEFAULTS = {"n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
               "first_k_dense_replace": 3, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
               "norm_topk_prob": True, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid"}
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")

ATTENTION_NAMES = {
    "q": ("t", ["self_attn.q_proj.weight"]), "q_a": ("t", ["self_attn.q_a_proj.weight"]),
    "q_a_norm": ("same", ["self_attn.q_a_layernorm.weight"]), "q_b": ("t", ["self_attn.q_b_proj.weight"]),
    "kv_a": ("t", ["self_attn.kv_a_proj_with_mqa.weight"]),
    "fused_qkv_a": ("cat_t", ["self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"]),
    "kv_a_norm": ("same", ["self_attn.kv_a_layernorm.weight"]),
}
SHARED_EXPERTS = {
    "shared_gate_up": ("stack_t", ["mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"]),
    "shared_down": ("t", ["mlp.shared_experts.down_proj.weight"]),
    "router_bias": ("same", ["mlp.gate.e_score_correction_bias"]),
}


def is_v3(cfg: ModelConfig) -> bool:
    return cfg.model_type == "deepseek_v3"


def check_config(cfg: ModelConfig) -> None:
    """Refuse the configs this implementation would silently get wrong."""
    llama.check_config(cfg)
    moe.check_config(cfg)
    extra = cfg.extra_dict
    if cfg.attention_bias:
        raise ModelLoadError("attention_bias=true is not supported for DeepSeek models")
    if not is_v3(cfg):
        if extra["topk_method"] not in V2_TOPK_METHODS:
            raise ModelLoadError(f"topk_method {extra['topk_method']!r} is not supported for DeepseekV2 "
                                 f"(supported: {', '.join(V2_TOPK_METHODS)})")
        if extra["norm_topk_prob"]:
            raise ModelLoadError("norm_topk_prob=true is not supported for DeepseekV2: transformers ignores it and "
                                 "the original code renormalises without routed_scaling_factor; no released V2 sets it")
    elif extra["scoring_func"] != "sigmoid":
        raise ModelLoadError(f"scoring_func {extra['scoring_func']!r} is not supported for DeepseekV3 (sigmoid)")
    groups, experts = _groups(cfg), int(extra["num_experts"])
    if experts % groups[0] or not 1 <= groups[1] <= groups[0]:
        raise ModelLoadError(f"n_group {groups[0]} must divide the {experts} experts and topk_group {groups[1]} must "
                             f"be between 1 and n_group")


def _groups(cfg: ModelConfig) -> tuple[int, int]:
    """(expert groups, groups a token may use): V2's ``greedy`` has one group."""
    extra = cfg.extra_dict
    if not is_v3(cfg) and extra["topk_method"] == "greedy":
        return 1, 1
    return int(extra["n_group"] or 1), int(extra["topk_group"] or 1)


def mla_spec(cfg: ModelConfig) -> MLASpec:
    e = cfg.extra_dict
    return MLASpec(q_lora_rank=int(e["q_lora_rank"]) if e["q_lora_rank"] else None,
                   kv_lora_rank=int(e["kv_lora_rank"]), qk_nope_head_dim=int(e["qk_nope_head_dim"]),
                   qk_rope_head_dim=int(e["qk_rope_head_dim"]), v_head_dim=int(e["v_head_dim"]),
                   fused_qkv_a=bool(e.get("fused_qkv_a")))


def fuses_qkv_a(hf: dict, q_lora_rank: int | None) -> bool:
    """Whether ``q_a_proj`` and ``kv_a_proj_with_mqa`` (both read the attention norm's output) load as one
    ``fused_qkv_a`` weight, one GEMM a layer: with a q LoRA, from a float checkpoint, or an fp8 one whose
    ``q_a_proj`` outputs fill whole 128 x 128 scale blocks (joined on the outputs, the blocks stay exact: V2 / V3's
    1536). Other checkpoints keep the two GEMMs (int4 formats: each module has its own groups and act order)."""
    if not q_lora_rank:
        return False
    qc = hf.get("quantization_config")
    if not qc:
        return True
    return qc.get("quant_method") == "fp8" and int(q_lora_rank) % FP8_BLOCK == 0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: ModelConfig, spec: MLASpec) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under scaled RoPE (HF's
    ``yarn_apply_mscale``)."""
    scale = spec.qk_head_dim ** -0.5
    scaling = cfg.rope_scaling_dict or {}
    if scaling and scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def decoder_spec(cfg: ModelConfig) -> DecoderSpec:
    extra, attn = cfg.extra_dict, mla_spec(cfg)
    rotary = make_rotary(cfg.rope_theta, attn.qk_rope_head_dim, cfg.rope_scaling_dict, cfg.max_position_embeddings,
                         interleaved=bool(extra["rope_interleave"]) or not is_v3(cfg))
    first_dense, freq = int(extra["first_k_dense_replace"] or 0), int(extra["moe_layer_freq"] or 1)
    groups, topk_groups = _groups(cfg)
    spec = moe.moe_spec(cfg, renormalize=bool(extra["norm_topk_prob"]), weights_in_hidden_dtype=False,
                        shared_intermediate_size=int(extra["shared_expert_intermediate_size"]) or None)
    spec = dataclasses.replace(
        spec, layers=tuple(i >= first_dense and i % freq == 0 for i in range(cfg.num_layers)),
        router="deepseek_v3" if is_v3(cfg) else "deepseek_v2", num_groups=groups, topk_groups=topk_groups,
        routed_scaling_factor=float(extra["routed_scaling_factor"]), shared_expert_gate=False)
    return DecoderSpec(sm_scale=softmax_scale(cfg, attn), windows=(None,) * cfg.num_layers, rotaries=(rotary,),
                       layer_rotary=(0,) * cfg.num_layers, moe=spec, mla=attn)


def layer_names(cfg: ModelConfig) -> dict:
    """Llama's norms and dense MLP, MLA's projections (``kv_b_proj`` split into ``uk`` and ``uv``), the routed
    experts (``mlp.experts.<e>.*``), the shared experts and V3's router bias."""
    dense = {k: llama.LAYER_NAMES[k] for k in ("attn_norm", "mlp_norm", "o", "gate_up", "down")}
    spec = mla_spec(cfg)
    split = (cfg.num_heads, spec.qk_nope_head_dim)
    kv_b = {"uk": (("mla_uk", *split), ["self_attn.kv_b_proj.weight"]),
            "uv": (("mla_uv", *split), ["self_attn.kv_b_proj.weight"])}
    return {**dense, **ATTENTION_NAMES, **kv_b, **SHARED_EXPERTS,
            **checkpoint_names.moe_layer_names(cfg.extra_dict["num_experts"], "mlp", router="gate",
                                               gate="gate_proj", up="up_proj", down="down_proj")}


def read_hf(hf: dict, fields: dict) -> dict:
    """The MLA and MoE fields into ``extra`` (and whether q_a and kv_a are fused: ``fuses_qkv_a``); the cache's
    one latent "kv head" of ``kv_lora_rank + qk_rope_head_dim`` values as ``num_kv_heads`` / ``head_dim``."""
    defaults = DEFAULTS | (V3_DEFAULTS if hf.get("model_type") == "deepseek_v3" else {})
    extra = family_extra(hf, defaults)
    if extra["num_experts_per_tok"] is None:
        raise ModelLoadError("the DeepSeek config has no num_experts_per_tok")
    extra |= {"num_experts": int(extra.pop("n_routed_experts")),
              "shared_expert_intermediate_size": int(extra["moe_intermediate_size"]) * int(extra["n_shared_experts"]),
              "fused_qkv_a": fuses_qkv_a(hf, extra["q_lora_rank"])}
    if extra["num_nextn_predict_layers"]:
        logger.info("%d multi-token-prediction layer(s) of this checkpoint are not part of the model (the "
                    "speculative method deepseek_mtp loads them as its draft head)",
                    int(extra["num_nextn_predict_layers"]))
    return fields | {"num_kv_heads": 1, "head_dim": int(extra["kv_lora_rank"]) + int(extra["qk_rope_head_dim"]),
                     "extra": extra}


FAMILY = DecoderFamily(decoder_spec, check_config, layer_names, architectures=ARCHITECTURES,
                       model_types=MODEL_TYPES, read_hf=read_hf)
