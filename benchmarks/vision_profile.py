"""Where a vision model's GPU time goes with images and without: offline, N prompts of one random image plus 64
text tokens, then N text prompts of the same length, each under ``jax.profiler``; prints the wall time, the GPU's
busy time and its kernels by total time for both.

    python -m jaxserve.benchmarks.vision_profile --model qwen2.5-vl-7b --num-prompts 64 --image-size 1024

Random weights (``load_format dummy``); the image prompts are token ids with the model's image placeholder, so
no chat template or tokenizer is needed. The warm-up sends two prompts of each kind and waits for the background
compiles (``step_variants_pending``), so no measured step runs in a larger bucket than its own.
"""
from __future__ import annotations

import argparse

import numpy as np

from .decode_profile import print_kernels, profiled_generate, wait_compiled


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-vl-7b")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args(argv)
    from PIL import Image

    from jaxserve import LLM, SamplingParams
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_model_len=args.max_model_len, max_num_seqs=256,
              max_num_batched_tokens=2048, token_buckets=[4, 8, 16, 64, 256, 2048])
    rng = np.random.default_rng(0)
    image_id = llm.engine.images.processing.image_token_id
    vocab = min(20000, llm.engine.facts().model_config.vocab_size - 1)
    n, size = args.num_prompts, args.image_size
    images = [{"prompt_token_ids": [image_id] + rng.integers(10, vocab, 64).tolist(),
               "multi_modal_data": {"image": Image.fromarray(rng.integers(0, 255, (size, size, 3), np.uint8))}}
              for _ in range(n + 2)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompt_len = len(llm.generate(images[:2], params, use_tqdm=False)[0].prompt_token_ids)
    texts = [{"prompt_token_ids": rng.integers(10, vocab, prompt_len).tolist()} for _ in range(n + 2)]
    llm.generate(texts[:2], params, use_tqdm=False)
    print(f"prompt tokens {prompt_len}; background compiles done after {wait_compiled(llm):.0f} s", flush=True)
    for name, prompts in (("images", images[2:]), ("text", texts[2:])):
        wall, by, steps = profiled_generate(llm, prompts, params)
        print(f"\n## {name}: wall {wall:.2f} s, {n * args.output_len / wall:.0f} output tok/s, GPU busy "
              f"{sum(by.values()) / 1e6:.2f} s, {steps} steps")
        print_kernels(by, args.top)


if __name__ == "__main__":
    main()
