"""What the speculative-decoding tests share: greedy parameters, the outputs' token ids, prompts, the check that
speculation keeps greedy output identical, a recorder of the drafts a draft proposer makes, a recorder of each
read step's verification per request, and EAGLE and EAGLE-3 heads made for the tiny Llama, and the tiny DeepSeek
V3 with an MTP layer."""
import contextlib
import json
import shutil

import numpy as np
from safetensors.numpy import load_file, save_file

from jaxserve import SamplingParams
from support.tiny_models import fixture_path, tiny_llm

MTP_TARGET = "tiny-deepseek-v3"


@contextlib.contextmanager
def read_steps(core):
    """Record each step the engine ``core`` reads, per request it sampled for: (its first output index in the
    step, ``StepResult.spec``'s (draft slots, accepted, verified) for it, or None: no draft slots)."""
    steps, read = [], core._process_read

    def spy(step, result):
        for req, first in step.sampled:
            steps.append((first, (result.spec or {}).get(req.request_id)))
        return read(step, result)
    core._process_read = spy
    try:
        yield steps
    finally:
        del core._process_read


def greedy(m: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def spec_prompts() -> list[list[int]]:
    """Sixteen prompts: fourteen random ones of 3 to 60 tokens, then two repetitive ones."""
    rng = np.random.default_rng(3)
    out = [rng.integers(3, 250, size=int(n)).tolist() for n in rng.integers(3, 60, size=14)]
    return out + [[5, 6, 7, 8] * 5, list(range(10, 30)) * 2]


def check_greedy_matches_with_preemption(llm, target: str, speculative_config: dict, prompts: list, **engine):
    """``prompts`` batched, greedy, through ``target`` with ``speculative_config`` and a KV pool small enough to
    preempt (``engine``: more engine options): the tokens are ``llm``'s (the same target without speculation),
    drafts were made, and every block went back. Returns the speculative LLM, the reference tokens and the
    lengths asked for."""
    lengths = [8 + 3 * (i % 7) for i in range(len(prompts))]
    ref = token_ids(llm.generate(prompts, [greedy(m) for m in lengths], use_tqdm=False))
    spec = tiny_llm(target, speculative_config=speculative_config, num_gpu_blocks_override=70, **engine)
    core = spec.engine.core
    assert token_ids(spec.generate(prompts, [greedy(m) for m in lengths], use_tqdm=False)) == ref
    stats = core.stats()
    assert core.scheduler.num_preemptions > 0
    assert stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"]
    assert core.kv_manager.usage == 0.0
    return spec, ref, lengths


def check_dummy_head_runs(target: str, speculative_config: dict, prompts: list, **engine) -> None:
    """A head with ``--load-format dummy`` weights loads, proposes and gives every request its tokens
    (``engine``: more engine options)."""
    spec = tiny_llm(target, speculative_config=speculative_config, load_format="dummy", **engine)
    outs = spec.generate(prompts[:3], greedy(10), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
    assert spec.engine.core.stats()["spec_decode_num_drafts"] > 0


def check_echo_head(llm, spec, prompts: list) -> tuple[list, list]:
    """An echo head's run (``spec``) gives the target's greedy tokens (``llm``'s) and proposes, at every round,
    the request's last token K times, over several rounds of three drafts: (the reference tokens, the
    drafts ``record_drafts`` saw)."""
    seen = record_drafts(spec)
    params = [greedy(12 + i) for i in range(6)]
    ref = token_ids(llm.generate(prompts[:5] + [prompts[-1]], params, use_tqdm=False))
    assert token_ids(spec.generate(prompts[:5] + [prompts[-1]], params, use_tqdm=False)) == ref
    assert len(seen) > 20 and any(len(d) == 3 for _, d in seen)
    assert all(d == [last] * len(d) for last, d in seen)
    return ref, seen


def record_drafts(llm) -> list[tuple[int, list[int]]]:
    """A list that fills, as ``llm`` runs, with (the request's last token, its drafts) for each proposal of its
    draft proposer to a request that has outputs (a prompt's last token is not the target's)."""
    draft, seen = llm.engine.core.speculator.draft, []
    propose = draft.propose

    def recording(wanted):
        out = propose(wanted)
        seen.extend((req._all_token_ids[-1], d) for (req, _), d in zip(wanted, out) if d and req.output_token_ids)
        return out
    draft.propose = recording
    return seen


def _target_config(target: str) -> dict:
    with open(f"{fixture_path(target)}/config.json") as f:
        return json.load(f)


def make_eagle_head(folder, *, echo: bool = False, bias: bool = False, seed: int = 0, target: str = "tiny-llama3",
                    **config) -> str:
    """An EAGLE head's folder for a tiny Llama fixture (``target``): one Llama layer and ``fc``, random (std
    0.1); ``echo``: fc passes the hidden state through and the layer adds nothing (o and down zero), so the head's output is
    its input hidden state."""
    hf = {**_target_config(target), "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"], **config}
    if bias:
        hf["bias"] = True
    h, i = hf["hidden_size"], hf["intermediate_size"]
    q, kv = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)
    pre = "layers.0."
    t = {"fc.weight": w(h, 2 * h), pre + "self_attn.q_proj.weight": w(q, h), pre + "self_attn.k_proj.weight": w(kv, h),
         pre + "self_attn.v_proj.weight": w(kv, h), pre + "self_attn.o_proj.weight": w(h, q),
         pre + "mlp.gate_proj.weight": w(i, h), pre + "mlp.up_proj.weight": w(i, h),
         pre + "mlp.down_proj.weight": w(h, i), pre + "post_attention_layernorm.weight": np.ones(h, np.float32)}
    if bias:
        t["fc.bias"] = w(h)
    if echo:
        t["fc.weight"] = np.concatenate([np.zeros((h, h)), np.eye(h)], axis=1).astype(np.float32)
        t[pre + "self_attn.o_proj.weight"][:] = 0
        t[pre + "mlp.down_proj.weight"][:] = 0
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    save_file(t, str(folder / "model.safetensors"))
    return str(folder)


