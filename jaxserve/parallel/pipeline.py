"""Pipeline stages: which layers each stage holds and which devices it runs on.

``P`` stages of ``T`` devices each (``P × T`` devices in all): stage ``k`` is a ``("tp",)`` mesh over devices
``k·T .. (k+1)·T - 1`` and holds a contiguous range of layers, their weights and their KV cache; the first also
holds the embedding, the last the final norm and the head (and, with tied embeddings, its own copy of the
embedding for the logits). Tensor parallelism inside a stage is the one-stage layout unchanged.

Weights are placed on their stage while they load: a loader asks ``param_shardings`` for each weight's
sharding, and inside ``placing(stages)`` that answers with the weight's stage's mesh, so no device ever holds
another stage's layers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxserve import envs

from .mesh import STAGE_PLACEMENT, check_device_count, make_mesh

def layer_partition(num_layers: int, num_stages: int, override: str | None = None) -> list[int]:
    """Layers per stage: ``override`` ("a,b,c", ``JAXSERVE_PP_LAYER_PARTITION``), else as even as they divide,
    the layers left over one each on the stages just before the last (vLLM's rule: the last one also runs
    the head, the first the embedding)."""
    override = envs.JAXSERVE_PP_LAYER_PARTITION if override is None else override
    if override:
        try:
            sizes = [int(x) for x in override.split(",")]
        except ValueError:
            raise ValueError(f"JAXSERVE_PP_LAYER_PARTITION={override!r}: expected comma-separated layer counts, "
                             f"e.g. {','.join(str(n) for n in layer_partition(num_layers, num_stages, ''))}") from None
        if len(sizes) != num_stages or sum(sizes) != num_layers or min(sizes) < 1:
            raise ValueError(f"JAXSERVE_PP_LAYER_PARTITION={override!r} must give {num_stages} stages of at least "
                             f"one layer that add up to the model's {num_layers} layers")
        return sizes
    if num_layers < num_stages:
        raise ValueError(f"pipeline_parallel_size={num_stages} is more than the model's {num_layers} layers")
    sizes = [num_layers // num_stages] * num_stages
    for i in range(2, num_layers % num_stages + 2):
        sizes[-i] += 1
    return sizes


def stage_bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` layer range of each stage."""
    ends = np.cumsum(sizes).tolist()
    return [(e - n, e) for n, e in zip(sizes, ends)]


@dataclasses.dataclass(frozen=True)
class StageMeshes:
    """The stages' meshes (each ``("tp",)`` over ``T`` devices) and, once the model's layer count is known
    (``for_layers``), their layer ranges."""
    meshes: tuple[Mesh, ...]
    bounds: tuple[tuple[int, int], ...] = ()

    def for_layers(self, num_layers: int) -> "StageMeshes":
        """These meshes with the layers of a ``num_layers`` model split over them (``layer_partition``)."""
        if self.bounds and self.num_layers == num_layers:
            return self
        return StageMeshes(self.meshes, tuple(stage_bounds(layer_partition(num_layers, len(self.meshes)))))

    @property
    def num_stages(self) -> int:
        return len(self.meshes)

    @property
    def num_layers(self) -> int:
        return self.bounds[-1][1]

    def stage_of_layer(self, layer: int) -> int:
        for k, (start, end) in enumerate(self.bounds):
            if start <= layer < end:
                return k
        raise IndexError(layer)

    def mesh_of(self, path: str) -> Mesh:
        """The mesh a weight (a dotted pytree path: ``layers.3.q``, ``embed``, ``final_norm``) lives on."""
        m = re.match(r"layers\.(\d+)", path)
        if m:
            return self.meshes[self.stage_of_layer(int(m.group(1)))]
        return self.meshes[0] if path.split(".")[0] == "embed" else self.meshes[-1]

    def replicated(self, k: int) -> NamedSharding:
        return NamedSharding(self.meshes[k], jax.sharding.PartitionSpec())


def make_stage_meshes(num_stages: int, tensor_parallel_size: int,
                      devices: Sequence[jax.Device] | None = None) -> StageMeshes:
    """Stage ``k`` over devices ``k·T .. (k+1)·T - 1`` of ``jax.devices()`` (no layers assigned yet)."""
    devices, t = list(jax.devices() if devices is None else devices), tensor_parallel_size
    check_device_count(f"pipeline_parallel_size={num_stages} × tensor_parallel_size={t}", num_stages * t, devices)
    return StageMeshes(tuple(make_mesh(t, devices[k * t:(k + 1) * t]) for k in range(num_stages)))


@contextlib.contextmanager
def placing(stages: StageMeshes | None):
    """Inside: ``param_shardings`` puts each weight on its stage's mesh (the loaders need no other change)."""
    token = STAGE_PLACEMENT.set(stages)
    try:
        yield
    finally:
        STAGE_PLACEMENT.reset(token)


def stage_params(params: dict, start: int, end: int, num_layers: int, tied_embed=None) -> dict:
    """The weights stage ``[start, end)`` runs with: its layers, the embedding on the first, the final norm
    and head on the last (``tied_embed``: the last stage's copy of a tied embedding)."""
    out = {"layers": params["layers"][start:end]}
    if start == 0:
        out["embed"] = params["embed"]
    if end == num_layers:
        out["final_norm"] = params["final_norm"]
        if "lm_head" in params:
            out["lm_head"] = params["lm_head"]
        elif start != 0:
            out["embed"] = params["embed"] if tied_embed is None else tied_embed
    return out
