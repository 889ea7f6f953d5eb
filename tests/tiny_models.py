"""The tiny random HF checkpoints of tests/fixtures/models and the checks each family runs against them.

A fixture folder holds the checkpoint and what HF transformers float32 gave for it (tests/make_model_fixtures.py,
tests/make_moe_fixtures.py): ``golden.json`` (the prompt ids and their 32-token greedy continuation) and
``logits.npy`` (the prompt's logits). ``PagedRunner`` drives a family's ``forward`` through a paged KV cache the
way the engine does; ``engine_with_preemption`` runs the engine under prefix caching, chunked prefill and
preemption at once.
"""
from __future__ import annotations

import functools
import json
import os
import random

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels import ops
from jaxserve.kernels.metadata import PAD_SLOT, AttentionMetadata

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models")


def fixture_path(name: str) -> str:
    return os.path.join(FIXTURES, name)


def golden(name: str) -> dict:
    with open(os.path.join(FIXTURES, name, "golden.json")) as f:
        return json.load(f)


def hf_logits(name: str) -> np.ndarray:
    return np.load(os.path.join(FIXTURES, name, "logits.npy"))


def load_tiny(name: str):
    """(name, the float32 model, its golden.json, HF's prompt logits): what a module-scoped fixture holds."""
    from jaxserve.models.loader import load_model
    return name, load_model(fixture_path(name), dtype="float32"), golden(name), hf_logits(name)


