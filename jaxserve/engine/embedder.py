"""Batched embeddings with padding buckets, for encoders (BERT) and decoders run with ``task="embed"``.

``Embedder.embed(token_id_lists)`` sorts the inputs by length, cuts them into batches that fit a token
budget, pads each batch to a (batch size, sequence length) bucket (powers of two) and runs one jitted
call per batch, so a steady stream of requests reuses the programs ``warmup()`` compiled. Pooling runs on
device; ``dimensions`` truncation and L2 normalization run on the host on the pooled ``[N, H]`` vectors.

Encoders run as ``[B, S]`` padded batches (``bert.forward``). Decoders run through their ragged paged
forward (``family.forward``): each sequence is one prefill chunk over a scratch KV cache that lives only
inside the jitted call, ``B * S`` flat tokens, ``S / block_size`` blocks per sequence.
"""
from __future__ import annotations

import json
import os
from typing import Any, Sequence

import jax
import numpy as np

from jaxserve.errors import InvalidRequestError
from jaxserve.kernels import ops
from jaxserve.runner.model_runner import token_buckets
from jaxserve.kernels.metadata import NULL_BLOCK, PAD_SLOT, AttentionMetadata
from jaxserve.models.bert import LoadedEncoder
from jaxserve.models.pooling import (PoolingConfig, check_dimensions, pool_padded, pool_ragged, postprocess,
                                     read_pooling_config)


