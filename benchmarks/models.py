"""The benchmarked model's shape (a `jaxserve.config.ModelConfig`) without loading its weights, and the
HF config dict that builds the same shape in transformers (for the same-GPU baseline)."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from .config import CONFIGS_DIR

MODELS_DIR = CONFIGS_DIR / "models"


def named_model_hf_config(name: str) -> dict | None:
    """The HF config.json values of a configs/models entry (NAME.json, NAME.yaml or NAME/config.json)."""
    for cand in (MODELS_DIR / f"{name}.json", MODELS_DIR / name / "config.json", MODELS_DIR / f"{name}.yaml",
                 MODELS_DIR / f"{name}.yml"):
        if cand.is_file():
            return json.loads(cand.read_text()) if cand.suffix == ".json" else yaml.safe_load(cand.read_text())
    return None


def resolve_model(cfg: dict):
    """(ModelConfig, HF config dict) of the config's model: a configs/models name, an HF folder, a GGUF
    file, or (neither) the embedded SmolLM2 GGUF; the engine section's ``hf_overrides`` applied as the engine
    applies them."""
    from jaxserve.models.configs import model_config_from_hf, with_hf_overrides
    from jaxserve.models.packaged import embedded_model_path, is_packaged_model, packaged_gguf_path
    overrides = (cfg.get("engine") or {}).get("hf_overrides")

    def read(hf: dict):
        hf = with_hf_overrides(hf, overrides)
        return model_config_from_hf(hf), hf

    m = cfg["model"]
    target = m.get("path") or m.get("name")
    if is_packaged_model(target):           # a packaged GGUF by its short name (gemma3-270m)
        target = packaged_gguf_path(target)
    if target and Path(target).is_dir():
        return read(json.loads((Path(target) / "config.json").read_text()))
    if m.get("name") and not Path(target).exists():
        hf = named_model_hf_config(m["name"])
        if hf is None:
            known = ", ".join(sorted(p.stem for p in MODELS_DIR.iterdir())) if MODELS_DIR.is_dir() else "none"
            raise ValueError(f"model.name {m['name']!r} is not in configs/models (known: {known})")
        return read(hf)
    path = target or embedded_model_path()
    if not str(path).endswith(".gguf") or not Path(path).is_file():
        raise ValueError(f"model {path!r}: expected an HF folder, a .gguf file or a configs/models name")
    from jaxserve.models.gguf_file import GGUFFile
    from jaxserve.models.gguf_loader import gguf_hf_config, gguf_rope_freqs, model_config_from_gguf
    reader = GGUFFile(path)
    names = {t.name for t in reader.tensors}
    hf = gguf_hf_config(reader.fields, names, reader)      # the architectures read through their HF config
    if hf is not None:
        return read(hf)
    mc = model_config_from_gguf(reader.metadata(), names, rope_freqs=gguf_rope_freqs(reader))
    return mc, hf_config_from_model_config(mc)


def hf_config_from_model_config(mc) -> dict:
    """An HF config.json dict with the same shape (for transformers' AutoConfig.for_model)."""
    return {"architectures": [mc.architecture], "model_type": mc.model_type, "vocab_size": mc.vocab_size,
            "hidden_size": mc.hidden_size, "intermediate_size": mc.intermediate_size,
            "num_hidden_layers": mc.num_layers, "num_attention_heads": mc.num_heads,
            "num_key_value_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "rms_norm_eps": mc.rms_norm_eps,
            "rope_theta": mc.rope_theta, "rope_scaling": mc.rope_scaling_dict,
            "max_position_embeddings": mc.max_position_embeddings, "tie_word_embeddings": mc.tie_word_embeddings,
            "attention_bias": mc.attention_bias, "mlp_bias": mc.mlp_bias, "hidden_act": mc.hidden_act}


def weight_dtype(cfg: dict, platform: str) -> str:
    """The dtype the engine runs the weights in, for the roofline: the config's `engine.dtype`, or for
    "auto" bfloat16 on accelerators and float32 on CPU."""
    dtype = (cfg["engine"].get("dtype") or "auto")
    if dtype == "auto":
        return "float32" if platform == "cpu" else "bfloat16"
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32", "fp32": "float32"}.get(dtype, dtype)


def kv_dtype(cfg: dict, weights: str) -> str:
    kv = cfg["engine"].get("kv_cache_dtype") or "auto"
    return weights if kv == "auto" else ("fp8" if kv.startswith("fp8") else kv)
