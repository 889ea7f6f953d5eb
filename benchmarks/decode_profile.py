"""Where a batch-B decode step's GPU time goes: offline, B random-token prompts decoding ``--output-len`` tokens
under ``jax.profiler``; prints the wall time, the GPU's busy time and its kernels by total time per step. Its
profiling pieces serve ``vision_profile`` too.

    python -m jaxserve.benchmarks.decode_profile --model llama-3.1-8b --quantization awq --batch 1

Random weights (``load_format dummy``). A warm-up batch runs first and the background compiles are awaited, so no
measured step runs in another bucket than its own.
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


def wait_compiled(llm, timeout: float = 300) -> float:
    """Wait for the engine's background compiles (``step_variants_pending``); the seconds waited."""
    t0 = time.time()
    while llm.engine.core.stats().get("step_variants_pending", 0) and time.time() - t0 < timeout:
        time.sleep(1)
    return time.time() - t0


def profiled_generate(llm, prompts, params) -> tuple[float, collections.Counter, int]:
    """``llm.generate(prompts)`` under ``jax.profiler``: (wall seconds, microseconds per GPU kernel, steps)."""
    import jax
    core = llm.engine.core
    with tempfile.TemporaryDirectory() as d:
        steps0 = core.stats()["steps"]
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        jax.profiler.stop_trace()
        return wall, gpu_kernels(d), core.stats()["steps"] - steps0


def print_kernels(by: collections.Counter, top: int, steps: int | None = None) -> None:
    """The ``top`` kernels by total time (per step when ``steps`` is given) and their share of the busy time."""
    busy = max(sum(by.values()), 1)
    for name, us in by.most_common(top):
        when = f"{us / steps:8.1f} us/step" if steps else f"{us / 1e3:9.1f} ms"
        print(f"| {when} | {100 * us / busy:5.1f} % | {name}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--hf-overrides", type=json.loads, default=None,
                    help='JSON over the model config, e.g. \'{"num_hidden_layers": 5}\' (a shape cut to fit a GPU)')
    args = ap.parse_args(argv)
    from jaxserve import LLM, SamplingParams
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", quantization=args.quantization,
              max_model_len=args.max_model_len, max_num_seqs=256, max_num_batched_tokens=2048,
              token_buckets=[4, 8, 16, 64, 256, 2048], hf_overrides=args.hf_overrides)
    rng = np.random.default_rng(0)
    vocab = min(20000, llm.engine.facts().model_config.vocab_size - 1)
    prompts = [{"prompt_token_ids": rng.integers(10, vocab, args.input_len).tolist()} for _ in range(2 * args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:args.batch], params, use_tqdm=False)
    wait_compiled(llm)
    wall, by, steps = profiled_generate(llm, prompts[args.batch:], params)
    busy = sum(by.values())
    print(f"## {args.model} {args.quantization or 'bf16'} batch {args.batch}: wall {wall:.2f} s, "
          f"{args.batch * args.output_len / wall:.0f} output tok/s, {steps} steps, GPU busy {busy / 1e6:.3f} s "
          f"({busy / 1e3 / max(steps, 1):.2f} ms a step)")
    print_kernels(by, args.top, max(steps, 1))


if __name__ == "__main__":
    main()
