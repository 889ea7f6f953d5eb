"""Benchmarks: roofline numbers, hardware files, config loading / --set, metrics math, workloads, the load
generator (against a scripted SSE server and the real server), and the cpu-smoke configs end to end."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

from jaxserve.benchmarks import config as bcfg
from jaxserve.benchmarks import metrics, roofline, workloads
from jaxserve.benchmarks.metrics import RequestTiming
from jaxserve.config import ModelConfig
from support.server_fakes import free_port

# Public config.json values.
LLAMA_31_8B = ModelConfig("LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                          num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)
QWEN25_7B = ModelConfig("Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                        num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, attention_bias=True)
SMOLLM2_135M = ModelConfig("LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
H200 = roofline.load_hardware("h200")[0]


# ----------------------------------------------------------------------------------------------- roofline
def test_param_counts_match_the_published_sizes():
    assert roofline.model_cost(LLAMA_31_8B).params == 8_030_261_248
    assert roofline.model_cost(QWEN25_7B).params == 7_615_616_512          # q/k/v biases included
    assert roofline.model_cost(SMOLLM2_135M).params == 134_515_008          # tied: one vocab matrix


def test_llama8b_bf16_weight_and_kv_bytes():
    c = roofline.model_cost(LLAMA_31_8B, "bfloat16")
    # every weight but the untied embedding table, of which a step gathers only its rows
    embed = LLAMA_31_8B.vocab_size * LLAMA_31_8B.hidden_size
    assert c.weight_bytes == 2 * (c.params - embed)
    assert c.weight_bytes / 1e9 == pytest.approx(15.01, abs=0.005)
    assert c.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2                     # 128 KiB per token
    assert roofline.model_cost(LLAMA_31_8B, "bfloat16", "fp8").kv_bytes_per_token == 2 * 32 * 8 * 128
    assert roofline.model_cost(LLAMA_31_8B, "float32").weight_bytes == 2 * c.weight_bytes
    # tied: the embedding table is the LM head, read whole
    s = roofline.model_cost(SMOLLM2_135M, "bfloat16")
    assert s.weight_bytes == 2 * s.params


def test_bs1_decode_bound_is_the_weight_stream_at_the_read_ceiling():
    c = roofline.model_cost(LLAMA_31_8B, "bfloat16")
    steps = 256
    at_4_3 = dataclasses.replace(H200, read_bandwidth=4.3e12)
    t = roofline.decode_steps_bound(c, at_4_3, batch=1, input_len=128, num_steps=steps)
    assert steps / t == pytest.approx(286, abs=1.0)                       # 15.01 GB + KV per step at 4.3 TB/s
    # the bound scales with the read ceiling, not the copy one
    t_h200 = roofline.decode_steps_bound(c, H200, batch=1, input_len=128, num_steps=steps)
    assert t / t_h200 == pytest.approx(H200.read_bandwidth / 4.3e12)
    assert H200.copy_bandwidth == 3.35e12 and H200.read_bandwidth == 4.60e12
    # memory-bound: the same step at batch 1 is far under the compute limit
    assert c.decode_flops(128) / H200.flops("bfloat16") < c.decode_bytes(128) / H200.bandwidth / 50


def _dummy_config(name: str) -> ModelConfig:
    from jaxserve.models.configs import model_config_from_hf
    return model_config_from_hf(json.loads((ROOT / "configs" / "models" / f"{name}.json").read_text()))


@pytest.mark.parametrize("name, params, tied", [
    ("qwen3-8b", 8_190_735_360, False),          # q/k-norms: 2 * 128 per layer
    ("gemma-2-9b", 9_241_705_984, True),         # four norms per layer, head_dim 256 (q is wider than hidden)
    ("gemma-3-12b", 11_766_034_176, True),       # the text model of the published 12.2B
    ("phi-4", 14_659_507_200, False),
    ("command-r-35b", 34_980_831_232, True),     # one LayerNorm per layer
])
def test_family_param_counts_match_the_published_sizes(name, params, tied):
    cfg = _dummy_config(name)
    c = roofline.model_cost(cfg)
    assert c.params == params
    embed = cfg.vocab_size * cfg.hidden_size
    assert c.weight_bytes == 2 * (params if tied else params - embed)
    assert c.lm_head_params == embed and c.body_matmul_params == params - embed * (1 if tied else 2)
    assert c.kv_bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2


@pytest.mark.parametrize("name, params, active, experts, top_k", [
    ("qwen3-30b-a3b", 30_532_122_624, 3.35e9, 128, 8),      # model card: 30.5 B, 3.3 B activated
    ("mixtral-8x7b", 46_702_792_704, 12.88e9, 8, 2),        # 46.7 B, 12.9 B active
    ("qwen2-moe-a2.7b", 14_315_784_192, 2.69e9, 60, 4),     # 14.3 B, 2.7 B activated (the shared expert dense)
])
def test_moe_steps_read_only_the_experts_their_tokens_touch(name, params, active, experts, top_k):
    cfg = _dummy_config(name)
    c = roofline.model_cost(cfg)
    embed = cfg.vocab_size * cfg.hidden_size
    assert c.params == params and c.active_params == pytest.approx(active, rel=2e-3)
    routed = c.expert_params * (1 - top_k / experts)              # the experts one token skips
    assert c.body_matmul_params == params - 2 * embed - routed
    assert c.weight_bytes == 2 * (params - embed - routed)        # batch 1: exactly top_k experts per layer
    assert c.step_weight_bytes(1) == c.weight_bytes
    for b in (4, 16, 64):                                         # b tokens: E·(1 − (1 − k/E)^b) experts
        touched = 1 - (1 - top_k / experts) ** b
        assert c.step_weight_bytes(b) == pytest.approx(2 * (params - embed - c.expert_params * (1 - touched)))
    assert c.step_weight_bytes(100_000) == pytest.approx(2 * (params - embed))     # every expert
    assert c.decode_bytes(128, batch=16) == pytest.approx(c.step_weight_bytes(16) + 16 * c.kv_read_bytes(128))
    assert c.prefill_bytes(1024) == pytest.approx(2 * (params - embed) + 1024 * c.kv_bytes_per_token)
    # FLOPs count the active experts only, at every batch
    assert c.decode_flops(0, batch=16) == 16 * 2 * (c.active_params - embed)
    t = roofline.decode_steps_bound(c, H200, batch=4, input_len=128, num_steps=1)
    assert t == pytest.approx(max(c.decode_bytes(129, 4) / H200.bandwidth,
                                  c.decode_flops(129, 4) / H200.flops("bfloat16")))


def test_qwen3_30b_a3b_batch1_bound_is_its_active_weights():
    c = roofline.model_cost(_dummy_config("qwen3-30b-a3b"))
    assert c.weight_bytes / 1e9 == pytest.approx(6.08, abs=0.01)        # of 60.4 GB stored
    steps = 256
    # ~1.33 ms a step
    assert steps / roofline.decode_steps_bound(c, H200, 1, 128, steps) == pytest.approx(753, rel=0.01)


def test_sliding_window_layers_read_at_most_their_window():
    g2, g3 = roofline.model_cost(_dummy_config("gemma-2-9b")), roofline.model_cost(_dummy_config("gemma-3-12b"))
    assert g2.layer_windows == (4096, None) * 21
    assert g3.layer_windows == ((1024,) * 5 + (None,)) * 8
    per_layer = g2.kv_bytes_per_token / 42
    # below the window every layer reads the whole context; past it half the layers stop at 4096
    assert g2.kv_read_bytes(4000) == pytest.approx(4000 * g2.kv_bytes_per_token)
    assert g2.kv_read_bytes(8192) == pytest.approx(per_layer * (21 * 4096 + 21 * 8192))
    assert g3.kv_read_bytes(8192) == pytest.approx(g3.kv_bytes_per_token / 48 * (40 * 1024 + 8 * 8192))
    # per sequence: an array of contexts sums each one's reads
    assert g2.kv_read_bytes(np.array([100, 8192])) == pytest.approx(g2.kv_read_bytes(100) + g2.kv_read_bytes(8192))
    assert g2.decode_bytes(8192, batch=3) == pytest.approx(g2.weight_bytes + 3 * g2.kv_read_bytes(8192))
    # attention FLOPs follow the same keys; prefill pairs: w(w+1)/2 + (n - w) w in a windowed layer
    assert g2.decode_flops(8192) - g2.decode_flops(0) == pytest.approx(g2.attn_flops_per_pair * 6144)
    n, w = 8192, 4096
    assert g2.prefill_pairs(n) == pytest.approx((n * (n + 1) / 2 + w * (w + 1) / 2 + (n - w) * w) / 2)
    assert g2.prefill_pairs(1000) == pytest.approx(1000 * 1001 / 2)
    # the decode bound sums the steps' window-aware bytes: long prompts are cheaper than all-global layers
    steps = 128
    t = roofline.decode_steps_bound(g2, H200, batch=64, input_len=8192, num_steps=steps)
    ctx = 8192 + 1 + np.arange(steps)
    want = sum(max(g2.decode_flops(x, 64) / H200.flops("bfloat16"), g2.decode_bytes(x, 64) / H200.bandwidth)
               for x in ctx)
    assert t == pytest.approx(want)
    all_global = dataclasses.replace(g2, layer_windows=())
    assert t < 0.8 * roofline.decode_steps_bound(all_global, H200, 64, 8192, steps)


def test_throughput_roofline_waves_fit_the_kv_cache():
    from types import SimpleNamespace
    from jaxserve.benchmarks.offline import _kv_capacity_seqs
    llm = SimpleNamespace(engine=SimpleNamespace(kv_manager=SimpleNamespace(block_size=16, num_usable_blocks=1000)))
    assert _kv_capacity_seqs(llm, 1152) == 13            # 72 blocks a sequence
    assert _kv_capacity_seqs(llm, 1153) == 13 and _kv_capacity_seqs(llm, 16) == 1000
    assert _kv_capacity_seqs(SimpleNamespace(), 1152) is None


def test_roofline_refuses_what_it_cannot_count():
    with pytest.raises(ValueError, match="no roofline for BertModel"):
        roofline.model_cost(dataclasses.replace(LLAMA_31_8B, architecture="BertModel"))
    with pytest.raises(ValueError, match="no roofline for NoSuchForCausalLM"):
        roofline.model_cost(dataclasses.replace(LLAMA_31_8B, architecture="NoSuchForCausalLM"))


def test_flops_per_token():
    c = roofline.model_cost(LLAMA_31_8B)
    embed = LLAMA_31_8B.vocab_size * LLAMA_31_8B.hidden_size
    # decode at empty context: 2 FLOPs per multiplied weight (all but the embedding gather)
    assert c.decode_flops(0) == 2 * (c.params - embed)
    # each cached token adds QK^T + PV: 4 * layers * heads * head_dim
    assert c.decode_flops(1000) - c.decode_flops(0) == 4 * 32 * 32 * 128 * 1000
    # prefill: the LM head runs once per sequence, attention over n(n+1)/2 causal pairs
    n = 512
    lm_head = embed
    assert c.prefill_flops(n) == pytest.approx(2 * (c.params - 2 * embed) * n + 2 * lm_head
                                               + 4 * 32 * 32 * 128 * n * (n + 1) / 2)
    # tied embeddings: the LM head is the embedding matrix, still multiplied once per sampled token
    s = roofline.model_cost(SMOLLM2_135M)
    assert s.decode_flops(0) == 2 * s.params


def test_prefill_is_compute_bound_and_generation_bound_adds_up():
    c = roofline.model_cost(LLAMA_31_8B)
    assert c.prefill_flops(1024, 64) / H200.flops("bfloat16") > c.prefill_bytes(1024, 64) / H200.bandwidth
    b = roofline.generation_bound(c, H200, num_prompts=1000, input_len=1024, output_len=128, max_batch=256)
    waves = [256, 256, 256, 232]
    pre = sum(roofline.prefill_bound(c, H200, w, 1024) for w in waves)
    dec = sum(roofline.decode_steps_bound(c, H200, w, 1024, 127) for w in waves)
    assert b["seconds"] == pytest.approx(pre + dec)
    assert b["output_tok_s"] == pytest.approx(1000 * 128 / (pre + dec))
    # a bigger batch amortises the weight reads: a higher limit
    small = roofline.generation_bound(c, H200, 1000, 1024, 128, max_batch=16)
    assert small["output_tok_s"] < b["output_tok_s"]
    # tensor parallelism over 2 chips doubles both limits
    h2 = H200.scaled(2)
    assert roofline.decode_steps_bound(c, h2, 1, 128, 10) == pytest.approx(
        roofline.decode_steps_bound(c, H200, 1, 128, 10) / 2)


def test_hardware_files():
    h200, raw = roofline.load_hardware("h200")
    assert h200.copy_bandwidth == 3.35e12 and h200.peak_flops["bfloat16"] == 789e12
    assert h200.memory_bytes == 141e9 and "--only bandwidth" in h200.bandwidth_source and "measured" in h200.copy_source
    assert h200.bandwidth == h200.read_bandwidth and h200.scaled(2).copy == 2 * h200.copy_bandwidth
    h100, _ = roofline.load_hardware("h100")
    assert "not measured" in h100.bandwidth_source and "not measured" in h100.flops_source["bfloat16"]
    cpu, raw = roofline.load_hardware("cpu")
    assert raw["measure_at_run_time"] and "not measured" in cpu.bandwidth_source
    assert roofline.detect_hardware_name("NVIDIA H200", "gpu") == "h200"
    assert roofline.detect_hardware_name("NVIDIA H100 80GB HBM3", "gpu") == "h100"
    assert roofline.detect_hardware_name("cpu", "cpu") == "cpu"
    with pytest.raises(ValueError, match="no configs/hardware file matches"):
        roofline.detect_hardware_name("Some TPU v9", "tpu")
    assert roofline.hardware_mismatch("h200", "NVIDIA H200", "gpu") is None
    assert roofline.hardware_mismatch("auto", "anything", "gpu") is None
    assert "WARNING" in roofline.hardware_mismatch("h200", "NVIDIA H100 80GB HBM3", "gpu")
    assert "WARNING" in roofline.hardware_mismatch("h200", "cpu", "cpu")
    with pytest.raises(ValueError, match="known: .*h200"):
        roofline.load_hardware("a100")


def test_percent_of_a_limit_never_exceeds_100():
    """A figure above its limit is a wrong limit: shown as 100 %, warned about, kept for the report's notes."""
    roofline.take_exceeded()
    assert roofline.percent(3.0, 4.0) == pytest.approx(75.0)
    assert np.isnan(roofline.percent(1.0, 0.0))
    with pytest.warns(roofline.RooflineExceeded, match="decode bandwidth is 104.7 %"):
        assert roofline.percent(4.5, 4.3, "decode bandwidth") == 100.0
    notes = roofline.take_exceeded()
    assert len(notes) == 1 and "configs/hardware" in notes[0] and roofline.take_exceeded() == []


