"""Writing small safetensors checkpoints in tests: the tensors, and a folder with its HF config."""
from __future__ import annotations

import json
import os

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
