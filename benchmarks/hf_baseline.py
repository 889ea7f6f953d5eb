"""Same-GPU baseline: HF transformers on the same model shape (random weights) and the same prompts, run by the
runner as `python benchmarks/hf_baseline.py SPEC.json OUT.json` (benchmarks/README.md's "Same-GPU baseline"): it
imports neither jax nor jaxserve, so any Python with torch + transformers runs it. eos is disabled so every request
produces exactly its output length, like jaxserve's ignore_eos."""
from __future__ import annotations

import json
import statistics
import sys
import time


def _percentiles(values: list[float]) -> dict:
    import numpy as np
    arr = np.asarray(values, dtype=float)
    out = {"count": len(values), "mean": float(arr.mean()), "median": float(np.median(arr))}
    out.update({f"p{q}": float(np.percentile(arr, q)) for q in (10, 25, 50, 75, 90, 99)})
    return out


def build_model(spec: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(spec["hf_config"])
    model_type = hf.pop("model_type", "llama")
    drop = ("architectures", "torch_dtype", "dtype", "transformers_version", "eos_token_id")   # eos: ignore_eos
    config = AutoConfig.for_model(model_type, **{k: v for k, v in hf.items()       # _x: notes such as _source
                                                 if v is not None and k not in drop and not k.startswith("_")})
    device = spec["device"] if spec["device"] != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[spec["dtype"]]
    torch.manual_seed(spec.get("seed", 0))
    with torch.device(device):                 # random init straight on the device: fast for 8B shapes
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), device


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_generate(model, device: str, prompts: list[list[int]], output_len: int, iters: int, warmup: int) -> dict:
    """Plain `generate` on the whole batch (left-padded), greedy, exactly output_len new tokens."""
    import torch
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    times = []
    with torch.inference_mode():
        for i in range(warmup + iters):
            _sync(device)
            t = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, **kw)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t)
    new_tokens = int(out.shape[1] - width) * len(prompts)
    e2e = _percentiles(times)
    return {"method": "generate", "e2e_s": e2e, "e2e_samples_s": times, "output_tokens": new_tokens,
            "output_tok_per_s": new_tokens / e2e["mean"], "elapsed_s": e2e["mean"]}


def run_generate_batch(model, device: str, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """transformers' continuous batching over all prompts (`paged|sdpa`); one max_new_tokens for all.
    Not under inference_mode: its background thread updates tensors in place."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    max_new = max(output_lens)
    gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = None
    if not device.startswith("cuda"):     # its memory-based sizing is for GPUs: size the CPU cache by hand
        need = sum(len(p) for p in prompts) + max_new * len(prompts)
        cb = ContinuousBatchingConfig(block_size=32, num_blocks=need // 32 + 2 * len(prompts) + 8,
                                      max_batch_tokens=256)
    model.set_attn_implementation("paged|sdpa")
    warm = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=prompts[:2], generation_config=warm, continuous_batching_config=cb)
    _sync(device)
    t = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb,
                                progress_bar=True)
    _sync(device)
    elapsed = time.perf_counter() - t
    out_tok = sum(len(o.generated_tokens) for o in outs.values())
    in_tok = sum(len(p) for p in prompts)
    failed = sum(1 for o in outs.values() if getattr(o, "error", None))
    return {"method": "generate_batch", "attn_implementation": "paged|sdpa", "elapsed_s": elapsed,
            "num_requests": len(outs), "failed": failed, "prompt_tokens": in_tok, "output_tokens": out_tok,
            "requests_per_s": len(outs) / elapsed, "output_tok_per_s": out_tok / elapsed,
            "total_tok_per_s": (in_tok + out_tok) / elapsed, "max_new_tokens": max_new}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python benchmarks/hf_baseline.py SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(open(argv[0]).read())
    import torch
    import transformers
    t0 = time.perf_counter()
    model, device = build_model(spec)
    load_s = time.perf_counter() - t0
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device,
           "device_name": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu", "load_s": load_s}
    results = {}
    prompts, outs = spec["prompts"], spec["output_lens"]
    for method in spec["methods"]:
        if method == "generate":
            if len(set(outs)) != 1:
                print("hf_baseline: generate uses the mean output length (lengths differ)", file=sys.stderr)
            results[method] = run_generate(model, device, prompts, int(round(statistics.mean(outs))),
                                           int(spec.get("iters", 3)), int(spec.get("warmup_iters", 1)))
        elif method == "generate_batch":
            results[method] = run_generate_batch(model, device, prompts, outs)
        else:
            print(f"hf_baseline: unknown method {method!r} (generate, generate_batch)", file=sys.stderr)
            return 2
    with open(argv[1], "w") as f:
        json.dump({"environment": env, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