def default_max_num_batched_tokens() -> int:
    """Token budget of one jitted call. On CPU larger calls do not pay: matmul throughput fell from ~70 to
    ~40 GFLOP/s between 2048 and 16384 rows here (2 cores; embed_bench.py, in git history), so batches stay
    small; accelerators want big calls."""
    return 2048 if jax.default_backend() == "cpu" else 16384


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``n``."""
    for b in buckets:
        if n <= b:
            return b
    raise AssertionError(f"{n} is above the largest bucket {buckets[-1]}")   # callers check lengths first


def is_embedding_model(model: Any, task: str = "auto") -> bool:
    """Whether ``model`` (a loaded model, or an HF folder path) serves embeddings under ``task``.

    Encoders (BERT family, or any folder with sentence-transformers' ``modules.json``) embed unless the
    task is ``generate``; decoders embed only when asked (``task="embed"``), as ``vllm --task embed``.
    """
    if task == "embed":
        return True
    if task == "generate":
        return False
    from jaxserve.models import registry
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if os.path.isfile(os.path.join(path, "modules.json")):
            return True
        try:
            with open(os.path.join(path, "config.json")) as f:
                archs = json.load(f).get("architectures") or []
        except (OSError, json.JSONDecodeError):
            return False
        return any(registry.is_encoder(a) for a in archs)
    return registry.is_encoder(getattr(getattr(model, "config", None), "architecture", ""))


class Embedder:
    """Embeds token-id lists with a loaded model (``bert.LoadedEncoder`` or a decoder ``LoadedModel``).

    max_batch_size: largest batch bucket (batch buckets are 1, 2, 4, ... up to it).
    buckets: sequence-length buckets (default: 16, 32, ... up to the model's max length).
    max_num_batched_tokens: token budget of one call (batch bucket x length bucket); bounds memory
        (default: 2048 on CPU, 16384 on accelerators).
    pooling: override the model's pooling recipe (decoders: default last token + normalize).
    attn_backend: decoders only, the paged attention backend (default: "pallas" on GPU, else "reference").
    call_overhead_tokens: what one more jitted call costs, in padded tokens, when planning batches.
    encoder_attn_impl: encoders only, ``jax.nn.dot_product_attention`` implementation (None = XLA, "cudnn").
    """

    def __init__(self, model, *, max_batch_size: int = 64, buckets: Sequence[int] | None = None,
                 max_num_batched_tokens: int | None = None, pooling: PoolingConfig | None = None,
                 attn_backend: str | None = None, block_size: int = 16, max_length: int | None = None,
                 model_name: str | None = None, call_overhead_tokens: int = 128,
                 encoder_attn_impl: str | None = None):
        self.model = model
        self.config = model.config
        self.tokenizer = model.tokenizer
        self.is_encoder = isinstance(model, LoadedEncoder)
        self.model_name = model_name or os.path.basename(os.path.normpath(str(model.source))) or "model"
        if pooling is None:
            pooling = model.pooling if self.is_encoder else self._decoder_pooling(model)
        self.pooling = pooling
        model_max = model.max_length if self.is_encoder else model.max_model_len
        self.max_length = min(max_length or model_max, model_max)
        self.block_size = block_size
        self.attn_backend = attn_backend or ops.default_backend()
        self.call_overhead_tokens = call_overhead_tokens
        self.encoder_attn_impl = encoder_attn_impl

        self.batch_buckets = token_buckets(max(1, max_batch_size), smallest=1)
        if buckets is None:
            buckets = token_buckets(self.max_length, smallest=min(16, self.max_length))
        self.seq_buckets = sorted(set(int(b) for b in buckets if b <= self.max_length))
        if not self.seq_buckets or self.seq_buckets[-1] < self.max_length:
            self.seq_buckets.append(self.max_length)         # every allowed input must fit some bucket
        if not self.is_encoder:                             # a sequence's blocks must tile its bucket
            self.seq_buckets = sorted(set(-(-s // block_size) * block_size for s in self.seq_buckets))
        budget = max_num_batched_tokens or default_max_num_batched_tokens()
        self.max_num_batched_tokens = max(budget, self.seq_buckets[-1])   # one longest input always fits

        self._run = jax.jit(self._encoder_fn if self.is_encoder else self._decoder_fn)

    # ------------------------------------------------------------------------------------------- setup
    @staticmethod
    def _decoder_pooling(model) -> PoolingConfig:
        source = str(model.source)
        if os.path.isdir(source):     # an HF folder may ship sentence-transformers files (e.g. Qwen3-Embedding)
            return read_pooling_config(source, default_pooling="last", default_normalize=True)
        return PoolingConfig("last", True, source="default for decoders (last token, normalize)")

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def max_batch_for(self, seq_bucket: int) -> int:
        """Largest batch bucket whose padded tokens fit the budget at this sequence length (at least 1)."""
        fits = [b for b in self.batch_buckets if b * seq_bucket <= self.max_num_batched_tokens]
        return fits[-1] if fits else 1

    def bucket_shapes(self) -> list[tuple[int, int]]:
        """Every (batch, seq_len) shape ``embed`` may run: what ``warmup`` compiles."""
        return [(b, s) for s in self.seq_buckets for b in self.batch_buckets if b <= self.max_batch_for(s)]

    @property
    def num_compilations(self) -> int:
        """Programs compiled so far (one per bucket shape used): a steady state must not grow it."""
        return self._run._cache_size()

    def warmup(self, shapes: Sequence[tuple[int, int]] | None = None, progress: bool = False) -> None:
        """Compile every bucket shape (or the given ones) ahead of traffic."""
        shapes = list(shapes or self.bucket_shapes())
        it = shapes
        if progress:
            from tqdm import tqdm
            it = tqdm(shapes, desc="Compiling embedding buckets")
        for b, s in it:
            ids = [[0] * s for _ in range(b)]
            jax.block_until_ready(self._dispatch(ids))

    # ---------------------------------------------------------------------------------------- requests
    def tokenize(self, texts: Sequence[str], *, truncate_prompt_tokens: int | None = None) -> list[list[int]]:
        """Token ids as the model's tokenizer makes them (special tokens included). With
        ``truncate_prompt_tokens`` the tokenizer truncates (keeping its special tokens, as
        sentence-transformers does); otherwise over-long texts are left for ``embed`` to reject."""
        if isinstance(texts, str):
            texts = [texts]
        limit = self._truncation_limit(truncate_prompt_tokens)
        enc = self.tokenizer(list(texts), add_special_tokens=True, truncation=limit is not None,
                             max_length=limit)
        return [list(map(int, ids)) for ids in enc["input_ids"]]

    def _truncation_limit(self, truncate_prompt_tokens: int | None) -> int | None:
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens == -1:           # vLLM: -1 means "the model's limit"
            return self.max_length
        if truncate_prompt_tokens < 1:
            raise InvalidRequestError(f"truncate_prompt_tokens is {truncate_prompt_tokens}; it must be -1 or "
                                      ">= 1", param="truncate_prompt_tokens")
        if truncate_prompt_tokens > self.max_length:
            raise InvalidRequestError(f"truncate_prompt_tokens is {truncate_prompt_tokens}, above the model's "
                                      f"maximum input length {self.max_length}", param="truncate_prompt_tokens")
        return truncate_prompt_tokens

    def _truncate(self, ids: list[int], limit: int) -> list[int]:
        """Right truncation that keeps a trailing special token (BERT's [SEP], a decoder's EOS), as the
        tokenizer truncates text: ``[CLS] a b c d [SEP]`` to 4 -> ``[CLS] a b [SEP]``."""
        if len(ids) <= limit:
            return ids
        special = set(getattr(self.tokenizer, "all_special_ids", None) or ())
        if ids and ids[-1] in special and limit >= 2:
            return ids[: limit - 1] + [ids[-1]]
        return ids[:limit]

    def validate(self, token_id_lists: Sequence[Sequence[int]], *, truncate_prompt_tokens: int | None = None,
                 dimensions: int | None = None) -> list[list[int]]:
        """Check a request before it is queued (``InvalidRequestError`` = HTTP 400); returns the token lists
        that will be embedded (truncated where asked)."""
        check_dimensions(dimensions, self.hidden_size, self.pooling, self.model_name)
        limit = self._truncation_limit(truncate_prompt_tokens)
        out = []
        vocab = self.config.vocab_size
        for i, ids in enumerate(token_id_lists):
            ids = [int(t) for t in ids]
            if not ids:
                raise InvalidRequestError(f"input {i} is empty; an embedding needs at least one token",
                                          param="input")
            if limit is not None:
                ids = self._truncate(ids, limit)
            if len(ids) > self.max_length:
                raise InvalidRequestError(
                    f"input {i} has {len(ids)} tokens, the model's maximum input length is {self.max_length}; "
                    "shorten it or set truncate_prompt_tokens", param="input")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"input {i} has token id {bad}, outside the vocabulary [0, {vocab})",
                                          param="input")
            out.append(ids)
        return out

    def embed(self, token_id_lists: Sequence[Sequence[int]], *, truncate_prompt_tokens: int | None = None,
              dimensions: int | None = None, normalize: bool | None = None) -> list[np.ndarray]:
        """One float32 vector per input, in input order. ``normalize=None`` uses the model's recipe;
        ``dimensions`` (matryoshka models only) keeps the first ``dimensions`` values, then renormalizes."""
        seqs = self.validate(token_id_lists, truncate_prompt_tokens=truncate_prompt_tokens, dimensions=dimensions)
        pooled = self.embed_pooled(seqs)
        normalize = self.pooling.normalize if normalize is None else bool(normalize)
        vecs = postprocess(pooled, dimensions=dimensions, normalize=normalize)
        return list(vecs)

    def embed_pooled(self, seqs: Sequence[Sequence[int]]) -> np.ndarray:
        """Pooled float32 ``[N, H]`` before normalization, for already-validated token lists."""
        if not seqs:
            return np.zeros((0, self.hidden_size), np.float32)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]), reverse=True)   # similar lengths batch
        pending = []
        for start, stop, seq_bucket in self.plan_batches([len(seqs[i]) for i in order]):
            take = order[start:stop]
            # dispatch every batch before reading any result, so host padding overlaps device work
            pending.append((take, self._dispatch([seqs[i] for i in take], seq_bucket)))
        out = np.zeros((len(seqs), self.hidden_size), np.float32)
        for take, result in pending:
            out[take] = np.asarray(result)[:len(take)]
        return out

    def plan_batches(self, lengths_desc: Sequence[int]) -> list[tuple[int, int, int]]:
        """Cut lengths sorted longest first into ``(start, stop, seq_bucket)`` batches with the fewest padded
        tokens (batch bucket x length bucket, plus ``call_overhead_tokens`` per call), by dynamic programming
        over the cut points that can matter: batch-bucket sizes and length-bucket boundaries."""
        n = len(lengths_desc)
        seq_bucket = [bucket_for(k, self.seq_buckets) for k in lengths_desc]
        boundaries = [k for k in range(1, n) if seq_bucket[k] != seq_bucket[k - 1]] + [n]
        best = [0.0] * (n + 1)            # best[i]: cost of batching lengths_desc[i:]
        cut = [n] * (n + 1)
        for i in range(n - 1, -1, -1):
            max_rows = self.max_batch_for(seq_bucket[i])
            stops = {min(i + b, n) for b in self.batch_buckets if b <= max_rows}
            stops.update(k for k in boundaries if i < k <= i + max_rows)
            best[i] = float("inf")
            for j in stops:
                cost = bucket_for(j - i, self.batch_buckets) * seq_bucket[i] + self.call_overhead_tokens + best[j]
                if cost < best[i]:
                    best[i], cut[i] = cost, j
        plan, i = [], 0
        while i < n:
            plan.append((i, cut[i], seq_bucket[i]))
            i = cut[i]
        return plan

    # ---------------------------------------------------------------------------------------- device
    def _dispatch(self, seqs: list[list[int]], seq_bucket: int | None = None):
        n = len(seqs)
        lengths = np.array([len(s) for s in seqs], np.int32)
        s_pad = seq_bucket or bucket_for(int(lengths.max()), self.seq_buckets)
        b_pad = bucket_for(n, self.batch_buckets)
        if self.is_encoder:
            ids = np.zeros((b_pad, s_pad), np.int32)
            for i, s in enumerate(seqs):
                ids[i, :len(s)] = s
            lens = np.zeros(b_pad, np.int32)
            lens[:n] = lengths
            return self._run(self.model.params, ids, lens)
        return self._run(self.model.params, *self._decoder_inputs(seqs, lengths, b_pad, s_pad))

    def _encoder_fn(self, params, ids, lengths):
        hidden = self.model.family.forward(params, ids, lengths, self.config, attn_impl=self.encoder_attn_impl)
        return pool_padded(hidden, lengths, self.pooling.pooling_type)

    def _decoder_inputs(self, seqs, lengths, b_pad: int, s_pad: int):
        """Flat ragged inputs: sequence r's tokens packed after r-1's, r owns blocks
        ``1 + r*P .. (r+1)*P`` of the scratch cache (block 0 is the null block padding writes to)."""
        bs = self.block_size
        blocks_per_seq = s_pad // bs
        T = b_pad * s_pad
        ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slots = np.full(T, PAD_SLOT, np.int32)
        qsl = np.zeros(b_pad + 1, np.int32)
        seq_lens = np.zeros(b_pad, np.int32)
        tables = np.full((b_pad, blocks_per_seq), NULL_BLOCK, np.int32)
        offset = 0
        for r, s in enumerate(seqs):
            n = len(s)
            first_block = 1 + r * blocks_per_seq
            tables[r] = np.arange(first_block, first_block + blocks_per_seq)
            ids[offset: offset + n] = s
            positions[offset: offset + n] = np.arange(n)
            slots[offset: offset + n] = first_block * bs + np.arange(n)
            offset += n
            qsl[r + 1] = offset
            seq_lens[r] = n
        qsl[len(seqs) + 1:] = offset              # padding requests: empty ranges at the end
        md = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                               query_start_loc=qsl, num_seqs=np.int32(len(seqs)))
        return ids, positions, md

    def _decoder_fn(self, params, ids, positions, md):
        cfg = self.config
        num_blocks = 1 + md.block_tables.shape[0] * md.block_tables.shape[1]
        # scratch cache: allocated and dropped inside this call (XLA temp memory), never an input
        caches = ops.init_kv_caches(cfg.num_layers, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                                    self.model.dtype)
        hidden, _ = self.model.family.forward(params, caches, ids, positions, md, cfg,
                                              attn_backend=self.attn_backend)
        return pool_ragged(hidden, md.query_start_loc, md.num_seqs, self.pooling.pooling_type)


__all__ = ["Embedder", "is_embedding_model"]
