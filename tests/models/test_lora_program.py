"""The LoRA path's share of the decode step's program. At decode sizes each op it adds is a GPU kernel of its
own, so the count is pinned: per layer one shrink and one expand for q, k, v together (``qkv_a`` / ``qkv_b``),
o, gate_up and down: 8 dots, and every slot stack read as stored (a reshape into a dot, no transpose, copy or
convert). The slot layout's deltas equal each token's own adapter's ``(x @ A) @ B``, with q, k, v's B merged
(no mesh) or apart (under a mesh)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxserve.config import ModelConfig
from jaxserve.kernels import ops
from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.lora.peft import LoRAAdapter, projection_shapes
from jaxserve.lora.slots import LoRASlots
from jaxserve.models import llama
from jaxserve.models.dummy_loader import dummy_params
from jaxserve.models.layers.lora import lora_batch

LAYERS, T = 2, 8
LORA_DOTS_PER_LAYER = 8
CFG = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=LAYERS,
                  num_heads=4, num_kv_heads=2, head_dim=64)


def _params():
    return jax.eval_shape(lambda: dummy_params(CFG, llama.FAMILY, jnp.bfloat16, 0, None, None))


def _decode_program(lora: bool) -> str:
    """The lowered StableHLO of an 8-token decode step of a two-layer Llama, with four adapter slots or none."""
    params = _params()
    caches = ops.init_kv_caches(LAYERS, 4, 16, 2, 64, jnp.bfloat16)
    md = AttentionMetadata(slot_mapping=jnp.zeros(T, jnp.int32), block_tables=jnp.zeros((T, 4), jnp.int32),
                           seq_lens=jnp.ones(T, jnp.int32), query_start_loc=jnp.arange(T + 1, dtype=jnp.int32),
                           num_seqs=jnp.int32(T), decode_only=True)
    stacks = LoRASlots(CFG, params, 4, 16, jnp.bfloat16).stacks if lora else None
    step = jax.jit(lambda p, kv, ids, st: llama.FAMILY.forward(p, kv, ids, ids, md, CFG,
                                                               lora=None if st is None else (st, ids)))
    return step.lower(params, caches, jnp.zeros(T, jnp.int32), stacks).as_text()


@pytest.fixture(scope="module")
def programs() -> dict[bool, str]:
    return {lora: _decode_program(lora) for lora in (False, True)}


def test_the_lora_path_adds_eight_dots_a_layer(programs):
    dots = {lora: text.count("stablehlo.dot_general") for lora, text in programs.items()}
    assert dots[True] - dots[False] == LAYERS * LORA_DOTS_PER_LAYER, dots


def test_every_stack_is_read_as_stored_by_one_dot(programs):
    """No per-step transpose, copy or dtype convert of a slot stack: each is reshaped (free) into one dot."""
    text = programs[True]
    main = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S).group(1)
    # the stacks are the step's last arguments: qkv_a, qkv_b, o, gate_up and down's A and B of each layer
    stacks = set(re.findall(r"(%arg\d+):", main)[-LAYERS * 8:])
    readers = {}
    for value, op, operands in re.findall(r"(%\w+) = (?:stablehlo|mhlo)\.(\w+) ([^:]*):", text):
        for used in re.findall(r"%\w+", operands):
            if used in stacks:
                readers.setdefault(used, []).append((op, value))
    for stack in stacks:
        (op, value), = readers[stack]
        assert op == "reshape", (stack, op)
        uses = re.findall(r"= (?:stablehlo|mhlo)\.(\w+) [^\n]*" + re.escape(value) + r"\b", text)
        assert uses == ["dot_general"], (stack, uses)


def _random_adapter(rng, rank: int, targets) -> LoRAAdapter:
    shapes = projection_shapes(CFG)
    layers = [{t: (rng.standard_normal((shapes[t][0], rank), np.float32),
                   rng.standard_normal((rank, shapes[t][1]), np.float32)) for t in targets} for _ in range(LAYERS)]
    return LoRAAdapter(path="", rank=rank, scaling=1.0, layers=layers)


@pytest.mark.parametrize("mesh", [None, "1-device"])
def test_each_token_gets_its_own_adapters_deltas(mesh):
    """Slots 1 and 2 hold adapters of different ranks and targets; every token's q, k, v, o, gate_up and down
    deltas are its own adapter's (zero for slot 0), whether q, k and v's B are merged (no mesh) or not."""
    mesh = None if mesh is None else Mesh(np.array(jax.devices()[:1]), ("tp",))
    slots = LoRASlots(CFG, _params(), 2, 8, jnp.float32, mesh)
    assert ("qkv_b" in slots.stacks[0]) == (mesh is None)
    rng = np.random.default_rng(0)
    adapters = {1: _random_adapter(rng, 8, ("q", "v", "o", "gate", "down")),
                2: _random_adapter(rng, 4, ("k", "up", "q"))}
    for slot, adapter in adapters.items():
        slots.write(slot, adapter)
    token_slots = np.array([0, 1, 2, 2, 1, 0], np.int32)
    batch = lora_batch(slots.stacks, jnp.asarray(token_slots), jnp.float32)
    shapes = projection_shapes(CFG)
    x = {t: rng.standard_normal((len(token_slots), shapes[t][0]), np.float32) for t in shapes}

    def want(layer: int, target: str, xt: np.ndarray) -> np.ndarray:
        rows = []
        for tok, s in enumerate(token_slots):
            a, b = adapters[s].layers[layer].get(target, (None, None)) if s else (None, None)
            rows.append(np.zeros(shapes[target][1], np.float32) if a is None else (xt[tok] @ a) @ b)
        return np.stack(rows)

    zeros = [jnp.zeros((len(token_slots), shapes[t][1]), jnp.float32) for t in ("q", "k", "v")]
    for layer in range(LAYERS):
        got = dict(zip("qkv", batch.add_qkv(layer, jnp.asarray(x["q"]), *zeros)))
        got["o"] = batch.delta(layer, "o", jnp.asarray(x["o"]))
        gate_up = batch.delta(layer, "gate_up", jnp.asarray(x["gate"]))
        got["gate"], got["up"] = gate_up[:, 0], gate_up[:, 1]
        got["down"] = batch.delta(layer, "down", jnp.asarray(x["down"]))
        for target, value in got.items():
            xt = x["q"] if target in "qkv" else x[target] if target != "up" else x["gate"]
            np.testing.assert_allclose(np.asarray(value), want(layer, target, xt), rtol=2e-5, atol=2e-4,
                                       err_msg=f"layer {layer} {target}")
