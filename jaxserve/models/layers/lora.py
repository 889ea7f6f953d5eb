"""LoRA deltas of the decoder's projections, each token through its own adapter slot.

The adapters live in fixed device slots (``jaxserve.lora.slots``): per layer and target an ``A [in, S, w]``
and a stack ``B [S, w, *out]`` (slot 0 all zeros: "no adapter"). A step gives each token a slot; the delta
``(x @ A[slot]) @ B[slot]`` of every token at once is one shrink over all slots ``x @ A`` (A read as a plain
``[in, S * w]`` matrix), one elementwise mask keeping each token's own slot's ``w`` columns, one expand
``[T, S * w] @ [S * w, *out]``. Shapes never change, so loading, swapping or mixing adapters never
recompiles; the extra work is ``S * w`` columns per projection, small beside the base weight's ``out``.

Folded (no mesh, float base weights): each target's A is not a stack of its own but ``S * w`` more columns
of its base weight, ``W_ext = [W | A_flat]`` of shape ``[in, out + S * w]`` (gate_up flattened to
``[hidden, 2 * inter + S * w]``). The base GEMM then yields the shrink too: ``y_ext = x @ W_ext``, ``y`` its
first ``out`` columns, the masked rest the shrunk input of the expand. At decode sizes every op is a GPU
kernel of its own, so their count is the cost: folded, a projection adds the mask and the expand (the add
joins its consumer) where apart it adds a shrink GEMM as well.

q, k and v read the same input, so they share one shrink (``qkv``, width ``3R``: q's columns, then k's, then
v's; folded, into q's weight: q, k and v are separate base weights); each of their B blocks spans all ``3R``
rows with zeros outside its own. Without tensor parallelism the three are one array along the output
(``qkv_b [S, 3R, q + k + v]``) and the expand is one matmul split after; under a mesh each keeps its own B
(``q_b``/``k_b``/``v_b``), split on its output as its base weight is. A quantized base or a mesh keeps the
A stacks apart (``<target>_a``): the step tells the two layouts apart by those keys.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LoRABatch(NamedTuple):
    layers: list[dict]      # per layer: {"<target>_b": [S, w, *out]} and, not folded, {"<target>_a": [in, S, w]}
    onehot: jax.Array       # [T, S]: each token's slot, in the activations' dtype

    @property
    def folded(self) -> bool:
        """The A slots are columns of the base weights (``W_ext``), not stacks of their own (see above)."""
        return "o_a" not in self.layers[0]

    def _mask(self, shrunk: jax.Array, s: int, w: int) -> jax.Array:
        """``[T, S * w]``: each token keeps only its own slot's ``w`` columns."""
        return (shrunk.reshape(-1, s, w) * self.onehot[:, :, None]).reshape(-1, s * w)

    def _shrink(self, x: jax.Array, a: jax.Array) -> jax.Array:
        """``x [T, in]`` through every slot's A, each token keeping only its own slot's columns: ``[T, S * w]``."""
        n_in, s, w = a.shape
        return self._mask(x @ a.reshape(n_in, s * w).astype(x.dtype), s, w)

    def _split(self, y_ext: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
        """A folded projection's ``y_ext [T, out + S * w]``: ``(y [T, out], its masked shrink [T, S * w])``."""
        s, w = b.shape[:2]
        return y_ext[:, :-s * w], self._mask(y_ext[:, -s * w:], s, w)

    @staticmethod
    def _expand(shrunk: jax.Array, b: jax.Array) -> jax.Array:
        """``[T, S * w]`` through B ``[S, w, *out]``: ``[T, *out]`` (the output axes kept apart: TP splits one)."""
        return jnp.einsum("tk,k...->t...", shrunk, b.reshape(-1, *b.shape[2:]).astype(shrunk.dtype))

    def delta(self, index: int, target: str, x: jax.Array) -> jax.Array:
        """Layer ``index``'s ``target`` (o, gate_up, down) delta for ``x [T, in]``: ``[T, *out]`` (not folded)."""
        layer = self.layers[index]
        return self._expand(self._shrink(x, layer[f"{target}_a"]), layer[f"{target}_b"])

    def add(self, index: int, target: str, x: jax.Array, y: jax.Array) -> jax.Array:
        """Layer ``index``'s ``target`` projection ``y`` of ``x [T, in]`` with its delta added: ``[T, *out]``.
        Folded, ``y`` is ``x @ W_ext``, its shrink columns still on."""
        b = self.layers[index][f"{target}_b"]
        if not self.folded:
            return y + self.delta(index, target, x)
        y, shrunk = self._split(y, b)
        return y.reshape(-1, *b.shape[2:]) + self._expand(shrunk, b)

    def add_qkv(self, index: int, h: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array):
        """Layer ``index``'s q, k, v ``[T, out]`` (all of ``h [T, hidden]``) with their deltas added; folded,
        ``q`` is ``h @ W_ext`` with the shared shrink's columns still on."""
        layer = self.layers[index]
        if self.folded:
            q, shrunk = self._split(q, layer["qkv_b"])
        else:
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