def test_kernel_bench_runs_its_sections_on_cpu(capsys):
    """The kernel microbenchmark at its smoke sizes on CPU (Pallas interpreted): the bandwidth lines for the
    hardware files, paged decode against the stock kernel, prefill, the quantized matmuls, the MoE GEMM's
    implementations (the rows kernel up to 16 tokens only), the MLA decode, and one summary; an unknown section stops it."""
    from jaxserve.benchmarks import kernel_bench
    assert kernel_bench.main(["--smoke", "--m", "1", "--tokens", "4,17"]) == 0
    out = capsys.readouterr().out
    assert float(out.split("read_bandwidth: ")[1].split()[0]) > 0
    assert float(out.split("copy_bandwidth: ")[1].split()[0]) > 0
    assert "| 2 | 64 |" in out and "| ours (pallas) |" in out and "| tiny 256x256 | 1 |" in out
    moe = {tuple(c.strip() for c in line.split("|")[2:4]) for line in out.splitlines() if line.startswith("| tiny |")}
    assert {("4", "rows"), ("4", "pallas"), ("17", "pallas"), ("17", "ragged_dot")} <= moe
    assert ("17", "rows") not in moe
    summary = out.split("## summary")[1]
    assert "| HBM read / copy |" in summary and "FAILED" not in summary
    assert "| MLA decode B=2 ctx=40 H=4 float8_e4m3fn | default" in summary
    with pytest.raises(SystemExit):
        kernel_bench.main(["--only", "attention,nope"])


