"""The mixture-of-experts MLP: a router, top-k experts per token through a grouped GEMM, the weighted combine,
and a shared expert (Qwen2-MoE's behind a sigmoid gate, DeepSeek's ungated). One more layer kind of
``layers.decoder``: a layer whose ``MoESpec.layers`` entry is True declares these weights instead of the dense
``gate_up`` / ``down``.

Routing, as HF transformers (and vLLM) computes it for Mixtral, Qwen2-MoE and Qwen3-MoE: router logits in the
parameter dtype, softmax over all experts in float32, top-k, then (``renormalize``: Mixtral always,
Qwen's ``norm_topk_prob``) the k weights divided by their sum. Qwen casts the weights to the hidden dtype
before the combine (``weights_in_hidden_dtype``), Mixtral keeps them in float32.

NOTE the expert computation: the ``T * k`` (token, expert) assignments are sorted by expert (a stable sort,
so ties keep token order); ``group_sizes`` counts each expert's rows; one grouped GEMM runs gate/up for every
expert's rows and the activation (the Pallas kernel inside itself: ``ragged_dot``'s gated form), a second runs
down; the rows go back to token order and each token sums its k rows times their weights (in float32).
Assignments this device does not compute — padding tokens, and under expert parallelism the experts another
device owns — sort after the last group, where the grouped GEMM gives zeros and an implementation that skips
them spends nothing.

Decode-sized steps (at most ``MoESpec.rows_path_max_tokens`` tokens, a static bucket size) skip the sort:
the (token, slot) rows go in token order to ``ragged_dot.expert_rows_matmul``, one kernel tile per distinct
expert gathering that expert's rows (at most one per token), and come back in token order; an unowned row
(padding, another device's expert) belongs to no tile. Both paths read each selected expert's weights once;
the rows path saves the sort, the group count, the tile plan's prefix sums and the scatter back (a handful
of small launches per layer, which at batch 1 are a large share of the step), at an ``(T·k)²`` plan.
``rows_fused`` (the GPU's default; ``JAXSERVE_MOE_GROUPED_GEMM=rows`` for the planned kernel) runs each
product as one launch (``expert_rows_matmul_fused``: every program makes its tile from the ids, gate/up reads
each token's hidden state for its k rows, unowned rows are zeroed by their own program), without the plan, the
repeat and the zero fills between the kernels, and the router's top-k, weights and padding mask as one more
(``kernels/moe_route``: the softmax router and DeepSeek's) instead of XLA's sort and its neighbours. With
``JAXSERVE_MOE_SHARED_IN_ROWS`` on (the default; 0 keeps its own products) the shared expert rides along in
the same two launches (``_shared_rides_along``: a shared MLP a whole number S of experts wide, plain weights,
no expert parallelism): its S expert-wide slices are S more rows of every real token, each weighing 1 in the
combine (Qwen2-MoE: its sigmoid gate), summed by the same all-reduce under tensor parallelism; no products of
its own.

Routing as computed: top-k of the logits (softmax is monotone, so the same experts in the same order), then
the weights in float32 from those k logits alone when renormalising (the softmax of the k values equals the
renormalised top-k probabilities), else ``exp(top - logsumexp(all))``: no softmax over all experts.

Parallelism over the ``"tp"`` mesh axis (the weights' ``out_sharding`` says which, ``expert_partition``):
- tensor parallel (default): every device holds every expert's ``intermediate / tp`` slice, like a dense MLP
  (gate/up column-parallel, down row-parallel); each device's combine is a partial sum, all-reduced.
- expert parallel (``--enable-expert-parallel``, ``cfg.extra["enable_expert_parallel"]``): each device holds
  ``num_experts / tp`` whole experts and computes only the assignments to them. Activations are already
  replicated (attention is tensor parallel), so no dispatch all-to-all is needed: the same one all-reduce
  sums every device's experts.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxserve import envs, parallel
from jaxserve.config import ModelConfig
from jaxserve.errors import ModelLoadError
from jaxserve.kernels import moe_route, ragged_dot

from . import moe_routing

TP = parallel.TP
EXPERT_PARALLEL = "enable_expert_parallel"       # the ModelConfig.extra key (vLLM's flag name)


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """What a family's MoE layers compute (hashable: part of ``DecoderSpec``, a static jit arg)."""
    num_experts: int
    top_k: int
    intermediate_size: int                     # per expert
    renormalize: bool                          # top-k weights divided by their sum
    weights_in_hidden_dtype: bool = False      # Qwen: routing weights cast to the hidden dtype before combine
    shared_intermediate_size: int | None = None   # Qwen2-MoE: a shared expert behind a sigmoid gate
    layers: tuple[bool, ...] = ()              # per layer: MoE (True) or the dense MLP
    expert_parallel: bool = False
    grouped_gemm: str = "ragged_dot"           # kernels.ragged_dot implementation
    rows_path_max_tokens: int = 0              # steps of at most this many tokens skip the sort (0: none do)
    rows_fused: bool = False                   # the rows path: one launch a product, one for the top-k
    rows_launch: tuple = (None, None)          # the fused products' launch bounds (gate/up, down; None: default)
    shared_in_rows: bool = True                # rows_fused: the shared expert in the same launches
    # DeepSeekMoE (``moe_routing``): its router, an ungated shared expert, the routed weights' scale
    router: str = "softmax"                    # "softmax" (route below) or a moe_routing.ROUTERS key
    num_groups: int = 1                        # expert groups for group-limited / node-limited top-k
    topk_groups: int = 1                       # groups a token's experts may come from
    routed_scaling_factor: float = 1.0
    shared_expert_gate: bool = True            # Qwen2-MoE's sigmoid gate on the shared expert


