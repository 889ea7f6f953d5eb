"""``--quantization`` (vLLM's names) and the checkpoint's ``quantization_config`` → one ``QuantConfig``.

``auto`` (the default) follows the checkpoint; ``none`` insists on an unquantized one; a method names what
the checkpoint must hold, except ``fp8`` on an unquantized checkpoint, which quantizes it at load (vLLM's
online fp8: per-channel weights, dynamic per-token activations). Any other disagreement is an error that
says what the checkpoint is, so a wrong flag never silently loads garbage. A GGUF file (``gguf_quantization``)
keeps its projections quantized (in the int4 layout) under ``auto`` and ``gguf``; ``none`` dequantizes every
tensor.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxserve.errors import ModelLoadError

QUANTIZATION_METHODS = ("auto", "fp8", "awq", "gptq", "compressed-tensors", "gguf", "none")
# vLLM's kernel-specific spellings of the same checkpoint formats
_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "compressed_tensors": "compressed-tensors"}
INT4_GROUP_DEFAULT = 128     # the group of dummy int4 weights (the formats' common default)
GGUF_GROUP = 32              # GGUF's blocks (its k-quants' sub-blocks)
FP8_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How the decoder's linear weights are stored.

    ``weights``: ``"int4"`` (W4A16: AWQ, GPTQ, compressed-tensors pack-quantized) or ``"fp8"`` (e4m3).
    ``fp8_scales``: ``"tensor"`` / ``"channel"`` / ``"block"`` (128 × 128); ``activation_scheme``:
    ``"dynamic"`` (per-token scales computed in the step) or ``"static"`` (the checkpoint's ``input_scale``).
    ``online``: quantized at load from a float checkpoint (``--quantization fp8``) or random (dummy weights).
    ``ignore``: module names (``lm_head``, ``model.layers.0.mlp.down_proj``) the checkpoint leaves in float.
    """
    method: str
    weights: str
    group_size: int = INT4_GROUP_DEFAULT
    symmetric: bool = False
    desc_act: bool = False
    fp8_scales: str = "channel"
    activation_scheme: str = "dynamic"
    online: bool = False
    ignore: tuple[str, ...] = ()

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint module ``model.layers.3.self_attn.q_proj`` is quantized (``ignore`` entries
        are module names, name suffixes, or compressed-tensors' ``re:`` patterns)."""
        for name in self.ignore:
            if name.startswith("re:"):
                if re.fullmatch(name[3:], module):
                    return False
            elif module == name or module.endswith("." + name) or name.endswith("." + module):
                return False
        return True


def canonical_method(name: str | None) -> str:
    """vLLM's spellings (``awq_marlin``, ``gptq_marlin``) of a method → its name here; None → ``auto``."""
    return _ALIASES.get(name or "auto", name or "auto")


def resolve_quantization(requested: str | None, hf_config: dict | None, source: str = "the checkpoint"
                         ) -> QuantConfig | None:
    """The quantization to load ``source`` with, or None for float weights; a clear error on a mismatch."""
    requested = canonical_method(requested)
    if requested not in QUANTIZATION_METHODS:
        raise ModelLoadError(f"quantization {requested!r} is not supported; choose one of "
                             f"{', '.join(QUANTIZATION_METHODS)}")
    qc = (hf_config or {}).get("quantization_config")
    stored = _ALIASES.get(qc.get("quant_method"), qc.get("quant_method")) if isinstance(qc, dict) else None
    if stored is None:
        if requested in ("auto", "none"):
            return None
        if requested == "fp8":
            return QuantConfig(method="fp8", weights="fp8", fp8_scales="channel", online=True)
        raise ModelLoadError(f"--quantization {requested}: {source} has no quantization_config in its "
                             f"config.json (an unquantized checkpoint: only fp8 quantizes one at load)")
    if requested == "none":
        raise ModelLoadError(f"{source} is quantized with {stored} (config.json quantization_config); "
                             f"pass --quantization {stored} or auto")
    if requested != "auto" and requested != stored:
        raise ModelLoadError(f"--quantization {requested} does not match {source}, which is quantized with "
                             f"{stored} (config.json quantization_config); pass --quantization {stored} or auto")
    parse = {"awq": _awq, "gptq": _gptq, "fp8": _fp8, "compressed-tensors": _compressed_tensors}.get(stored)
    if parse is None:
        raise ModelLoadError(f"{source} is quantized with {stored!r}, which is not supported (supported: "
                             f"awq, gptq, fp8, compressed-tensors)")
    return parse(qc, source)


def gguf_quantization(requested: str | None, source: str, float_modules: tuple[str, ...]) -> QuantConfig | None:
    """How a GGUF file's projections load: ``auto`` / ``gguf`` keep them in the int4 layout (``gguf_formats``;
    ``float_modules``: the projections' modules whose type has no exact form there, dequantized); ``none``:
    None, every tensor dequantized to the float dtype."""
    requested = canonical_method(requested)
    if requested == "none":
        return None
    if requested not in ("auto", "gguf"):
        raise ModelLoadError(f"--quantization {requested}: {source} is a GGUF file; pass auto or gguf (its "
                             f"quantized weights kept so) or none (every weight dequantized)")
    return QuantConfig(method="gguf", weights="int4", group_size=GGUF_GROUP, ignore=float_modules)


def checkpoint_quantization(method: str) -> QuantConfig:
    """The QuantConfig of random weights in ``method``'s storage (``--load-format dummy --quantization X``)."""
    if method in ("fp8",):
        return QuantConfig(method="fp8", weights="fp8", fp8_scales="channel", online=True)
    group = GGUF_GROUP if method == "gguf" else INT4_GROUP_DEFAULT
    return QuantConfig(method=method, weights="int4", group_size=group, online=True)


def _bits(qc: dict, source: str, key: str = "bits") -> None:
    if int(qc.get(key, 4)) != 4:
        raise ModelLoadError(f"{source}: {qc.get(key)}-bit {qc.get('quant_method')} weights are not supported "
                             f"(4-bit only)")


def _group(value: Any, source: str) -> int:
    g = int(value if value is not None else INT4_GROUP_DEFAULT)
    if g != -1 and (g <= 0 or g % 8):
        raise ModelLoadError(f"{source}: group_size {g} is not supported (a multiple of 8, or -1)")
    return g


def _ignored(qc: dict, *keys: str) -> tuple[str, ...]:
    out: list[str] = []
    for key in keys:
        out += [str(n) for n in (qc.get(key) or [])]
    return tuple(out)


def _awq(qc: dict, source: str) -> QuantConfig:
    _bits(qc, source, "bits" if "bits" in qc else "w_bit")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelLoadError(f"{source}: AWQ version {version!r} is not supported (GEMM layout only)")
    if qc.get("zero_point") is False:
        raise ModelLoadError(f"{source}: AWQ without zero points is not supported")
    return QuantConfig(method="awq", weights="int4", group_size=_group(qc.get("group_size", qc.get("q_group_size")),
                                                                      source),
                       ignore=_ignored(qc, "modules_to_not_convert"))


def _gptq(qc: dict, source: str) -> QuantConfig:
    _bits(qc, source)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", None):
        raise ModelLoadError(f"{source}: GPTQ checkpoint_format {fmt!r} is not supported (gptq, i.e. v1 zeros)")
    return QuantConfig(method="gptq", weights="int4", group_size=_group(qc.get("group_size"), source),
                       symmetric=bool(qc.get("sym", True)), desc_act=bool(qc.get("desc_act", False)),
                       ignore=_ignored(qc, "modules_to_not_convert"))


def _fp8(qc: dict, source: str) -> QuantConfig:
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ModelLoadError(f"{source}: fp8 activation_scheme {scheme!r} is not supported (dynamic, static)")
    block = qc.get("weight_block_size")
    if block is not None and list(block) != [FP8_BLOCK, FP8_BLOCK]:
        raise ModelLoadError(f"{source}: fp8 weight_block_size {block} is not supported ([128, 128])")
    return QuantConfig(method="fp8", weights="fp8", fp8_scales="block" if block else "tensor",
                       activation_scheme=scheme, ignore=_ignored(qc, "modules_to_not_convert", "ignored_layers"))


def _compressed_tensors(qc: dict, source: str) -> QuantConfig:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ModelLoadError(f"{source}: compressed-tensors with {len(groups)} config groups is not supported "
                             f"(one scheme for every Linear)")
    scheme = next(iter(groups.values()))
    w, act = scheme.get("weights") or {}, scheme.get("input_activations")
    fmt, strategy = qc.get("format"), w.get("strategy")
    ignore = _ignored(qc, "ignore")
    if w.get("type") == "int" and fmt == "pack-quantized":
        _bits(w, source, "num_bits")
        if act:
            raise ModelLoadError(f"{source}: compressed-tensors int4 with quantized activations is not supported "
                                 f"(W4A16 only)")
        if w.get("actorder") not in (None, "weight", False):
            raise ModelLoadError(f"{source}: compressed-tensors actorder {w.get('actorder')!r} is not supported")
        if strategy not in ("group", "channel"):
            raise ModelLoadError(f"{source}: compressed-tensors int4 strategy {strategy!r} is not supported")
        group = _group(w.get("group_size"), source) if strategy == "group" else -1
        return QuantConfig(method="compressed-tensors", weights="int4", group_size=group,
                           symmetric=bool(w.get("symmetric", True)), ignore=ignore)
    if w.get("type") == "float" and int(w.get("num_bits", 8)) == 8 and fmt in ("float-quantized",
                                                                               "naive-quantized"):
        if strategy not in ("tensor", "channel", "block"):
            raise ModelLoadError(f"{source}: compressed-tensors fp8 strategy {strategy!r} is not supported")
        if strategy == "block" and list(w.get("block_structure") or []) != [FP8_BLOCK, FP8_BLOCK]:
            raise ModelLoadError(f"{source}: compressed-tensors fp8 block_structure {w.get('block_structure')} "
                                 f"is not supported ([128, 128])")
        scheme_name = "static" if act and not act.get("dynamic", False) else "dynamic"
        if act and scheme_name == "static" and act.get("strategy") != "tensor":
            raise ModelLoadError(f"{source}: static fp8 activation scales must be per tensor")
        return QuantConfig(method="compressed-tensors", weights="fp8", fp8_scales=strategy,
                           activation_scheme=scheme_name, ignore=ignore)
    raise ModelLoadError(f"{source}: compressed-tensors format {fmt!r} with {w.get('num_bits')}-bit "
                         f"{w.get('type')} weights is not supported (pack-quantized int4, float-quantized fp8)")