# ------------------------------------------------------------------------------------------------- config
def test_config_load_and_set_overrides():
    cfg = bcfg.load_config("cpu-smoke", ["workload.num_prompts=3", "engine.max_num_seqs=2",
                                         "engine.enable_prefix_caching=false", "workload.output_len={dist: uniform, min: 2, max: 4}",
                                         "seed=7", "model.name=llama-3.2-1b", "model.load_format=dummy"])
    assert cfg["name"] == "cpu-smoke" and cfg["mode"] == "throughput" and cfg["seed"] == 7
    assert cfg["workload"]["num_prompts"] == 3
    assert cfg["workload"]["output_len"] == {"dist": "uniform", "min": 2, "max": 4}
    assert cfg["workload"]["ignore_eos"] is True                          # default filled
    kw = bcfg.engine_kwargs(cfg)
    assert kw["model"] == "llama-3.2-1b" and kw["load_format"] == "dummy" and kw["max_num_seqs"] == 2
    assert kw["seed"] == 7
    flags = bcfg.server_flags(cfg)
    assert flags[0] == "llama-3.2-1b"
    assert "--no-enable-prefix-caching" in flags
    assert flags[flags.index("--max-num-seqs") + 1] == "2"


def test_parse_set_values():
    assert bcfg.parse_set("a.b=3") == (["a", "b"], 3)
    assert bcfg.parse_set("x=1.5e3") == (["x"], 1500.0)
    assert bcfg.parse_set("x=[1, 2]") == (["x"], [1, 2])
    assert bcfg.parse_set("x=null") == (["x"], None)
    assert bcfg.parse_set("x=inf")[1] == "inf"
    assert bcfg.parse_set("serve.base_url=http://h:1/v1") == (["serve", "base_url"], "http://h:1/v1")
    with pytest.raises(bcfg.ConfigError, match="expected key=value"):
        bcfg.parse_set("workload.num_prompts")


