"""What a family declares to read GGUF files (``GGUFArch``), and the metadata lookups its readers share
(``GGUFMeta``: ``<arch>.<key>`` values and the HF config fields every architecture stores alike).

llama.cpp's converters write a model's hyper-parameters as ``<general.architecture>.<key>`` metadata and
hard-code the rest in llama.cpp; a family's reader turns that back into the HF ``config.json`` the model came
from (``hf_config``), so the family's one config reader applies, or (``model_config``) straight into a
``ModelConfig``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from jaxserve.errors import ModelLoadError


@dataclasses.dataclass(frozen=True)
class GGUFArch:
    """How a family reads one GGUF ``general.architecture``.

    The config, by one of ``hf_config(meta: GGUFMeta, reader) -> dict`` (the HF config.json; ``reader`` is the
    ``GGUFFile`` for configs kept in tensors, None when only the metadata is at hand) or ``model_config(metadata,
    tensor names, rope_freqs) -> ModelConfig``; ``check(metadata)`` refuses the files the family would read
    wrong. The tensors: ``tensor_names``, (HF name pattern, llama.cpp replacement) pairs applied before the
    names every architecture shares (``gguf_loader.TENSOR_NAMES``); ``fix_tensor(gguf name, values, cfg)``
    undoes what llama.cpp's converter changed in a tensor's values (HF layout in, HF values out).
    """
    hf_config: Callable[[GGUFMeta, Any], dict] | None = None
    model_config: Callable[..., Any] | None = None
    check: Callable[[dict], None] | None = None
    tensor_names: tuple[tuple[str, str], ...] = ()
    fix_tensor: Callable[[str, np.ndarray, Any], np.ndarray] | None = None


class GGUFMeta:
    """``<arch>.<key>`` lookups of one GGUF's metadata, and the HF config fields every architecture shares."""

    def __init__(self, meta: dict[str, Any], tensor_names: set[str]):
        self.meta, self.arch, self.tensor_names = meta, meta.get("general.architecture"), tensor_names

    def get(self, key: str, default: Any = None) -> Any:
        value = self.meta.get(f"{self.arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata has no {self.arch}.{key}")
        return value

    def real(self, key: str, default: float | None = None) -> float | None:
        """A float32 metadata value as the decimal the converter wrote (1e-05, not 9.99999974e-06): the
        shortest one that rounds to the same float32. None stays None when ``default`` is None and the key
        is absent."""
        value = self.meta.get(f"{self.arch}.{key}", default)
        return None if value is None else float(str(np.float32(value)))

    def eos_ids(self, end_of_turn: str | None = None) -> list[int]:
        """The eos id, and the end-of-turn token (``tokenizer.ggml.eot_token_id``, else ``end_of_turn`` by
        name) that llama.cpp also stops at."""
        eos = [int(self.meta.get("tokenizer.ggml.eos_token_id", 1))]
        tokens = self.meta.get("tokenizer.ggml.tokens")
        eot = self.meta.get("tokenizer.ggml.eot_token_id")
        if eot is None and end_of_turn and tokens is not None and end_of_turn in tokens:
            eot = tokens.index(end_of_turn)
        return eos + ([int(eot)] if eot is not None and int(eot) not in eos else [])

    def common(self) -> dict[str, Any]:
        hidden, heads = int(self.get("embedding_length")), int(self.get("attention.head_count"))
        tokens = self.meta.get("tokenizer.ggml.tokens")
        vocab = self.meta.get(f"{self.arch}.vocab_size", len(tokens) if tokens is not None else None)
        if vocab is None:
            raise ModelLoadError("GGUF metadata has no vocab size")
        scaling = self.meta.get(f"{self.arch}.rope.scaling.type")
        if scaling not in (None, "none", "linear"):
            raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not supported for {self.arch}")
        return {
            "vocab_size": int(vocab), "hidden_size": hidden, "intermediate_size": int(self.get("feed_forward_length")),
            "num_hidden_layers": int(self.get("block_count")), "num_attention_heads": heads,
            "num_key_value_heads": int(self.get("attention.head_count_kv", heads)),
            "head_dim": int(self.get("attention.key_length", hidden // heads)),
            "max_position_embeddings": int(self.get("context_length")),
            "rope_theta": self.real("rope.freq_base", 10000.0),
            "rope_scaling": ({"rope_type": "linear", "factor": float(self.get("rope.scaling.factor"))}
                             if scaling == "linear" else None),
            "tie_word_embeddings": "output.weight" not in self.tensor_names, "attention_bias": False,
            "bos_token_id": self.meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": self.eos_ids(),
            "pad_token_id": self.meta.get("tokenizer.ggml.padding_token_id"),
        }


def gguf_tensor(reader, name: str) -> np.ndarray:
    """The tensor ``name`` of a ``GGUFFile``, dequantized to float32."""
    from gguf.quants import dequantize  # noqa: PLC0415

    t = next(t for t in reader.tensors if t.name == name)
    return dequantize(t.data, t.tensor_type).astype(np.float32)
