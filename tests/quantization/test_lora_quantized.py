"""LoRA adapters over a quantized base (int4 GPTQ act-order, FP8 W8A8), as vLLM serves them: the adapter stays in
the activation dtype beside the quantized weight and reads the float activations. The reference is the float
model whose weights are the dequantized base plus the adapter merged in (``W + B A``), decoded without LoRA."""
from __future__ import annotations

import numpy as np
import pytest

from jaxserve.lora import LoRARequest, read_adapter
from jaxserve.lora.peft import write_random_adapter
from jaxserve.models.configs import model_config_from_hf
from jaxserve.models.loader import load_model
from support.safetensors_files import write_folder
from support.tp_greedy import PROMPTS, GreedyDecoder
from test_quant_checkpoints import HF, fp8_checkpoint, quantized_checkpoint

RANK, NEW_TOKENS = 4, 6
HF_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def merged_reference(tmp, name: str, ref: dict, adapter_folder: str):
    """(greedy tokens, logits [steps, R, vocab]) of the float model ``ref`` with the adapter merged in."""
    adapter = read_adapter(adapter_folder, model_config_from_hf(HF), RANK)
    merged = dict(ref)
    for i, layer in enumerate(adapter.layers):
        for target, (a, b) in layer.items():          # A [in, r], B [r, out] scaled; HF weights are [out, in]
            key = f"model.layers.{i}.{HF_NAMES[target]}.weight"
            merged[key] = (merged[key] + (a @ b).T).astype(np.float32)
    model = load_model(write_folder(tmp / f"{name}-merged", merged, HF | {"torch_dtype": "float32"}), dtype="float32")
    return GreedyDecoder(model.config, model.params, max_new_tokens=NEW_TOKENS).generate()


def engine_outputs(folder: str, adapter_folder: str):
    """Greedy tokens and each step's top-5 logprobs of the quantized engine with the adapter, and without it."""
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams
    llm = LLM(folder, dtype="float32", max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4,
              kv_cache_memory_bytes=1 << 21, skip_warmup=True, compilation_cache_dir="", use_tqdm_on_load=False,
              enable_lora=True, max_loras=1, max_lora_rank=RANK)
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    runs = [llm.generate(PROMPTS, sp, use_tqdm=False, lora_request=lora)
            for lora in (LoRARequest("rand", 1, adapter_folder), None)]
    return [([list(r.outputs[0].token_ids) for r in res], [r.outputs[0].logprobs for r in res]) for res in runs]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("lora-quant")


@pytest.fixture(scope="module")
def adapter(tmp):
    return write_random_adapter(str(tmp / "adapter"), model_config_from_hf(HF), RANK, seed=5, std=0.1)


def test_int4_base_with_an_adapter_is_the_merged_float_model(tmp, adapter):
    tensors, qc, ref, _ = quantized_checkpoint("gptq", symmetric=True, desc_act=True)   # act-order: x[:, perm]
    folder = write_folder(tmp / "gptq", tensors, HF | {"quantization_config": qc})
    (with_adapter, _), (without, _) = engine_outputs(folder, adapter)
    want, _ = merged_reference(tmp, "gptq", ref, adapter)
    assert with_adapter == want
    assert without != want                            # the adapter moves the greedy path


def test_fp8_w8a8_base_with_an_adapter_is_the_merged_float_model_within_e4m3(tmp, adapter):
    """fp8 W8A8 quantizes the activations of its GEMMs; the adapter's shrink reads the float ones. The first
    token's top logprobs match the merged float model's within e4m3's error; without the adapter they do not."""
    tensors, qc, ref = fp8_checkpoint("channel", "dynamic")
    folder = write_folder(tmp / "fp8", tensors, HF | {"quantization_config": qc})
    (_, lp_with), (_, lp_without) = engine_outputs(folder, adapter)
    _, logits = merged_reference(tmp, "fp8", ref, adapter)
    want = logits[0] - np.log(np.exp(logits[0] - logits[0].max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits[0].max(-1, keepdims=True)                               # log-softmax of the first step [R, vocab]

    def worst_error(logprobs) -> float:
        return max(abs(lp.logprob - want[r, tok]) for r, steps in enumerate(logprobs) for tok, lp in steps[0].items())

    spread = float(np.ptp(want))
    assert worst_error(lp_with) < 0.05 * spread, (worst_error(lp_with), spread)
    assert worst_error(lp_without) > 4 * worst_error(lp_with)


def test_the_slot_stacks_shard_like_a_quantized_base_weight():
    """Under tensor parallelism A takes a row-parallel weight's input split, B a column-parallel one's output
    split; a quantized weight names its split axis (``tp_axis``) instead of carrying a sharding."""
    import jax
    from jax.sharding import Mesh
    from jaxserve.lora.slots import _sharding
    from jaxserve.quantization import Int4Weight
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    packed = np.zeros((32, 2, 512), np.int32)
    gate_up = Int4Weight(packed, packed, packed, None, group_size=128, tp_axis=2)          # [256, 2, 512]
    down = Int4Weight(packed[:, 0], packed[:, 0], packed[:, 0], None, group_size=128, tp_axis=0)
    assert tuple(_sharding(mesh, gate_up, a=False).spec) == (None, None, None, "tp")
    assert tuple(_sharding(mesh, gate_up, a=True).spec) == (None, None, None)
    assert tuple(_sharding(mesh, down, a=True).spec) == ("tp", None, None)


_TP_SCRIPT = r'''
import json, sys
from jaxserve.llm import LLM
from jaxserve.lora import LoRARequest
from jaxserve.sampling_params import SamplingParams
from support.tp_greedy import PROMPTS
llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", max_model_len=64, max_num_batched_tokens=32,
          max_num_seqs=4, kv_cache_memory_bytes=1 << 21, skip_warmup=True, compilation_cache_dir="",
          use_tqdm_on_load=False, enable_lora=True, max_loras=1, max_lora_rank=int(sys.argv[3]))
sp = SamplingParams(max_tokens=int(sys.argv[4]), temperature=0.0, ignore_eos=True)
outs = llm.generate(PROMPTS, sp, use_tqdm=False, lora_request=LoRARequest("rand", 1, sys.argv[2]))
print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
'''


@pytest.mark.slow
def test_tensor_parallel_2_int4_base_with_an_adapter(tmp, adapter):
    """TP=2 on fake CPU devices: the stacks split like the int4 weights (``tp_axis``), the merged model's tokens."""
    from support.fake_devices import fake_device_report
    tensors, qc, ref, _ = quantized_checkpoint("awq")
    folder = write_folder(tmp / "awq-tp", tensors, HF | {"quantization_config": qc})
    out = fake_device_report(["-c", _TP_SCRIPT, folder, adapter, str(RANK), str(NEW_TOKENS)], 2, timeout=600)
    assert out == merged_reference(tmp, "awq-tp", ref, adapter)[0]