def test_config_errors_name_the_problem():
    with pytest.raises(bcfg.ConfigError, match="unknown config key.*wrkload"):
        bcfg.load_config("cpu-smoke", ["wrkload.num_prompts=3"])
    with pytest.raises(bcfg.ConfigError, match="not used by mode 'throughput'.*known"):
        bcfg.load_config("cpu-smoke", ["workload.batch_size=3"])
    with pytest.raises(bcfg.ConfigError, match="mode is 'fast'"):
        bcfg.load_config("cpu-smoke", ["mode=fast"])
    with pytest.raises(bcfg.ConfigError, match="not found .*cpu-smoke"):
        bcfg.load_config("no-such-config")
    with pytest.raises(bcfg.ConfigError, match="is a int, not a section"):
        bcfg.load_config("cpu-smoke", ["seed.x=1"])


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "bench").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_configs_validate(path):
    cfg = bcfg.load_config(str(path))
    assert cfg["name"] == path.stem
    if cfg["mode"] in ("throughput", "latency", "serve"):
        rng = np.random.default_rng(0)
        wl = cfg["workload"]
        n = wl.get("num_prompts") or wl.get("batch_size")
        n = max(n) if isinstance(n, list) else n
        lens = workloads.sample_lengths(wl["input_len"], n, rng, "input_len") + \
            workloads.sample_lengths(wl["output_len"], n, rng, "output_len")
        max_len = cfg["engine"].get("max_model_len")
        assert max_len is None or lens.max() + (wl.get("prefix_len", 0) if wl.get("dataset") == "prefix" else 0) <= max_len


# ------------------------------------------------------------------------------------------------ metrics
def test_percentiles_and_summary():
    v = list(range(1, 101))
    s = metrics.summarize(v)
    assert s["p50"] == 50.5 and s["p99"] == pytest.approx(99.01)      # linear interpolation (numpy's default)
    assert s["mean"] == 50.5 and s["min"] == 1 and s["max"] == 100 and s["p10"] == pytest.approx(10.9)
    assert s["p10"] <= s["p25"] <= s["median"] <= s["p75"] <= s["p90"] <= s["p99"]
    assert np.isnan(metrics.summarize([])["mean"])


def _timing(ttft, e2e, n, ok=True, prompt=10):
    itl = [(e2e - ttft) / (n - 1)] * (n - 1) if n > 1 else []
    return RequestTiming(prompt_tokens=prompt, output_tokens=n, ttft=ttft, e2e=e2e, itl=itl, success=ok,
                         error="" if ok else "HTTP 500: boom")


