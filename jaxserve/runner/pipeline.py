"""A step's forward through pipeline stages (``parallel.pipeline``): one jitted program per stage, each on its
own devices with its own layers' weights and KV cache, the residual stream handed from stage to stage with
``jax.device_put`` (a device-to-device copy JAX schedules itself: nothing visits the host).

To the runner the stages look like the one-stage forward: ``StagedForward(params, kv_caches, ints,
prev_tokens) -> (kv_caches, logits)`` over the whole model's weights and the flat per-layer cache list, and
``StagedLowered.compile()`` is what ``StepCompiler`` compiles for a forward key. Every call returns at once;
stage k + 1 of a step waits on the device for stage k's hidden states only, so while the last stage runs one
step, the first can run the next (the engine core's batch queue keeps steps of other requests in flight).
"""
from __future__ import annotations

from functools import partial

import jax

from jaxserve.parallel import bind_mesh, kv_cache_sharding
from jaxserve.parallel.pipeline import StageMeshes, stage_params


class StagedForward:
    """A compiled forward of every stage, called like the one-stage executable."""

    def __init__(self, exes: list, plan: "PipelinePlan"):
        self.exes, self.plan = exes, plan
        self._params, self._split = None, None     # the weights never change under stages: split them once

    def __call__(self, params, kv_caches, ints, prev_tokens):
        plan = self.plan
        if params is not self._params:
            self._params, self._split = params, plan.split(params)
        carry = jax.device_put(prev_tokens, plan.stages.replicated(0))
        new_caches = []
        for k, (exe, p, kv) in enumerate(zip(self.exes, self._split, plan.split_kv(kv_caches))):
            kv, carry = exe(p, kv, ints, carry)
            new_caches += kv
            if k + 1 < len(self.exes):
                carry = jax.device_put(carry, plan.stages.replicated(k + 1))
        return new_caches, carry


class StagedLowered:
    """The stages' lowered programs; ``compile()`` compiles each (one ``StepCompiler`` entry)."""

    def __init__(self, lowered: list, plan: "PipelinePlan"):
        self.lowered, self.plan = lowered, plan

    def compile(self) -> StagedForward:
        return StagedForward([lo.compile() for lo in self.lowered], self.plan)


class PipelinePlan:
    """The stages of one model: their jitted forwards (``forward_fn`` with ``stage``), how the weights and the
    cache split over them, and (tied embeddings) the last stage's copy of the embedding."""

    def __init__(self, model, stages: StageMeshes, forward_fn, backend: str):
        cfg = model.config
        self.stages = stages = stages.for_layers(cfg.num_layers)
        self.num_layers = cfg.num_layers
        self.tied_embed = None
        embed = model.params["embed"]
        if cfg.tie_word_embeddings and stages.num_stages > 1:
            self.tied_embed = jax.device_put(embed, jax.sharding.NamedSharding(stages.meshes[-1],
                                                                               embed.sharding.spec))
        self.jits = []
        for k, (mesh, bounds) in enumerate(zip(stages.meshes, stages.bounds)):
            fn = bind_mesh(partial(forward_fn, model.family, cfg, backend, False, stage=bounds), mesh)
            self.jits.append(jax.jit(fn, static_argnames=("layout", "decode_only", "max_seq_len"),
                                     donate_argnums=(1,),
                                     out_shardings=(kv_cache_sharding(mesh, cfg), stages.replicated(k))))

    def split(self, params) -> list[dict]:
        """Each stage's weights (a pytree of arrays or of their specs alike)."""
        tied = self.tied_embed
        if tied is not None and isinstance(params["embed"], jax.ShapeDtypeStruct):
            tied = jax.ShapeDtypeStruct(tied.shape, tied.dtype, sharding=tied.sharding)
        return [stage_params(params, a, b, self.num_layers, tied) for a, b in self.stages.bounds]

    def split_kv(self, kv_caches: list) -> list[list]:
        return [kv_caches[a:b] for a, b in self.stages.bounds]

    def lower(self, param_specs, kv_specs, ints, prev_spec, static: dict) -> StagedLowered:
        """Lower every stage for one step shape; each stage after the first takes the spec of what its
        predecessor returns, placed on its own devices."""
        lowered, carry = [], jax.ShapeDtypeStruct(prev_spec.shape, prev_spec.dtype,
                                                  sharding=self.stages.replicated(0))
        for k, (jitted, p, kv) in enumerate(zip(self.jits, self.split(param_specs), self.split_kv(kv_specs))):
            lo = jitted.lower(p, kv, ints, carry, **static)
            lowered.append(lo)
            out = lo.out_info[1]
            if k + 1 < len(self.jits):
                carry = jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=self.stages.replicated(k + 1))
        return StagedLowered(lowered, self)
