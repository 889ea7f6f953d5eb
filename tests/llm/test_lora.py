"""LoRA adapters offline (LLM.generate(lora_request=...)) on the tiny Llama against HF + peft float32: each
adapter's greedy output, a batch mixing the base model and all three adapters with fewer slots than adapters
(each request waits for a slot and gets its solo output), no recompilation when slots are loaded or swapped,
prefix-cache blocks never shared across adapters, and the errors of bad adapters."""
import json
import shutil

import pytest

from jaxserve import SamplingParams
from jaxserve.engine.lora_manager import LoRAManager
from jaxserve.errors import InvalidRequestError
from jaxserve.lora import LoRARequest, read_adapter
from jaxserve.lora.peft import AdapterError
from support.lora import adapter_names, adapter_path, lora_golden

LLM_ARGS = dict(enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2)


def lora(name: str) -> LoRARequest:
    return LoRARequest(name, adapter_names().index(name) + 1, adapter_path(name))


def greedy():
    return SamplingParams(temperature=0, max_tokens=lora_golden()["max_tokens"], ignore_eos=True)


def run(llm, prompts, loras):
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False, lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in out]


def test_each_adapter_matches_hf_peft(llm):
    g = lora_golden()
    assert run(llm, g["prompts"], None) == g["base"]
    for name in adapter_names():
        assert run(llm, g["prompts"], lora(name)) == g["adapters"][name], name


def test_a_mixed_batch_gives_each_request_its_solo_output(llm):
    """Base + three adapters in one generate call with two slots: requests wait for a slot, none fails."""
    g = lora_golden()
    prompts, loras, want = [], [], []
    for j, p in enumerate(g["prompts"]):
        for name in [None, *adapter_names()]:
            prompts.append(p)
            loras.append(None if name is None else lora(name))
            want.append(g["base"][j] if name is None else g["adapters"][name][j])
    assert run(llm, prompts, loras) == want


def test_loading_and_swapping_adapters_compiles_nothing(llm):
    g = lora_golden()
    runner = llm.engine.core.runner
    run(llm, g["prompts"][:1], lora("attn-r8"))
    runner.wait_compiled(timeout=600)
    before, writes = runner.compiled_variants(), runner.lora._write._cache_size()   # (shared across engines)
    for name in adapter_names():              # three adapters through two slots: each swap writes a slot
        assert run(llm, g["prompts"][:1], lora(name)) == g["adapters"][name][:1]
    assert runner.compiled_variants() == before
    assert runner.lora._write._cache_size() == writes


def test_two_adapters_never_share_prefix_cache_blocks(llm):
    prompt = list(range(40, 60))               # five blocks of 4
    first = llm.generate([{"prompt_token_ids": prompt}], greedy(), use_tqdm=False, lora_request=lora("mlp-r16"))
    again = llm.generate([{"prompt_token_ids": prompt}], greedy(), use_tqdm=False, lora_request=lora("mlp-r16"))
    other = llm.generate([{"prompt_token_ids": prompt}], greedy(), use_tqdm=False, lora_request=lora("attn-r8"))
    base = llm.generate([{"prompt_token_ids": prompt}], greedy(), use_tqdm=False)
    assert again[0].num_cached_tokens > 0 and again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert other[0].num_cached_tokens == 0 and base[0].num_cached_tokens == 0


def test_bad_adapters_are_request_errors(llm, tmp_path):
    p = [{"prompt_token_ids": [5, 6, 7]}]
    with pytest.raises(InvalidRequestError, match="does not exist"):
        llm.generate(p, greedy(), use_tqdm=False, lora_request=LoRARequest("nope", 9, str(tmp_path / "nope")))
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        llm.generate(p, SamplingParams(prompt_logprobs=1), use_tqdm=False, lora_request=lora("attn-r8"))
    # the engine keeps serving
    assert run(llm, lora_golden()["prompts"][:1], lora("attn-r8")) == lora_golden()["adapters"]["attn-r8"][:1]


