"""CPU speed of the real model, one stream: prefill tok/s and decode tok/s of the jitted ``llama.forward``
(reference attention over the paged cache), no engine or scheduler around it.

    .venv/bin/python benchmarks/model_speed_cpu.py [--model PATH] [--dtype float32] [--prompt-len 128 512]
        [--decode-tokens 64] [--out benchmarks/results/DATE-cpu-smollm2-model-speed.md]

Prefill: one step with the whole prompt (one request), compiled once, timed over repeats (median).
Decode: greedy, one token per step, the host reads each token before dispatching the next (the slowest
honest loop: no overlap), block table sized for prompt + decode tokens.
"""
from __future__ import annotations

import argparse
import datetime as dt
import functools
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.kernels.metadata import AttentionMetadata  # noqa: E402
from jaxserve.models.loader import load_model  # noqa: E402

BLOCK_SIZE = 16


def _step(params, caches, ids, pos, md, last, *, family, cfg):
    hidden, caches = family.forward(params, caches, ids, pos, md, cfg, attn_backend="reference")
    return family.compute_logits(params, hidden[last][None], cfg)[0].argmax(), caches


def metadata(start: int, n: int, max_blocks: int) -> AttentionMetadata:
    pos = np.arange(start, start + n)
    table = np.arange(1, max_blocks + 1)                       # block 0 is the null block
    return AttentionMetadata(
        slot_mapping=jnp.asarray(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE, jnp.int32),
        block_tables=jnp.asarray(table[None], jnp.int32), seq_lens=jnp.array([start + n], jnp.int32),
        query_start_loc=jnp.array([0, n], jnp.int32), num_seqs=jnp.array(1, jnp.int32))


def bench(model, prompt_len: int, decode_tokens: int, repeats: int) -> dict:
    cfg, family = model.config, model.family
    max_blocks = -(-(prompt_len + decode_tokens + 1) // BLOCK_SIZE)
    caches = family.init_kv_caches(cfg, max_blocks + 1, BLOCK_SIZE, model.dtype)
    step = jax.jit(functools.partial(_step, family=family, cfg=cfg), donate_argnums=(1,))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(100, cfg.vocab_size - 100, prompt_len), jnp.int32)
    pos = jnp.arange(prompt_len, dtype=jnp.int32)
    md = metadata(0, prompt_len, max_blocks)
    last = jnp.int32(prompt_len - 1)

    t0 = time.perf_counter()
    tok, caches = step(model.params, caches, ids, pos, md, last)
    tok.block_until_ready()
    compile_prefill = time.perf_counter() - t0
    prefill_times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tok, caches = step(model.params, caches, ids, pos, md, last)
        tok.block_until_ready()
        prefill_times.append(time.perf_counter() - t0)

    token = int(tok)
    t0 = time.perf_counter()
    decode_times = []
    for i in range(decode_tokens + 1):                         # the first decode step compiles
        p = prompt_len + i
        s0 = time.perf_counter()
        tok, caches = step(model.params, caches, jnp.array([token], jnp.int32), jnp.array([p], jnp.int32),
                           metadata(p, 1, max_blocks), jnp.int32(0))
        token = int(tok)                                       # the host waits for every token
        decode_times.append(time.perf_counter() - s0)
    compile_decode, decode_times = decode_times[0], decode_times[1:]
    prefill_s = statistics.median(prefill_times)
    decode_s = statistics.median(decode_times)
    return {"prompt_len": prompt_len, "prefill_s": prefill_s, "prefill_tok_s": prompt_len / prefill_s,
            "decode_tokens": decode_tokens, "decode_ms": decode_s * 1e3, "decode_tok_s": 1 / decode_s,
            "compile_prefill_s": compile_prefill, "compile_decode_s": compile_decode}


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{cpu}, {os.cpu_count()} cores visible, {platform.system()} {platform.release()}, load average {load}"


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        return out or "?"
    except OSError:
        return "?"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write a markdown result file")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    model = load_model(args.model, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    rows = [bench(model, n, args.decode_tokens, args.repeats) for n in args.prompt_len]

    lines = [f"# CPU model speed: {os.path.basename(model.source)} ({args.dtype}), one stream", "",
             f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}",
             f"- commit: {commit()}",
             f"- machine: {machine()} (shared with other engineers' jobs while measured: expect noise)",
             f"- jax {jax.__version__}, backend {jax.default_backend()}, attention: reference (pure jnp)",
             f"- command: `{shlex.join([os.path.relpath(sys.executable), *sys.argv])}`",
             f"- load time: {load_s:.1f} s", "",
             "| prompt tokens | prefill (median) | prefill tok/s | decode ms/token (median) | decode tok/s "
             "| compile prefill / decode |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['prompt_len']} | {r['prefill_s'] * 1e3:.0f} ms | {r['prefill_tok_s']:.0f} "
                     f"| {r['decode_ms']:.1f} | {r['decode_tok_s']:.1f} "
                     f"| {r['compile_prefill_s']:.1f} s / {r['compile_decode_s']:.1f} s |")
    lines += ["", f"Decode: {args.decode_tokens} greedy tokens after the prompt, one step each, the host reading "
              "every token before the next dispatch; the reference attention reads the whole block table "
              "each step, so decode cost grows with the table width, not the live context."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
