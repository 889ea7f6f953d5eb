"""The adapters' device slots: per layer and target projection a stack ``A [S, in, R]`` / ``B [S, R, *out]``
of ``S = max_loras + 1`` slots at rank ``R = max_lora_rank`` (``jaxserve.models.layers.lora`` multiplies
through them). Slot 0 stays zero ("no adapter"). Writing an adapter into a slot is one jitted update of the
stacks (donated, the slot index an argument): the step executables never change.

A smaller rank fills the first ``r`` columns of A and rows of B (the rest zero, which adds nothing); a
projection the adapter does not target is zero. gate and up share the fused ``gate_up`` stack at rank ``2R``:
gate's A and B in the first ``R``, up's in the second, each B writing only its half of ``[2, inter]``.

A quantized base (AWQ / GPTQ int4, FP8) keeps its packed weights; the stacks stay in the activation dtype and
the deltas read the float activations beside the quantized matmul (``layers.decoder``: with LoRA on, the
norms hand fp8 W8A8 projections float activations, which each quantizes for its own GEMM).

Tensor parallelism: each stack is sharded as its base weight is. B's output axes like the base weight's
(q/k/v/gate_up split on their outputs), A's input axis like the base weight's input (o and down split on
theirs); the other factor is replicated, and the partial sums of a row projection's shrink are summed by
XLA's partitioner.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.quantization import is_quantized
from jaxserve.quantization.weights import TP
from .peft import LoRAAdapter, projection_shapes


def stack_shapes(cfg: ModelConfig, num_slots: int, rank: int) -> dict[str, tuple[int, ...]]:
    """One layer's stacks: ``{"<target>_a": shape, "<target>_b": shape}``."""
    p = projection_shapes(cfg)
    i = cfg.intermediate_size
    out = {}
    for t in ("q", "k", "v", "o", "down"):
        n_in, n_out = p[t]
        out[f"{t}_a"], out[f"{t}_b"] = (num_slots, n_in, rank), (num_slots, rank, n_out)
    out["gate_up_a"], out["gate_up_b"] = (num_slots, cfg.hidden_size, 2 * rank), (num_slots, 2 * rank, 2, i)
    return out


def _sharding(mesh, base_weight, a: bool):
    """A stack's sharding from its base weight's ``[in, *out]`` spec: A ``[S, in, r]`` takes the input axis's,
    B ``[S, r, *out]`` the output axes'. A quantized base weight says which logical axis it splits
    (``tp_axis``)."""
    if mesh is None:
        return None
    if is_quantized(base_weight):
        spec = tuple(TP if i == base_weight.tp_axis else None for i in range(len(base_weight.shape)))
    else:
        spec = tuple(getattr(base_weight.sharding, "spec", None) or ())
        spec += (None,) * (base_weight.ndim - len(spec))
    return NamedSharding(mesh, P(None, spec[0], None) if a else P(None, None, *spec[1:]))


def _write(stacks, slot, values):
    return [{k: s.at[slot].set(values[i][k].astype(s.dtype)) for k, s in layer.items()}
            for i, layer in enumerate(stacks)]


class LoRASlots:
    """The slot stacks of one model (``stacks``: what the step takes as its ``params["lora"]``)."""

    def __init__(self, cfg: ModelConfig, params: dict, max_loras: int, max_rank: int, dtype, mesh=None):
        self.cfg, self.num_slots, self.rank, self.dtype = cfg, max_loras + 1, max_rank, jnp.dtype(dtype)
        shapes = stack_shapes(cfg, self.num_slots, max_rank)
        self.shardings = [{k: _sharding(mesh, layer[k.rpartition("_")[0]], k.endswith("_a")) for k in shapes}
                          for layer in params["layers"]]
        self.stacks = [{k: jnp.zeros(shape, self.dtype, device=sh[k]) for k, shape in shapes.items()}
                       for sh in self.shardings]
        self._write = jax.jit(_write, donate_argnums=0, out_shardings=self.shardings if mesh is not None else None)

    def write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put ``adapter`` (None: zeros) in ``slot`` (1 .. max_loras); the step's next dispatch reads it."""
        assert 0 < slot < self.num_slots, slot
        values = [self._layer_values(adapter.layers[i] if adapter is not None else {})
                  for i in range(self.cfg.num_layers)]
        self.stacks = self._write(self.stacks, np.int32(slot), values)

    def _layer_values(self, layer: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
        R, shapes = self.rank, stack_shapes(self.cfg, 1, self.rank)
        out = {k: np.zeros(shape[1:], np.float32) for k, shape in shapes.items()}
        for t, (a, b) in layer.items():
            r = a.shape[1]
            if t in ("gate", "up"):
                half = 0 if t == "gate" else 1
                out["gate_up_a"][:, half * R:half * R + r] = a
                out["gate_up_b"][half * R:half * R + r, half, :] = b
            else:
                out[f"{t}_a"][:, :r] = a
                out[f"{t}_b"][:r] = b
        return out



def check_supported(model, config) -> None:
    """Refuse, with the reason, a LoRA engine this implementation would get wrong (``model``: a LoadedModel)."""
    family = model.family
    if not getattr(family, "supports_lora", lambda cfg: False)(model.config) or hasattr(family, "encode_images"):
        raise ValueError(f"LoRA adapters are not supported for {model.config.architecture} (jaxserve serves them "
                         "on Llama-style text decoders: Llama, Mistral, Qwen2, Qwen3)")
    if config.parallel.num_processes > 1 or config.parallel.distributed_executor_backend == "mp":
        # the other processes follow the steps process 0 sends; slot writes are not among them
        raise ValueError("--enable-lora runs in one process (no --num-processes / --distributed-executor-backend "
                         "mp): tensor parallelism over the local devices works with -tp")
    if config.scheduler.num_scheduler_steps > 1:
        raise ValueError("--enable-lora does not combine with --num-scheduler-steps > 1 (the multi-step decode "
                         "loop has no adapter inputs)")
