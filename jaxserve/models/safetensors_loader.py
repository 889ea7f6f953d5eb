"""HF model folders: ``config.json``, single or sharded (``model.safetensors.index.json``) safetensors, the
tokenizer files. Decoder weights go through the family's plan (``hf_weights.load_weights``), quantized
checkpoints through ``jaxserve.quantization``; an encoder family loads its folder itself."""
from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxserve import envs
from jaxserve.errors import ModelLoadError
from jaxserve.models import checkpoint_names, dummy_loader, registry
from jaxserve.models import configs as model_configs
from jaxserve.models.hf_weights import load_weights
from jaxserve.models.layers.moe import with_expert_parallel
from jaxserve.models.loaded_model import (LoadedModel, config_dtype, float_only, generation_config, resolve_dtype,
                                          resolve_max_model_len, with_fused_qkv)
from jaxserve.models.tokenizers import folder_tokenizer, with_tokenizer
from jaxserve.quantization import config as quant_config

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}


class SafetensorsFile:
    """A memory-mapped safetensors file: ``get(name)`` is a zero-copy numpy view; ``release(name)`` lets go of
    the pages a finished copy read."""

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
        self._start = 8 + n                     # the data's offset in the file
        self._map = None
        if data_len:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def names(self) -> list[str]:
        return list(self.header)

    def get(self, tname: str) -> np.ndarray:
        info = self.header[tname]
        start, end = info["data_offsets"]
        dtype = np.dtype(_ST_DTYPES[info["dtype"]])
        if end == start:
            return np.empty(info["shape"], dtype)
        return np.frombuffer(self._map, dtype, (end - start) // dtype.itemsize, self._start + start).reshape(
            info["shape"])

    def release(self, tname: str) -> None:
        """Unmap the tensor's pages from this process once its copies are done (the page cache keeps them; a
        later read maps them again): without it every page a load read stays in the process's resident set,
        the whole checkpoint by the end of the load."""
        start, end = self.header[tname]["data_offsets"]
        first = (self._start + start) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, first, self._start + end - first)


def safetensors_getter(folder: str) -> tuple[Callable[[str], np.ndarray], Callable[[str], str]]:
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
    opening = threading.Lock()          # the loader's reader threads share the opened files

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
        with opening:
            if fname not in opened:
                path = os.path.join(folder, fname)
                if not os.path.exists(path):
                    raise ModelLoadError(f"{fname}: file not found ({path}); the index lists tensor {hf_name} in it")
                opened[fname] = SafetensorsFile(path)
        if hf_name not in opened[fname].header:
            raise ModelLoadError(f"{fname}: tensor {hf_name} not found (the index lists it in this file)")
        return opened[fname].get(hf_name)

    def release(hf_name: str) -> None:
        hf_name = stored_name(hf_name)
        with opening:
            file = opened.get(weight_map.get(hf_name))
        if file is not None:
            file.release(hf_name)

    get.has = has      # quantized checkpoints: which optional tensors (g_idx, zero points) a module has
    get.release = release
    return get, file_of


def load_hf_folder(folder: str, *, dtype="auto", max_model_len=None, mesh=None, dummy=False,
                   seed: int = 0, quantization: str | None = "auto",
                   enable_expert_parallel: bool = False, hf_overrides: dict | None = None) -> LoadedModel:
    """The model of an HF folder; ``dummy``: random weights in the shape (and storage) its config describes;
    ``hf_overrides``: vLLM's ``--hf-overrides`` (``configs.with_hf_overrides``)."""
    hf = model_configs.with_hf_overrides(model_configs.read_json(os.path.join(folder, "config.json")), hf_overrides)
    arch, family = registry.resolve_architecture(hf.get("architectures"))
    if dummy:     # random weights in the checkpoint's storage, or in any method's the flag names
        stored = (hf.get("quantization_config") or {}).get("quant_method")
        quant = dummy_loader.dummy_quantization(stored if quantization in (None, "auto") else quantization)
    else:
        quant = quant_config.resolve_quantization(quantization, hf, folder)
    # a quantized checkpoint's float tensors (scales aside) are fp16/bf16: its torch_dtype says which
    jdtype = resolve_dtype(dtype, config_dtype(hf, jnp.float32))
    if registry.is_encoder(arch):
        float_only(quantization, f"{folder} is an encoder model")
        if hf_overrides:
            raise ModelLoadError(f"{folder} is an encoder model: --hf-overrides applies to decoder models")
        return family.load(folder, dtype)   # the encoder family resolves "auto" itself
    gen = model_configs.read_generation_config(folder)
    cfg = model_configs.model_config_from_hf(hf, gen)
    cfg = with_fused_qkv(with_expert_parallel(cfg, enable_expert_parallel), family, quant, mesh)
    family.check_config(cfg)

    def load():
        if dummy:
            return dummy_loader.dummy_params(cfg, family, jdtype, seed, mesh, quant)
        get, file_of = safetensors_getter(folder)
        return load_weights(cfg, family, get, jdtype, mesh=mesh, file_of=file_of, quant=quant,
                            desc=f"Loading {os.path.basename(os.path.normpath(folder))}",
                            threads=envs.JAXSERVE_LOAD_THREADS)

    params, tokenizer = with_tokenizer(lambda: folder_tokenizer(folder), load)
    return LoadedModel(config=cfg, params=params, family=family, tokenizer=tokenizer,
                       chat_template=getattr(tokenizer, "chat_template", None),
                       generation_config=generation_config(cfg, gen), source=folder, dtype=jdtype,
                       max_model_len=resolve_max_model_len(cfg, max_model_len),
                       load_format="dummy" if dummy else "safetensors",
                       quantization=quant.method if quant is not None else None)
