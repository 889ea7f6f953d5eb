"""Fields of an HF ``config.json`` that every family reads the same way: RoPE parameters, eos ids, and the family
hyper-parameters kept in ``ModelConfig.extra``.

RoPE parameters are normalised to one shape whatever the transformers version wrote: ``rope_theta`` on the
config and ``rope_scaling`` as ``(("rope_type", ...), ...)`` pairs, or ``None`` for plain RoPE.
"""
from __future__ import annotations

from typing import Any

from jaxserve.errors import ModelLoadError

# RoPE variants layers.rotary implements; "dynamic" (NTK) depends on each request's length, which a ragged
# batch does not have one of, so it is refused rather than silently approximated.
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "longrope", "yarn")
# fields a family with hyper-parameters in ModelConfig.extra reads from config.json as they are
FAMILY_FIELDS = ("layer_types", "use_sliding_window", "attention_bias", "final_logit_softcapping",
                 "attn_logit_softcapping", "use_bidirectional_attention", "max_window_layers")


def freeze(value: Any) -> Any:
    """Lists → tuples, recursively, so the value can sit in a hashable ModelConfig."""
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    return value


def rope(hf: dict, layer_type: str = "full_attention") -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(rope_theta, rope_scaling pairs) from either transformers 4 (``rope_theta`` + ``rope_scaling``) or
    transformers 5 (``rope_parameters``, per layer type when a family gives its layer types their own RoPE)
    spelling."""
    params = dict(hf.get("rope_parameters") or {})
    if layer_type in params or "sliding_attention" in params:
        params = dict(params.get(layer_type) or {})
    scaling = params
    if hf.get("rope_scaling") and layer_type == "full_attention":   # the older, more specific key wins
        scaling = {k: v for k, v in scaling.items() if k == "rope_theta"} | dict(hf["rope_scaling"])
    theta = float(scaling.pop("rope_theta", hf.get("rope_theta") or 10000.0))
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    scaling.pop("partial_rotary_factor", None)
    if rope_type == "su":
        rope_type = "longrope"     # LongRoPE's old name (transformers renames it too)
    if rope_type in ("longrope", "yarn") and hf.get("original_max_position_embeddings"):
        scaling.setdefault("original_max_position_embeddings", int(hf["original_max_position_embeddings"]))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"rope_scaling type {rope_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    return theta, freeze({"rope_type": rope_type, **scaling})


def eos_ids(*values: Any) -> tuple[int, ...]:
    """The distinct ids of ``values`` (each an id, a list of ids or None), in order."""
    ids: list[int] = []
    for v in values:
        for i in (v if isinstance(v, (list, tuple)) else [v]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def family_extra(hf: dict, defaults: dict) -> dict:
    """A family's ``ModelConfig.extra``: its hyper-parameters (``defaults``: HF's values where config.json may
    omit them) and the ``FAMILY_FIELDS`` the config has."""
    return {k: hf.get(k, v) for k, v in defaults.items()} | {k: hf[k] for k in FAMILY_FIELDS if k in hf}
