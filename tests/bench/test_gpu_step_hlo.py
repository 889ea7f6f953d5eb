"""benchmarks/gpu_step_hlo.py: the decode step compiled for an H200 on this host, and its thunks counted inside
and outside XLA's command buffers."""
import importlib.util
import json

import pytest

from jaxserve.benchmarks import gpu_step_hlo

# XLA's dumps, cut down: a command buffer around a copy and a kernel, then a Pallas call and a while loop outside
SEQUENCE = """000: kCommandBuffer [source | sink]
    001: kCopy         [source       | next=002 (1)] kCopy
    002: kCustomKernel [prev=001 (1) | sink        ] loop_add_fusion grid: [1, 1, 1]
003: kCustomKernel [source | sink] ragged_paged_decode grid: [4, 8, 1]
004: kWhile [source | sink]
    005: kKernel [source | sink] body_fusion
"""
METADATA = """thunk_metadata {
  thunk_info {
    profile_annotation: "command_buffer_1"
  }
  thunk_kind: "kCommandBuffer"
}
thunk_metadata {
  thunk_info {
    profile_annotation: "pallas_call.8"
    thunk_id: 3
  }
  thunk_kind: "kCustomKernel"
}
thunk_metadata {
  thunk_info {
    profile_annotation: "while.2"
    thunk_id: 4
  }
  thunk_kind: "kWhile"
}
"""
HLO = """ENTRY %main.2 (x: s32[4]) -> s32[4] {
  %pallas_call.8 = (bf16[128,128]{1,0}) custom-call(%x), custom_call_target="__gpu$xla.gpu.triton", api_version=4
  ROOT %while.2 = (s32[4]{0}) while(%t), condition=%cond, body=%body
}
"""


def test_thunk_counts_split_the_sequence_at_the_command_buffers():
    counts = gpu_step_hlo.thunk_counts(SEQUENCE, METADATA, HLO)
    assert counts["command_buffers"] == 1
    assert counts["commands"] == 2 and counts["commands_by_kind"] == {"kCopy": 1, "kCustomKernel": 1}
    assert counts["outside_by_kind"] == {"kCustomKernel custom-call __gpu$xla.gpu.triton": 1, "kWhile while": 1}
    assert counts["outside"] == 2 and counts["nested_outside"] == 1


def cuda_plugin() -> bool:
    """Whether the CUDA PJRT plugin is installed (without it, ``jax_plugins`` itself may be missing)."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.slow      # ~11 s: one decoder layer compiled for the GPU
@pytest.mark.skipif(not cuda_plugin(),
                    reason="needs the CUDA PJRT plugin (pip install -e .[gpu-aot])")
def test_a_one_layer_decode_step_compiles_for_an_h200_into_one_command_buffer(capsys):
    assert gpu_step_hlo.main(["--model", "llama-3.1-8b", "--layers", "1", "--moving"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["gpu"] == "NVIDIA H200" and row["variant"] == [4, True, 512]
    assert row["command_buffers"] == 1 and row["outside"] == 0
    # a layer's kernels (norms, QKV, the Pallas attention, o, MLP) and the head's are all in the graph
    assert row["commands"] >= 15
    # on each call XLA updates only the commands using the step's new buffers: the packed inputs' one copy, the
    # previous tokens' gather and the logits' zero fill and final add (not the layer's kernels: step_functions)
    assert row["moving_unmapped"] == 0 and row["moving_commands"] <= 4, row["moving_by_allocation"]


def test_the_step_is_traced_with_the_gpus_moe_path(monkeypatch):
    """The MoE layers choose their grouped GEMM by the backend ("auto": rows_fused on a GPU), which on this host reads
    cpu: the tool must ask for the GPU's path (``ragged_dot`` there would be a dense product the GPU never runs)."""
    from jaxserve.models.layers import moe

    monkeypatch.delenv("JAXSERVE_MOE_GROUPED_GEMM", raising=False)
    seen = []

    def compile_step(*args):
        seen.append(moe._grouped_gemm())
        raise SystemExit(0)

    monkeypatch.setattr(gpu_step_hlo, "compile_step", compile_step)
    with pytest.raises(SystemExit):
        gpu_step_hlo.main(["--model", "qwen3-30b-a3b", "--layers", "1"])
    assert seen == [("pallas", True, True)]


@pytest.mark.slow      # ~20 s: three steps of two DeepSeek layers compiled for the GPU
@pytest.mark.skipif(not cuda_plugin(), reason="needs the CUDA PJRT plugin (pip install -e .[gpu-aot])")
def test_deepseek_float32_steps_fit_an_h100s_shared_memory(tmp_path):
    """Every Pallas kernel of DeepSeek-V2-Lite's float32 steps (a step with prefill chunks: the MLA kernel's
    tiles; decodes; the fused MoE rows kernels) compiles for an H100: Triton's shared-memory check runs in
    XLA's compile here, where the GPU tests first met a float32 rows launch asking for 272 KB."""
    from jaxserve.benchmarks import step_memory
    step_memory.use_gpu_moe_path()
    for key, long_context in ((("forward", 16, False), False), (None, False), (None, True)):
        gpu_step_hlo.compile_step("deepseek-v2-lite", 4, "h100", 2, long_context, str(tmp_path), "float32", key)