def test_serving_metrics_and_goodput():
    rs = [_timing(0.1, 1.1, 11), _timing(0.2, 2.2, 11), _timing(0.5, 1.5, 11), _timing(0.1, 0.1, 1),
          _timing(0, 0, 0, ok=False)]
    assert rs[0].tpot == pytest.approx(0.1) and rs[3].tpot is None
    m = metrics.serving_metrics(rs, duration_s=4.0, slo_ms={"ttft_ms": 300, "tpot_ms": 150})
    assert m["completed"] == 4 and m["failed"] == 1 and m["errors"] == {"HTTP 500: boom": 1}
    assert m["output_tokens"] == 34 and m["prompt_tokens"] == 40
    assert m["output_throughput"] == pytest.approx(34 / 4) and m["request_throughput"] == 1.0
    assert m["total_token_throughput"] == pytest.approx(74 / 4)
    # within both SLOs: #0 (100 ms, 100 ms/token) and #3 (single token: no TPOT); #1 TPOT 200 ms; #2 TTFT 500 ms
    assert m["goodput"] == pytest.approx(2 / 4)
    assert m["ttft_ms"]["median"] == pytest.approx(150.0)
    assert m["tpot_ms"]["mean"] == pytest.approx((100 + 200 + 100) / 3)
    assert m["e2el_ms"]["p99"] == pytest.approx(np.percentile([1100, 2200, 1500, 100], 99))
    assert len([g for r in rs if r.success for g in r.itl]) == 30
    assert metrics.serving_metrics(rs, 4.0)["goodput"] is None
    with pytest.raises(ValueError, match="unknown SLO"):
        metrics.serving_metrics(rs, 4.0, {"ttfb_ms": 1})


def test_a_request_that_streamed_no_text_completes_untimed():
    """Its tokens (usage) count; its TTFT / TPOT are unknown, so it stays out of them and out of goodput."""
    untimed = RequestTiming(prompt_tokens=10, output_tokens=11, ttft=None, e2e=1.0, success=True)
    assert untimed.tpot is None
    m = metrics.serving_metrics([_timing(0.1, 1.1, 11), untimed], 2.0, slo_ms={"ttft_ms": 300})
    assert m["completed"] == 2 and m["untimed"] == 1 and m["output_tokens"] == 22
    assert m["ttft_ms"]["mean"] == pytest.approx(100.0) and m["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert m["goodput"] == pytest.approx(1 / 2)


# ---------------------------------------------------------------------------------------------- workloads
def test_lengths_and_prompts_are_seeded_and_in_range():
    rng = np.random.default_rng(0)
    assert workloads.sample_lengths(5, 3, rng, "x").tolist() == [5, 5, 5]
    u = workloads.sample_lengths({"dist": "uniform", "min": 3, "max": 6}, 2000, rng, "x")
    assert u.min() == 3 and u.max() == 6
    n = workloads.sample_lengths({"dist": "normal", "mean": 100, "std": 50, "min": 10, "max": 150}, 2000, rng, "x")
    assert n.min() >= 10 and n.max() <= 150 and abs(n.mean() - 100) < 5
    assert set(workloads.sample_lengths({"dist": "choice", "values": [7, 9]}, 50, rng, "x")) == {7, 9}
    with pytest.raises(ValueError, match="workload.input_len"):
        workloads.sample_lengths({"dist": "zipf"}, 2, rng, "input_len")
    a = workloads.random_requests(np.random.default_rng(1), 4, 16, 8, 49152)
    b = workloads.random_requests(np.random.default_rng(1), 4, 16, 8, 49152)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    lo, hi = workloads.token_id_range(49152)
    assert all(lo <= t < hi for r in a for t in r.prompt) and all(r.prompt_len == 16 for r in a)


def test_prefix_requests_share_prefixes():
    reqs = workloads.prefix_requests(np.random.default_rng(0), 20, num_prefixes=2, prefix_len=32,
                                     input_len=8, output_len=4, vocab_size=49152)
    assert all(r.prompt_len == 40 for r in reqs)
    assert len({tuple(r.prompt[:32]) for r in reqs}) == 2
    assert len({tuple(r.prompt[32:]) for r in reqs}) == 20


def test_sharegpt_requests(tmp_path):
    data = [{"conversations": [{"from": "human", "value": "one two three"},
                               {"from": "gpt", "value": " ".join(["w"] * 30)}]},
            {"conversations": [{"from": "human", "value": "only a question"}]}]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(data))
    reqs = workloads.sharegpt_requests(np.random.default_rng(0), str(p), 3)
    assert len(reqs) == 3 and reqs[0].prompt == "one two three" and reqs[0].output_len == 40
    assert workloads.sharegpt_requests(np.random.default_rng(0), str(p), 1, output_len=5)[0].output_len == 5
    with pytest.raises(ValueError, match="file not found"):
        workloads.sharegpt_requests(np.random.default_rng(0), str(tmp_path / "none.json"), 1)


def test_arrivals_poisson_and_gamma():
    rng = np.random.default_rng(0)
    d = workloads.arrival_delays(rng, 20000, request_rate=10.0)
    assert d.mean() == pytest.approx(0.1, rel=0.03) and d.std() / d.mean() == pytest.approx(1.0, rel=0.05)
    bursty = workloads.arrival_delays(rng, 20000, request_rate=10.0, burstiness=0.25)
    assert bursty.mean() == pytest.approx(0.1, rel=0.05)
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(4.0, rel=0.1)   # CV^2 = 1 / burstiness
    assert not workloads.arrival_delays(rng, 5, float("inf")).any()


