"""LoRA deltas of the decoder's projections, each token through its own adapter slot.

The adapters live in fixed device slots (``jaxserve.lora.slots``): per layer and target projection a stack
``A [S, in, r]`` and ``B [S, r, *out]`` (slot 0 all zeros: "no adapter"). A step gives each token a slot;
``LoRABatch.delta`` computes ``(x @ A[slot]) @ B[slot]`` for every token at once as a shrink over all slots
(``[T, S, r]``), masked to each token's own slot, then an expand: two dense matmuls whose shapes never
change, so loading, swapping or mixing adapters never recompiles. The extra work is ``S * r`` columns per
projection, small beside the base weight's ``out`` while ``S * r`` is.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# the decoder's projections an adapter may target (gate and up fused, as the base weight is)
TARGETS = ("q", "k", "v", "o", "gate_up", "down")


class LoRABatch(NamedTuple):
    layers: list[dict]      # per layer: {"<target>_a": [S, in, r], "<target>_b": [S, r, *out]}
    onehot: jax.Array       # [T, S]: each token's slot, in the activations' dtype

    def delta(self, index: int, target: str, x: jax.Array) -> jax.Array:
        """Layer ``index``'s ``target`` delta for ``x [T, in]``: ``[T, *out]``."""
        a, b = self.layers[index][f"{target}_a"], self.layers[index][f"{target}_b"]
        shrunk = jnp.einsum("ti,sir->tsr", x, a.astype(x.dtype)) * self.onehot[:, :, None]
        return jnp.einsum("tsr,sr...->t...", shrunk, b.astype(x.dtype))


def lora_batch(stacks: list[dict], slots: jax.Array, dtype) -> LoRABatch:
    """The step's view of the slot stacks: ``slots [T]`` int32, each token's slot (0: none)."""
    num_slots = stacks[0]["q_a"].shape[0]
    return LoRABatch(stacks, (slots[:, None] == jnp.arange(num_slots, dtype=slots.dtype)).astype(dtype))
