"""Writing small safetensors checkpoints in tests: the tensors, a folder with its HF config, and a sharded
Llama checkpoint with its index."""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    # safetensors writes a non-contiguous array's memory as it lies (a transposed view comes back scrambled)
    save_file({name: np.ascontiguousarray(a) for name, a in tensors.items()}, path)


def write_folder(folder, tensors: dict[str, np.ndarray], hf: dict) -> str:
    """A one-file checkpoint folder: ``config.json`` (``hf``) and ``model.safetensors``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    write_safetensors(os.path.join(folder, "model.safetensors"), tensors)
    return str(folder)


# a Llama of a few tens of MB in bf16, its largest tensor a small share of it, written in SHARDS files
SHARDED_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
                 "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                 "num_hidden_layers": 6, "vocab_size": 2048, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
                 "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                 "bos_token_id": 1, "eos_token_id": 2}
SHARDS = 4


def llama_tensors(hf: dict) -> dict[str, np.ndarray]:
    """Random bf16 tensors of a Llama checkpoint of ``hf``'s shape, by HF name (seeded: the same each call)."""
    from jaxserve.models import checkpoint_names, registry
    from jaxserve.models.configs import model_config_from_hf
    cfg, family = model_config_from_hf(hf), registry.resolve_architecture(hf["architectures"])[1]
    shapes = checkpoint_names.hf_shapes(family.weight_plan(cfg), family.param_shapes(cfg))
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s, np.float32).astype(ml_dtypes.bfloat16) for n, s in shapes.items()}


def write_sharded(folder, hf: dict = SHARDED_LLAMA, tensors: dict | None = None) -> list[str]:
    """The checkpoint in SHARDS files with its index, as HF writes a large model; the files' names."""
    tensors = llama_tensors(hf) if tensors is None else tensors
    names = list(tensors)
    files = [f"model-{k + 1:05d}-of-{SHARDS:05d}.safetensors" for k in range(SHARDS)]
    weight_map = {n: files[j * SHARDS // len(names)] for j, n in enumerate(names)}
    for fname in files:
        write_safetensors(str(folder / fname), {n: tensors[n] for n in names if weight_map[n] == fname})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(hf))
    return files