def test_a_base_request_scores_its_prompt_on_the_lora_engine(llm):
    """prompt_logprobs without an adapter run the base model over the LoRA engine's weights (folded ones hold
    the adapters' A columns): the golden base continuation scores rank 1 at each of its positions."""
    g = lora_golden()
    assert llm.engine.core.runner.lora.folded
    prompt, continuation = g["prompts"][0], g["base"][0]
    out = llm.generate([{"prompt_token_ids": prompt + continuation}], SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)
    scored = out[0].prompt_logprobs[len(prompt):]
    assert [lp[tok].rank for lp, tok in zip(scored, continuation)] == [1] * len(continuation)


def _copy_with_config(tmp_path, name: str, **changes) -> str:
    folder = tmp_path / name
    shutil.copytree(adapter_path(name), folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(cfg | changes))
    return str(folder)


def test_read_adapter_errors(llm, tmp_path):
    cfg = llm.engine.model_config
    with pytest.raises(AdapterError, match="rank 16, above --max-lora-rank 8"):
        read_adapter(adapter_path("mlp-r16"), cfg, 8)
    with pytest.raises(AdapterError, match=r"target modules \['lm_head'\] are not supported"):
        read_adapter(_copy_with_config(tmp_path, "attn-r8", target_modules=["q_proj", "lm_head"]), cfg, 16)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter(str(tmp_path), cfg, 16)
    with pytest.raises(AdapterError, match="DoRA"):
        read_adapter(_copy_with_config(tmp_path, "all-r4-rslora", use_dora=True), cfg, 16)
    with pytest.raises(AdapterError, match="do not fit"):
        read_adapter(_copy_with_config(tmp_path, "mlp-r16", r=8), cfg, 16)
    a = read_adapter(adapter_path("all-r4-rslora"), cfg, 16)
    assert a.rank == 4 and a.scaling == 8 / 4 ** 0.5          # rsLoRA: alpha / sqrt(r)


class _Req:
    def __init__(self, lora_request):
        self.lora_request, self.lora_slot = lora_request, 0


def test_manager_slots_lru_and_pins(llm):
    writes = []
    mgr = LoRAManager(lambda slot, adapter: writes.append((slot, adapter.path)), llm.engine.model_config,
                      max_loras=2, max_lora_rank=16, max_cpu_loras=2)
    a, b, c = (_Req(lora(n)) for n in adapter_names())
    assert mgr.acquire(a) and mgr.acquire(b) and (a.lora_slot, b.lora_slot) == (1, 2)
    assert not mgr.acquire(c)                   # both slots pinned: c waits
    mgr.release(a)
    assert mgr.acquire(c) and c.lora_slot == 1  # a's slot, the least recently used unpinned one
    a2 = _Req(lora("attn-r8"))
    assert not mgr.acquire(a2)
    mgr.release(b)
    assert mgr.acquire(a2) and a2.lora_slot == 2
    assert [s for s, _ in writes] == [1, 2, 1, 2] and len(mgr.host) == 2
    assert mgr.running_names() == "attn-r8,mlp-r16"
    assert mgr.waiting_names([a, _Req(None)]) == "attn-r8"


_TP_SCRIPT = r'''
import json, sys
from jaxserve.llm import LLM
from jaxserve.lora import LoRARequest
from jaxserve.sampling_params import SamplingParams
from support.lora import adapter_names, adapter_path, lora_golden
g = lora_golden()
llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", max_model_len=128, max_num_batched_tokens=64,
          max_num_seqs=16, kv_cache_memory_bytes=1 << 22, skip_warmup=True, compilation_cache_dir="",
          use_tqdm_on_load=False, enable_lora=True, max_loras=3)
stacks = llm.engine.core.runner.lora.stacks[0]
specs = {k: list(v.sharding.spec) + [None] * (v.ndim - len(v.sharding.spec)) for k, v in stacks.items()}
prompts, loras = [], []
for p in g["prompts"]:
    for i, name in enumerate([None, *adapter_names()]):
        prompts.append({"prompt_token_ids": p})
        loras.append(None if name is None else LoRARequest(name, i, adapter_path(name)))
sp = SamplingParams(temperature=0, max_tokens=g["max_tokens"], ignore_eos=True)
outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
print(json.dumps({"specs": specs, "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
'''


