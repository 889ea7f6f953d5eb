"""What the speculative-decoding tests share: greedy parameters, the outputs' token ids, a recorder of the
drafts a draft proposer makes, and EAGLE heads made for the tiny Llama."""
import json

import numpy as np
from safetensors.numpy import save_file

from jaxserve import SamplingParams
from support.tiny_models import fixture_path


def greedy(m: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


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
