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
import collections
import glob
import gzip
import json
import tempfile
import time

import numpy as np


def gpu_kernels(trace_dir: str) -> collections.Counter:
    """Microseconds per kernel name on the GPU streams of the Perfetto trace ``jax.profiler`` wrote."""
    path = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)[0]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    by: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e and "GPU" in procs.get(e.get("pid"), ""):
            by[e["name"][:60]] += e["dur"]
    return by


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-vl-7b")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args(argv)
    import jax
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
    core, t0 = llm.engine.core, time.time()
    while core.stats().get("step_variants_pending", 0) and time.time() - t0 < 300:
        time.sleep(1)
    print(f"prompt tokens {prompt_len}; background compiles done after {time.time() - t0:.0f} s", flush=True)
    for name, prompts in (("images", images[2:]), ("text", texts[2:])):
        with tempfile.TemporaryDirectory() as d:
            steps0 = core.stats()["steps"]
            jax.profiler.start_trace(d, create_perfetto_trace=True)
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t
            jax.profiler.stop_trace()
            by = gpu_kernels(d)
        busy = sum(by.values())
        print(f"\n## {name}: wall {wall:.2f} s, {n * args.output_len / wall:.0f} output tok/s, GPU busy "
              f"{busy / 1e6:.2f} s, {core.stats()['steps'] - steps0} steps")
        for k, v in by.most_common(args.top):
            print(f"| {v / 1e3:9.1f} ms | {100 * v / max(busy, 1):5.1f} % | {k}")


if __name__ == "__main__":
    main()