# ------------------------------------------------------------------ load generator vs a scripted SSE server
class ScriptedServer:
    """A raw-ASGI OpenAI-ish server: each completion streams `max_tokens` one-token chunks `gap` s apart
    and a usage chunk; records the peak number of requests in flight. Prompts of [13] get HTTP 400."""

    def __init__(self, gap: float):
        self.gap, self.in_flight, self.peak, self.bodies = gap, 0, 0, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["path"] == "/v1/models":
            await self._send(send, 200, json.dumps({"data": [{"id": "scripted"}]}).encode())
            return
        if scope["path"] != "/v1/completions":
            await self._send(send, 404, b'{"error": {"message": "not found"}}')
            return
        req = json.loads(body)
        self.bodies.append(req)
        if req["prompt"] == [13]:
            await self._send(send, 400, b'{"error": {"message": "bad prompt"}}')
            return
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(req["max_tokens"]):
            await asyncio.sleep(self.gap)
            chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True})
        usage = {"choices": [], "usage": {"prompt_tokens": len(req["prompt"]), "completion_tokens": req["max_tokens"]}}
        self.in_flight -= 1
        await send({"type": "http.response.body", "body": f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()})

    @staticmethod
    async def _send(send, status, body):
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def scripted_server():
    import uvicorn
    app = ScriptedServer(gap=0.02)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    yield app, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)