def make_eagle3_head(folder, *, echo: bool = False, draft_ids=None, d2t: bool = True, layer0: str = "midlayer.",
                     embed: bool = False, lm_head: bool = True, seed: int = 0, target: str = "tiny-llama3", aux_layers=(0, 1, 2),
                     **config) -> str:
    """An EAGLE-3 head's folder for a tiny Llama fixture (``target``): one layer, ``fc`` over its auxiliary layers
    ``aux_layers``, random (std 0.1). ``draft_ids``: the target ids of its draft vocabulary, in its order
    (``d2t``, unless ``d2t`` is False; None: the target's vocabulary, no ``d2t``). ``echo``: fc passes the last
    auxiliary stream (the target's last residual stream, for the default layers) through, the layer adds
    nothing (o and down zero), and its norm and lm_head are the target's (rows ``draft_ids``): its logits at a
    target row are the target's there, over the draft vocabulary, and at its own rows the same again.
    ``layer0``: its checkpoint's prefix of layer 0 (``midlayer.`` or ``layers.0.``); ``embed``: an embedding of
    its own (random), else the target's; ``lm_head`` False: none, the target's (over the target's vocabulary)."""
    hf = {**_target_config(target), "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"],
          "eagle_aux_hidden_state_layer_ids": list(aux_layers), **config}
    h, i = hf["hidden_size"], hf["intermediate_size"]
    q, kv = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]
    vocab = hf["vocab_size"]
    ids = np.arange(vocab) if draft_ids is None else np.asarray(draft_ids)
    if draft_ids is not None:
        hf["draft_vocab_size"] = len(ids)
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)
    t = {"fc.weight": w(h, 3 * h), layer0 + "self_attn.q_proj.weight": w(q, 2 * h),
         layer0 + "self_attn.k_proj.weight": w(kv, 2 * h), layer0 + "self_attn.v_proj.weight": w(kv, 2 * h),
         layer0 + "self_attn.o_proj.weight": w(h, q), layer0 + "mlp.gate_proj.weight": w(i, h),
         layer0 + "mlp.up_proj.weight": w(i, h), layer0 + "mlp.down_proj.weight": w(h, i),
         layer0 + "input_layernorm.weight": 1 + w(h), layer0 + "hidden_norm.weight": 1 + w(h),
         layer0 + "post_attention_layernorm.weight": np.ones(h, np.float32), "norm.weight": 1 + w(h),
         "lm_head.weight": w(len(ids), h)}
    if embed:
        t["embed_tokens.weight"] = w(vocab, h)
    if draft_ids is not None and d2t:
        t["d2t"] = (ids - np.arange(len(ids))).astype(np.int64)
        t["t2d"] = np.isin(np.arange(vocab), ids)
    if echo:
        from jaxserve.models.safetensors_loader import safetensors_getter
        get, _ = safetensors_getter(fixture_path(target))
        eye = np.eye(h, dtype=np.float32)
        t["fc.weight"] = np.concatenate([np.zeros((h, 2 * h), np.float32), eye], axis=1)
        t[layer0 + "self_attn.o_proj.weight"][:] = 0
        t[layer0 + "mlp.down_proj.weight"][:] = 0
        t["norm.weight"] = np.asarray(get("model.norm.weight"), np.float32)
        if lm_head:
            t["lm_head.weight"] = np.asarray(get("lm_head.weight"), np.float32)[ids]
    if not lm_head:
        del t["lm_head.weight"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    save_file(t, str(folder / "model.safetensors"))
    return str(folder)


def with_mtp_layer(folder, echo: bool = False) -> str:
    """The tiny DeepSeek V3 with a full MTP layer 3: layer 2's block (MLA, MoE), random ``eh_proj``, unit norms,
    ``shared_head.head`` the lm_head. ``echo``: ``eh_proj`` passes the (normed) hidden state through and the
    block adds nothing (o and every down projection zero)."""
    shutil.copytree(fixture_path(MTP_TARGET), folder)
    tensors = load_file(f"{folder}/model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    L, h = config["num_hidden_layers"], config["hidden_size"]
    for name in [n for n in tensors if n.startswith(f"model.layers.{L - 1}.")]:
        tensors[name.replace(f"layers.{L - 1}.", f"layers.{L}.")] = tensors[name].copy()
    rng = np.random.default_rng(0)
    pre = f"model.layers.{L}."
    dtype = tensors["lm_head.weight"].dtype
    tensors[pre + "eh_proj.weight"] = (rng.standard_normal((h, 2 * h)) * 0.1).astype(dtype)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{pre}{norm}.weight"] = np.ones(h, dtype)
    tensors[pre + "shared_head.head.weight"] = tensors["lm_head.weight"].copy()
    if echo:
        tensors[pre + "eh_proj.weight"] = np.concatenate([np.zeros((h, h)), np.eye(h)], axis=1).astype(dtype)
        for name in [n for n in tensors if n.startswith(pre) and (n.endswith("down_proj.weight") or "o_proj" in n)]:
            tensors[name] = np.zeros_like(tensors[name])
    save_file(tensors, f"{folder}/model.safetensors")
    return str(folder)
