"""GGUF files (llama.cpp's format): the config from the metadata, the weights dequantized on the host into HF
layout and values, then the family's plan (``hf_weights.load_weights``), the tokenizer from the file's own
vocabulary. The projections of the common types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K) skip the
dequantization: their blocks are repacked exactly into the int4 layout (``quantization.gguf_formats``) unless
``--quantization none``. The family that reads the file's ``general.architecture``
(``registry.gguf_architecture``) says how: its config reader, its tensor names beyond the shared ones, and
what the converter changed in a tensor.

The converted weights of the last load of a file are kept on disk (``weight_cache``), so a warm start maps
them instead of dequantizing again.
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import registry, weight_cache
from jaxserve.models.configs import model_config_from_hf, with_config_overrides, with_hf_overrides
from jaxserve.models.gguf_config import GGUFMeta, gguf_tensor
from jaxserve.models.gguf_file import dequantize, open_gguf
from jaxserve.models.hf_weights import load_weights, tree_set
from jaxserve.models.layers.moe import with_expert_parallel
from jaxserve.models.loaded_model import LoadedModel, generation_config, resolve_dtype, resolve_max_model_len
from jaxserve.models.tokenizers import gguf_tokenizer
from jaxserve.quantization import gguf_formats, loading as quant_loading
from jaxserve.quantization.config import gguf_quantization

logger = logging.getLogger(__name__)

# HF tensor name -> llama.cpp's, in order: the names every architecture shares (a family's own go first)
TENSOR_NAMES = ((r"^model\.embed_tokens\.", "token_embd."), (r"^model\.norm\.", "output_norm."),
                (r"^lm_head\.", "output."), (r"^model\.layers\.(\d+)\.", r"blk.\1."),
                (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
                (r"\.self_attn\.q_proj\.", ".attn_q."), (r"\.self_attn\.k_proj\.", ".attn_k."),
                (r"\.self_attn\.v_proj\.", ".attn_v."), (r"\.self_attn\.o_proj\.", ".attn_output."),
                (r"\.self_attn\.q_norm\.", ".attn_q_norm."), (r"\.self_attn\.k_norm\.", ".attn_k_norm."),
                (r"\.mlp\.gate_proj\.", ".ffn_gate."), (r"\.mlp\.up_proj\.", ".ffn_up."),
                (r"\.mlp\.down_proj\.", ".ffn_down."),
                # mixture of experts: the router, a shared expert and its gate
                (r"\.mlp\.gate\.", ".ffn_gate_inp."), (r"\.mlp\.shared_expert_gate\.", ".ffn_gate_inp_shexp."),
                (r"\.mlp\.shared_expert\.gate_proj\.", ".ffn_gate_shexp."),
                (r"\.mlp\.shared_expert\.up_proj\.", ".ffn_up_shexp."),
                (r"\.mlp\.shared_expert\.down_proj\.", ".ffn_down_shexp."))
# HF's per-expert tensor "model.layers.<i>.mlp.experts.<e>.<p>_proj.weight" is row e of llama.cpp's stacked
# "blk.<i>.ffn_<p>_exps.weight" ([E, out, in], HF's Linear layout per expert)
EXPERT_TENSOR = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """The llama.cpp tensor name of an HF tensor name, for GGUF ``general.architecture`` ``arch``."""
    spec = registry.gguf_architecture(arch)
    for pattern, repl in (spec.tensor_names if spec is not None else ()) + TENSOR_NAMES:
        hf_name = re.sub(pattern, repl, hf_name)
    return hf_name


def gguf_getter(reader, path: str, cfg: ModelConfig | None) -> Callable[[str], np.ndarray]:
    """``get(hf_name)``: the GGUF tensor dequantized to float32, in HF layout and HF values (the family's
    ``fix_tensor`` undoes what llama.cpp's converter changed: Llama's q/k rows permuted for its RoPE,
    Gemma's norm weights stored as ``1 + w``). ``get.gguf_rows(hf_name)``: a 2-D tensor's quantized rows
    as stored, its type and its HF shape ``[out, in]`` (``quantization.gguf_formats``); the fix applies to
    the rows too, which holds for the fixes of projections (row permutations)."""
    tensors = {t.name: t for t in reader.tensors}
    arch = reader.fields["general.architecture"]
    spec = registry.gguf_architecture(arch)
    fix = spec.fix_tensor if spec is not None else None
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
        expert = EXPERT_TENSOR.match(hf_name)
        if expert:
            layer, e, proj = expert.groups()
            return dequantized(f"blk.{layer}.ffn_{proj}_exps.weight", hf_name)[int(e)]
        name = gguf_name(hf_name, arch)
        w = dequantized.__wrapped__(name, hf_name)
        return fix(name, w, cfg) if fix is not None else w

    def gguf_rows(hf_name: str) -> tuple[np.ndarray, Any, tuple[int, int]]:
        t = tensors[gguf_name(hf_name, arch)]
        rows = fix(t.name, t.data, cfg) if fix is not None else t.data
        return rows, t.tensor_type, (t.shape[1], t.shape[0])

    get.gguf_rows = gguf_rows
    return get


def gguf_float_modules(reader, cfg: ModelConfig, family) -> tuple[tuple[str, ...], dict, str]:
    """The projections' modules that load dequantized (their GGUF type has no exact form in the int4 layout, or
    a fused weight's modules differ in type), the type of each weight that stays quantized (by its path), and
    the one log line that says which types stay quantized and which were dequantized."""
    arch = reader.fields["general.architecture"]
    types = {t.name: t.tensor_type for t in reader.tensors}
    kept, dequantized, float_modules, kept_paths = collections.Counter(), collections.Counter(), [], {}
    for path, names, _ in family.weight_plan(cfg):
        if not quant_loading.is_linear(path):
            continue
        found = [types.get(gguf_name(n, arch)) for n in names]
        if None not in found and len(set(found)) == 1 and gguf_formats.kept(found[0]):
            kept.update(t.name for t in found)
            kept_paths[path] = found[0]
        else:
            dequantized.update(t.name for t in found if t is not None)
            float_modules += [quant_loading.module_of(n) for n in names]

    def listed(counts):
        return ", ".join(f"{n} {c}" for n, c in sorted(counts.items())) or "none"
    line = (f"{os.path.basename(reader.path)}: projections kept quantized: {listed(kept)}; dequantized: "
            f"{listed(dequantized)}; the other tensors (embeddings, norms, lm_head, experts) dequantized")
    return tuple(float_modules), kept_paths, line


def gguf_structure(family, cfg: ModelConfig, kept: dict):
    """The weight tree's structure, the ``kept`` weights (path → GGUF type) as their int4 weights: what the
    weight cache keys and rebuilds a warm start's tree with."""
    tree = family.param_shapes(cfg)
    for path, tensor_type in kept.items():
        tree_set(tree, path, quant_loading.int4_weight(gguf_formats.form(tensor_type)))
    return jax.tree.structure(tree, is_leaf=lambda x: isinstance(x, tuple))


def gguf_rope_freqs(reader) -> np.ndarray | None:
    """The ``rope_freqs.weight`` factors of a Llama 3.1 GGUF (float32), or None."""
    has = any(t.name == "rope_freqs.weight" for t in reader.tensors)
    return gguf_tensor(reader, "rope_freqs.weight") if has else None


def gguf_hf_config(meta: dict[str, Any], tensor_names: set[str], reader=None) -> dict | None:
    """The HF ``config.json`` that a GGUF's metadata (``GGUFFile.fields``) describes, or None for the
    architectures whose family reads the metadata straight into a ``ModelConfig`` (``model_config_from_gguf``)
    and the ones no family reads. ``reader`` (the ``GGUFFile``) supplies the tensors some configs live in
    (Phi-3's LongRoPE factors)."""
    spec = registry.gguf_architecture(meta.get("general.architecture"))
    if spec is None:
        return None
    if spec.check is not None:
        spec.check(meta)
    return None if spec.hf_config is None else spec.hf_config(GGUFMeta(meta, tensor_names), reader)


def model_config_from_gguf(meta: dict[str, Any], tensor_names: set[str], rope_freqs=None) -> ModelConfig:
    """``ModelConfig`` from GGUF metadata (``GGUFFile.metadata()``) of an architecture whose family reads it
    straight (``GGUFArch.model_config``); ``rope_freqs``: the file's ``rope_freqs.weight`` values, if any."""
    arch = meta.get("general.architecture")
    spec = registry.gguf_architecture(arch)
    if spec is None or spec.model_config is None:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join(registry.gguf_architectures())}")
    return spec.model_config(meta, tensor_names, rope_freqs)


