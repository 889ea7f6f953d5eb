"""EAGLE speculation (``{"method": "eagle", "model": HEAD}``) on the tiny Llama, with heads made here (no
trained head is at hand): a random head keeps greedy output token-identical to the engine without
speculation (batched, prefix cache on, preemption forced); a head that echoes the target's hidden state
proves the hidden-state plumbing (its every draft is the target's greedy token at the previous position,
i.e. the request's last token, which only the right rows give); bad configs are refused by name."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.errors import ModelLoadError
from jaxserve.models import load_model
from jaxserve.models.eagle_loader import load_eagle_head
from support.speculation import (check_dummy_head_runs, check_echo_head, check_greedy_matches_with_preemption, greedy,
                                make_eagle_head as make_head, spec_prompts, token_ids as _tokens)
from support.tiny_models import fixture_path, tiny_llm

TARGET = "tiny-llama3"
# the engines here compile two token buckets (16 and the largest) instead of five: what these tests check does
# not depend on the step sizes, and each bucket is a forward (and its samplers) compiled per engine
BUCKETS = [16]
LLM_ARGS = dict(token_buckets=BUCKETS)


def eagle(path, k=3):
    return {"method": "eagle", "model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    return {"random": make_head(root / "random", bias=True), "echo": make_head(root / "echo", echo=True)}


@pytest.fixture(scope="module")
def prompts():
    return spec_prompts()


def test_greedy_matches_without_speculation_batched_with_preemption(llm, heads, prompts):
    spec, ref, lengths = check_greedy_matches_with_preemption(llm, TARGET, eagle(heads["random"]), prompts,
                                                              token_buckets=BUCKETS)
    core = spec.engine.core
    stats = core.stats()
    # the prefix cache holds the finished requests' blocks, the head's its own: again, a hit, the same tokens,
    # and drafts from the head's cached K/V
    drafts = stats["spec_decode_num_drafts"]
    again = spec.generate(prompts[-2:], [greedy(m) for m in lengths[-2:]], use_tqdm=False)
    assert _tokens(again) == ref[-2:] and all(o.num_cached_tokens > 0 for o in again)
    assert core.stats()["spec_decode_num_drafts"] >= drafts + 2 * 3
    # the head's blocks go back with its requests (a finished one's at the next round)
    assert set(core.speculator.draft.seqs) <= {o.request_id for o in again}


def test_a_head_echoing_the_target_hidden_state_drafts_the_last_token(llm, heads, prompts):
    """The echo head's logits are the target's lm_head over the hidden state it is given: its first draft is the
    target's greedy token at the position before the last (the request's last token, once it has outputs)
    only if the target's row for that position arrives, and the later drafts repeat it only if the head's own
    output row does. A prompt longer than the token budget catches up over several steps; run again, the
    prompts hit the prefix caches and the head starts from its cached blocks."""
    spec = tiny_llm(TARGET, speculative_config=eagle(heads["echo"]), max_num_batched_tokens=32, token_buckets=BUCKETS)
    ref, seen = check_echo_head(llm, spec, prompts)
    params = [greedy(12 + i) for i in range(6)]
    first = len(seen)
    again = spec.generate(prompts[:5] + [prompts[-1]], params, use_tqdm=False)
    assert _tokens(again) == ref and sum(o.num_cached_tokens > 0 for o in again) >= 4
    assert len(seen) > first + 20 and all(d == [last] * len(d) for last, d in seen)


def test_logit_scale_multiplies_the_head_logits(tmp_path):
    """vLLM's EagleLlamaForCausalLM: ``LogitsProcessor(vocab_size, scale=logit_scale)`` over the shared lm_head."""
    target = load_model(fixture_path(TARGET), dtype="float32")
    scaled = load_eagle_head(make_head(tmp_path / "scaled", logit_scale=0.5), target)
    plain = load_eagle_head(make_head(tmp_path / "plain"), target)
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((3, target.config.hidden_size)), jnp.float32)
    np.testing.assert_allclose(np.asarray(scaled.family.compute_logits(scaled.params, hidden, scaled.config)),
                               0.5 * np.asarray(plain.family.compute_logits(plain.params, hidden, plain.config)),
                               rtol=1e-6, atol=1e-6)


def test_seeded_sampling_is_reproducible(heads, prompts):
    """The same drafts, the same seeded samples (no prefix cache: a request that hits it proposes nothing, and
    a seeded sample depends on the drafts it verifies)."""
    spec = tiny_llm(TARGET, speculative_config=eagle(heads["random"]), enable_prefix_caching=False,
                    token_buckets=BUCKETS)
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=20, seed=s, ignore_eos=True) for s in range(4)]
    first = _tokens(spec.generate(prompts[-2:] * 2, params, use_tqdm=False))
    assert first == _tokens(spec.generate(prompts[-2:] * 2, params, use_tqdm=False))
    assert len({tuple(t) for t in first}) > 1


def test_dummy_head_weights_run(heads, prompts):
    check_dummy_head_runs(TARGET, eagle(heads["random"]), prompts, token_buckets=BUCKETS)


def test_bad_configs_are_refused(tmp_path, heads):
    with pytest.raises(ModelLoadError, match="deepseek_mtp needs a DeepSeek"):
        tiny_llm(TARGET, speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="EAGLE head's folder"):
        tiny_llm(TARGET, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    wide = make_head(tmp_path / "wide", hidden_size=96, num_attention_heads=6)
    with pytest.raises(Exception, match="hidden_size is 96 and the target's 64"):
        tiny_llm(TARGET, speculative_config=eagle(wide))
    with pytest.raises(ModelLoadError, match="add_para_norm"):
        tiny_llm(TARGET, speculative_config=eagle(make_head(tmp_path / "hass", add_para_norm=True)))
    with pytest.raises(Exception, match="not a folder"):
        tiny_llm(TARGET, speculative_config=eagle(str(tmp_path / "missing")))
    served = make_head(tmp_path / "served", architectures=["EagleLlamaForCausalLM"])
    with pytest.raises(ModelLoadError, match="EAGLE draft head"):     # a head is not a model to serve
        load_model(served)
