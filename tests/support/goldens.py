"""Reading the golden data under tests/fixtures (what the make_*_fixtures.py scripts wrote from the oracles)."""
from __future__ import annotations

import json
import os

import numpy as np

from support import FIXTURES


def load_golden(path: str) -> dict:
    """A golden JSON file: an absolute path, or one under tests/fixtures."""
    with open(os.path.join(FIXTURES, path)) as f:
        return json.load(f)


def minilm_golden() -> tuple[dict, np.ndarray, np.ndarray]:
    """sentence-transformers on all-MiniLM-L6-v2: (the sentences, ids and versions; the normalized embeddings;
    the pooled vectors before normalizing)."""
    arrays = np.load(os.path.join(FIXTURES, "embeddings", "minilm.npz"))
    return load_golden(os.path.join("embeddings", "minilm.json")), arrays["embeddings"], arrays["pooled"]
