"""Where a batch-B decode step's GPU time goes: offline, B random-token prompts decoding ``--output-len`` tokens
under ``jax.profiler``; prints the wall time, the GPU's busy time and its kernels by total time per step.

    python -m jaxserve.benchmarks.decode_profile --model llama-3.1-8b --quantization awq --batch 1

Random weights (``load_format dummy``). A warm-up batch runs first and the background compiles are awaited, so no
measured step runs in another bucket than its own.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from .vision_profile import gpu_kernels


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args(argv)
    import tempfile

    import jax

    from jaxserve import LLM, SamplingParams
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", quantization=args.quantization,
              max_model_len=args.max_model_len, max_num_seqs=256, max_num_batched_tokens=2048,
              token_buckets=[4, 8, 16, 64, 256, 2048])
    rng = np.random.default_rng(0)
    vocab = min(20000, llm.engine.facts().model_config.vocab_size - 1)
    prompts = [{"prompt_token_ids": rng.integers(10, vocab, args.input_len).tolist()} for _ in range(2 * args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:args.batch], params, use_tqdm=False)
    core, t0 = llm.engine.core, time.time()
    while core.stats().get("step_variants_pending", 0) and time.time() - t0 < 300:
        time.sleep(1)
    with tempfile.TemporaryDirectory() as d:
        steps0 = core.stats()["steps"]
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        t = time.perf_counter()
        llm.generate(prompts[args.batch:], params, use_tqdm=False)
        wall = time.perf_counter() - t
        jax.profiler.stop_trace()
        by = gpu_kernels(d)
    steps = core.stats()["steps"] - steps0
    busy = sum(by.values())
    print(f"## {args.model} {args.quantization or 'bf16'} batch {args.batch}: wall {wall:.2f} s, "
          f"{args.batch * args.output_len / wall:.0f} output tok/s, {steps} steps, GPU busy {busy / 1e6:.3f} s "
          f"({busy / 1e3 / max(steps, 1):.2f} ms a step)")
    for k, v in by.most_common(args.top):
        print(f"| {v / 1e3 / max(steps, 1) * 1e3:8.1f} us/step | {100 * v / max(busy, 1):5.1f} % | {k}")


if __name__ == "__main__":
    main()
