"""Benchmarks: roofline numbers (parameter counts, weight and KV bytes, MoE and sliding-window reads, FLOPs,
bounds), hardware files, and the kernel bench's sections on CPU."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

from jaxserve.benchmarks import roofline
from jaxserve.config import ModelConfig

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


@pytest.mark.slow     # ~30 s of interpret-mode kernels the kernel tests already run
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
