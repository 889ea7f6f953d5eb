"""LoRA deltas of the decoder's projections, each token through its own adapter slot.

The adapters live in fixed device slots (``jaxserve.lora.slots``): per layer a stack ``A [in, S, w]`` and
``B [S, w, *out]`` per target (slot 0 all zeros: "no adapter"). A step gives each token a slot;
``LoRABatch.delta`` computes ``(x @ A[slot]) @ B[slot]`` for every token at once: one shrink over all slots
``x @ A`` as a plain ``[T, in] @ [in, S * w]`` matmul (A stores ``in`` major for that: no per-step
transpose), one elementwise mask keeping each token's own slot's ``w`` columns, one expand
``[T, S * w] @ [S * w, *out]``. Shapes never change, so loading, swapping or mixing adapters never
recompiles; the extra work is ``S * w`` columns per projection, small beside the base weight's ``out``.

q, k and v read the same input, so they share one shrink (``qkv_a``, width ``3R``: q's columns, then k's,
then v's); each of their B blocks spans all ``3R`` rows with zeros outside its own. Without tensor
parallelism the three are one array along the output (``qkv_b [S, 3R, q + k + v]``) and the expand is one
matmul split after; under a mesh each keeps its own B (``q_b``/``k_b``/``v_b``), split on its output as
its base weight is. Each op here is a GPU kernel of its own at decode sizes, so their count is the cost.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LoRABatch(NamedTuple):
    layers: list[dict]      # per layer: {"<target>_a": [in, S, w], "<target>_b": [S, w, *out]} (see above)
    onehot: jax.Array       # [T, S]: each token's slot, in the activations' dtype

    def _shrink(self, x: jax.Array, a: jax.Array) -> jax.Array:
        """``x [T, in]`` through every slot's A, each token keeping only its own slot's columns: ``[T, S * w]``."""
        n_in, s, w = a.shape
        shrunk = (x @ a.reshape(n_in, s * w).astype(x.dtype)).reshape(-1, s, w) * self.onehot[:, :, None]
        return shrunk.reshape(-1, s * w)

    @staticmethod
    def _expand(shrunk: jax.Array, b: jax.Array) -> jax.Array:
        """``[T, S * w]`` through B ``[S, w, *out]``: ``[T, *out]`` (the output axes kept apart: TP splits one)."""
        return jnp.einsum("tk,k...->t...", shrunk, b.reshape(-1, *b.shape[2:]).astype(shrunk.dtype))

    def delta(self, index: int, target: str, x: jax.Array) -> jax.Array:
        """Layer ``index``'s ``target`` (o, gate_up, down) delta for ``x [T, in]``: ``[T, *out]``."""
        layer = self.layers[index]
        return self._expand(self._shrink(x, layer[f"{target}_a"]), layer[f"{target}_b"])

    def add_qkv(self, index: int, h: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array):
        """Layer ``index``'s q, k, v ``[T, out]`` (all of ``h [T, hidden]``) with their deltas added."""
        layer = self.layers[index]
        shrunk = self._shrink(h, layer["qkv_a"])
        if "qkv_b" in layer:
            dq, dk, dv = jnp.split(self._expand(shrunk, layer["qkv_b"]), [q.shape[1], q.shape[1] + k.shape[1]],
                                   axis=1)
        else:
            dq, dk, dv = (self._expand(shrunk, layer[f"{t}_b"]) for t in ("q", "k", "v"))
        return q + dq, k + dk, v + dv


def lora_batch(stacks: list[dict], slots: jax.Array, dtype) -> LoRABatch:
    """The step's view of the slot stacks: ``slots [T]`` int32, each token's slot (0: none)."""
    num_slots = stacks[0]["o_b"].shape[0]
    return LoRABatch(stacks, (slots[:, None] == jnp.arange(num_slots, dtype=slots.dtype)).astype(dtype))
