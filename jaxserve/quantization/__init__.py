"""Quantized checkpoints: FP8 and int4 W4A16 (AWQ, GPTQ, compressed-tensors, GGUF's block types) weights of the
decoder's projections (``--quantization``, vLLM's names).

``config`` reads the flag and the checkpoint's ``quantization_config``; ``int4_formats`` repacks each int4
format into one layout (``gguf_formats`` GGUF's types); ``weights`` holds the quantized weight pytrees and the
matmul each runs (the kernels: ``kernels/int4_matmul_pallas.py`` on GPUs, XLA's fp8 dot); ``loading`` places them (with their
tensor-parallel shards) for ``models.hf_weights``; ``online`` quantizes float weights on the device.
"""
from .config import QUANTIZATION_METHODS, QuantConfig, checkpoint_quantization, resolve_quantization
from .weights import (Fp8Activation, Fp8Weight, Int4Weight, describe_bytes, is_quantized, matmul,
                      reads_fp8_activations, rms_norm_fp8)

__all__ = ["QUANTIZATION_METHODS", "QuantConfig", "checkpoint_quantization", "resolve_quantization",
           "Fp8Activation", "Fp8Weight", "Int4Weight", "describe_bytes", "is_quantized", "matmul",
           "reads_fp8_activations", "rms_norm_fp8"]
