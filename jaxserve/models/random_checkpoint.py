"""An HF checkpoint folder of random weights for a decoder config's shape: bf16 safetensors shards with their
index, config.json and the embedded SmolLM2 tokenizer's files, written a tensor at a time (the host holds a pool
of random values, not the checkpoint). What a benchmark of loading from the disk serves, and a test's large
checkpoint."""
from __future__ import annotations

import json
import math
import os
import shutil
import struct

import ml_dtypes
import numpy as np

from jaxserve.models import checkpoint_names, packaged, registry
from jaxserve.models.configs import model_config_from_hf

POOL = 1 << 24            # random values every tensor is cut from, so writing runs at the disk's speed


def write_random_checkpoint(folder: str, hf: dict, shards: int = 4, seed: int = 0) -> list[str]:
    """The shards' paths, of about equal size (each synced to the disk); ``hf``: the config.json values."""
    cfg, family = model_config_from_hf(hf), registry.resolve_architecture(hf.get("architectures"))[1]
    shapes = checkpoint_names.hf_shapes(family.weight_plan(cfg), family.param_shapes(cfg))
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(POOL, np.float32) * 0.02).astype(ml_dtypes.bfloat16).view(np.uint16)
    sizes = {n: 2 * math.prod(s) for n, s in shapes.items()}
    shard_of = np.cumsum(list(sizes.values())) * shards // (sum(sizes.values()) + 1)
    paths = [os.path.join(folder, f"model-{k + 1:05d}-of-{shards:05d}.safetensors") for k in range(shards)]
    os.makedirs(folder, exist_ok=True)
    for k, path in enumerate(paths):
        names = [n for n, s in zip(sizes, shard_of) if s == k]
        ends = np.cumsum([0] + [sizes[n] for n in names]).tolist()
        header = json.dumps({n: {"dtype": "BF16", "shape": list(shapes[n]), "data_offsets": ends[i:i + 2]}
                             for i, n in enumerate(names)}).encode()
        header += b" " * (-len(header) % 8)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for name in names:
                left = sizes[name] // 2
                while left:
                    start = int(rng.integers(POOL))
                    f.write(memoryview(pool[start:start + left]))
                    left -= min(left, POOL - start)
            os.fsync(f.fileno())
    weight_map = {n: os.path.basename(paths[s]) for n, s in zip(sizes, shard_of)}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    shutil.copytree(packaged.DUMMY_CONFIG_DIR.parent / "tokenizers" / "smollm2", folder, dirs_exist_ok=True)
    return paths