class PagedRunner:
    """A minimal host driver over a family's ``forward``: fixed token/request buckets (so each shape compiles
    once), a paged cache with shuffled block ids, the cache donated to every step."""

    def __init__(self, model, *, max_reqs: int, max_len: int, block_size: int = 4, seed: int = 0):
        self.model, self.cfg, self.bs, self.max_reqs = model, model.config, block_size, max_reqs
        self.max_blocks = -(-max_len // block_size)
        num_blocks = 1 + max_reqs * self.max_blocks
        pool = list(range(1, num_blocks))               # block 0 is the null block
        random.Random(seed).shuffle(pool)
        self.tables = [pool[r * self.max_blocks:(r + 1) * self.max_blocks] for r in range(max_reqs)]
        self.caches = ops.init_kv_caches(self.cfg.num_layers, num_blocks, block_size, self.cfg.num_kv_heads,
                                         self.cfg.head_dim, model.dtype)
        self._step = jax.jit(functools.partial(paged_step, family=model.family, cfg=self.cfg), donate_argnums=(1,))

    def step(self, chunks: list[tuple[int, list[int], int]], num_tokens: int, logits_rows: list[int] | None = None):
        """``chunks``: (request slot, new token ids, start position). Returns float32 logits of the last new
        token of each chunk (or of ``logits_rows``, flat token indices)."""
        ids, pos, slots, seq_lens, qsl, tables = [], [], [], [], [0], []
        for slot, toks, start in chunks:
            for j, tok in enumerate(toks):
                p = start + j
                ids.append(tok)
                pos.append(p)
                slots.append(self.tables[slot][p // self.bs] * self.bs + p % self.bs)
            seq_lens.append(start + len(toks))
            qsl.append(qsl[-1] + len(toks))
            tables.append(self.tables[slot])
        n, r = len(ids), len(chunks)
        assert n <= num_tokens and r <= self.max_reqs
        pad_t, pad_r = num_tokens - n, self.max_reqs - r
        md = AttentionMetadata(
            slot_mapping=jnp.array(slots + [PAD_SLOT] * pad_t, jnp.int32),
            block_tables=jnp.array(tables + [[0] * self.max_blocks] * pad_r, jnp.int32),
            seq_lens=jnp.array(seq_lens + [0] * pad_r, jnp.int32),
            query_start_loc=jnp.array(qsl + [n] * pad_r, jnp.int32),
            num_seqs=jnp.array(r, jnp.int32))
        rows = logits_rows if logits_rows is not None else [q - 1 for q in qsl[1:]] + [0] * pad_r
        logits, self.caches = self._step(self.model.params, self.caches, jnp.array(ids + [0] * pad_t, jnp.int32),
                                         jnp.array(pos + [0] * pad_t, jnp.int32), md, jnp.array(rows, jnp.int32))
        return np.asarray(logits)

    def prompt_logits(self, prompt: list[int], num_tokens: int = 16) -> np.ndarray:
        """Logits of every prompt position, the prompt prefilled in one step into slot 0."""
        return self.step([(0, prompt, 0)], num_tokens, logits_rows=list(range(len(prompt))))

    def greedy(self, prompts: list[list[int]], num_new: int, prefill_tokens: int) -> list[list[int]]:
        """Greedy continuations of several prompts decoded together (one prefill step, then decode steps)."""
        logits = self.step([(r, p, 0) for r, p in enumerate(prompts)], prefill_tokens)
        out = [[int(logits[r].argmax())] for r in range(len(prompts))]
        for _ in range(num_new - 1):
            chunks = [(r, [out[r][-1]], len(p) + len(out[r]) - 1) for r, p in enumerate(prompts)]
            logits = self.step(chunks, self.max_reqs)
            for r in range(len(prompts)):
                out[r].append(int(logits[r].argmax()))
        return out


def paged_step(params, caches, ids, pos, md, rows, *, family, cfg):
    """One forward of ``family`` over a ragged batch (reference attention) and the logits of ``rows``."""
    hidden, caches = family.forward(params, caches, ids, pos, md, cfg, attn_backend="reference")
    return family.compute_logits(params, hidden[rows], cfg), caches


# ------------------------------------------------------------------ the checks every tiny family passes
def check_logits_match_hf(name, model, golden, hf_logits) -> None:
    """The prompt's logits, prefilled in one step, within 1e-4 of HF float32."""
    logits = PagedRunner(model, max_reqs=1, max_len=16).prompt_logits(golden["prompt_ids"])
    err = np.abs(logits - hf_logits).max()
    assert err <= 1e-4, f"{name}: max abs logit error {err:.2e} vs HF float32"


def check_chunked_prefill_matches_hf(name, model, golden, hf_logits) -> None:
    """Prefill in two chunks: the second chunk's logits read the first chunk's K/V from the cache."""
    prompt = golden["prompt_ids"]
    runner = PagedRunner(model, max_reqs=1, max_len=16)
    runner.step([(0, prompt[:6], 0)], 16)
    logits = runner.step([(0, prompt[6:], 6)], 16, logits_rows=list(range(len(prompt) - 6)))
    np.testing.assert_allclose(logits, hf_logits[6:], atol=1e-4, rtol=0, err_msg=name)


def check_greedy_matches_hf(name, model, golden, hf_logits=None) -> None:
    """HF's 32-token greedy continuation, decoded twice in one batch (different block placements)."""
    prompt, expected = golden["prompt_ids"], golden["greedy_ids"]
    runner = PagedRunner(model, max_reqs=2, max_len=len(prompt) + len(expected), seed=1)
    out = runner.greedy([prompt, prompt], len(expected), prefill_tokens=24)
    assert out[0] == expected and out[1] == expected, f"{name}: greedy continuation differs from HF"


def engine_with_preemption(name: str):
    """The engine (``LLM``, float32) on HF's prompt three times among three others: prefix caching on (the
    copies share the prompt's blocks), 8-token prefill chunks, and a block pool too small for the batch, so
    the scheduler preempts and recomputes. Returns (llm, golden, outputs); copies are outputs 0, 2 and 4."""
    from jaxserve import LLM, SamplingParams

    gold = golden(name)
    llm = LLM(fixture_path(name), dtype="float32", max_model_len=64, block_size=4,
              max_num_batched_tokens=8, max_num_seqs=4, num_gpu_blocks_override=24, enable_prefix_caching=True,
              compilation_cache_dir="", use_tqdm_on_load=False)
    rng = np.random.default_rng(0)
    others = [rng.integers(3, 250, size=int(n)).tolist() for n in (5, 17, 12)]
    prompts = [gold["prompt_ids"], others[0], gold["prompt_ids"], others[1], gold["prompt_ids"], others[2]]
    params = SamplingParams(temperature=0, max_tokens=len(gold["greedy_ids"]), ignore_eos=True)
    return llm, gold, llm.generate(prompts, params, use_tqdm=False)


def tiny_llm(name: str = "tiny-llama3", **overrides):
    """An ``LLM`` on a tiny fixture with the test defaults (float32, pages of 4, a 16 MiB KV cache, no
    persistent compile cache); keyword arguments override them."""
    from jaxserve import LLM

    opts = dict(dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=64, max_num_seqs=16,
                kv_cache_memory_bytes=1 << 24, compilation_cache_dir="", use_tqdm_on_load=False)
    return LLM(fixture_path(name), **(opts | overrides))


def params_equal(a, b) -> bool:
    """Two parameter pytrees hold the same arrays: as many leaves, each of the same dtype, bit for bit."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
                                      for x, y in zip(la, lb))


def check_orbax_round_trip(name: str, folder: str) -> None:
    """``convert`` of the fixture into ``folder`` restores its config (a family's extra hyper-parameters
    included), its family and its weights bit for bit."""
    from jaxserve.models import load_model, orbax_io

    orbax_io.convert(fixture_path(name), folder, dtype="float32")
    restored, original = load_model(folder), load_model(fixture_path(name), dtype="float32")
    assert restored.load_format == "orbax" and restored.config == original.config
    assert restored.family is original.family
    assert params_equal(restored.params, original.params)
