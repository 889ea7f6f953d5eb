"""Orbax checkpoints (folders ``orbax_io.convert`` writes): restored straight into the mesh's sharding.

Layout of a converted folder::

    DIR/jaxserve_checkpoint.json   ModelConfig, dtype, generation config, chat template, what it came from
    DIR/params/                    orbax (OCDBT + tensorstore) checkpoint of the weight pytree
    DIR/tokenizer.json, ...        the tokenizer (save_pretrained), so the folder is self-contained

The stored arrays carry no sharding, so a checkpoint written at one tensor_parallel_size restores at any other
(the restore names each weight's target ``NamedSharding``; tensorstore reads only the slices a device owns,
each read once and placed on the devices that hold it). The weights are stored exactly as the step consumes
them, so a load converts nothing. Reads run in parallel under a bound on the bytes read and not yet placed
(``in_flight_bytes``), so the host never holds the whole model.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve import envs
from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import registry
from jaxserve.models.loaded_model import LoadedModel, resolve_dtype, resolve_max_model_len
from jaxserve.models.tokenizers import folder_tokenizer

MARKER = "jaxserve_checkpoint.json"
PARAMS_DIR = "params"
FORMAT_VERSION = 1


def is_orbax_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def load_orbax(path: str, *, dtype: str | Any = "auto", max_model_len: int | None = None, mesh=None) -> LoadedModel:
    """Restore a converted folder as a ``LoadedModel``; with a ``mesh`` every weight lands directly in its
    ``NamedSharding`` (each device reads only its slice). ``dtype="auto"`` keeps the stored dtype."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    from jaxserve.parallel import param_shardings  # noqa: PLC0415

    meta = read_metadata(path)
    cfg = config_from_json(meta["model_config"])
    _, family = registry.resolve_architecture(cfg.architecture)
    family.check_config(cfg)
    jdtype = resolve_dtype(dtype, jnp.dtype(meta["dtype"]).type)
    shapes = family.param_shapes(cfg)
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x)  # noqa: E731
    if mesh is not None:
        shardings = param_shardings(family.param_partition_specs(cfg), mesh, cfg)
    else:
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: one, shapes, is_leaf=is_shape)
    target = jax.tree.map(lambda s, sh, dt: jax.ShapeDtypeStruct(s, dt, sharding=sh), shapes, shardings,
                          family.param_dtypes(cfg, jdtype), is_leaf=is_shape)
    stored = family.param_dtypes(cfg, jnp.dtype(meta["dtype"]).type)
    # a read's bytes are the larger of the stored and the loaded dtype's (tensorstore casts as it reads)
    read_size = lambda s, a, b: math.prod(s) * max(jnp.dtype(a).itemsize, jnp.dtype(b).itemsize)  # noqa: E731
    sizes = jax.tree.leaves(jax.tree.map(read_size, shapes, stored, family.param_dtypes(cfg, jdtype),
                                         is_leaf=is_shape))
    in_flight = in_flight_bytes(sizes, envs.JAXSERVE_LOAD_THREADS)
    checkpointer = ocp.StandardCheckpointer(restore_concurrent_gb=in_flight / 1e9)   # orbax takes a float here
    try:
        params = checkpointer.restore(os.path.join(os.path.abspath(path), PARAMS_DIR), target)
    except Exception as e:  # orbax raises several types for a damaged or mismatched checkpoint
        raise ModelLoadError(f"{path}: cannot restore the orbax checkpoint ({type(e).__name__}: {e})") from None
    finally:
        checkpointer.close()
    tokenizer = folder_tokenizer(path)
    limit = max_model_len if max_model_len is not None else meta.get("max_model_len")
    return LoadedModel(config=cfg, params=params, family=family, tokenizer=tokenizer,
                       chat_template=meta.get("chat_template"),
                       generation_config=meta.get("generation_config") or {}, source=path,
                       dtype=jdtype, max_model_len=resolve_max_model_len(cfg, limit), load_format="orbax")


def in_flight_bytes(sizes: list[int], threads: int) -> int:
    """Orbax's bound on the bytes read and not yet placed, from the weights' read sizes: the largest weight and
    two average ones per reader thread beside it, as the safetensors loader's threads keep two weights each
    in flight (``threads`` 0: about one weight at a time)."""
    return max(sizes) + 2 * threads * sum(sizes) // len(sizes) + 1     # orbax refuses a read of the whole bound


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


def config_to_json(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_from_json(d: dict) -> ModelConfig:
    """JSON lists back to the tuples that keep ``ModelConfig`` hashable."""
    def tuples(x):
        return tuple(tuples(v) for v in x) if isinstance(x, list) else x

    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: tuples(v) for k, v in d.items() if k in names})