@pytest.mark.slow
def test_tensor_parallel_2_gives_the_same_tokens():
    """A 2-device mesh (fake CPU devices, so a subprocess): B sharded like its base weight's output on the
    column projections, A like its input on the row ones; every request of a mixed batch gets HF + peft's."""
    from support.fake_devices import fake_device_report
    from support.tiny_models import fixture_path
    out = fake_device_report(["-c", _TP_SCRIPT, fixture_path("tiny-llama3")], 2, timeout=600)
    g = lora_golden()
    want = [g["base"][j] if name is None else g["adapters"][name][j]
            for j in range(len(g["prompts"])) for name in [None, *adapter_names()]]
    assert out["tokens"] == want
    specs = out["specs"]
    assert specs["q_b"] == specs["k_b"] == [None, None, "tp"] and specs["qkv_a"] == [None, None, None]
    assert specs["o_a"] == ["tp", None, None] and specs["o_b"] == [None, None, None]
    assert specs["gate_up_b"] == [None, None, None, "tp"] and specs["down_a"] == ["tp", None, None]


def test_adapter_requests_queue_behind_one_waiting_for_a_slot(llm):
    """Two slots, three adapters: the third adapter's request waits, and so does a later request of a resident
    adapter (FCFS: it would keep that slot pinned), while a base-model request passes."""
    core = llm.engine.core
    names = [*adapter_names(), "attn-r8", None]
    for i, name in enumerate(names):
        core.add_request(f"q{i}", [5, 6, 7, 8], greedy(), 0.0, 0, lora_request=lora(name) if name else None)
    try:
        scheduled = [s.request.request_id for s in core.scheduler.schedule().scheduled]
        assert sorted(scheduled) == ["q0", "q1", "q4"]
        assert [r.request_id for r in core.scheduler.waiting] == ["q2", "q3"]
    finally:
        core.abort_requests([f"q{i}" for i in range(len(names))])
    assert not core.lora.pins


def test_with_lora_off_the_step_carries_nothing_of_it(llm):
    """--enable-lora off: the runner has no slots, the step's weights and packed inputs are today's; a request
naming an adapter is refused."""
    from support.tiny_models import tiny_llm
    plain_llm = tiny_llm(skip_warmup=True)
    plain = plain_llm.engine.core.runner
    assert plain.lora is None and plain.step_params is plain.model.params
    assert "lora_slot" not in {p.name for p in plain.variants.padding_inputs(8)[1]}
    with pytest.raises(InvalidRequestError, match="start the engine with --enable-lora"):
        plain_llm.generate([[5, 6]], greedy(), use_tqdm=False, lora_request=lora("attn-r8"))
    lora_runner = llm.engine.core.runner
    assert "lora_slot" in {p.name for p in lora_runner.variants.padding_inputs(8)[1]}


def test_a_random_adapter_folder_reads_back(llm, tmp_path):
    """``write_random_adapter`` (what a benchmark serves): a PEFT folder the engine reads and runs."""
    from jaxserve.lora.peft import write_random_adapter
    cfg = llm.engine.model_config
    folder = write_random_adapter(str(tmp_path / "rand"), cfg, 8, seed=3, std=0.3)
    a = read_adapter(folder, cfg, 16)
    assert a.rank == 8 and a.targets == {"q", "k", "v", "o", "gate", "up", "down"}
    out = run(llm, lora_golden()["prompts"][:1], LoRARequest("rand", 77, folder))
    assert out != lora_golden()["base"][:1]
