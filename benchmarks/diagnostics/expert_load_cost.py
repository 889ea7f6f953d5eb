"""What the engine's expert-load statistics cost: an MoE model's compiled forward with the per-layer
tokens-per-expert output (what the engine runs) against the same forward without it (XLA drops the
histograms), timed alternately, and the host's per-step bookkeeping (``ExpertLoad.add``).

    python benchmarks/diagnostics/expert_load_cost.py --model qwen3-30b-a3b --layers 4 --tokens 4 64 256

``--model``: a configs/models name (random weights); ``--layers`` keeps the first N layers (a full model does
not fit a CPU's time); ``--hidden`` / ``--vocab`` shrink it further on CPU. Prints one row per token count.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels import ops
from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.models import registry
from jaxserve.models.configs import model_config_from_hf, read_json
from jaxserve.models.packaged import DUMMY_CONFIG_DIR
from jaxserve.runner.model_runner import ExpertLoad


def _config(a):
    cfg = model_config_from_hf(read_json(str(DUMMY_CONFIG_DIR / f"{a.model}.json")))
    changes = {"num_layers": a.layers or cfg.num_layers}
    if a.hidden:
        changes |= {"hidden_size": a.hidden, "num_heads": a.hidden // cfg.head_dim,
                    "num_kv_heads": min(cfg.num_kv_heads, a.hidden // cfg.head_dim)}
    if a.vocab:
        changes["vocab_size"] = a.vocab
    return dataclasses.replace(cfg, **changes)


def _time(fn, args, reps: int) -> float:
    """Best of ``reps`` calls, in ms (the first compiles and is not counted)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=0)
    p.add_argument("--vocab", type=int, default=0)
    p.add_argument("--tokens", type=int, nargs="+", default=[4, 64, 256])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16" if jax.default_backend() == "gpu" else "float32")
    a = p.parse_args()
    cfg = _config(a)
    full_layers = sum(registry.resolve_architecture(cfg.architecture)[1].decoder_spec(
        model_config_from_hf(read_json(str(DUMMY_CONFIG_DIR / f"{a.model}.json")))).moe.layers)
    _, family = registry.resolve_architecture(cfg.architecture)
    params = family.init_dummy_params(cfg, a.dtype)
    moe = family.decoder_spec(cfg).moe
    print(f"{a.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {moe.num_experts} experts top-{moe.top_k}, "
          f"{jax.devices()[0].device_kind}")
    print("| tokens | forward ms | forward + expert load ms | difference % | host ExpertLoad.add us (all layers) |")
    print("|---|---|---|---|---|")
    block = 16
    for t in a.tokens:
        blocks = -(-t // block) + 1
        caches = ops.init_kv_caches(cfg.num_layers, blocks, block, cfg.num_kv_heads, cfg.head_dim, jnp.dtype(a.dtype))
        md = AttentionMetadata(slot_mapping=jnp.arange(t, dtype=jnp.int32) + block,
                               block_tables=jnp.arange(1, blocks, dtype=jnp.int32)[None],
                               seq_lens=jnp.array([t], jnp.int32), query_start_loc=jnp.array([0, t], jnp.int32),
                               num_seqs=jnp.array(1, jnp.int32))
        ids = jnp.arange(t, dtype=jnp.int32) % cfg.vocab_size
        plain = jax.jit(lambda p, c, i: family.forward(p, c, i, i, md, cfg)[0])
        counted = jax.jit(lambda p, c, i: family.forward_with_expert_load(p, c, i, i, md, cfg)[::2])
        times = {"plain": [], "counted": []}
        for _ in range(3):          # alternated, best of each: other work on the machine hits both alike
            times["plain"].append(_time(plain, (params, caches, ids), a.reps))
            times["counted"].append(_time(counted, (params, caches, ids), a.reps))
        base, with_load = min(times["plain"]), min(times["counted"])
        # the host's share at the full model's layer count, from this step's histogram rows repeated
        counts = np.asarray(counted(params, caches, ids)[1])
        counts = np.resize(counts, (full_layers, counts.shape[1]))
        load = ExpertLoad(np.zeros(counts.shape, np.int64))
        t0 = time.perf_counter()
        for _ in range(1000):
            load.add(counts)
        host_us = (time.perf_counter() - t0) * 1e3
        print(f"| {t} | {base:.3f} | {with_load:.3f} | {100 * (with_load - base) / base:+.1f} | {host_us:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
