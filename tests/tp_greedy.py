"""A minimal greedy decoder over ``llama.FAMILY.forward`` for the tensor-parallel and multi-process tests.

Not the engine: a fixed batch of prompts, one ragged prefill step then one-token decode steps, all padded to
one shape so each mesh compiles the step once. Split as ``build_inputs`` (host, process 0 only) and
``run_step`` (every process) because that is how the multi-process runner splits a step.
"""
from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.kernels import ops
from jaxserve.kernels.metadata import AttentionMetadata
from jaxserve.models import llama
from jaxserve import parallel

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


class GreedyDecoder:
    """Greedy decoding of ``PROMPTS`` on ``mesh`` (None = one device)."""

    def __init__(self, cfg: ModelConfig, params, mesh=None, prompts=PROMPTS, max_new_tokens=6):
        self.cfg, self.mesh, self.prompts = cfg, mesh, [list(p) for p in prompts]
        self.max_len = max(map(len, prompts)) + max_new_tokens
        self.max_new_tokens = max_new_tokens
        self.blocks_per_seq = -(-self.max_len // BLOCK_SIZE)
        self.num_tokens = -(-sum(map(len, prompts)) // 8) * 8
        num_blocks = 1 + len(prompts) * self.blocks_per_seq
        dtype = jax.tree.leaves(params)[0].dtype
        if mesh is None:
            self.params = params
            cache_sharding = None
        else:
            shardings = parallel.param_shardings(llama.FAMILY.param_partition_specs(cfg), mesh, cfg)
            # from host numpy: every process passes the same values and keeps only its shards
            self.params = jax.device_put(jax.tree.map(np.asarray, params), shardings)
            cache_sharding = parallel.kv_cache_sharding(mesh, cfg)
        self.kv_caches = ops.init_kv_caches(cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                                            dtype, sharding=cache_sharding)
        self._step = jax.jit(parallel.bind_mesh(self._step_fn, mesh), donate_argnums=(1,))
        self.tokens = [list(p) for p in self.prompts]   # host state (process 0)
        self.computed = [0] * len(prompts)

    def _step_fn(self, params, kv_caches, input_ids, positions, md, logits_idx):
        hidden, kv_caches = llama.FAMILY.forward(params, kv_caches, input_ids, positions, md, self.cfg,
                                          attn_backend="reference")
        return kv_caches, parallel.gather_logits(llama.FAMILY.compute_logits(params, hidden[logits_idx], self.cfg))

    def build_inputs(self) -> dict:
        """Padded host arrays for the next step: every request's not-yet-computed tokens."""
        T, R = self.num_tokens, len(self.prompts)
        ids, pos, slots = (np.zeros(T, np.int32) for _ in range(3))
        tables = np.zeros((R, self.blocks_per_seq), np.int32)
        seq_lens, qsl, logits_idx = np.zeros(R, np.int32), np.zeros(R + 1, np.int32), np.zeros(R, np.int32)
        off = 0
        for r, toks in enumerate(self.tokens):
            tables[r] = 1 + r * self.blocks_per_seq + np.arange(self.blocks_per_seq)
            new = np.arange(self.computed[r], len(toks), dtype=np.int32)
            n = len(new)
            ids[off:off + n] = np.asarray(toks)[new]
            pos[off:off + n] = new
            slots[off:off + n] = tables[r, new // BLOCK_SIZE] * BLOCK_SIZE + new % BLOCK_SIZE
            seq_lens[r] = len(toks)
            off += n
            qsl[r + 1] = off
            logits_idx[r] = off - 1
        return dict(input_ids=ids, positions=pos, slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                    query_start_loc=qsl, num_seqs=np.int32(R), logits_idx=logits_idx)

    def run_step(self, inputs: dict) -> jax.Array:
        """Run one step (every process, same inputs); returns the last-token logits ``[R, vocab]``."""
        placed = shard_step_inputs(self.mesh, inputs)
        md = AttentionMetadata(slot_mapping=placed["slot_mapping"], block_tables=placed["block_tables"],
                               seq_lens=placed["seq_lens"], query_start_loc=placed["query_start_loc"],
                               num_seqs=placed["num_seqs"])
        self.kv_caches, logits = self._step(self.params, self.kv_caches, placed["input_ids"],
                                            placed["positions"], md, placed["logits_idx"])
        return logits

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


def shard_step_inputs(mesh, tree):
    """Place a step's host inputs (token ids, positions, metadata, sampling arrays) replicated on the mesh.

    Every process passes the same values (each builds them from the step process 0 sent, see
    ``jaxserve.executor``), so this works whether the mesh spans one process or several.
    """
    if mesh is None:
        return jax.device_put(tree)
    return jax.device_put(tree, parallel.replicated(mesh))
