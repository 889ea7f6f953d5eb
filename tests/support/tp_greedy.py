"""Greedy decoding of ``llama.FAMILY`` for the tensor-parallel and multi-process tests, on ``PagedRunner`` (the
runner's step inputs and forward).

Not the engine: a fixed batch of prompts, one ragged prefill step then one-token decode steps, all padded to
one shape so each mesh compiles the step once. Split as ``build_inputs`` (host, process 0 only) and
``run_step`` (every process) because that is how the multi-process runner splits a step.
"""
from __future__ import annotations

import types

import numpy as np

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve import parallel
from support.tiny_models import PagedRunner

BLOCK_SIZE = 4
PROMPTS = [[5, 17, 99, 3, 42, 7, 250], [1, 2, 3], [200, 11, 11, 11, 11, 64, 9, 31, 8, 77, 123]]


def tiny_config(num_heads=8, num_kv_heads=4, **kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16,
                max_position_embeddings=128, tie_word_embeddings=True)
    return ModelConfig(**(base | kw))


def random_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32) -> dict:
    """``llama.FAMILY.init_dummy_params`` rescaled to std 1/sqrt(fan_in) so each layer moves the residual stream and
    greedy tokens depend on attention (at std 0.02 every step echoes its input token through the tied
    embedding)."""
    params = llama.FAMILY.init_dummy_params(cfg, jnp.float32, seed=seed)

    def rescale(path, x):
        name = str(path[-1].key) if hasattr(path[-1], "key") else ""
        if name.endswith("norm"):
            return x.astype(dtype)
        fan_in = x.shape[1] if name == "embed" else 1 if x.ndim == 1 else x.shape[0]
        return (x / (0.02 * np.sqrt(fan_in))).astype(dtype)

    return jax.tree_util.tree_map_with_path(rescale, params)


class GreedyDecoder(PagedRunner):
    """Greedy decoding of ``PROMPTS`` on ``mesh`` (None = one device): the params placed with their shardings,
    every step of the same shape (each mesh compiles it once)."""

    def __init__(self, cfg: ModelConfig, params, mesh=None, prompts=PROMPTS, max_new_tokens=6):
        if mesh is not None:
            shardings = parallel.param_shardings(llama.FAMILY.param_partition_specs(cfg), mesh, cfg)
            # from host numpy: every process passes the same values and keeps only its shards
            params = jax.device_put(jax.tree.map(np.asarray, params), shardings)
        model = types.SimpleNamespace(family=llama.FAMILY, config=cfg, params=params,
                                      dtype=jax.tree.leaves(params)[0].dtype)
        super().__init__(model, max_reqs=len(prompts), max_len=max(map(len, prompts)) + max_new_tokens,
                         block_size=BLOCK_SIZE, mesh=mesh)
        self.prompts = [list(p) for p in prompts]
        self.max_new_tokens = max_new_tokens
        self.num_tokens = -(-sum(map(len, prompts)) // 8) * 8
        self.tokens = [list(p) for p in self.prompts]   # host state (process 0)
        self.computed = [0] * len(prompts)

    def build_inputs(self) -> tuple:
        """The next step's packed host inputs (buffer, layout): every request's not-yet-computed tokens."""
        return self.inputs([(r, toks[c:], c) for r, (toks, c) in enumerate(zip(self.tokens, self.computed))],
                           self.num_tokens)

    def run_step(self, inputs: tuple) -> jax.Array:
        """Run one step (every process, same inputs); returns the last-token logits ``[R, vocab]``."""
        return self.run(*inputs)

    def generate(self, channel=None) -> tuple[list[list[int]], np.ndarray]:
        """Greedy tokens per prompt and the stacked per-step logits ``[steps, R, vocab]`` (process 0)."""
        all_logits = []
        for _ in range(self.max_new_tokens):
            inputs = self.build_inputs()
            if channel is not None:
                channel.send(inputs)
            logits = fetch_replicated(self.run_step(inputs))
            all_logits.append(logits)
            for r, toks in enumerate(self.tokens):
                self.computed[r] = len(toks)
                toks.append(int(np.argmax(logits[r])))
        if channel is not None:
            channel.stop()
        new = [toks[len(p):] for toks, p in zip(self.tokens, self.prompts)]
        return new, np.stack(all_logits)


def fetch_replicated(x: jax.Array) -> np.ndarray:
    """Host copy of a replicated array, also when the mesh spans processes; a clear error for an array
    sharded over processes (which no single process can read)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if not x.is_fully_replicated:
        raise ValueError(f"array of shape {x.shape} is sharded over processes ({x.sharding}); "
                         "replicate it in the step (jaxserve.parallel.gather_logits) before fetching it")
    return np.asarray(x.addressable_data(0))
