"""The tiny random HF checkpoints of tests/fixtures/models and the checks each family runs against them.

A fixture folder holds the checkpoint and what HF transformers float32 gave for it (tests/make_model_fixtures.py,
tests/make_moe_fixtures.py): ``golden.json`` (the prompt ids and their 32-token greedy continuation) and
``logits.npy`` (the prompt's logits). ``PagedRunner`` drives a family's ``forward`` through a paged KV cache with
the runner's own step inputs and forward; ``engine_with_preemption`` runs the engine under prefix caching, chunked prefill and
preemption at once.
"""
from __future__ import annotations

import functools
import os
import random

import jax
import numpy as np

from jaxserve import parallel
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler_output import ScheduledRequest
from jaxserve.runner import kv_cache, step_inputs
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.step_functions import forward_fn
from jaxserve.sampling_params import SamplingParams

import support
from support.goldens import load_golden

FIXTURES = os.path.join(support.FIXTURES, "models")
GREEDY = SamplingParams(temperature=0.0)


def fixture_path(name: str) -> str:
    return os.path.join(FIXTURES, name)


def golden(name: str) -> dict:
    return load_golden(os.path.join(FIXTURES, name, "golden.json"))


def hf_logits(name: str) -> np.ndarray:
    return np.load(os.path.join(FIXTURES, name, "logits.npy"))


def load_tiny(name: str):
    """(name, the float32 model, its golden.json, HF's prompt logits): what a module-scoped fixture holds."""
    from jaxserve.models.loader import load_model
    return name, load_model(fixture_path(name), dtype="float32"), golden(name), hf_logits(name)


class PagedRunner:
    """The runner's own step inputs (``step_inputs``) and forward (``step_functions.forward_fn``) driven from a
    test, returning logits where the engine samples: fixed token/request buckets (so each shape compiles once),
    a paged cache with shuffled block ids, donated to every step. Under ``mesh`` the params must be placed
    already; the step inputs go replicated (every process passes the same values)."""

    def __init__(self, model, *, max_reqs: int, max_len: int, block_size: int = 4, seed: int = 0, mesh=None):
        self.family, self.cfg, self.params, self.mesh = model.family, model.config, model.params, mesh
        self.bs, self.max_reqs = block_size, max_reqs
        self.max_blocks = -(-max_len // block_size)
        num_blocks = 1 + max_reqs * self.max_blocks
        pool = list(range(1, num_blocks))               # block 0 is the null block
        random.Random(seed).shuffle(pool)
        self.tables = [pool[r * self.max_blocks:(r + 1) * self.max_blocks] for r in range(max_reqs)]
        self.kv_caches = kv_cache.allocate(self.cfg, num_blocks, block_size, model.dtype, mesh)
        self.input_batch = InputBatch(max_reqs, self.max_blocks, self.cfg.vocab_size)
        self._step = jax.jit(parallel.bind_mesh(functools.partial(forward_fn, self.family, self.cfg, "reference", False),
                                                mesh), static_argnames=("layout",), donate_argnums=(1,))
        self.no_prev = shard_step_inputs(mesh, np.zeros(max_reqs, np.int32))

    def inputs(self, chunks: list[tuple[int, list[int], int]], num_tokens: int, logits_rows: list[int] | None = None,
               mm_features: list | None = None):
        """The packed forward inputs (int32 buffer, layout) of ``chunks``: (request slot, new token ids, start
        position), in a step of ``num_tokens`` tokens; logits of the last new token of each chunk (or of
        ``logits_rows``, flat token indices). ``mm_features``: the images of every chunk's request (an M-RoPE
        model's positions read them)."""
        scheduled = [ScheduledRequest(Request(str(slot), [0] * start + list(toks), GREEDY, mm_features=mm_features),
                                      len(toks), start, self.tables[slot]) for slot, toks, start in chunks]
        x = step_inputs.forward_inputs(scheduled, self.input_batch, self.bs,
                                       lambda n, all_decode: (num_tokens, self.max_reqs, False),
                                       mrope=getattr(self.family, "mrope_positions", None))
        rows = x.logits_idx if logits_rows is None else np.asarray(logits_rows, np.int32)
        return step_inputs.forward_pack(x.input_ids, x.positions, x.md, rows, x.prev_index)

    def run(self, ints: np.ndarray, layout) -> jax.Array:
        """One forward of packed inputs (every process of a mesh, the same inputs): the logits it asks for."""
        self.kv_caches, logits = self._step(self.params, self.kv_caches, shard_step_inputs(self.mesh, ints),
                                            self.no_prev, layout=layout)
        return logits

    def step(self, chunks: list[tuple[int, list[int], int]], num_tokens: int, logits_rows: list[int] | None = None):
        """``run`` of ``inputs``: float32 logits on the host."""
        return np.asarray(self.run(*self.inputs(chunks, num_tokens, logits_rows)))

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


def shard_step_inputs(mesh, tree):
    """Place a step's host inputs replicated on the mesh (None: one device).

    Every process passes the same values (each builds them from the step process 0 sent, see
    ``jaxserve.executor``), so this works whether the mesh spans one process or several.
    """
    if mesh is None:
        return jax.device_put(tree)
    return jax.device_put(tree, parallel.replicated(mesh))


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


def engine_with_preemption(name: str, **overrides):
    """The engine (``LLM``, float32) on HF's prompt three times among three others: prefix caching on (the
    copies share the prompt's blocks), 8-token prefill chunks, and a block pool too small for the batch, so
    the scheduler preempts and recomputes. Returns (llm, golden, outputs); copies are outputs 0, 2 and 4.
    Keyword arguments are the ``LLM``'s (e.g. parallelism)."""
    from jaxserve import LLM, SamplingParams

    gold = golden(name)
    llm = LLM(fixture_path(name), dtype="float32", max_model_len=64, block_size=4,
              max_num_batched_tokens=8, max_num_seqs=4, num_gpu_blocks_override=24, enable_prefix_caching=True,
              compilation_cache_dir="", use_tqdm_on_load=False, **overrides)
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
