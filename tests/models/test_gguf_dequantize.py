"""The whole-tensor Q8_0 / Q4_1 dequantizer gives gguf.quants' values bit for bit (the embedded SmolLM2 is
Q4_1 with a Q8_0 embedding); other types go through gguf.quants."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from jaxserve.models.gguf_file import dequantize


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1,
                                   GGMLQuantizationType.Q5_0, GGMLQuantizationType.F16])
def test_dequantize_matches_gguf(qtype):
    w = np.random.default_rng(0).normal(size=(3, 5, 128)).astype(np.float32)
    q = quantize(w, qtype)
    ours, ref = dequantize(q, qtype), gguf_dequantize(q, qtype)
    assert ours.shape == ref.shape == w.shape and ours.dtype == np.float32
    assert np.array_equal(ours, ref)
    assert np.abs(ours - w).max() < 0.5                     # it is the tensor, not just the same bytes
