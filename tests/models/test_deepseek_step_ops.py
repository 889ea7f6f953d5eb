"""The DeepSeek decode step's size: the HLO ops one MoE (or dense) layer adds to the batch-1 decode step, as the
GPU build lowers it (Pallas MLA decode and the fused sort-free MoE rows path, lowered for CUDA here on CPU), pinned so
that a change adding ops to every layer shows. On the GPU each layer's small ops become launches of their own, a large
share of a batch-1 step (benchmarks/results/2026-12-03-h200-deepseek-v2-lite-step.md).

The count is of the module before optimization (``lower().as_text()``), every call expanded at its call site,
parameters, constants and tuples left out; one layer's share is the difference between the step with one MoE
layer more and the same step without it. Two pins: the ops that start a kernel of their own (reductions,
matmuls, top-k, gathers and scatters, the Pallas kernels) and every op but the free views (broadcasts,
reshapes). A change that lowers a count should lower its pin with it.
"""
from __future__ import annotations

import collections
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest

import support
from jaxserve.kernels.metadata import SHORT_SEQ_LEN, AttentionMetadata
from jaxserve.models import registry
from jaxserve.models.configs import model_config_from_hf

TRITON, MOSAIC = "__gpu$xla.gpu.triton", "mosaic_gpu_v2"
# ops that start a GPU kernel of their own (the rest fuse into them or into loop fusions)
LAUNCHES = {"reduce", "reduce-window", "scan", "sort", "topk", "dot", "gather", "scatter", "while", TRITON, MOSAIC}
# the MLA decode's kernel: Triton at 16 heads, Mosaic GPU from 64 (kernels.ops.MGPU_MIN_HEADS); its launches at
# batch 1: Triton splits a short context and combines them (mla_decode_pallas.pick_splits), Mosaic GPU does not
MLA_MOSAIC = {"deepseek-v2-lite": 0, "deepseek-v3-6l": 1}
MLA_LAUNCHES = {"deepseek-v2-lite": 2, "deepseek-v3-6l": 1}
FREE = {"broadcast", "reshape", "opt-barrier"}    # views XLA folds into their users; a fusion boundary
# per MoE layer: (ops but FREE ones, LAUNCHES ops); config, its first MoE layer
# (V3's count holds one concatenate more than V2-Lite's for the Mosaic GPU MLA kernel's one metadata operand;
# V2-Lite's one launch more for its MLA splits' combine; 4 ops of each are the latent write's slots for padding,
# the same in every layer, which XLA's CSE computes once)
PINS = {"deepseek-v2-lite": (70, 16), "deepseek-v3-6l": (81, 16)}
FIRST_MOE = {"deepseek-v2-lite": 1, "deepseek-v3-6l": 3}
# per dense layer of deepseek-v3-6l (its first three are dense): the same two pins
DENSE_PINS = (78, 13)
NOT_COUNTED = {"parameter", "constant", "tuple", "get-tuple-element", "Sharding"}   # the last: the mesh's notes


def op_counts(hlo: str) -> collections.Counter:
    """Ops by kind of an HLO module's entry, each ``call`` counted as its callee's ops (a custom call as its
    target); the computations ops only apply (reducers, comparators) are not counted."""
    comps, entry, current = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?(\S+) .*\{$", line)
        if head:
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            op = re.match(r"\s*(?:ROOT )?\S+ = (?:\([^=]*?\)|\S+) ([\w-]+)\(", line)
            if op:
                callee = re.search(r"to_apply=([^,\s]+)", line)
                target = re.search(r'custom_call_target="([^"]*)"', line)
                comps[current].append((op.group(1), callee and callee.group(1), target and target.group(1)))
    counts = collections.Counter()

    def walk(name):
        for op, callee, target in comps[name]:
            if op == "call":
                walk(callee)
            elif (target if op == "custom-call" else op) not in NOT_COUNTED:
                counts[target if op == "custom-call" else op] += 1
    walk(entry)
    return counts


def decode_step_hlo(name: str, num_layers: int) -> str:
    """The batch-1 decode step (a bucket of 4 tokens, contexts within ``SHORT_SEQ_LEN``) of ``configs/models/
    name`` cut to ``num_layers`` layers, bf16, lowered for CUDA with the Pallas backend."""
    with open(os.path.join(support.ROOT, "configs", "models", f"{name}.json")) as f:
        hf = json.load(f) | {"num_hidden_layers": num_layers}
    cfg = model_config_from_hf(hf)
    family = registry.family_of_model_type(cfg.model_type)
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)  # noqa: E731
    params = jax.tree.map(jax.ShapeDtypeStruct, family.param_shapes(cfg), family.param_dtypes(cfg, jnp.bfloat16),
                          is_leaf=is_shape)
    caches = [tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in family.kv_cache_shapes(cfg, 64, 16, jnp.bfloat16))
              for _ in range(num_layers)]
    tokens, reqs, pages = 4, 4, 32
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731

    def step(params, caches, ids, positions, slots, tables, seq_lens, qsl, num_seqs):
        md = AttentionMetadata(slots, tables, seq_lens, qsl, num_seqs, decode_only=True, max_seq_len=SHORT_SEQ_LEN)
        hidden, caches = family.forward(params, caches, ids, positions, md, cfg, attn_backend="pallas")
        return caches, family.compute_logits(params, hidden[:1], cfg)

    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    args = (params, caches, i32(tokens), i32(tokens), i32(tokens), i32(reqs, pages), i32(reqs), i32(reqs + 1), i32())
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(step, donate_argnums=(1,)).trace(*args).lower(lowering_platforms=("cuda",)).as_text(
            dialect="hlo")


@pytest.mark.parametrize("name", sorted(PINS))
def test_moe_layer_ops_in_the_decode_step(name, monkeypatch):
    # the GPU build's choices (Pallas kernels, the MoE rows path) follow the default backend
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setenv("JAXSERVE_MOE_SHARED_IN_ROWS", "1")
    first = FIRST_MOE[name]
    without, with_one = (op_counts(decode_step_hlo(name, n)) for n in (first + 1, first + 2))
    layer = with_one - without
    ops, launches = PINS[name]
    summary = sorted(layer.items(), key=lambda kv: -kv[1])
    # the MLA decode (its splits and their combine at 16 heads), the router's top-k, the gate/up and down of the
    # routed and shared experts together (the fused rows path, the GPU's default, the shared expert in it)
    assert layer[MOSAIC] == MLA_MOSAIC[name] and layer[TRITON] + layer[MOSAIC] == MLA_LAUNCHES[name] + 3, summary
    assert layer["scatter"] == 1 and "sort" not in layer, summary      # the latent write
    assert sum(n for op, n in layer.items() if op in LAUNCHES) <= launches, summary
    assert sum(n for op, n in layer.items() if op not in FREE) <= ops, summary


def test_dense_layer_ops_in_the_decode_step(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    without, with_one = (op_counts(decode_step_hlo("deepseek-v3-6l", n)) for n in (1, 2))
    layer = with_one - without
    ops, launches = DENSE_PINS
    summary = sorted(layer.items(), key=lambda kv: -kv[1])
    assert layer[MOSAIC] == 1 and layer["scatter"] == 1, summary        # the MLA decode; the latent write
    assert sum(n for op, n in layer.items() if op in LAUNCHES) <= launches, summary
    assert sum(n for op, n in layer.items() if op not in FREE) <= ops, summary