def test_loadgen_timings_and_concurrency_cap(scripted_server):
    from jaxserve.benchmarks.loadgen import run_load
    app, url = scripted_server
    reqs = workloads.random_requests(np.random.default_rng(0), 6, 5, 4, 1000)
    app.peak = 0
    timings, duration = asyncio.run(run_load(url, reqs, max_concurrency=2, progress=False))
    assert app.peak == 2                                           # the cap is reached and never exceeded
    assert all(t.success and t.output_tokens == 4 and t.prompt_tokens == 5 for t in timings)
    assert all(len(t.itl) == 3 for t in timings)
    gaps = sorted(g for t in timings for g in t.itl)                # the server's 20 ms gaps (a late read
    assert gaps[len(gaps) // 2] >= 0.015                            # can shorten one on a loaded machine)
    assert all(t.ttft >= 0.015 and t.e2e >= t.ttft + 0.045 for t in timings)
    assert duration >= 3 * 4 * 0.02                                # 6 requests, 2 at a time, 80 ms each
    body = app.bodies[-1]
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
    m = metrics.serving_metrics(timings, duration)
    assert m["completed"] == 6 and m["output_tokens"] == 24 and m["failed"] == 0


def test_loadgen_reports_http_errors(scripted_server):
    from jaxserve.benchmarks.loadgen import run_load
    _, url = scripted_server
    reqs = [workloads.RequestSpec([13], 1, 3), workloads.RequestSpec([1, 2], 2, 2)]
    timings, _ = asyncio.run(run_load(url, reqs, progress=False))
    assert not timings[0].success and timings[0].error.startswith("HTTP 400") and "bad prompt" in timings[0].error
    assert timings[1].success and timings[1].output_tokens == 2


def test_loadgen_poisson_rate_spreads_sends(scripted_server):
    from jaxserve.benchmarks.loadgen import run_load
    _, url = scripted_server
    reqs = workloads.random_requests(np.random.default_rng(0), 5, 3, 1, 1000)
    timings, duration = asyncio.run(run_load(url, reqs, request_rate=20.0, seed=3, progress=False))
    gaps = workloads.arrival_delays(np.random.default_rng(3), 5, 20.0)
    starts = [t.start for t in timings]
    assert starts == sorted(starts)
    # sleeps never end early; a busy machine may make them late, not by half a second
    for i in range(1, 5):
        assert gaps[1:i + 1].sum() - 0.005 <= starts[i] - starts[0] <= gaps[1:i + 1].sum() + 0.5


# ------------------------------------------------------------------------------- end to end on the engine
def _run_main(args: list[str], out: Path) -> dict[str, dict]:
    from jaxserve.benchmarks.runner import main
    assert main([*args, "--out", str(out)]) == 0
    found = {}
    for d in out.iterdir():
        found[d.name] = json.loads((d / "result.json").read_text())
        assert (d / "result.md").is_file() and (d / "config.yaml").is_file()
    return found


def test_cpu_smoke_throughput_and_latency_end_to_end(tmp_path):
    res = _run_main(["--config", "cpu-smoke", "--config", "cpu-smoke-latency"], tmp_path)
    thr = next(r for r in res.values() if r["mode"] == "throughput")
    lat = next(r for r in res.values() if r["mode"] == "latency")
    j = thr["jaxserve"]
    assert j["num_requests"] == 6 and j["output_tokens"] == 6 * 8                # ignore_eos: exact lengths
    assert j["output_tok_per_s"] == pytest.approx(j["output_tokens"] / j["elapsed_s"])
    # the engine cannot beat the roofline; if it "does", the roofline or the timing is wrong
    assert 0 < j["output_tok_per_s"] < thr["roofline"]["output_tok_s"]
    env = thr["environment"]
    assert env["jax"] and env["platform"] == "cpu" and env["command"].startswith("python -m jaxserve bench")
    assert thr["config"]["workload"]["num_prompts"] == 6
    lj = lat["jaxserve"]
    assert len(lj["e2e_samples_s"]) == 3 and lj["e2e_s"]["p10"] <= lj["e2e_s"]["p50"] <= lj["e2e_s"]["p99"]
    assert 0 < lj["prefill_s"]["mean"] < lj["e2e_s"]["mean"]
    # every timed run draws fresh prompts: nothing is served from the prefix cache
    assert lj["engine_steps"]["prefix_cache_hits"] == 0 and j["engine_steps"]["prefix_cache_hits"] == 0
    assert j["engine_steps"]["prefix_cache_queries"] > 0
    assert lat["roofline"]["e2e_bound_s"] < lj["e2e_s"]["mean"]
    assert lat["model"]["params"] == 134_515_008
    from jaxserve.benchmarks import plots
    if plots.available():
        assert any(p.suffix == ".png" for p in tmp_path.rglob("*.png"))


@pytest.mark.slow
def test_cpu_smoke_serve_against_a_real_server(tmp_path):
    res = _run_main(["--config", "cpu-smoke-serve"], tmp_path)
    (r,) = res.values()
    assert r["sweep_param"] == "max_concurrency" and [p["sweep_value"] for p in r["points"]] == [1, 4]
    for p in r["points"]:
        assert p["failed"] == 0 and p["completed"] == 8 and p["output_tokens"] == 8 * 6
        assert p["ttft_ms"]["median"] > 0 and p["tpot_ms"]["median"] > 0 and p["goodput"] is not None


ORACLE_PYTHON = ROOT / ".venv-oracle" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not ORACLE_PYTHON.exists(), reason="needs the torch env .venv-oracle (tools/oracle_env.sh)")
def test_hf_baseline_subprocess_on_a_tiny_shape(tmp_path):
    import subprocess
    from jaxserve.benchmarks.models import hf_config_from_model_config
    tiny = ModelConfig("LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16)
    spec = {"hf_config": hf_config_from_model_config(tiny), "dtype": "float32", "device": "cpu",
            "prompts": [[5, 6, 7, 8]] * 3, "output_lens": [6] * 3, "methods": ["generate", "generate_batch"],
            "iters": 2, "warmup_iters": 1}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    subprocess.run([str(ORACLE_PYTHON), "-m", "benchmarks.hf_baseline", str(tmp_path / "spec.json"),
                    str(tmp_path / "out.json")], cwd=ROOT, check=True, timeout=600,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    out = json.loads((tmp_path / "out.json").read_text())["results"]
    assert out["generate"]["output_tokens"] == 18 and len(out["generate"]["e2e_samples_s"]) == 2
    assert out["generate_batch"]["output_tokens"] == 18 and out["generate_batch"]["num_requests"] == 3


# ------------------------------------------------------------------------------------- serve / kernels glue
def test_sweep_and_prompt_counts():
    from jaxserve.benchmarks.serve import prompt_counts, sweep_points
    assert sweep_points({"sweep": None}) == (None, [None])
    assert sweep_points({"sweep": {"request_rate": [1, 2]}}) == ("request_rate", [1, 2])
    with pytest.raises(ValueError, match="workload.sweep"):
        sweep_points({"sweep": {"batch": [1]}})
    assert prompt_counts({"num_prompts": 5}, [1, 2]) == [5, 5]
    assert prompt_counts({"num_prompts": [4, 8]}, [1, 2]) == [4, 8]
    with pytest.raises(ValueError, match="2 counts for 3 sweep values"):
        prompt_counts({"num_prompts": [4, 8]}, [1, 2, 3])


def test_server_flags_use_the_cli_names():
    cfg = bcfg.load_config("cpu-smoke-serve", ["engine.kv_cache_memory_bytes=1000",
                                               "serve.server_args=[--api-key, k]"])
    flags = bcfg.server_flags(cfg)
    assert flags[flags.index("--kv-cache-memory") + 1] == "1000" and flags[-2:] == ["--api-key", "k"]
    assert flags[0] == "--dtype"                         # no model: the server's default (embedded SmolLM2)


def test_metrics_scrape_parsing(scripted_server):
    from jaxserve.benchmarks import serve
    text = ('# HELP x\njaxserve:prefix_cache_queries_total{model_name="m"} 120.0\n'
            'jaxserve:prefix_cache_hits_total{model_name="m"} 90.0\njaxserve:num_preemptions_total{model_name="m"} 2.0\n'
            'jaxserve:num_requests_running{model_name="m"} 1.0\njaxserve:images_encoded_total{model_name="m"} 4.0\n'
            'jaxserve:encoder_seconds_total{model_name="m"} 0.2\n')
    got = {}
    for line in text.splitlines():
        m = serve._COUNTER.match(line)
        if m:
            got[m.group(1)] = float(m.group(2))
    assert got == {"prefix_cache_queries": 120.0, "prefix_cache_hits": 90.0, "num_preemptions": 2.0,
                   "images_encoded": 4.0, "encoder_seconds": 0.2}
    d = serve.counter_delta({"prefix_cache_queries": 20.0, "prefix_cache_hits": 10.0}, got)
    assert d["prefix_cache_hit_rate"] == pytest.approx(80 / 100) and d["num_preemptions"] == 2.0
    assert d["encoder_ms_per_image"] == pytest.approx(50.0)
    _, url = scripted_server
    assert serve.scrape_counters(url) == {}          # a server without those counters: nothing, no error


def test_set_overrides_across_configs_of_different_modes():
    thr, lat = bcfg.load_configs(["cpu-smoke", "cpu-smoke-latency"], ["workload.num_prompts=3", "workload.batch_size=5",
                                                                      "workload.output_len=2"])
    assert thr["workload"]["num_prompts"] == 3 and thr["workload"]["output_len"] == 2
    assert lat["workload"]["batch_size"] == 5 and lat["workload"]["output_len"] == 2
    with pytest.raises(bcfg.ConfigError, match="num_prompt"):
        bcfg.load_configs(["cpu-smoke", "cpu-smoke-latency"], ["workload.num_prompt=3"])


@pytest.mark.slow
@pytest.mark.skipif(not ORACLE_PYTHON.exists(), reason="needs the torch env .venv-oracle (tools/oracle_env.sh)")
def test_hf_baseline_runs_first_on_the_same_prompts(tmp_path):
    """The two-phase flow: HF (subprocess, torch env) on the first 3 prompts, then jaxserve on all 6."""
    res = _run_main(["--config", "cpu-smoke", "--set", "model.path=tests/fixtures/models/tiny-llama3",
                     "--set", "baseline.hf=true", "--set", "baseline.python=.venv-oracle/bin/python",
                     "--set", "baseline.device=cpu", "--set", "baseline.num_prompts=3"], tmp_path)
    (r,) = res.values()
    spec = bcfg.load_config("cpu-smoke")["workload"]["input_len"]
    lens = workloads.sample_lengths(spec, 6, np.random.default_rng(0), "input_len")
    hf = r["hf_baseline"]
    assert hf["method"] == "generate_batch" and hf["num_requests"] == 3 and hf["output_tokens"] == 3 * 8
    assert hf["prompt_tokens"] == lens[:3].sum()                  # the same prompts as jaxserve's first 3
    assert r["jaxserve"]["prompt_tokens"] == lens.sum()
    md = next(tmp_path.iterdir()) / "result.md"
    assert "jaxserve / HF" in md.read_text() and "on the first 3 of 6 prompts" in md.read_text()


def test_serve_mode_end_to_end_against_a_base_url(scripted_server, tmp_path):
    """The serve mode's whole path (ShareGPT dataset, request-rate sweep, SLOs, report) against --base-url."""
    app, url = scripted_server
    data = [{"conversations": [{"from": "human", "value": f"question {i}"},
                               {"from": "gpt", "value": " ".join(["word"] * (3 * i + 3))}]} for i in range(4)]
    (tmp_path / "sg.json").write_text(json.dumps(data))
    out = tmp_path / "results"
    res = _run_main(["--config", "cpu-smoke-serve", "--base-url", url, "--set", "workload.dataset=sharegpt",
                     "--set", f"workload.dataset_path={tmp_path / 'sg.json'}", "--set", "workload.num_prompts=4",
                     "--set", "workload.output_len=null",        # ShareGPT: the replies' lengths
                     "--set", "workload.sweep={request_rate: [100, inf]}", "--set", "workload.max_concurrency=null",
                     "--set", "workload.slo={ttft_ms: 10000, e2el_ms: 1}", "--set", "workload.warmup_requests=0"], out)
    (r,) = res.values()
    assert r["base_url"] == url and r["sweep_param"] == "request_rate"
    assert [p["sweep_value"] for p in r["points"]] == [100, "inf"]
    for p in r["points"]:
        assert p["completed"] == 4 and p["failed"] == 0
        assert p["output_tokens"] == sum(round(len(("word " * (3 * i + 3)).split()) * 4 / 3) for i in range(4))
        assert p["goodput"] == 0.0                        # nobody finishes within 1 ms
        assert p["ttft_ms"]["median"] >= 15               # the scripted 20 ms before each chunk
    prompts = {b["prompt"] for b in app.bodies[-8:]}
    assert prompts == {f"question {i}" for i in range(4)}
    assert "| request_rate |" in (next(out.iterdir()) / "result.md").read_text()


def test_plots_are_optional(tmp_path, monkeypatch):
    from jaxserve.benchmarks import plots
    if plots.available():
        assert plots.cdf(tmp_path / "a.png", {"x": [1.0, 2.0, 3.0]}, "s", "t") and (tmp_path / "a.png").stat().st_size
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # as if not installed: import fails
    assert not plots.available()
    assert not plots.cdf(tmp_path / "b.png", {"x": [1.0]}, "s", "t") and not (tmp_path / "b.png").exists()
    assert not plots.sweep(tmp_path / "c.png", [{"output_throughput": 1}], "p", "t")


def test_bench_without_its_configs_says_where_to_find_them(tmp_path, monkeypatch, capsys):
    """An installed jaxserve has no configs/ beside benchmarks/: `jaxserve bench` exits 2 naming
    JAXSERVE_CONFIGS; with them it reaches the runner (a bad config is its own exit 2)."""
    from jaxserve import cli
    monkeypatch.setattr(bcfg, "BENCH_CONFIG_DIR", tmp_path / "configs" / "bench")
    assert cli.main(["bench", "--config", "x.yaml"]) == 2
    assert "JAXSERVE_CONFIGS" in capsys.readouterr().err
    monkeypatch.undo()
    assert cli.main(["bench", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err.startswith("bench: ")


def test_image_requests_stay_in_a_small_vocab():
    """Random-weight vision models are served with the embedded SmolLM2 tokenizer and its chat template: the image
    workload's rendered chats must tokenize below LLaVA-7B's 32,064 ids (its default system prompt and a line-led
    word did not), and a word a token."""
    from jaxserve.models.tokenizers import embedded_tokenizer
    tok = embedded_tokenizer()
    for req in workloads.image_requests(np.random.default_rng(0), 20, 32, 24, 8):
        system, user = req.extra["messages"]
        text = user["content"][1]["text"]
        chat = [system, {"role": "user", "content": "<image>\n" + text}]
        rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = [i for piece in rendered.split("<image>") for i in tok.encode(piece, add_special_tokens=False)]
        assert max(ids) < 32064, rendered
        assert len(tok.encode(text, add_special_tokens=False)) == req.prompt_len
