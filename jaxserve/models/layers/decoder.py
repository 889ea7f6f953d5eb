"""The decoder stack as ``flax.nnx`` modules, configured by a ``DecoderSpec`` that a family derives from its
``ModelConfig``; ``DecoderFamily`` turns a family's spec function into the functions the engine calls.

Weights: every parameter is declared once, in ``DecoderLayer`` / ``DecoderModel``, as an ``nnx.Param`` with its
tensor-parallel layout (``out_sharding``: axis names over the ``"tp"`` mesh axis; q/k/v/gate/up
column-parallel, o/down row-parallel, embedding and lm_head vocab-parallel, norms replicated) and its dummy
initialiser (``init``). ``nnx.split`` of the abstract model gives the state; its pure-dict form, with the
layers as a list, is the weight pytree the loaders fill and the jitted step takes:
``{"embed", "layers": [{"attn_norm", "q", "k", ...}, ...], "final_norm", "lm_head"?}``. A layer's weights stay
flat (no per-layer-module nesting) so checkpoint names map onto one dict per layer and tensor parallelism
can tell a kv projection by its name (``parallel.mesh.adjust_spec_for_tp``).

Layout: matmul weights are ``[in, out]`` so the step never transposes; ``gate_up`` is the gated MLP's input
projection ``[hidden, 2, intermediate]`` (gate then up), fused along its own axis so tensor parallelism still
shards ``intermediate``; q/k/v stay separate (under GQA a fused column split would not line up with head
shards; Phi-3's fused checkpoint tensors are split at load), except that a quantized model without tensor
parallelism loads them as one ``qkv [hidden, q_out + 2 * kv_out]`` (``with_fused_qkv``: one quantized GEMM a
layer instead of three, where XLA cannot merge the three custom calls itself). With LoRA adapters folded
(``layers.lora``), q, o, gate_up and down are ``[in, out + S * w]`` instead: their adapter slots' A columns
appended (gate_up flat).

The step: ``forward`` merges the graph definition (static, cached per config) with the weight pytree it was
given and runs the model: layers unrolled in Python, each writing its K/V into its paged cache (the caches
are plain arrays the step donates) and attending through the step's block tables. Each row-parallel
projection is followed by the residual add and the next norm in one call so TP's all-reduce can fuse them.

Numerics follow HF transformers: compute in the parameter dtype; norm statistics, RoPE angles and the
attention softmax in float32; logits in float32.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxserve import parallel
from jaxserve.config import ModelConfig
from jaxserve.quantization.weights import live_tokens
from jaxserve.kernels import mla_ref, ops as kernel_ops
from jaxserve.kernels.metadata import PAD_SLOT, AttentionMetadata
# kernels.ops's write_kv_and_attend, wrapped in shard_map over "tp" when the step runs under a mesh
from jaxserve.parallel import attention as tp_attention

from . import mla, moe
from .dummy_init import dummy_init_fn, leaf_seed
from .lora import LoRABatch, lora_batch
from .linear import linear, normed_input, row_parallel_linear, row_parallel_linear_add_rms_norm, unmerged
from .norms import NORMS, inv_rms
from .rotary import Rotary

TP = "tp"
COLUMN, ROW, VOCAB, REPLICATED, COLUMN_BIAS = (None, TP), (TP, None), (TP, None), (), (TP,)
# ModelConfig.extra: q, k and v loaded as one ``qkv [hidden, q_out + 2 * kv_out]`` weight (``with_fused_qkv``)
FUSED_QKV = "fused_qkv"
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """What a family's decoder computes, beyond the shapes in ``ModelConfig`` (hashable: a static jit arg)."""
    norm: str = "rms"                          # layers.norms.NORMS key
    qk_norm: bool = False                      # per-head norm of q and k before RoPE (Qwen3, Gemma 3)
    attention_bias: bool = False               # q/k/v bias (Qwen2)
    sandwich_norms: bool = False               # Gemma: norms after attention and after the MLP as well
    parallel_block: bool = False               # Command-R: attention and MLP both read the input norm
    activation: str = "silu"                   # ACTIVATIONS key, of the gate
    embed_scale: float | None = None           # Gemma: embeddings times sqrt(hidden_size)
    sm_scale: float = 1.0                      # attention scale (head_dim ** -0.5, Gemma query_pre_attn_scalar)
    attn_soft_cap: float | None = None         # Gemma 2 attention-logit soft-capping
    final_soft_cap: float | None = None        # Gemma 2 final-logit soft-capping
    logit_scale: float | None = None           # Command-R
    windows: tuple[int | None, ...] = ()       # per layer: sliding window or None (global)
    rotaries: tuple[Rotary, ...] = ()          # the distinct RoPE tables
    layer_rotary: tuple[int, ...] = ()         # per layer: index into ``rotaries``
    moe: moe.MoESpec | None = None             # mixture-of-experts MLPs (on the layers it lists)
    mla: mla.MLASpec | None = None             # DeepSeek's latent attention instead of q/k/v (every layer)


