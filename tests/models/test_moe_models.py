"""The mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) against HF transformers float32.

Tiny random checkpoints of tests/make_moe_fixtures.py (per-expert HF tensors, stacked at load): the prompt's
logits within 1e-4 through the paged forward, prefill in two chunks, HF's 32-token greedy continuation
decoded twice in one batch, and through the engine with prefix caching, chunked prefill and preemption.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.models.loader import load_model
from support.tiny_models import (FIXTURES, check_chunked_prefill_matches_hf, check_greedy_matches_hf, check_logits_match_hf,
                         check_orbax_round_trip, engine_with_preemption, golden, hf_logits, load_tiny)

MOE = ["tiny-mixtral", "tiny-qwen2moe", "tiny-qwen3moe"]


@pytest.fixture(scope="module", params=MOE)
def tiny(request):
    return load_tiny(request.param)


def test_moe_logits_match_hf(tiny):
    check_logits_match_hf(*tiny)


def test_moe_chunked_prefill_matches_hf(tiny):
    check_chunked_prefill_matches_hf(*tiny)


def test_moe_greedy_matches_hf(tiny):
    check_greedy_matches_hf(*tiny)


def test_moe_stacks_experts_at_load(tiny):
    """Per-expert HF tensors become one ``[E, hidden, 2, intermediate]`` gate/up and one ``[E, i, hidden]``
    down per MoE layer (Qwen2-MoE's layer 1 is a dense MLP: mlp_only_layers)."""
    name, model, _, _ = tiny
    extra = model.config.extra_dict
    layer0 = model.params["layers"][0]
    e, i, h = extra["num_experts"], extra["moe_intermediate_size"], model.config.hidden_size
    assert layer0["experts_gate_up"].shape == (e, h, 2, i) and layer0["experts_down"].shape == (e, i, h)
    assert layer0["router"].shape == (h, e)
    if name == "tiny-qwen2moe":
        assert "gate_up" in model.params["layers"][1] and "experts_down" not in model.params["layers"][1]
        assert layer0["shared_gate"].shape == (h, 1)


# Mixtral in the default run, the Qwen families (whose paged greedy decoding the tests above check) with the slow ones
@pytest.mark.parametrize("name", [n if n == "tiny-mixtral" else pytest.param(n, marks=pytest.mark.slow) for n in MOE])
def test_moe_engine_greedy_matches_hf(name):
    """Through the engine: the prompt three times among others, prefix caching, 8-token chunks, and a block
    pool small enough that the scheduler preempts."""
    llm, golden, outs = engine_with_preemption(name)
    assert llm.engine.core.scheduler.get_stats()["num_preemptions"] > 0
    for i in (0, 2, 4):
        assert outs[i].outputs[0].token_ids == golden["greedy_ids"], f"{name}: copy {i} differs from HF"


@pytest.mark.parametrize("name,architecture,billions,experts,top_k,renormalize,shared", [
    ("mixtral-8x7b", "MixtralForCausalLM", 46.70, 8, 2, True, None),
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 30.53, 128, 8, True, None),
    ("qwen2-moe-a2.7b", "Qwen2MoeForCausalLM", 14.32, 60, 4, False, 5632),
])
def test_moe_dummy_configs(name, architecture, billions, experts, top_k, renormalize, shared):
    """The public configs' parameter counts and routing; expert parallelism shards the expert axis and needs
    the experts to divide the devices."""
    import jax
    from jax.sharding import PartitionSpec as P

    from jaxserve.models import registry
    from jaxserve.models.configs import model_config_from_hf, read_json
    from jaxserve.models.layers.moe import with_expert_parallel
    from jaxserve.models.packaged import DUMMY_CONFIG_DIR
    from jaxserve.parallel import check_tp_compatible

    cfg = model_config_from_hf(read_json(str(DUMMY_CONFIG_DIR / f"{name}.json")))
    arch, family = registry.resolve_architecture(cfg.architecture)
    family.check_config(cfg)
    shapes = jax.tree.leaves(family.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    assert arch == architecture
    assert sum(int(np.prod(s)) for s in shapes) / 1e9 == pytest.approx(billions, abs=0.01)
    spec = family.decoder_spec(cfg).moe
    assert (spec.num_experts, spec.top_k, spec.renormalize, spec.shared_intermediate_size) == (
        experts, top_k, renormalize, shared)
    assert all(spec.layers) and len(family.weight_plan(cfg)) > 0
    ep = with_expert_parallel(cfg, True)
    assert family.param_partition_specs(ep)["layers"][0]["experts_down"] == P("tp", None, None)
    assert family.param_partition_specs(cfg)["layers"][0]["experts_down"] == P(None, "tp", None)
    check_tp_compatible(ep, 4)
    if experts % 8:
        with pytest.raises(ValueError, match=f"{experts} experts are not divisible by 8"):
            check_tp_compatible(ep, 8)


def test_moe_orbax_round_trip(tmp_path):
    """``convert`` keeps the MoE config (expert count, shared expert, dense layers) and the stacked experts."""
    check_orbax_round_trip("tiny-qwen2moe", str(tmp_path / "ckpt"))


@pytest.mark.parametrize("impl", ["rows", "rows_fused"])
@pytest.mark.parametrize("name", MOE)
def test_moe_rows_path_matches_hf(name, impl, monkeypatch):
    """The GPU default's sort-free decode path (``rows``, the Pallas kernel interpreted here; ``rows_fused``, its
    one-launch form): a 16-token prefill step takes it, then HF's greedy continuation decoded twice in one
    batch."""
    monkeypatch.setenv("JAXSERVE_MOE_GROUPED_GEMM", impl)
    monkeypatch.setenv("JAXSERVE_MOE_SHARED_IN_ROWS", "1")      # rows_fused: Qwen2-MoE's shared expert rides along
    model = load_model(os.path.join(FIXTURES, name), dtype="float32")
    model.family.clear_caches()          # specs are cached per config: forget the other runs'
    try:
        _rows_path_matches_hf(name, model)
    finally:
        model.family.clear_caches()


def _rows_path_matches_hf(name, model):
    assert model.family.decoder_spec(model.config).moe.rows_path_max_tokens == 16
    check_logits_match_hf(name, model, golden(name), hf_logits(name))
    check_greedy_matches_hf(name, model, golden(name))


@pytest.mark.parametrize("name,scheduler_steps", [("tiny-mixtral", 1), ("tiny-qwen3moe", 1), ("tiny-mixtral", 4)])
def test_engine_expert_load_matches_hf_routing(name, scheduler_steps):
    """The engine's expert-load statistics after generating HF's greedy continuation (8-token prefill
    chunks; multi-step decoding too) equal HF's own routing of that sequence, per layer and expert
    (tests/make_moe_fixtures.py writes expert_load.json from HF's router logits)."""
    gold = golden(name)
    with open(os.path.join(FIXTURES, name, "expert_load.json")) as f:
        hf = json.load(f)
    llm = LLM(os.path.join(FIXTURES, name), dtype="float32", max_model_len=64, block_size=4,
              max_num_batched_tokens=8, max_num_seqs=2, num_scheduler_steps=scheduler_steps,
              compilation_cache_dir="", use_tqdm_on_load=False)
    params = SamplingParams(temperature=0, max_tokens=len(gold["greedy_ids"]), ignore_eos=True)
    out = llm.generate([gold["prompt_ids"]], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == gold["greedy_ids"]
    want = np.asarray(hf["tokens_per_expert"])
    np.testing.assert_array_equal(llm.engine.core.runner.stats.expert_load.tokens, want)
    stats = llm.engine.stats()
    k = llm.engine.model_config.extra_dict["num_experts_per_tok"]
    assert stats["moe_layers"] == want.shape[0] and stats["moe_expert_tokens_total"] == want.sum(axis=0).tolist()
    assert stats["moe_mean_expert_tokens_total"] == pytest.approx(want.shape[0] * hf["num_tokens"] * k / want.shape[1])
    assert 0 < stats["moe_expert_balancedness"] <= 1
    assert stats["moe_max_expert_tokens_total"] >= stats["moe_mean_expert_tokens_total"]


def test_roofline_counts_active_experts():
    """A batch-1 step reads attention and its top-k experts (Mixtral-8x7B: ~25.5 GB of 93, the issue's
    ~25.8 GB estimate); a large batch reaches every expert; FLOPs per token count k of E experts."""
    from jaxserve.benchmarks import roofline
    from jaxserve.benchmarks.models import named_model_hf_config
    from jaxserve.models.configs import model_config_from_hf

    c = roofline.model_cost(model_config_from_hf(named_model_hf_config("mixtral-8x7b")))
    assert (c.num_experts, c.experts_per_token) == (8, 2)
    assert c.step_weight_bytes(1) / 1e9 == pytest.approx(25.50, abs=0.01)
    assert c.weight_bytes == c.step_weight_bytes(1)                  # the batch-1 read
    assert c.step_weight_bytes(4096) - c.step_weight_bytes(1) == pytest.approx(2 * c.expert_params * 6 / 8)
    assert c.body_matmul_params == pytest.approx(c.params - 2 * 32000 * 4096 - c.expert_params * 6 / 8,
                                                 rel=1e-6)
    assert c.decode_bytes(100.0, batch=1) == pytest.approx(c.step_weight_bytes(1) + c.kv_read_bytes(100.0))


def test_metrics_export_expert_load():
    """/metrics: tokens per expert (summed over layers) as a counter labelled by expert, and balancedness."""
    from jaxserve.runner.stats import ExpertLoad
    from server.metrics import ServerMetrics

    load = ExpertLoad(np.zeros((2, 4), np.int64))
    load.add(np.array([[3, 1, 0, 0], [1, 1, 1, 1]]))

    class Engine:
        def stats(self):
            return {"num_running": 0, **load.snapshot()}

    text = ServerMetrics(Engine(), "m").render().decode()
    assert 'jaxserve:moe_expert_tokens_total{expert="0",model_name="m"} 4.0' in text
    assert 'jaxserve:moe_expert_tokens_total{expert="3",model_name="m"} 1.0' in text
    assert 'jaxserve:moe_expert_balancedness{model_name="m"} 0.5' in text   # (1 + 1) / (3 + 1)


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_moe_bench_configs_share_one_engine(model):
    """The H200 MoE configs validate, name an MoE model, and a model's latency and throughput configs have
    the same engine section (the h200-moe suite loads and compiles each model once)."""
    from jaxserve.benchmarks.config import engine_kwargs, load_config
    from jaxserve.benchmarks.models import resolve_model

    latency, offline = (load_config(f"h200-{model}-{kind}") for kind in ("latency-bs1", "throughput"))
    assert (latency["mode"], offline["mode"]) == ("latency", "throughput")
    assert engine_kwargs(latency) == engine_kwargs(offline)
    assert "num_experts" in resolve_model(latency)[0].extra_dict
