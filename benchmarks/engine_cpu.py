"""Continuous batching vs one request at a time, on the embedded SmolLM2 (CPU by default).

    .venv/bin/python benchmarks/engine_cpu.py [--requests 64] [--sequential 8] [--input-len 64] [--output-len 64]

Prints output tok/s batched and sequential, and the engine's host-ms vs device-ms per step.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--sequential", type=int, default=8, help="requests run one at a time (output tok/s of those)")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args(argv)

    import jax
    from jaxserve import LLM, SamplingParams

    llm = LLM(a.model, max_model_len=512, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens)
    rng = np.random.default_rng(0)
    vocab = min(llm.engine.model_config.vocab_size, 32000)
    prompts = [rng.integers(100, vocab, size=a.input_len).tolist() for _ in range(a.requests)]
    sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)   # warm caches

    eng = llm.engine
    t0 = time.perf_counter()
    for p in prompts[:a.sequential]:
        llm.generate([p], sp, use_tqdm=False)
    seq_s = time.perf_counter() - t0
    seq_tps = a.sequential * a.output_len / seq_s

    st = eng.runner.stats
    st.steps = 0
    st.host_ms = st.device_ms = 0.0
    st.tokens = 0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    batch_s = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    snap = st.snapshot()
    res = {
        "date": time.strftime("%Y-%m-%d"), "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        "cpu_count": os.cpu_count(), "machine": platform.machine(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "requests": a.requests, "input_len": a.input_len, "output_len": a.output_len,
        "sequential_output_tok_s": round(seq_tps, 2),
        "batched_output_tok_s": round(n_out / batch_s, 2),
        "batched_total_tok_s": round((n_out + a.requests * a.input_len) / batch_s, 2),
        "speedup": round(n_out / batch_s / seq_tps, 2),
        "steps": snap["steps"], "host_ms_per_step": round(snap["host_ms_per_step"], 2),
        "device_ms_per_step": round(snap["device_ms_per_step"], 2),
        "tokens_per_step": round(snap["tokens_per_step"], 1),
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
    }
    print(json.dumps(res, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