def load_gguf(path: str, *, dtype="auto", max_model_len=None, mesh=None, quantization: str | None = "auto",
              enable_expert_parallel: bool = False, hf_overrides: dict | None = None) -> LoadedModel:
    """``quantization``: ``auto`` / ``gguf`` keep the projections of the types ``gguf_formats`` repacks (one log
    line names the types kept and dequantized), ``none`` dequantizes every tensor (``config.gguf_quantization``)."""
    reader = open_gguf(path)
    meta = reader.metadata()
    tensor_names = {t.name for t in reader.tensors}
    hf = gguf_hf_config(reader.fields, tensor_names, reader)
    cfg = (model_config_from_hf(with_hf_overrides(hf, hf_overrides)) if hf is not None else
           with_config_overrides(model_config_from_gguf(meta, tensor_names, rope_freqs=gguf_rope_freqs(reader)),
                                 hf_overrides, os.path.basename(path)))
    cfg = with_expert_parallel(cfg, enable_expert_parallel)
    _, family = registry.resolve_architecture(cfg.architecture)
    family.check_config(cfg)
    # GGUF weights are quantized: "auto" means float32 on CPU (fast there), bfloat16 on accelerators.
    jdtype = resolve_dtype(dtype, jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    float_modules, kept, kept_line = gguf_float_modules(reader, cfg, family)
    quant = gguf_quantization(quantization, os.path.basename(path), float_modules)
    if quant is None:
        logger.info("%s: every tensor dequantized (--quantization none)", os.path.basename(path))
    elif kept:
        logger.info(kept_line)
    else:           # a float file: nothing to keep, the float path as before
        quant = None
    # the converted weights from the last load of this file (one device: a mesh places each shard itself);
    # the structure (with the kept weights' int4 fields) is part of the key
    cache = weight_cache.directory_for(jax.config.jax_compilation_cache_dir) if mesh is None else None
    structure = gguf_structure(family, cfg, kept if quant is not None else {})
    key = weight_cache.key_text(path, cfg, jdtype, structure) if cache else ""
    # the tokenizer (importing transformers: over a second) builds on a thread while the weights load: the
    # copies and numpy's dequantization release the GIL
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gguf-tokenizer") as pool:
        tokenizer = pool.submit(gguf_tokenizer, path)
        params = weight_cache.load(cache, key, structure)
        if params is None:
            params = load_weights(cfg, family, gguf_getter(reader, path, cfg), jdtype, mesh=mesh, quant=quant,
                                  desc=f"Loading {os.path.basename(path)}", file_of=lambda n: os.path.basename(path))
            weight_cache.store(cache, key, params, structure)
        tokenizer = tokenizer.result()
    return LoadedModel(config=cfg, params=params, family=family, tokenizer=tokenizer,
                       chat_template=meta.get("tokenizer.chat_template"),
                       generation_config=generation_config(cfg), source=path, dtype=jdtype,
                       max_model_len=resolve_max_model_len(cfg, max_model_len), load_format="gguf",
                       quantization=None if quant is None else quant.method)