def _param(shape: tuple[int, ...], sharding: tuple, init: str = "normal", fixed_dtype=None) -> nnx.Param:
    """A parameter declared with its TP layout and dummy initialiser; the value is a placeholder (the model is
    only ever built under ``nnx.eval_shape``: real values come from a loader). ``fixed_dtype``: the weight is
    kept in it whatever the model's dtype (``DecoderFamily.param_dtypes``)."""
    return nnx.Param(jnp.zeros(shape, jnp.float32), out_sharding=sharding, eager_sharding=False, init=init,
                     fixed_dtype=fixed_dtype)


def _w(variable: nnx.Variable) -> jax.Array:
    return variable.get_value()


def effective_window(window: int | None, md: AttentionMetadata, k_cache: jax.Array) -> int | None:
    """The sliding window a layer's attention needs: ``None`` (global) when the window covers every position a
    request of this step can reach (its block table's span), since it then masks no key. Gemma 2's 4096-token
    windows served at ``max_model_len <= 4096`` run the global kernel on every layer: one attention variant,
    no window arithmetic. The K pages are ``[blocks, kv_heads, block_size, head_dim]``."""
    if window is not None and window >= md.block_tables.shape[1] * k_cache.shape[2]:
        return None
    return window


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, index: int):
        h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
        norm_init = "zeros" if spec.norm == "offset_rms" else "ones"
        self.cfg, self.spec, self.index = cfg, spec, index
        self.norm = NORMS[spec.norm]
        self.attn_norm = _param((h,), REPLICATED, norm_init)
        if spec.mla is not None:
            mla.declare_params(self, h, cfg.num_heads, spec.mla, _param)
        else:
            if cfg.extra_dict.get(FUSED_QKV):
                self.qkv = _param((h, q_out + 2 * kv_out), COLUMN)
            else:
                self.q, self.k = _param((h, q_out), COLUMN), _param((h, kv_out), COLUMN)
                self.v = _param((h, kv_out), COLUMN)
            self.o = _param((q_out, h), ROW)
        if spec.attention_bias:
            self.q_bias, self.k_bias, self.v_bias = (_param((q_out,), COLUMN_BIAS), _param((kv_out,), COLUMN_BIAS),
                                                     _param((kv_out,), COLUMN_BIAS))
        if spec.qk_norm:
            self.q_norm, self.k_norm = _param((d,), REPLICATED, norm_init), _param((d,), REPLICATED, norm_init)
        if not spec.parallel_block:
            self.mlp_norm = _param((h,), REPLICATED, norm_init)
        if spec.sandwich_norms:
            self.post_attn_norm = _param((h,), REPLICATED, norm_init)
            self.post_mlp_norm = _param((h,), REPLICATED, norm_init)
        self.is_moe = spec.moe is not None and spec.moe.layers[index]
        if self.is_moe:
            moe.declare_params(self, h, spec.moe, _param)
        else:
            self.gate_up = _param((h, 2, i), (None, None, TP))
            self.down = _param((i, h), ROW)

    def attention_readers(self) -> tuple:
        """The projections that read the attention norm's output (``normed_input``)."""
        if self.spec.mla is not None:
            return mla.readers(self._weights(("q", "q_a", "kv_a", "fused_qkv_a")), self.spec.mla)
        if hasattr(self, "qkv"):
            return (_w(self.qkv),)
        return (_w(self.q), _w(self.k), _w(self.v))

    def _weights(self, names) -> dict:
        return {n: _w(getattr(self, n)) for n in names if hasattr(self, n)}

    def attention(self, h: jax.Array, cos_sin, kv_cache, md: AttentionMetadata, backend: str,
                  lora: LoRABatch | None = None):
        """Self-attention of the normed input ``h [T, hidden]`` up to (not including) the o projection:
        ``(attn [T, heads * head_dim], (k_cache, v_cache))``; ``lora``: the step's adapters' q/k/v deltas."""
        cfg, spec = self.cfg, self.spec
        t, hq, hkv, d = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rotary = spec.rotaries[spec.layer_rotary[self.index]]
        if spec.mla is not None:
            weights = self._weights(("q", "q_a", "q_a_norm", "q_b", "kv_a", "fused_qkv_a", "kv_a_norm", "uk", "uv"))
            return mla.attention(h, weights, spec.mla, hq, rotary, cos_sin[spec.layer_rotary[self.index]], kv_cache,
                                 md, sm_scale=spec.sm_scale, backend=backend)
        cos, sin = cos_sin[spec.layer_rotary[self.index]]
        if hasattr(self, "qkv"):        # one GEMM, its output split after it (``with_fused_qkv``)
            q, k, v = jnp.split(linear(h, _w(self.qkv)), (hq * d, (hq + hkv) * d), axis=-1)
        else:
            hq_in, hk_in, hv_in = unmerged(h, 3)
            q, k, v = linear(hq_in, _w(self.q)), linear(hk_in, _w(self.k)), linear(hv_in, _w(self.v))
        if lora is not None:
            q, k, v = lora.add_qkv(self.index, h, q, k, v)
        if spec.attention_bias:
            q, k, v = q + _w(self.q_bias), k + _w(self.k_bias), v + _w(self.v_bias)
        q, k, v = q.reshape(t, hq, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d)
        if spec.qk_norm:
            q, k = self._qk_norm(q, k)
        q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
        k_cache, v_cache = kv_cache
        attn, k_cache, v_cache = tp_attention.write_kv_and_attend(
            q, k, v, k_cache, v_cache, md, sm_scale=spec.sm_scale, soft_cap=spec.attn_soft_cap,
            sliding_window=effective_window(spec.windows[self.index], md, k_cache), backend=backend)
        return attn.reshape(t, hq * d), (k_cache, v_cache)

    def _qk_norm(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The per-head norms of q ``[T, hq, d]`` and k ``[T, hkv, d]``. Without a tp mesh their statistics
        come from one reduction over the heads side by side (two would each be a GPU kernel of their own, and
        a batch-1 step runs ~15 kernels a layer); the normalised values are still made from q and k
        themselves, so the join feeds only the reduction. Under a mesh q and k are split on heads separately
        and joining them would reshard, so each is normed alone."""
        eps = self.cfg.rms_norm_eps
        if parallel.current_tp_mesh() is not None or self.spec.norm not in ("rms", "offset_rms"):
            return self.norm(q, _w(self.q_norm), eps), self.norm(k, _w(self.k_norm), eps)
        hq = q.shape[1]
        inv = inv_rms(jnp.concatenate([q, k], axis=1), eps)
        return self.norm(q, _w(self.q_norm), eps, inv[:, :hq]), self.norm(k, _w(self.k_norm), eps, inv[:, hq:])

    def gated(self, h: jax.Array, lora: LoRABatch | None = None) -> jax.Array:
        """The gated MLP up to (not including) the down projection: ``act(h @ gate) * (h @ up)``."""
        gate_up = linear(h, _w(self.gate_up))
        if lora is not None:
            gate_up = lora.add(self.index, "gate_up", h, gate_up)
        return ACTIVATIONS[self.spec.activation](gate_up[:, 0]) * gate_up[:, 1]

    def moe_mlp(self, h: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The whole MoE MLP (all-reduced under a mesh): router, top-k experts, combine, shared expert; and
        each token's routed expert ids ``[T, k]``."""
        names = ("router", "router_bias", "experts_gate_up", "experts_down", "shared_gate_up", "shared_down",
                 "shared_gate")
        return moe.moe_mlp(h, self._weights(names), self.spec.moe, ACTIVATIONS[self.spec.activation], valid)


class DecoderModel(nnx.Module):
    """The decoder, or with ``stage=(start, end)`` a pipeline stage of it: layers ``start .. end - 1``, the
    embedding when it is the first, the final norm (and head) when it is the last."""

    def __init__(self, cfg: ModelConfig, spec: DecoderSpec, stage: tuple[int, int] | None = None):
        h = cfg.hidden_size
        self.cfg, self.spec = cfg, spec
        start, end = stage or (0, cfg.num_layers)
        self.first, self.last = start == 0, end == cfg.num_layers
        self.norm = NORMS[spec.norm]
        if self.first or (self.last and cfg.tie_word_embeddings):
            self.embed = _param((cfg.vocab_size, h), VOCAB)
        self.layers = nnx.List([DecoderLayer(cfg, spec, i) for i in range(start, end)])
        if self.last:
            self.final_norm = _param((h,), REPLICATED, "zeros" if spec.norm == "offset_rms" else "ones")
            if not cfg.tie_word_embeddings:
                self.lm_head = _param((h, cfg.vocab_size), COLUMN)

    def __call__(self, kv_caches: list, input_ids: jax.Array, positions: jax.Array, md: AttentionMetadata,
                 backend: str, mm_embeds: jax.Array | None = None, mm_rows: jax.Array | None = None,
                 lora: tuple | None = None, hidden_in: jax.Array | None = None, aux_layers: tuple[int, ...] = ()):
        """``(h, kv_caches, expert load)``: h the final norm's output, or on a stage before the last the
        residual stream its successor takes as ``hidden_in``. ``aux_layers`` (an EAGLE-3 target's): a fourth
        item, the residual streams entering those layers (``num_layers``: leaving the last) side by side,
        ``[T, len * hidden]``."""
        spec, eps = self.spec, self.cfg.rms_norm_eps
        x = jnp.take(_w(self.embed), input_ids, axis=0) if self.first else hidden_in
        # LoRA (the plain pre-norm block only: ``supports_lora``): (slot stacks, each token's slot)
        lora = lora_batch(*lora, x.dtype) if lora is not None else None
        if spec.embed_scale is not None and self.first:
            x = x * jnp.asarray(spec.embed_scale, x.dtype)
        if mm_embeds is not None:       # image embeddings over their token rows (padding: distinct rows past T)
            x = x.at[mm_rows].set(mm_embeds.astype(x.dtype), mode="drop", unique_indices=True)
        cos_sin = [r.cos_sin(positions, x.dtype) for r in spec.rotaries]
        layers = list(self.layers)
        # a stage before the last hands on x, not the next norm's output (that norm's weight is the next
        # stage's): its last layer normalizes with its own first norm weight, a result nobody reads
        last_norm = _w(self.final_norm) if self.last else _w(layers[0].attn_norm)
        next_norms = [_w(layer.attn_norm) for layer in layers[1:]] + [last_norm]
        # the projections each norm's output feeds (fp8 W8A8 ones take it quantized); with LoRA none: the
        # adapters' shrink reads the float activations, and each fp8 projection quantizes its own input
        readers = [() if lora is not None else layer.attention_readers() for layer in layers] + [()]
        h = normed_input(x, self.norm, _w(layers[0].attn_norm), eps, readers[0])
        new_caches, routed, aux = [], [], []
        with live_tokens(md.query_start_loc[-1]):     # int4 decode computes only the bucket's real rows
            for layer, next_norm, next_readers, kv_cache in zip(layers, next_norms, readers[1:], kv_caches):
                if layer.index in aux_layers:
                    aux.append(x)
                attn, kv_cache = layer.attention(h, cos_sin, kv_cache, md, backend, lora)
                new_caches.append(kv_cache)
                if spec.parallel_block:
                    mlp = row_parallel_linear(layer.gated(h), _w(layer.down))
                    x = (row_parallel_linear(attn, _w(layer.o)) + mlp) + x
                    h = self.norm(x, next_norm, eps)
                elif spec.sandwich_norms:
                    x = x + self.norm(row_parallel_linear(attn, _w(layer.o)), _w(layer.post_attn_norm), eps)
                    h = self.norm(x, _w(layer.mlp_norm), eps)
                    x = x + self.norm(row_parallel_linear(layer.gated(h), _w(layer.down)),
                                      _w(layer.post_mlp_norm), eps)
                    h = self.norm(x, next_norm, eps)
                elif layer.is_moe:
                    x, h = self._add_norm(attn, _w(layer.o), x, _w(layer.mlp_norm))
                    mlp, ids = layer.moe_mlp(h, md.slot_mapping != PAD_SLOT)
                    x = x + mlp
                    routed.append(ids)
                    h = self.norm(x, next_norm, eps)
                elif lora is None:
                    x, h = self._add_norm(attn, _w(layer.o), x, _w(layer.mlp_norm), (_w(layer.gate_up),))
                    x, h = self._add_norm(layer.gated(h), _w(layer.down), x, next_norm, next_readers)
                elif lora.folded:   # no mesh: o's and down's weights are W_ext (x @ W_ext holds the shrink)
                    x = x + lora.add(layer.index, "o", attn, linear(attn, _w(layer.o)))
                    g = layer.gated(self.norm(x, _w(layer.mlp_norm), eps), lora)
                    x = x + lora.add(layer.index, "down", g, linear(g, _w(layer.down)))
                    h = self.norm(x, next_norm, eps)
                else:   # the row-parallel deltas join the residual, so the fused add + norm stays one call
                    x, h = self._add_norm(attn, _w(layer.o), x + lora.delta(layer.index, "o", attn),
                                          _w(layer.mlp_norm))
                    g = layer.gated(h, lora)
                    x, h = self._add_norm(g, _w(layer.down), x + lora.delta(layer.index, "down", g), next_norm,
                                          next_readers)
        # tokens per expert per MoE layer [L_moe, E] (None for a dense model)
        load = moe.expert_load(jnp.stack(routed), spec.moe.num_experts) if routed else None
        if aux_layers:
            if self.cfg.num_layers in aux_layers:      # the stream leaving the last layer
                aux.append(x)
            return h, new_caches, load, jnp.concatenate(aux, axis=-1)
        return h if self.last else x, new_caches, load

    def _add_norm(self, x, w, residual, norm_weight, readers=()):
        """``s = residual + x @ w`` (row-parallel) and the next norm of ``s``; fused with TP's all-reduce
        where the custom all-reduce can (RMSNorm only); quantized once for ``readers`` when they are fp8."""
        if self.spec.norm == "rms":
            return row_parallel_linear_add_rms_norm(x, w, residual, norm_weight, self.cfg.rms_norm_eps,
                                                    self.norm, readers)
        s = residual + row_parallel_linear(x, w)
        return s, self.norm(s, norm_weight, self.cfg.rms_norm_eps)


# ----------------------------------------------------------------------------------- the family interface
# the nnx.List attributes of the models (nnx's pure dict keys their items 0..n-1)
_LISTS = ("layers", "global_layers", "cross_layers")


def _to_external(pure: dict) -> dict:
    """nnx's pure dict (layers keyed 0..n-1) → the weight pytree (layers as a list; a sub-model's too, e.g. a
    vision tower's: stored programs take only string-keyed dicts)."""
    out = {k: _to_external(v) if isinstance(v, dict) and any(n in v for n in _LISTS) else v
           for k, v in pure.items()}
    for n in _LISTS:
        if n in pure:
            out[n] = [pure[n][i] for i in range(len(pure[n]))]
    return out


def _to_internal(params: dict) -> dict:
    out = {k: _to_internal(v) if isinstance(v, dict) and any(n in v for n in _LISTS) else v
           for k, v in params.items()}
    for n in _LISTS:
        if n in params:
            out[n] = dict(enumerate(params[n]))
    return out


def _is_shape(x) -> bool:
    return isinstance(x, tuple)


class DecoderFamily:
    """A decoder family as the registry holds it: what it serves and how it reads a model, and from that the
    functions the loaders and the step call.

    - ``spec(cfg) -> DecoderSpec``, ``check_config(cfg)`` (refuse configs it would get wrong) and
      ``layer_names``: its checkpoint names per layer weight (``checkpoint_names.weight_plan``; a dict, or a
      function of the config);
    - ``architectures``: the HF ``architectures`` names it serves; ``model_types``: the HF ``model_type`` values
      of its configs, each with the architecture a config.json without an ``architectures`` list means;
    - ``unwrap_hf(hf) -> hf``: the config the shared reading applies to (a multimodal wrapper's text config);
      ``read_hf(hf, fields) -> fields``: the ``ModelConfig`` fields after its own quirks, defaults and
      ``extra`` (``configs.model_config_from_hf`` read the shared ones);
    - ``gguf``: GGUF ``general.architecture`` → how it reads such a file (``gguf_config.GGUFArch``).
    """

    def __init__(self, spec: Callable[[ModelConfig], DecoderSpec], check_config: Callable[[ModelConfig], None],
                 layer_names: dict | Callable[[ModelConfig], dict], *, architectures: tuple[str, ...],
                 model_types: dict[str, str], read_hf: Callable[[dict, dict], dict] | None = None,
                 unwrap_hf: Callable[[dict], dict] | None = None, gguf: dict | None = None):
        self.decoder_spec = functools.lru_cache(maxsize=16)(spec)
        self.check_config = check_config
        self.layer_names = layer_names
        self.architectures = tuple(architectures)
        self.model_types = dict(model_types)
        self.read_hf = read_hf or (lambda hf, fields: fields)
        self.unwrap_hf = unwrap_hf or (lambda hf: hf)
        self.gguf = dict(gguf or {})

    def clear_caches(self) -> None:
        """Forget the specs and abstract models made so far: both read switches from the environment (the MoE
        grouped GEMM) when first made, and the abstract model holds its spec."""
        self.decoder_spec.cache_clear()
        self.abstract.cache_clear()
        self.abstract_stage.cache_clear()

    def weight_plan(self, cfg: ModelConfig) -> list:
        """``(param path, HF tensor names, build)`` per weight (``checkpoint_names.weight_plan``)."""
        from jaxserve.models import checkpoint_names  # noqa: PLC0415
        names = self.layer_names(cfg) if callable(self.layer_names) else self.layer_names
        return checkpoint_names.weight_plan(self.param_shapes(cfg), names)

    @functools.lru_cache(maxsize=16)  # noqa: B019  (one per family object, which lives as long as its module)
    def abstract(self, cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
        """(graph definition, abstract state) of the model of ``cfg``: no weight is allocated."""
        return nnx.split(nnx.eval_shape(lambda: DecoderModel(cfg, self.decoder_spec(cfg))))

    @functools.lru_cache(maxsize=16)  # noqa: B019
    def abstract_stage(self, cfg: ModelConfig, stage: tuple[int, int]) -> nnx.GraphDef:
        """The graph definition of pipeline stage ``stage`` = (first layer, end) of ``cfg``'s model."""
        return nnx.split(nnx.eval_shape(lambda: DecoderModel(cfg, self.decoder_spec(cfg), stage)))[0]

    def _metadata(self, cfg: ModelConfig, fn: Callable[[nnx.Variable], object]) -> dict:
        _, state = self.abstract(cfg)
        return _to_external(nnx.to_pure_dict(nnx.map_state(lambda path, v: fn(v), state)))

    def param_shapes(self, cfg: ModelConfig) -> dict:
        """The weight pytree's structure with a shape tuple at each leaf."""
        return self._metadata(cfg, lambda v: tuple(v.get_value().shape))

    def param_partition_specs(self, cfg: ModelConfig) -> dict:
        """``PartitionSpec`` of each weight over the mesh axis ``"tp"``, as its ``nnx.Param`` declares it."""
        return self._metadata(cfg, lambda v: P(*v.get_metadata()["out_sharding"]))

    def param_inits(self, cfg: ModelConfig) -> dict:
        return self._metadata(cfg, lambda v: v.get_metadata()["init"])

    def param_dtypes(self, cfg: ModelConfig, dtype) -> dict:
        """Each weight's dtype when the model's is ``dtype``: ``dtype``, except the weights declared with a
        ``fixed_dtype`` (V3's router bias stays float32, as transformers keeps it). Every loader builds to it."""
        return self._metadata(cfg, lambda v: jnp.dtype(v.get_metadata().get("fixed_dtype") or dtype))

    def kv_cache_shapes(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype) -> tuple[tuple[int, ...], ...]:
        """The shapes of one layer's cache arrays: K and V pages (``kernels.ops.kv_cache_shapes``), or with
        latent attention one latent page (``kernels.mla_ref``). The runner allocates and sizes the cache from
        these, whatever the layout."""
        spec = self.decoder_spec(cfg)
        if spec.mla is not None:
            return (mla_ref.latent_cache_shape(num_blocks, block_size, spec.mla.kv_lora_rank,
                                               spec.mla.qk_rope_head_dim),)
        return kernel_ops.kv_cache_shapes(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)

    def supports_lora(self, cfg: ModelConfig) -> bool:
        """LoRA adapters apply to this family's models: the plain pre-norm block with q/k/v attention and a
        dense gated MLP (Llama, Mistral, Qwen2/3)."""
        spec = self.decoder_spec(cfg)
        return not (spec.parallel_block or spec.sandwich_norms or spec.moe is not None or spec.mla is not None)

    def forward(self, params: dict, kv_caches: list, input_ids: jax.Array, positions: jax.Array,
                md: AttentionMetadata, cfg: ModelConfig, *, attn_backend: str = "reference", mm_embeds=None,
                mm_rows=None, lora=None):
        """One ragged step: ``input_ids``/``positions`` ``[T]`` int32 → ``(hidden [T, hidden_size], kv_caches)``.
        ``mm_embeds [E, hidden]`` / ``mm_rows [E]``: image embeddings and the token rows they replace (a
        multimodal step; rows ``>= T`` are padding). ``lora``: (the adapter slots' stacks, each token's slot
        ``[T]``), ``jaxserve.lora.slots``."""
        hidden, kv_caches, _ = self.forward_with_expert_load(params, kv_caches, input_ids, positions, md, cfg,
                                                             attn_backend=attn_backend, mm_embeds=mm_embeds,
                                                             mm_rows=mm_rows, lora=lora)
        return hidden, kv_caches

    def forward_with_expert_load(self, params: dict, kv_caches: list, input_ids: jax.Array, positions: jax.Array,
                                 md: AttentionMetadata, cfg: ModelConfig, *, attn_backend: str = "reference",
                                 mm_embeds=None, mm_rows=None, lora=None, stage=None, hidden_in=None,
                                 aux_layers=()):
        """``forward`` and the tokens routed to each expert of each MoE layer ``[L_moe, E]`` int32 (None for a
        dense model): the engine's expert-load statistics, from the step itself. ``stage``: (first layer,
        end) of a pipeline stage, ``params``/``kv_caches`` its own (``parallel.pipeline.stage_params``); one
        after the first takes the residual stream as ``hidden_in`` and one before the last returns it.
        ``aux_layers``: also the residual streams entering those layers (``DecoderModel.__call__``)."""
        graphdef = self.abstract(cfg)[0] if stage is None else self.abstract_stage(cfg, stage)
        model = nnx.merge(graphdef, _to_internal(params))
        return model(kv_caches, input_ids, positions, md, attn_backend, mm_embeds, mm_rows, lora, hidden_in,
                     aux_layers)

    def compute_logits(self, params: dict, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
        """``hidden [N, hidden_size]`` → logits ``[N, vocab]`` in float32 (float32 accumulation)."""
        spec = self.decoder_spec(cfg)
        if cfg.tie_word_embeddings:
            logits = jnp.einsum("nh,vh->nv", hidden, params["embed"], preferred_element_type=jnp.float32)
        else:
            logits = jnp.dot(hidden, params["lm_head"], preferred_element_type=jnp.float32)
        if spec.logit_scale is not None:
            logits = logits * spec.logit_scale
        if spec.final_soft_cap is not None:
            logits = jnp.tanh(logits / spec.final_soft_cap) * spec.final_soft_cap
        return logits

    def init_dummy_params(self, cfg: ModelConfig, dtype, *, seed: int = 0, mesh=None,
                          transform: Callable[[tuple, jax.Array], object] | None = None) -> dict:
        """Random weights of the right shapes (uniform with std 0.02; norms the identity), each made on
        device where it lives, in its own sharding: no host buffer, no transfer. ``transform(path, weight)``
        (e.g. quantization) runs on each as it is made, so the float weights never all exist at once (a 70B
        model's bf16 copy does not fit one GPU)."""
        shapes = self.param_shapes(cfg)
        keyed, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)
        paths = [tuple(getattr(k, "key", getattr(k, "idx", None)) for k in kp) for kp, _ in keyed]
        leaves = [shape for _, shape in keyed]
        inits = jax.tree.leaves(self.param_inits(cfg))
        dtypes = jax.tree.leaves(self.param_dtypes(cfg, dtype))
        if mesh is not None:
            from jaxserve.parallel import param_shardings  # noqa: PLC0415  (whole kv heads when tp > kv heads)
            sharding_leaves = jax.tree.leaves(param_shardings(self.param_partition_specs(cfg), mesh, cfg))
        else:
            sharding_leaves = [None] * len(leaves)
        out = []
        for i, (path, shape, kind, dt, sharding) in enumerate(zip(paths, leaves, inits, dtypes, sharding_leaves)):
            w = dummy_init_fn(kind, shape, dt, sharding)(leaf_seed(seed, i))
            out.append(w if transform is None else transform(path, w))
        return jax.tree.unflatten(treedef, out)
