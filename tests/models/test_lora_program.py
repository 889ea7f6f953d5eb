"""The LoRA path's share of the decode step's program. At decode sizes each op it adds is a GPU kernel of its
own, so the counts are pinned, on CPU's compiled program too. Folded (no mesh, float base weights), each A is
columns of its base weight and a projection adds only the expand and the mask: per layer 4 dots (q, k, v
together, o, gate_up, down) and 8 kernels. Kept apart (a mesh or a quantized base), it adds the shrink as well:
8 dots and 12 kernels. Every slot stack and every folded weight is read as stored (reshapes into one dot, no
transpose, copy or convert). The slot layout's deltas equal each token's own adapter's ``(x @ A) @ B``, with
q, k, v's B merged (no mesh) or apart (under a mesh), the A columns folded or not."""
from __future__ import annotations

import collections
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
from jaxserve.lora.slots import FOLDED_INTO, LoRASlots
from jaxserve.models import llama
from jaxserve.models.dummy_loader import dummy_params
from jaxserve.models.layers.linear import linear
from jaxserve.models.layers.lora import lora_batch

LAYERS, T = 2, 8
# per layer: (dots, kernels of the compiled program's entry computation) the LoRA path adds
ADDED_PER_LAYER = {"folded": (4, 8), "apart": (8, 12)}
CFG = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=256, intermediate_size=512, num_layers=LAYERS,
                  num_heads=4, num_kv_heads=2, head_dim=64)
# entry-computation instructions that launch nothing
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast"}


def _params(dtype=jnp.bfloat16):
    return dummy_params(CFG, llama.FAMILY, dtype, 0, None, None)


def _decode_program(lora: str | None) -> tuple[str, str, list[str]]:
    """(lowered StableHLO, compiled HLO, the flat argument paths) of an 8-token decode step of a two-layer
    Llama, with four adapter slots (``lora``: "folded" or "apart") or none."""
    params = _params()
    caches = ops.init_kv_caches(LAYERS, 4, 16, 2, 64, jnp.bfloat16)
    md = AttentionMetadata(slot_mapping=jnp.zeros(T, jnp.int32), block_tables=jnp.zeros((T, 4), jnp.int32),
                           seq_lens=jnp.ones(T, jnp.int32), query_start_loc=jnp.arange(T + 1, dtype=jnp.int32),
                           num_seqs=jnp.int32(T), decode_only=True)
    stacks = LoRASlots(CFG, params, 4, 16, jnp.bfloat16, fold=lora == "folded").stacks if lora else None
    step = jax.jit(lambda p, kv, ids, st: llama.FAMILY.forward(p, kv, ids, ids, md, CFG,
                                                               lora=None if st is None else (st, ids)),
                   keep_unused=True)
    args = (params, caches, jnp.zeros(T, jnp.int32), stacks)
    lowered = step.lower(*args)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    return lowered.as_text(), lowered.compile().as_text(), paths


def _entry_kernels(hlo: str) -> collections.Counter:
    entry = hlo[hlo.index("\nENTRY"):]
    ops_ = (m.group(1) for m in re.finditer(r"= \S+ ([\w-]+)\(", entry[:entry.index("\n}")]))
    return collections.Counter(op for op in ops_ if op not in _FREE)


@pytest.fixture(scope="module")
def programs() -> dict:
    return {lora: _decode_program(lora) for lora in (None, "folded", "apart")}


@pytest.mark.parametrize("lora", ["folded", "apart"])
def test_the_lora_path_adds_its_dots_and_kernels(programs, lora):
    (base, base_hlo, _), (text, hlo, _) = programs[None], programs[lora]
    dots = text.count("stablehlo.dot_general") - base.count("stablehlo.dot_general")
    kernels = sum(_entry_kernels(hlo).values()) - sum(_entry_kernels(base_hlo).values())
    assert (dots, kernels) == tuple(LAYERS * n for n in ADDED_PER_LAYER[lora]), (_entry_kernels(hlo),
                                                                                 _entry_kernels(base_hlo))