def moe_spec(cfg: ModelConfig, *, renormalize: bool, weights_in_hidden_dtype: bool,
             shared_intermediate_size: int | None = None) -> MoESpec:
    """The spec from ``cfg.extra`` (a family's ``read_hf`` puts the MoE fields there under HF's names, see
    ``experts_from_hf``); layer i is MoE unless listed in ``mlp_only_layers`` or off the
    ``decoder_sparse_step`` stride (HF's rule)."""
    extra = cfg.extra_dict
    step, dense = int(extra.get("decoder_sparse_step") or 1), set(extra.get("mlp_only_layers") or ())
    layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(cfg.num_layers))
    impl, rows_path, rows_fused = _grouped_gemm()
    return MoESpec(num_experts=int(extra["num_experts"]), top_k=int(extra["num_experts_per_tok"]),
                   intermediate_size=int(extra["moe_intermediate_size"]), renormalize=renormalize,
                   weights_in_hidden_dtype=weights_in_hidden_dtype,
                   shared_intermediate_size=shared_intermediate_size, layers=layers,
                   expert_parallel=bool(extra.get(EXPERT_PARALLEL, False)), grouped_gemm=impl,
                   rows_path_max_tokens=ROWS_PATH_MAX_TOKENS if rows_path else 0, rows_fused=rows_fused,
                   rows_launch=_rows_launch(envs.JAXSERVE_MOE_ROWS_LAUNCH),
                   shared_in_rows=envs.JAXSERVE_MOE_SHARED_IN_ROWS)


def experts_from_hf(hf: dict, extra: dict) -> dict:
    """A MoE family's ``ModelConfig.extra`` with the expert count under one name whatever the config calls it
    (Mixtral and transformers 5's Qwen3-MoE say ``num_local_experts``) and each expert's width (Mixtral's
    experts use ``intermediate_size``)."""
    return extra | {"num_experts": int(hf.get("num_experts") or hf.get("num_local_experts") or 8),
                    "moe_intermediate_size": extra.get("moe_intermediate_size", int(hf["intermediate_size"]))}


