"""EAGLE-3 speculation (``{"method": "eagle3", "model": HEAD}``) on the tiny Llama, with heads made here: a random
head over a shuffled subset of the vocabulary keeps greedy output token-identical to the engine without
speculation (batched, prefix cache on, preemption forced); a head that echoes the target's last residual
stream (one of its three auxiliary layers) through its fc, with the target's norm and lm_head, drafts the
request's last token, which only the right rows, the right auxiliary layer and the d2t map give; over a
subset of the vocabulary it drafts only that subset's tokens; bad configs are refused with what is wrong."""
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxserve.config import SpeculativeConfig
from jaxserve.errors import ModelLoadError
from jaxserve.models import llava, load_model
from jaxserve.models.eagle_loader import aux_layer_ids, draft_to_target, eagle3_config, load_eagle3_head
from jaxserve.models.layers.norms import rms_norm
from jaxserve.runner.step_functions import forward_fn
from support.speculation import (check_dummy_head_runs, check_echo_head, check_greedy_matches_with_preemption, greedy,
                                make_eagle3_head as make_head, record_drafts, spec_prompts, token_ids as _tokens)
from support.tiny_models import PagedRunner, fixture_path, tiny_llm

TARGET = "tiny-llama3"
VOCAB = 256
# the engines here compile two token buckets (16 and the largest) instead of five: what these tests check does
# not depend on the step sizes, and each bucket is a forward (and its samplers) compiled per engine
BUCKETS = [16]
LLM_ARGS = dict(token_buckets=BUCKETS)


