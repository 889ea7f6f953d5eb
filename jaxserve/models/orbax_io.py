"""Orbax checkpoints: ``convert`` any loadable model (HF folder, GGUF, dummy) into a folder that
``load_model(..., load_format="orbax")`` restores straight into the mesh's sharding.

Layout of a converted folder::

    DIR/jaxserve_checkpoint.json   ModelConfig, dtype, generation config, chat template, what it came from
    DIR/params/                    orbax (OCDBT + tensorstore) checkpoint of the weight pytree
    DIR/tokenizer.json, ...        the tokenizer (save_pretrained), so the folder is self-contained

Why orbax: each process writes and reads only its own shards, chunked, in parallel, and the stored
arrays carry no sharding, so a checkpoint written at one tensor_parallel_size restores at any other
(the restore names each weight's target ``NamedSharding``; tensorstore reads only the slices a device
owns). No layout conversion at load time: weights are stored exactly as the step consumes them
(``[in, out]``, fused gate/up, GGUF already dequantized), in the chosen dtype.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError


MARKER = "jaxserve_checkpoint.json"
PARAMS_DIR = "params"
FORMAT_VERSION = 1


def is_orbax_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


# ------------------------------------------------------------------------------------------------ save
def convert(model: str | None, output_dir: str, dtype: str = "auto", tensor_parallel_size: int = 1, *,
            load_format: str = "auto") -> dict:
    """Load ``model`` (sharded over ``tensor_parallel_size`` devices, so it never sits whole on one) and
    write it as an orbax checkpoint in ``output_dir``. Returns a summary (paths, sizes, seconds)."""
    from jaxserve.models.loader import load_model
    from jaxserve.parallel import make_mesh

    _check_output_dir(output_dir)
    mesh = make_mesh(tensor_parallel_size) if tensor_parallel_size > 1 else None
    t0 = time.perf_counter()
    loaded = load_model(model, dtype=dtype, load_format=load_format, mesh=mesh)
    load_s = time.perf_counter() - t0
    summary = save(loaded, output_dir)
    return summary | {"load_seconds": load_s}


def save(loaded, output_dir: str) -> dict:
    """Write a ``LoadedModel`` (decoder families) as an orbax checkpoint + config + tokenizer."""
    import orbax.checkpoint as ocp

    _check_output_dir(output_dir)
    if not hasattr(loaded.family, "param_shapes"):
        raise ModelLoadError(f"{loaded.source}: only decoder models can be converted to orbax")
    if getattr(loaded, "quantization", None):
        raise ModelLoadError(f"{loaded.source}: {loaded.quantization} weights cannot be converted to orbax (it "
                             f"stores float weights); serve the checkpoint itself")
    output_dir = os.path.abspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    t0 = time.perf_counter()
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(output_dir, PARAMS_DIR), loaded.params)
    checkpointer.wait_until_finished()
    checkpointer.close()
    if jax.process_index() == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "model_config": _config_to_json(loaded.config),
            "dtype": jnp.dtype(loaded.dtype).name,
            "source": loaded.source,
            "source_load_format": loaded.load_format,
            "max_model_len": loaded.max_model_len,
            "generation_config": loaded.generation_config,
            "chat_template": loaded.chat_template,
        }
        if loaded.tokenizer is not None:
            loaded.tokenizer.save_pretrained(output_dir)
        # the marker goes last: a folder with it is complete
        with open(os.path.join(output_dir, MARKER), "w") as f:
            json.dump(meta, f, indent=1)
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(loaded.params))
    return {"output_dir": output_dir, "bytes": int(nbytes), "save_seconds": time.perf_counter() - t0}


def _check_output_dir(output_dir: str) -> None:
    if os.path.exists(output_dir) and (not os.path.isdir(output_dir) or os.listdir(output_dir)):
        raise ModelLoadError(f"{output_dir} already exists and is not empty; choose a new --output folder")


# ------------------------------------------------------------------------------------------------ load
def load_orbax(path: str, *, dtype: str | Any = "auto", max_model_len: int | None = None, mesh=None):
    """Restore a converted folder as a ``LoadedModel``; with a ``mesh`` every weight lands directly in its
    ``NamedSharding`` (each device reads only its slice). ``dtype="auto"`` keeps the stored dtype."""
    import orbax.checkpoint as ocp

    from jaxserve.models import loader, registry
    from jaxserve.parallel import param_shardings

    meta = read_metadata(path)
    cfg = _config_from_json(meta["model_config"])
    _, family = registry.resolve_architecture(cfg.architecture)
    family.check_config(cfg)
    jdtype = loader._resolve_dtype(dtype, jnp.dtype(meta["dtype"]).type)
    shapes = family.param_shapes(cfg)
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x)  # noqa: E731
    if mesh is not None:
        shardings = param_shardings(family.param_partition_specs(cfg), mesh, cfg)
    else:
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: one, shapes, is_leaf=is_shape)
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s, jdtype, sharding=sh), shapes, shardings,
                          is_leaf=is_shape)
    checkpointer = ocp.StandardCheckpointer()
    try:
        params = checkpointer.restore(os.path.join(os.path.abspath(path), PARAMS_DIR), target)
    except Exception as e:  # orbax raises several types for a damaged or mismatched checkpoint
        raise ModelLoadError(f"{path}: cannot restore the orbax checkpoint ({type(e).__name__}: {e})") from None
    finally:
        checkpointer.close()
    tokenizer = loader._folder_tokenizer(path)
    limit = max_model_len if max_model_len is not None else meta.get("max_model_len")
    return loader.LoadedModel(config=cfg, params=params, family=family, tokenizer=tokenizer,
                              chat_template=meta.get("chat_template"),
                              generation_config=meta.get("generation_config") or {}, source=path,
                              dtype=jdtype, max_model_len=loader._max_model_len(cfg, limit),
                              load_format="orbax")


def read_metadata(path: str) -> dict:
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise ModelLoadError(f"{path} is not a jaxserve orbax checkpoint (no {MARKER}); "
                             f"create one with: python -m jaxserve convert MODEL --output {path}")
    with open(marker) as f:
        meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(f"{marker}: format_version {meta.get('format_version')} is not "
                             f"{FORMAT_VERSION}; convert the model again with this version of jaxserve")
    return meta


# ------------------------------------------------------------------------------------- config as JSON
def _config_to_json(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def _config_from_json(d: dict) -> ModelConfig:
    """JSON lists back to the tuples that keep ``ModelConfig`` hashable."""
    def tuples(x):
        return tuple(tuples(v) for v in x) if isinstance(x, list) else x

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: tuples(v) for k, v in d.items() if k in names})


# -------------------------------------------------------------------------------------------------- CLI
def add_convert_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of ``python -m jaxserve convert MODEL --output DIR [--dtype] [--tensor-parallel-size]``."""
    parser.add_argument("model", nargs="?", default=None,
                        help="HF folder, .gguf file or configs/models name (default: the embedded SmolLM2)")
    parser.add_argument("--output", "-o", required=True, help="new folder for the orbax checkpoint")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--load-format", default="auto", help="auto | safetensors | gguf | dummy")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="load and write over this many devices (the checkpoint restores at any size)")
    return parser


def run_convert(args: argparse.Namespace) -> int:
    summary = convert(args.model, args.output, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                      load_format=args.load_format)
    print(f"wrote {summary['output_dir']} ({summary['bytes'] / 2**20:.1f} MiB of weights; "
          f"load {summary['load_seconds']:.1f}s, save {summary['save_seconds']:.1f}s)")
    return 0