ROWS = "rows"      # JAXSERVE_MOE_GROUPED_GEMM: the Pallas kernel, and the sort-free rows path at decode sizes
ROWS_FUSED = "rows_fused"      # the same, each rows product one launch (ragged_dot.expert_rows_matmul_fused)


def _grouped_gemm() -> tuple[str, bool, bool]:
    """(the grouped GEMM the MoE layers run, whether decode-sized steps take the sort-free rows path, whether
    that path runs ``expert_rows_matmul_fused``: no plan, repeat or zero-fill ops around its two kernels).
    ``auto`` is ``rows_fused`` on a GPU (benchmarks/results/2026-12-06-h100-moe-rows-fused.md) and ``ragged_dot``
    elsewhere. On a GPU ``lax.ragged_dot`` lowers to a dense padded product, far slower than the Pallas kernel
    past a few tokens (benchmarks/results/2026-12-01-h200-moe-grouped-gemm.md). A named ragged_dot
    implementation runs at every size (A/B runs)."""
    impl = envs.JAXSERVE_MOE_GROUPED_GEMM
    if impl == "auto":
        impl = ROWS_FUSED if jax.default_backend() == "gpu" else "ragged_dot"
    if impl in (ROWS, ROWS_FUSED):
        return "pallas", True, impl == ROWS_FUSED
    if impl not in ragged_dot.IMPLEMENTATIONS:
        raise ValueError(f"JAXSERVE_MOE_GROUPED_GEMM={impl!r} is not one of auto, {ROWS}, {ROWS_FUSED}, "
                         f"{', '.join(ragged_dot.IMPLEMENTATIONS)}")
    return impl, False, False


def _rows_launch(text: str) -> tuple:
    """``JAXSERVE_MOE_ROWS_LAUNCH`` ("GATE_UP[,DOWN]") as ``(gate/up launch, down launch)``; one launch is both's."""
    if not text.strip():
        return None, None
    launches = [ragged_dot.parse_rows_launch(s) for s in text.split(",")]
    if len(launches) > 2:
        raise ValueError(f"JAXSERVE_MOE_ROWS_LAUNCH={text!r}: at most two launches (gate/up, down)")
    return launches[0], launches[-1]


ROWS_PATH_MAX_TOKENS = 16    # one 16-row kernel tile holds an expert's rows; the plan is (16·k)² compares


def with_expert_parallel(cfg: ModelConfig, enable: bool) -> ModelConfig:
    """``cfg`` with experts sharded over the mesh (``enable``) or tensor parallel; a config without experts
    is returned as it is (vLLM ignores the flag for dense models too)."""
    extra = {k: v for k, v in cfg.extra if k != EXPERT_PARALLEL}
    if "num_experts" not in extra:
        return cfg
    if enable:
        extra[EXPERT_PARALLEL] = True
    return dataclasses.replace(cfg, extra=tuple(sorted(extra.items())))


def expert_partition(spec: MoESpec) -> tuple[tuple, tuple]:
    """Out-shardings of ``experts_gate_up [E, hidden, 2, i]`` and ``experts_down [E, i, hidden]``."""
    if spec.expert_parallel:
        return (TP, None, None, None), (TP, None, None)
    return (None, None, None, TP), (None, TP, None)


def declare_params(layer, hidden: int, spec: MoESpec, param: Callable) -> None:
    """The MoE weights of one decoder layer, declared on it (flat, like the layer's other weights)."""
    gate_up, down = expert_partition(spec)
    e, i = spec.num_experts, spec.intermediate_size
    layer.router = param((hidden, e), ())
    if spec.router in moe_routing.BIASED:
        layer.router_bias = param((e,), (), "zeros", jnp.float32)     # transformers keeps it in float32
    layer.experts_gate_up = param((e, hidden, 2, i), gate_up)
    layer.experts_down = param((e, i, hidden), down)
    if spec.shared_intermediate_size:
        si = spec.shared_intermediate_size
        layer.shared_gate_up = param((hidden, 2, si), (None, None, TP))
        layer.shared_down = param((si, hidden), (TP, None))
        if spec.shared_expert_gate:
            layer.shared_gate = param((hidden, 1), ())


