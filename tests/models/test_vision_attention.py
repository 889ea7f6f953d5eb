"""The CLIP / SigLIP towers (LLaVA, Gemma 3) through ``JAXSERVE_VISION_ATTENTION``'s fused attention call
(``jax.nn.dot_product_attention``: cuDNN's kernel on a GPU, its XLA path here) encode as the dense scores.
Qwen's windows and segments: ``test_qwen2_vl.py``; the cuDNN kernel itself: ``tests/kernels/test_gpu.py``."""
from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from jaxserve.models.layers import vision

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models")


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-gemma3-vision"])
def test_fused_attention_call_encodes_as_the_dense_scores(name, monkeypatch):
    from jaxserve.models.loader import load_model
    folder = os.path.join(FIXTURES, name)
    model = load_model(folder, dtype="float32")
    with open(os.path.join(folder, "config.json")) as f:
        size = json.load(f)["vision_config"]["image_size"]
    pixels = np.random.default_rng(0).standard_normal((2, 3, size, size)).astype(np.float32)
    dense = np.asarray(model.family.encode_images(model.params, pixels, model.config))
    monkeypatch.setenv("JAXSERVE_VISION_ATTENTION", "xla")
    assert vision.attention_implementation() == "xla"
    fused = np.asarray(model.family.encode_images(model.params, pixels, model.config))
    np.testing.assert_allclose(fused, dense, atol=1e-5, rtol=0)


def test_cudnn_is_asked_for_on_a_gpu_only(monkeypatch):
    monkeypatch.setenv("JAXSERVE_VISION_ATTENTION", "cudnn")
    assert vision.attention_implementation() is None            # this host has no GPU: dense
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert vision.attention_implementation() == "cudnn"
    monkeypatch.delenv("JAXSERVE_VISION_ATTENTION")
    assert vision.attention_implementation() == "cudnn"         # auto: cuDNN on a GPU
    # cuDNN's kernel takes 16-bit inputs and head sizes of multiples of 8 up to 128: other towers attend densely
    # (and so keep the query blocks of a long row)
    assert vision.attention_implementation(jax.numpy.ones((1, 4, 2, 64), jax.numpy.bfloat16)) == "cudnn"
    for q in (jax.numpy.ones((1, 4, 2, 8), jax.numpy.float32), jax.numpy.ones((1, 4, 2, 12), jax.numpy.bfloat16),
              jax.numpy.ones((1, 4, 2, 144), jax.numpy.bfloat16)):
        assert vision.attention_implementation(q) is None
        np.testing.assert_array_equal(vision._attend(q, q, q, None, vision.attention_implementation(q)),
                                      vision._attend(q, q, q))
    monkeypatch.setenv("JAXSERVE_VISION_ATTENTION", "dense")
    assert vision.attention_implementation() is None
