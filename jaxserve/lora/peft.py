"""A PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) read into per-layer
float32 matrices and checked against the base model, with errors a user can act on.

Per layer and target projection the adapter is ``A [in, r]`` and ``B [r, out]`` (PEFT stores them as torch
``Linear`` weights, ``[r, in]`` and ``[out, r]``) with PEFT's scaling folded into B: ``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` under rsLoRA. The targets are the decoder's seven projections; PEFT's gate and up
stay apart here (the device stacks fuse them, ``jaxserve.lora.slots``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import JaxServeError, ModelLoadError
from jaxserve.models.safetensors_loader import SafetensorsFile

# PEFT module name -> the decoder's projection
TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
           "down_proj": "down"}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class AdapterError(JaxServeError, ValueError):
    """An adapter that cannot be served: a bad folder, a rank above --max-lora-rank, a target the model lacks."""


@dataclasses.dataclass
class LoRAAdapter:
    """An adapter read from its folder: ``layers[i][target] = (A [in, r], B [r, out] scaled)``, float32."""
    path: str
    rank: int
    scaling: float
    layers: list[dict[str, tuple[np.ndarray, np.ndarray]]]

    @property
    def targets(self) -> set[str]:
        return {t for layer in self.layers for t in layer}


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target projection's ``(in, out)`` in the base model."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)}


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise AdapterError(f"LoRA adapter folder {path!r} does not exist")
    cfg_path = os.path.join(path, "adapter_config.json")
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise AdapterError(f"{path!r} is not a PEFT adapter: it has no adapter_config.json") from None
    except ValueError as e:
        raise AdapterError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{cfg_path}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (full trained layers)"),
                     ("rank_pattern", "per-module ranks (rank_pattern)"),
                     ("alpha_pattern", "per-module alphas (alpha_pattern)")):
        if config.get(key):
            raise AdapterError(f"{cfg_path}: {why} is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise AdapterError(f"{cfg_path}: LoRA bias terms are not supported (bias must be 'none')")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise AdapterError(f"{cfg_path}: r must be a positive integer, got {config.get('r')!r}")
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        unknown = sorted(str(t) for t in targets if str(t).rpartition(".")[2] not in TARGETS)
        if unknown:
            raise AdapterError(f"{cfg_path}: target modules {unknown} are not supported (the model's projections: "
                               f"{', '.join(TARGETS)})")
    return config


def read_adapter(path: str, cfg: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Read and check the adapter at ``path`` for the base model ``cfg``; raises ``AdapterError``."""
    config = _read_config(path)
    rank = config["r"]
    if rank > max_lora_rank:
        raise AdapterError(f"LoRA adapter {path!r} has rank {rank}, above --max-lora-rank {max_lora_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    st_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(st_path):
        raise AdapterError(f"{path!r} has no adapter_model.safetensors (only safetensors adapters are read)")
    try:
        st = SafetensorsFile(st_path)
    except ModelLoadError as e:
        raise AdapterError(str(e)) from None
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name in st.names():
        m = _KEY.match(name)
        if m is None:
            raise AdapterError(f"{st_path}: tensor {name} is not a LoRA A/B weight of a decoder layer's projection")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS:
            raise AdapterError(f"{st_path}: target module {module} is not supported (the model's projections: "
                               f"{', '.join(TARGETS)})")
        if layer >= cfg.num_layers:
            raise AdapterError(f"{st_path}: tensor {name} is for layer {layer}; the model has {cfg.num_layers}")
        found.setdefault((layer, TARGETS[module]), {})[which] = np.asarray(st.get(name), np.float32)
    if not found:
        raise AdapterError(f"{st_path} holds no LoRA weights")
    shapes = projection_shapes(cfg)
    layers: list[dict] = [{} for _ in range(cfg.num_layers)]
    for (layer, target), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{st_path}: layer {layer} {target} has lora_{'A' if 'A' in ab else 'B'} only")
        n_in, n_out = shapes[target]
        if ab["A"].shape != (rank, n_in) or ab["B"].shape != (n_out, rank):
            raise AdapterError(f"{st_path}: layer {layer} {target}: lora_A {ab['A'].shape} / lora_B {ab['B'].shape} "
                               f"do not fit the model's projection ({n_in} -> {n_out}) at rank {rank}")
        layers[layer][target] = (np.ascontiguousarray(ab["A"].T), np.ascontiguousarray(ab["B"].T) * scaling)
    return LoRAAdapter(path=path, rank=rank, scaling=scaling, layers=layers)


def write_random_adapter(folder: str, cfg: ModelConfig, rank: int, *, seed: int = 0, alpha: float | None = None,
                         targets: tuple[str, ...] = tuple(TARGETS), std: float = 0.02) -> str:
    """A PEFT adapter folder of random weights for ``cfg`` (every layer, ``targets`` as PEFT names): what a
    benchmark serves when it needs adapters of a model's shape and no trained ones. Returns ``folder``."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    rng, shapes = np.random.default_rng(seed), projection_shapes(cfg)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in targets:
            n_in, n_out = shapes[TARGETS[module]]
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) * std).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * std).astype(np.float32)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha or rank, "target_modules": list(targets),
                   "bias": "none", "task_type": "CAUSAL_LM"}, f, indent=2)
    return folder