def route(router_logits: jax.Array, spec: MoESpec) -> tuple[jax.Array, jax.Array]:
    """``(weights [T, k] float32, expert ids [T, k] int32)``: the top-k of the softmax over the experts in
    float32, optionally renormalised; computed from the top-k logits (see the module docstring)."""
    # top-k in the logits' own dtype (widening to float32 is exact and keeps the order): no [T, E] convert
    top, ids = lax.top_k(router_logits, spec.top_k)
    top = top.astype(jnp.float32)
    shifted = jnp.exp(top - top[:, :1])          # top[:, 0] is the largest logit
    if spec.renormalize:
        total = jnp.sum(shifted, axis=-1, keepdims=True)
    else:
        total = jnp.sum(jnp.exp(router_logits.astype(jnp.float32) - top[:, :1]), axis=-1, keepdims=True)
    return shifted / total, ids.astype(jnp.int32)


def moe_mlp(h: jax.Array, w: dict, spec: MoESpec, activation: Callable,
            valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The MoE MLP of the normed input ``h [T, hidden]`` (``w``: the layer's MoE weights by name);
    ``valid [T]`` marks real tokens (padding tokens are routed nowhere). Returns the output and the routed
    expert ids ``[T, k]`` (a padding token's: ``num_experts``), which ``expert_load`` counts."""
    if spec.rows_fused and h.shape[0] <= spec.rows_path_max_tokens:
        # h as one array for the router and the Pallas kernels: else XLA fuses the norm weight's multiply into
        # the router GEMM and runs it again as a kernel of its own for the Pallas input (a launch a MoE layer)
        h = lax.optimization_barrier(h)
        weights, ids = _fused_route(h, w, spec, valid)
    else:
        if spec.router == "softmax":
            weights, ids = route(h @ w["router"], spec)
        else:
            weights, ids = moe_routing.route(h, w["router"], w.get("router_bias"), spec)
        if valid is not None:
            ids = jnp.where(valid[:, None], ids, spec.num_experts)      # an id no device owns
    if spec.weights_in_hidden_dtype:
        weights = weights.astype(h.dtype)
    shared = None
    if _shared_rides_along(h.shape[0], w, spec):
        gate = jax.nn.sigmoid(h @ w["shared_gate"]) if spec.shared_expert_gate else None
        shared = (w["shared_gate_up"], w["shared_down"], gate)
    out = routed_experts(h, ids, weights, w["experts_gate_up"], w["experts_down"], spec, activation, shared)
    if spec.shared_intermediate_size and shared is None:
        gate_up = jnp.einsum("th,hci->tci", h, w["shared_gate_up"])
        shared = parallel.row_parallel_matmul(activation(gate_up[:, 0]) * gate_up[:, 1], w["shared_down"])
        out = out + (jax.nn.sigmoid(h @ w["shared_gate"]) * shared if spec.shared_expert_gate else shared)
    return out, ids


def _shared_rides_along(t: int, w: dict, spec: MoESpec) -> bool:
    """Whether the shared expert runs in the routed experts' two launches (``_experts``): a ``rows_fused`` step,
    a shared MLP that is whole experts wide, plain arrays of one dtype, and no expert parallelism (each device
    would add it to the all-reduce)."""
    si, names = spec.shared_intermediate_size, ("experts_gate_up", "experts_down", "shared_gate_up", "shared_down")
    return (spec.rows_fused and spec.shared_in_rows and t <= spec.rows_path_max_tokens and bool(si)
            and si % spec.intermediate_size == 0
            and not spec.expert_parallel and all(isinstance(w[n], jax.Array) for n in names)
            and len({w[n].dtype for n in names}) == 1)


def _fused_route(h: jax.Array, w: dict, spec: MoESpec, valid: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``route`` / ``moe_routing.route`` and the padding mask in one launch (``kernels.moe_route``)."""
    if spec.router == "softmax":
        return moe_route.softmax_top_k(h @ w["router"], spec.top_k, spec.renormalize, valid)
    if spec.router not in moe_routing.ROUTERS:
        raise ValueError(f"unknown MoE router {spec.router!r}; one of softmax, {', '.join(moe_routing.ROUTERS)}")
    v3 = spec.router == "deepseek_v3"        # V2's weights are never renormalised (as transformers')
    weights, ids = moe_route.grouped_top_k(moe_routing.router_logits(h, w["router"]), spec.top_k,
                                           v3 and spec.renormalize, valid, w.get("router_bias"), sigmoid=v3,
                                           num_groups=spec.num_groups, topk_groups=spec.topk_groups)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, ids


def expert_load(ids: jax.Array, num_experts: int) -> jax.Array:
    """Tokens routed to each expert of each layer ``[L, E]`` int32 from the layers' routed ids ``[L, T, k]``
    (an id of ``num_experts``, a padding token's, counts nowhere): one histogram for the whole step, not one
    per layer (a decode step's layers then gain no kernel). From the replicated ids, so under a mesh every
    device holds all of it; a caller that drops it costs nothing (XLA removes it)."""
    layers = ids.shape[0]
    flat = (ids + jnp.arange(layers, dtype=ids.dtype)[:, None, None] * (num_experts + 1)).reshape(-1)
    counts = jnp.bincount(flat, length=layers * (num_experts + 1)).reshape(layers, num_experts + 1)
    return counts[:, :num_experts].astype(jnp.int32)


def routed_experts(h, ids, weights, gate_up, down, spec: MoESpec, activation: Callable,
                   shared: tuple | None = None) -> jax.Array:
    """Sum over each token's k experts of weight × expert MLP, on one device or over the tp mesh; with
    ``shared`` (``(shared_gate_up, shared_down, gate [T, 1] or None)``, the rows_fused path only) plus the
    shared expert (times its gate)."""
    mesh = parallel.current_tp_mesh()

    def compute(h, ids, wts, gu, dn, offset, *shared):
        return _experts(h, ids, wts, gu, dn, offset, spec, activation, shared or None)

    shared = () if shared is None else shared
    if mesh is None:
        return compute(h, ids, weights, gate_up, down, 0, *shared)
    gate_up_spec, down_spec = expert_partition(spec)
    # the shared MLP's intermediate columns are split like the experts': each device's S experts are its part
    shared_specs = (P(None, None, TP), P(TP, None), P())[:len(shared)]

    def local(h, ids, wts, gu, dn, *shared):
        offset = lax.axis_index(TP) * gu.shape[0] if spec.expert_parallel else 0
        return lax.psum(compute(h, ids, wts, gu, dn, offset, *shared), TP)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P(*gate_up_spec), P(*down_spec), *shared_specs),
                         out_specs=P(), check_vma=False)(h, ids, weights, gate_up, down, *shared)


def _experts(h, ids, weights, gate_up, down, offset, spec: MoESpec, activation: Callable,
             shared: tuple | None = None) -> jax.Array:
    """This device's experts ``offset .. offset + E_local`` (see the module NOTE); ``shared``: see
    ``routed_experts``."""
    t, k = ids.shape
    local_experts, hidden = gate_up.shape[:2]
    if isinstance(offset, int) and offset == 0 and local_experts == spec.num_experts:
        # every expert is here: the ids are already the keys (a padding token's, num_experts, is owned by
        # no tile and its rows come out zero)
        key = ids.reshape(-1)
    else:
        local = ids - offset
        mine = (local >= 0) & (local < local_experts)
        key = jnp.where(mine, local, local_experts).reshape(-1)
        weights = jnp.where(mine, weights, 0)
    if t <= spec.rows_path_max_tokens and spec.rows_fused:     # decode sizes, one launch a product
        gu_launch, down_launch = spec.rows_launch
        shared_gu, shared_down, shared_gate = shared or (None, None, None)
        if shared:       # S more rows a token: the shared MLP as S experts (ragged_dot.expert_rows_matmul_fused)
            shared_gu, key = shared_gu.reshape(hidden, -1), key.reshape(t, k)    # [hidden, 2 * si]: gates, ups
        per = k + (shared_down.shape[0] // down.shape[1] if shared else 0)
        y = ragged_dot.expert_rows_matmul_fused(h, gate_up.reshape(local_experts, hidden, -1), key, t,
                                                rows_per_lhs_row=per, activation=activation, launch=gu_launch,
                                                shared=shared_gu)                          # [T * per + 1, i]
        y = ragged_dot.expert_rows_matmul_fused(y, down, key, t, launch=down_launch,
                                                shared=shared_down)                        # row T * per: scratch
        return _combine(weights, y[:t * per].reshape(t, per, hidden), h.dtype, shared_gate)
    if t <= spec.rows_path_max_tokens:        # decode sizes: (token, slot) rows as they are, no sort
        rows = jnp.repeat(h, k, axis=0)                                            # [T * k, hidden]
        plan = ragged_dot.expert_rows_plan(key, local_experts, t)                  # one plan for both products
        y = ragged_dot.expert_rows_matmul(rows, gate_up.reshape(local_experts, hidden, -1), None, t, plan=plan,
                                          activation=activation)                  # act(gate) * up, [T * k, i]
        y = ragged_dot.expert_rows_matmul(y, down, None, t, plan=plan)
        y = y.reshape(t, k, hidden)
        return _combine(weights, y, h.dtype)
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=local_experts + 1)[:local_experts].astype(jnp.int32)
    rows = jnp.take(h, order // k, axis=0)                                         # [T * k, hidden]
    y = ragged_dot.grouped_matmul(rows, gate_up.reshape(local_experts, hidden, -1), group_sizes, spec.grouped_gemm,
                                  activation=activation)
    y = ragged_dot.grouped_matmul(y, down, group_sizes, spec.grouped_gemm)
    # back to token order as a row gather (the inverse permutation is a small int scatter): XLA fuses the
    # gather into _combine's weighted sum, where scattering the rows wrote and re-read all T * k of them
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype),
                                                  unique_indices=True, mode="promise_in_bounds")
    return _combine(weights, y.at[inverse].get(mode="promise_in_bounds").reshape(t, k, hidden), h.dtype)


def _combine(weights: jax.Array, y: jax.Array, dtype, shared_gate: jax.Array | None = None) -> jax.Array:
    """Each token's ``sum_k weights[t, k] * y[t, k]`` in float32: a multiply and a sum over the k rows, which
    XLA fuses with the widening and the residual add (a batched dot of depth k is a matmul launch of its own).
    Rows of ``y`` past the k (the shared expert's) weigh 1, or ``shared_gate [T, 1]``: still one reduction."""
    weights = weights.astype(jnp.float32)
    t, k = weights.shape
    if y.shape[1] > k:
        gate = jnp.ones((t, 1), jnp.float32) if shared_gate is None else shared_gate.astype(jnp.float32)
        weights = jnp.concatenate([weights, jnp.broadcast_to(gate, (t, y.shape[1] - k))], axis=1)
    return jnp.sum(weights[..., None] * y.astype(jnp.float32), axis=1).astype(dtype)


def check_config(cfg: ModelConfig) -> None:
    """Refuse MoE configs this layer would get wrong, with the field to fix."""
    extra = cfg.extra_dict
    experts, top_k = int(extra.get("num_experts") or 0), int(extra.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ModelLoadError(f"num_experts_per_tok {top_k} must be between 1 and the number of experts {experts}")