def eagle3_spec(path, k=3):
    return {"method": "eagle3", "model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def subset():
    return np.random.default_rng(5).permutation(VOCAB)[:200]


@pytest.fixture(scope="module")
def heads(tmp_path_factory, subset):
    root = tmp_path_factory.mktemp("eagle3")
    perm = np.random.default_rng(7).permutation(VOCAB)
    return {"random": make_head(root / "random", draft_ids=subset, embed=True),
            "echo": make_head(root / "echo", echo=True, draft_ids=perm, layer0="layers.0."),
            "echo_subset": make_head(root / "echo_subset", echo=True, draft_ids=subset)}


@pytest.fixture(scope="module")
def prompts():
    return spec_prompts()


def test_greedy_matches_without_speculation_batched_with_preemption(llm, heads, prompts):
    """Then again: the prefix caches (the target's and the head's) hit, and the tokens are the same."""
    spec, ref, lengths = check_greedy_matches_with_preemption(llm, TARGET, eagle3_spec(heads["random"]), prompts,
                                                              token_buckets=BUCKETS)
    head, target = spec.engine.core.speculator.draft.model, spec.engine.core.executor.model
    assert head.params["embed"] is not target.params["embed"]       # its checkpoint has one
    assert head.params["lm_head"].shape == (64, 200) and head.params["draft_to_target"].shape == (200,)
    drafts = spec.engine.core.stats()["spec_decode_num_drafts"]
    again = spec.generate(prompts[-2:], [greedy(m) for m in lengths[-2:]], use_tqdm=False)
    assert _tokens(again) == ref[-2:] and all(o.num_cached_tokens > 0 for o in again)
    assert spec.engine.core.stats()["spec_decode_num_drafts"] >= drafts + 2 * 3


def test_a_head_echoing_the_target_last_stream_drafts_the_last_token(llm, heads, prompts):
    """Its first draft is the target's greedy token at the position before the last (the request's last token)
    only if the target's row for that position arrives with its last residual stream in the third auxiliary
    slot, and the draft id is mapped through its (permuted) d2t; the later drafts repeat it only if the head's
    own output row arrives unmapped by fc. A prompt longer than the token budget catches up over several steps."""
    spec = tiny_llm(TARGET, speculative_config=eagle3_spec(heads["echo"]), max_num_batched_tokens=32,
                    token_buckets=BUCKETS)
    assert spec.engine.core.speculator.draft.model.params["embed"] is spec.engine.core.executor.model.params["embed"]
    check_echo_head(llm, spec, prompts)


def test_a_draft_vocabulary_subset_drafts_only_its_tokens(llm, heads, prompts, subset):
    spec = tiny_llm(TARGET, speculative_config=eagle3_spec(heads["echo_subset"], k=2), token_buckets=BUCKETS)
    seen = record_drafts(spec)
    ref = _tokens(llm.generate(prompts[:6], greedy(16), use_tqdm=False))
    assert _tokens(spec.generate(prompts[:6], greedy(16), use_tqdm=False)) == ref
    allowed = set(subset.tolist())
    assert len(seen) > 10 and all(set(d) <= allowed for _, d in seen)
    assert all(d == [last] * len(d) for last, d in seen if last in allowed)
    assert any(last not in allowed for last, _ in seen)


@pytest.mark.slow    # ~25 s
def test_a_head_without_lm_head_shares_the_tied_targets(tmp_path, prompts):
    """On a target that ties its lm_head to its embedding, an echo head with no lm_head of its own drafts the
    last token through the target's embedding."""
    tied = "tiny-llama-tied"
    head = make_head(tmp_path / "tied", echo=True, lm_head=False, target=tied)
    spec = tiny_llm(tied, speculative_config=eagle3_spec(head))
    seen = record_drafts(spec)
    ref = _tokens(tiny_llm(tied).generate(prompts[:4], greedy(12), use_tqdm=False))
    assert _tokens(spec.generate(prompts[:4], greedy(12), use_tqdm=False)) == ref
    assert "lm_head" not in spec.engine.core.speculator.draft.model.params
    assert len(seen) > 5 and all(d == [last] * len(d) for last, d in seen)


@pytest.mark.slow    # ~16 s
def test_logit_scale_multiplies_the_draft_logits_as_vllm(tmp_path, llm, prompts, subset):
    """vLLM's Eagle3LlamaForCausalLM: ``LogitsProcessor(draft_vocab_size, scale=logit_scale)`` over its lm_head's
    draft-vocabulary logits (of the final norm), which d2t then places among the target's (-inf elsewhere).
    Greedy output stays the target's."""
    target = load_model(fixture_path(TARGET), dtype="float32")
    path = make_head(tmp_path / "scaled", draft_ids=subset, logit_scale=4.0)
    scaled = load_eagle3_head(path, target)
    plain = load_eagle3_head(make_head(tmp_path / "plain", draft_ids=subset), target)    # the same weights
    assert "logit_scale" not in plain.config.extra_dict
    hidden = np.random.default_rng(0).standard_normal((5, target.config.hidden_size)).astype(np.float32)
    t = load_file(f"{path}/model.safetensors")
    normed = hidden / np.sqrt((hidden ** 2).mean(-1, keepdims=True) + target.config.rms_norm_eps) * t["norm.weight"]
    expected = np.full((5, VOCAB), -np.inf, np.float32)
    expected[:, subset] = normed @ t["lm_head.weight"].T * 4.0
    got = np.asarray(scaled.family.compute_logits(scaled.params, jnp.asarray(hidden), scaled.config))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    unscaled = np.asarray(plain.family.compute_logits(plain.params, jnp.asarray(hidden), plain.config))
    np.testing.assert_allclose(got[:, subset], 4.0 * unscaled[:, subset], rtol=1e-6, atol=1e-6)
    spec = tiny_llm(TARGET, speculative_config=eagle3_spec(path))
    ref = _tokens(llm.generate(prompts[:6], greedy(12), use_tqdm=False))
    assert _tokens(spec.generate(prompts[:6], greedy(12), use_tqdm=False)) == ref
    assert spec.engine.core.stats()["spec_decode_num_drafts"] > 0
    with pytest.raises(ModelLoadError, match="logit_scale 'x' must be a number"):
        load_eagle3_head(make_head(tmp_path / "bad", logit_scale="x"), target)


def test_no_step_compiles_on_first_use(heads, prompts):
    """The head's catch-up steps (the target's streams, through fc) and its draft steps (its own output) run
    the same executables, compiled ahead like the target's."""
    spec = tiny_llm(TARGET, speculative_config=eagle3_spec(heads["random"]), max_num_batched_tokens=32)
    core = spec.engine.core
    runners = [core.runner, core.speculator.draft.runner]
    assert all(r.wait_compiled(timeout=600) for r in runners)
    before = [r.compiled_variants() for r in runners]
    assert min(before) > 0
    spec.generate(prompts[:6], greedy(12), use_tqdm=False)
    assert [r.compiled_variants() for r in runners] == before
    assert [r.variants.on_first_use for r in runners] == [[], []]
    assert core.stats()["spec_decode_num_drafts"] > 0


def test_dummy_head_weights_run(heads, prompts):
    check_dummy_head_runs(TARGET, eagle3_spec(heads["random"]), prompts, token_buckets=BUCKETS)


def test_bad_configs_are_refused(tmp_path, heads):
    with pytest.raises(ValueError, match="EAGLE-3 head's folder"):
        SpeculativeConfig.coerce({"method": "eagle3", "num_speculative_tokens": 2})
    target = load_model(fixture_path(TARGET))
    cfg = target.config
    for n, ids in enumerate(([0, 1], [0, 1, 1], [0, 1, 3], [-1, 0, 1], [0, 1, True])):
        bad = make_head(tmp_path / f"aux{n}", aux_layers=ids)
        with pytest.raises(ModelLoadError, match="eagle_aux_hidden_state_layer_ids"):
            aux_layer_ids(bad, cfg)
    assert aux_layer_ids(make_head(tmp_path / "order", aux_layers=(2, 0, 1)), cfg) == (0, 1, 2)
    with pytest.raises(ModelLoadError, match=r"\(2, 1, -1\) \(vLLM's default"):     # too shallow a target for it
        aux_layer_ids(make_head(tmp_path / "default", aux_layers=()), cfg)
    hf = {"hidden_size": 64, "vocab_size": VOCAB, "num_hidden_layers": 1, "num_attention_heads": 4,
          "head_dim": 16, "num_key_value_heads": 2, "intermediate_size": 96, "rms_norm_eps": 1e-5}
    with pytest.raises(ModelLoadError, match="hidden_size is 96 and the target's 64"):
        eagle3_config({**hf, "hidden_size": 96}, cfg)
    with pytest.raises(ModelLoadError, match="target_hidden_size"):
        eagle3_config({**hf, "target_hidden_size": 128}, cfg)
    with pytest.raises(ModelLoadError, match="draft_vocab_size 300"):
        eagle3_config({**hf, "draft_vocab_size": 300}, cfg)
    with pytest.raises(ModelLoadError, match="no lm_head.weight"):
        eagle3_config({**hf, "draft_vocab_size": 100}, cfg, has_lm_head=False)
    with pytest.raises(ModelLoadError, match="speculators format"):
        eagle3_config({"transformer_layer_config": hf, "speculators_config": {}}, cfg)
    with pytest.raises(ModelLoadError, match="use_aux_hidden_state"):
        eagle3_config({**hf, "eagle_config": {"use_aux_hidden_state": False}}, cfg)
    with pytest.raises(ModelLoadError, match="outside the target's 256 tokens"):
        draft_to_target(np.full(4, 300), 4, VOCAB)
    with pytest.raises(ModelLoadError, match="two draft ids to one target id"):
        draft_to_target(np.array([1, 0, 0, 0]), 4, VOCAB)
    with pytest.raises(ModelLoadError, match=r"expected integers of shape \(4,\)"):
        draft_to_target(np.zeros(5, np.int64), 4, VOCAB)
    assert draft_to_target(np.zeros(VOCAB, np.int64), VOCAB, VOCAB) is None
    assert draft_to_target(np.array([3, 3]), 2, VOCAB).tolist() == [3, 4]
    with pytest.raises(ModelLoadError, match="smaller than the target's and no d2t"):
        load_eagle3_head(make_head(tmp_path / "no_d2t", draft_ids=np.arange(100), d2t=False), target)
    with pytest.raises(Exception, match="not a folder"):
        load_eagle3_head(str(tmp_path / "missing"), target)
    with pytest.raises(ModelLoadError, match="draft_vocab_size 101 is not divisible by tensor_parallel_size=2"):
        load_eagle3_head(make_head(tmp_path / "odd", draft_ids=np.arange(101)), target,
                         mesh=SimpleNamespace(shape={"tp": 2}))       # (refused before any weight is placed)
    vision = SimpleNamespace(family=llava.FAMILY, config=SimpleNamespace(architecture="LlavaForConditionalGeneration"))
    with pytest.raises(ModelLoadError, match="LlavaForConditionalGeneration does not return"):
        load_eagle3_head(heads["random"], vision)
    with pytest.raises(ModelLoadError, match="EAGLE-3 draft head"):     # a head is not a model to serve
        load_model(heads["random"])


def test_the_target_step_returns_its_auxiliary_layers_streams():
    """The target's step under eagle3 returns, per token row, the streams entering layers 0 and 1 and leaving
    the last (layer 2 of 2) side by side: the first is the token's embedding, the last gives the step's
    logits through the final norm, the middle is neither; the logits are the plain step's."""
    target = load_model(fixture_path(TARGET), dtype="float32")
    cfg, params, h = target.config, target.params, target.config.hidden_size
    runner = PagedRunner(target, max_reqs=2, max_len=32)
    prompt = [5, 9, 33, 7, 120, 64]
    ints, layout = runner.inputs([(0, prompt, 0)], 16, logits_rows=list(range(len(prompt))))
    step = jax.jit(functools.partial(forward_fn, target.family, cfg, "reference", False, hidden_rows=20,
                                     hidden_width=3 * h, aux_layers=(0, 1, 2)), static_argnames=("layout",))
    _, logits, aux = step(params, runner.kv_caches, ints, runner.no_prev, layout=layout)
    aux, n = np.asarray(aux), len(prompt)
    assert aux.shape == (20, 3 * h) and not aux[16:].any()      # padded past the step's 16 rows
    np.testing.assert_allclose(aux[:n, :h], np.asarray(params["embed"])[prompt], rtol=1e-6)
    last = rms_norm(jnp.asarray(aux[:n, 2 * h:]), params["final_norm"], cfg.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(target.family.compute_logits(params, last, cfg)), np.asarray(logits),
                               rtol=1e-4, atol=1e-4)
    assert not np.allclose(aux[:n, h:2 * h], aux[:n, :h]) and not np.allclose(aux[:n, h:2 * h], aux[:n, 2 * h:])
    np.testing.assert_allclose(runner.prompt_logits(prompt), np.asarray(logits), rtol=1e-5, atol=1e-5)
