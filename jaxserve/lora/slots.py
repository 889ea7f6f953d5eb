"""The adapters' device slots: per layer and target a stack ``A [in, S, w]`` / ``B [S, w, *out]`` of
``S = max_loras + 1`` slots at rank ``R = max_lora_rank`` (``jaxserve.models.layers.lora`` multiplies through
them and says why they are laid out so). Slot 0 stays zero ("no adapter"). Writing an adapter into a slot is
one jitted update of the stacks (donated, the slot index an argument): the step executables never change.

A smaller rank fills the first ``r`` of its ``R`` columns of A and rows of B (the rest zero, which adds
nothing); a projection the adapter does not target is zero. Stacks shared by several projections give each
its own ``R`` of the width ``w``: gate and up the fused ``gate_up`` (``2R``; each B writes only its half of
``[2, inter]``), q, k and v ``qkv_a`` (``3R``), their B blocks zero outside their own rows and, without a
mesh, side by side in ``qkv_b`` along the output.

Folded (no mesh, float base weights; ``jaxserve.models.layers.lora``): each A is ``S * w`` more columns of
the base weight it shares an input with (``FOLDED_INTO``: q, k and v's into q's), which the slots replace in
the model's weight tree once, at creation (``W_ext = [W | 0]``, one weight at a time: the base weights are
never held twice); a slot write updates its columns in place, the weights donated. The ``stacks`` are then
the B stacks alone.

A quantized base (AWQ / GPTQ int4, FP8) keeps its packed weights; the stacks stay in the activation dtype and
the deltas read the float activations beside the quantized matmul (``layers.decoder``: with LoRA on, the
norms hand fp8 W8A8 projections float activations, which each quantizes for its own GEMM).

Tensor parallelism: each stack is sharded as its base weight is. B's output axes like the base weight's
(q/k/v/gate_up split on their outputs, which is why q, k, v keep their own B under a mesh), A's input axis
like the base weight's input (o and down split on theirs); the other factor is replicated, and the partial
sums of a row projection's shrink are summed by XLA's partitioner.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.quantization import is_quantized
from jaxserve.quantization.weights import TP
from .peft import LoRAAdapter, projection_shapes

QKV = ("q", "k", "v")
# folded: the base weight whose columns each A stack becomes (q, k and v share one input, and one shrink)
FOLDED_INTO = {"qkv_a": "q", "o_a": "o", "gate_up_a": "gate_up", "down_a": "down"}


def stack_shapes(cfg: ModelConfig, num_slots: int, rank: int, merge_qkv: bool = True) -> dict[str, tuple[int, ...]]:
    """One layer's stacks: ``{"<target>_a": shape, "<target>_b": shape}``; ``merge_qkv``: q, k and v's B
    side by side in one ``qkv_b`` (else ``q_b``, ``k_b``, ``v_b``)."""
    S, R, p = num_slots, rank, projection_shapes(cfg)
    h, i = cfg.hidden_size, cfg.intermediate_size
    out = {"qkv_a": (h, S, 3 * R)}
    if merge_qkv:
        out["qkv_b"] = (S, 3 * R, sum(p[t][1] for t in QKV))
    else:
        out.update({f"{t}_b": (S, 3 * R, p[t][1]) for t in QKV})
    for t in ("o", "down"):
        n_in, n_out = p[t]
        out[f"{t}_a"], out[f"{t}_b"] = (n_in, S, R), (S, R, n_out)
    out["gate_up_a"], out["gate_up_b"] = (h, S, 2 * R), (S, 2 * R, 2, i)
    return out


def _base_weight(layer: dict, key: str):
    """The base weight whose sharding a stack follows (q's for the shared qkv_a and the merged qkv_b; a fused
    ``qkv`` weight's for q, k and v)."""
    name = key.rpartition("_")[0]
    name = "q" if name == "qkv" else name
    return layer[name] if name in layer else layer["qkv"]


def _sharding(mesh, base_weight, a: bool):
    """A stack's sharding from its base weight's ``[in, *out]`` spec: A ``[in, S, w]`` takes the input axis's,
    B ``[S, w, *out]`` the output axes'. A quantized base weight says which logical axis it splits
    (``tp_axis``)."""
    if mesh is None:
        return None
    if is_quantized(base_weight):
        spec = tuple(TP if i == base_weight.tp_axis else None for i in range(len(base_weight.shape)))
    else:
        spec = tuple(getattr(base_weight.sharding, "spec", None) or ())
        spec += (None,) * (base_weight.ndim - len(spec))
    return NamedSharding(mesh, P(spec[0], None, None) if a else P(None, None, *spec[1:]))


def _write(stacks, folded, slot, values, num_slots: int):
    """Each stack's ``slot``: A's second axis, B's first; ``folded``: per layer the ``W_ext`` of each A key,
    whose ``slot``'s ``w`` columns (after the base weight's ``out``) take that A."""
    def columns(w_ext, a):
        width = a.shape[1]
        start = w_ext.shape[1] - num_slots * width + slot * width
        return jax.lax.dynamic_update_slice(w_ext, a.astype(w_ext.dtype), (0, start))
    return ([{k: (s.at[:, slot] if k.endswith("_a") else s.at[slot]).set(values[i][k].astype(s.dtype))
              for k, s in layer.items()} for i, layer in enumerate(stacks)],
            [{k: columns(w, values[i][k]) for k, w in layer.items()} for i, layer in enumerate(folded)])


@functools.partial(jax.jit, static_argnums=1)
def _fold(w: jax.Array, width: int) -> jax.Array:
    """``W [in, *out]`` → ``W_ext = [W | 0]`` ``[in, prod(out) + width]``."""
    return jnp.concatenate([w.reshape(w.shape[0], -1), jnp.zeros((w.shape[0], width), w.dtype)], axis=1)


def can_fold(params: dict, mesh) -> bool:
    """The A stacks can be columns of their base weights: no mesh, and every target a float array."""
    return mesh is None and all(isinstance(layer.get(t), jax.Array) and jnp.issubdtype(layer[t].dtype, jnp.floating)
                                for layer in params["layers"] for t in set(FOLDED_INTO.values()))


class LoRASlots:
    """The slot stacks of one model (``stacks``: what the step takes as its ``params["lora"]``); folded, also
    the A columns of the model's ``FOLDED_INTO`` weights, which it replaces in ``params`` (the model's tree)."""

    def __init__(self, cfg: ModelConfig, params: dict, max_loras: int, max_rank: int, dtype, mesh=None,
                 fold: bool | None = None):
        """``fold``: the A stacks become columns of the base weights (default: where ``can_fold``)."""
        self.cfg, self.num_slots, self.rank, self.dtype = cfg, max_loras + 1, max_rank, jnp.dtype(dtype)
        # a merged qkv_b's output axis would not split as the three base weights' do
        self.merge_qkv = mesh is None
        shapes = stack_shapes(cfg, self.num_slots, max_rank, self.merge_qkv)
        # folded: the model's weight tree, whose FOLDED_INTO weights become W_ext here and at each write
        self.params = params if (can_fold(params, mesh) if fold is None else fold) else None
        if self.params is not None:
            for layer in params["layers"]:
                for k, name in FOLDED_INTO.items():     # each W freed once its W_ext is made: one at a time
                    layer[name] = _fold(layer[name], self.num_slots * shapes[k][2]).block_until_ready()
            shapes = {k: shape for k, shape in shapes.items() if k not in FOLDED_INTO}
        self.shardings = [{k: _sharding(mesh, _base_weight(layer, k), k.endswith("_a")) for k in shapes}
                          for layer in params["layers"]]
        self.stacks = [{k: jnp.zeros(shape, self.dtype, device=sh[k]) for k, shape in shapes.items()}
                       for sh in self.shardings]
        self._write = jax.jit(functools.partial(_write, num_slots=self.num_slots), donate_argnums=(0, 1),
                              out_shardings=(self.shardings, []) if mesh is not None else None)

    @property
    def folded(self) -> bool:
        return self.params is not None

    def write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put ``adapter`` (None: zeros) in ``slot`` (1 .. max_loras); the step's next dispatch reads it."""
        assert 0 < slot < self.num_slots, slot
        values = [self._layer_values(adapter.layers[i] if adapter is not None else {})
                  for i in range(self.cfg.num_layers)]
        layers = self.params["layers"] if self.folded else []
        folded = [{k: layer[name] for k, name in FOLDED_INTO.items()} for layer in layers]
        self.stacks, folded = self._write(self.stacks, folded, np.int32(slot), values)
        for layer, weights in zip(layers, folded):
            layer.update({FOLDED_INTO[k]: w for k, w in weights.items()})

    def _layer_values(self, layer: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
        """One slot's part of each stack (A ``[in, w]``, B ``[w, *out]``) for one layer of an adapter."""
        R, shapes = self.rank, stack_shapes(self.cfg, 1, self.rank, self.merge_qkv)
        out = {k: np.zeros(shape[:1] + shape[2:] if k.endswith("_a") else shape[1:], np.float32)
               for k, shape in shapes.items()}
        q_k_v_out = np.cumsum([0] + [projection_shapes(self.cfg)[t][1] for t in QKV])
        for t, (a, b) in layer.items():
            r = a.shape[1]
            if t in QKV:
                j = QKV.index(t)
                rows = slice(j * R, j * R + r)
                out["qkv_a"][:, rows] = a
                if self.merge_qkv:
                    out["qkv_b"][rows, q_k_v_out[j]:q_k_v_out[j + 1]] = b
                else:
                    out[f"{t}_b"][rows] = b
            elif t in ("gate", "up"):
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