@pytest.mark.parametrize("lora", ["folded", "apart"])
def test_every_stack_and_folded_weight_is_read_as_stored_by_one_dot(programs, lora):
    """No per-step transpose, copy or dtype convert of a slot stack or of a base weight holding A columns:
    each is reshaped (free) into one dot."""
    text, _, paths = programs[lora]
    main = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S).group(1)
    names = re.findall(r"(%arg\d+):", main)
    assert len(names) == len(paths)
    folded = tuple(f"['{name}']" for name in FOLDED_INTO.values()) if lora == "folded" else ()
    read = {n for n, p in zip(names, paths) if p.startswith("[3]") or p.endswith(folded) and "layers" in p}
    assert len(read) == LAYERS * 8      # apart: 8 stacks; folded: 4 B stacks, 4 weights with A columns
    users = collections.defaultdict(list)
    for value, op, operands in re.findall(r"(%[\w#]+) = (?:stablehlo|mhlo)\.(\w+) ([^:]*):", text):
        for used in re.findall(r"%[\w#]+", operands):
            users[used].append((op, value))
    for arg in read:
        chain = users[arg]
        while len(chain) == 1 and chain[0][0] == "reshape":
            chain = users[chain[0][1]]
        assert [op for op, _ in chain] == ["dot_general"], (arg, users[arg])


def _random_adapter(rng, rank: int, targets) -> LoRAAdapter:
    shapes = projection_shapes(CFG)
    layers = [{t: (rng.standard_normal((shapes[t][0], rank), np.float32),
                   rng.standard_normal((rank, shapes[t][1]), np.float32)) for t in targets} for _ in range(LAYERS)]
    return LoRAAdapter(path="", rank=rank, scaling=1.0, layers=layers)


@pytest.mark.parametrize("layout", ["folded", "apart", "apart under a mesh"])
def test_each_token_gets_its_own_adapters_deltas(layout):
    """Slots 1 and 2 hold adapters of different ranks and targets; every token's q, k, v, o, gate_up and down
    projections are the base weight's plus its own adapter's delta (none for slot 0), whether q, k and v's B
    are merged (no mesh) or not, and the A columns folded into the base weights or not."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",)) if "mesh" in layout else None
    params = _params(jnp.float32)
    base = [{k: np.asarray(w) for k, w in layer.items()} for layer in params["layers"]]
    slots = LoRASlots(CFG, params, 2, 8, jnp.float32, mesh, fold=layout == "folded")
    assert slots.folded == (layout == "folded") and ("qkv_b" in slots.stacks[0]) == (mesh is None)
    rng = np.random.default_rng(0)
    adapters = {1: _random_adapter(rng, 8, ("q", "v", "o", "gate", "down")),
                2: _random_adapter(rng, 4, ("k", "up", "q"))}
    for slot, adapter in adapters.items():
        slots.write(slot, adapter)
    token_slots = np.array([0, 1, 2, 2, 1, 0], np.int32)
    batch = lora_batch(slots.stacks, jnp.asarray(token_slots), jnp.float32)
    assert batch.folded == slots.folded
    shapes = projection_shapes(CFG)
    x = {t: rng.standard_normal((len(token_slots), shapes[t][0]), np.float32) for t in shapes}

    def want(layer: int, target: str, xt: np.ndarray) -> np.ndarray:
        rows = []
        for tok, s in enumerate(token_slots):
            a, b = adapters[s].layers[layer].get(target, (None, None)) if s else (None, None)
            rows.append(np.zeros(shapes[target][1], np.float32) if a is None else (xt[tok] @ a) @ b)
        w = base[layer][target if target in ("q", "k", "v", "o", "down") else "gate_up"]
        y = xt @ w.reshape(w.shape[0], -1)
        if target in ("gate", "up"):
            y = y.reshape(len(xt), 2, -1)[:, int(target == "up")]
        return y + np.stack(rows)

    for layer in range(LAYERS):
        w = params["layers"][layer]
        xq, xo, xg, xd = (jnp.asarray(x[t]) for t in ("q", "o", "gate", "down"))
        got = dict(zip("qkv", batch.add_qkv(layer, xq, *(linear(xq, w[t]) for t in "qkv"))))
        got["o"] = batch.add(layer, "o", xo, linear(xo, w["o"]))
        gate_up = batch.add(layer, "gate_up", xg, linear(xg, w["gate_up"]))
        got["gate"], got["up"] = gate_up[:, 0], gate_up[:, 1]
        got["down"] = batch.add(layer, "down", xd, linear(xd, w["down"]))
        for target, value in got.items():
            xt = x["q"] if target in "qkv" else x[target] if target != "up" else x["gate"]
            np.testing.assert_allclose(np.asarray(value), want(layer, target, xt), rtol=2e-5, atol=2e-4,
                                       err_msg=f"layer {layer} {target}")
