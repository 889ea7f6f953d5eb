"""DeepSeek MTP speculation (``{"method": "deepseek_mtp"}``) on the tiny DeepSeek V3, whose checkpoint gets a
multi-token-prediction layer here (its fixture holds only stubs of one): greedy output token-identical to the
engine without speculation (batched, preemption forced), the layer's weights read from layer
``num_hidden_layers``, and a checkpoint without MTP layers refused."""
import json
import shutil

import numpy as np
import pytest

from support.speculation import MTP_TARGET as TARGET, greedy, record_drafts, token_ids as _tokens, with_mtp_layer
from support.tiny_models import fixture_path, tiny_llm


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return with_mtp_layer(tmp_path_factory.mktemp("mtp") / "deepseek")


@pytest.mark.slow     # ~20 s; the greedy test below keeps MTP speculation token-identical
def test_an_echoing_mtp_layer_drafts_the_last_token(tmp_path):
    """As the EAGLE test's echo head: the layer's logits are the target's lm_head over the (normed) hidden state
    it is given, so every draft is the request's last token (the target's greedy token there) only if the
    target's rows, and then its own, arrive."""
    spec = tiny_llm(with_mtp_layer(tmp_path / "echo", echo=True), max_model_len=128,
                    speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 3})
    seen = record_drafts(spec)
    rng = np.random.default_rng(7)
    spec.generate([rng.integers(3, 250, size=n).tolist() for n in (5, 17, 30)], greedy(12), use_tqdm=False)
    assert len(seen) > 10 and all(d == [last] * len(d) for last, d in seen)


def test_greedy_matches_without_speculation_batched_with_preemption(target):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 250, size=int(n)).tolist() for n in rng.integers(3, 40, size=8)]
    lengths = [6 + 2 * (i % 5) for i in range(len(prompts))]
    # two token buckets (16 and the largest) instead of five: fewer forwards to compile, the same steps otherwise
    ref = _tokens(tiny_llm(target, max_model_len=128, token_buckets=[16]).generate(
        prompts, [greedy(m) for m in lengths], use_tqdm=False))
    spec = tiny_llm(target, speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2},
                    max_model_len=128, num_gpu_blocks_override=40, token_buckets=[16])
    assert _tokens(spec.generate(prompts, [greedy(m) for m in lengths], use_tqdm=False)) == ref
    core = spec.engine.core
    assert core.scheduler.num_preemptions > 0
    assert core.stats()["spec_decode_num_drafts"] > 0
    head = core.speculator.draft.model
    assert head.config.extra_dict["mtp_layer"] == 3 and head.family.decoder_spec(head.config).moe.layers == (True,)


def test_a_checkpoint_without_mtp_layers_is_refused(tmp_path):
    folder = tmp_path / "no-mtp"
    shutil.copytree(fixture_path(TARGET), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(Exception, match="no multi-token-prediction layers"):
        tiny_llm(str(folder), speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1})
