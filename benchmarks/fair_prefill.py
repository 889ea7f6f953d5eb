"""Short-request latency under a stream of long prompts (chunked prefill's fairness).

Drives an in-process ``LLMEngine`` step by step: ``--long-inflight`` long prompts (``--long-len`` random tokens,
a few output tokens each) are kept in the engine at all times, and a short request (``--short-len`` tokens,
``--short-out`` output tokens) arrives every ``--short-every`` steps. Reports, for the short requests, the
steps and seconds from arrival to the first token and to the last, and for the long ones the seconds to the
first token (what fairness costs them), as percentiles.

    .venv/bin/python -m benchmarks.fair_prefill --duration 120 --out benchmarks/results/X.md
    .venv/bin/python -m benchmarks.fair_prefill --set long_prefill_token_threshold=0 ...   # any engine option

The engine options default to the platform's (on CPU: the embedded SmolLM2, 256 tokens a step).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    a = np.asarray(values, float)
    return {"n": len(a), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def run(args) -> dict:
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.llm import engine_config_from_kwargs
    from jaxserve.sampling_params import RequestOutputKind, SamplingParams

    from .config import parse_set
    options = {".".join(keys): value for keys, value in map(parse_set, args.set)}
    config = engine_config_from_kwargs(args.model, max_model_len=args.long_len + 64, **options)
    engine = LLMEngine(config, progress=False)
    engine.wait_compiled()
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    long_params, short_params = (SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                output_kind=RequestOutputKind.DELTA) for n in (2, args.short_out))
    ids = iter(range(1 << 30))
    live: dict[str, dict] = {}          # request id -> kind, arrival (s, step), first token (s, step)
    done: list[dict] = []

    def add(kind: str, n: int, params, step: int) -> None:
        rid = f"{kind}-{next(ids)}"
        engine.add_request(rid, rng.integers(200, vocab - 200, n).tolist(), params)
        live[rid] = {"kind": kind, "t0": time.perf_counter(), "s0": step}

    step, t_end = 0, time.perf_counter() + args.duration
    while time.perf_counter() < t_end:
        while sum(r["kind"] == "long" for r in live.values()) < args.long_inflight:
            add("long", args.long_len, long_params, step)
        if step % args.short_every == 0:
            add("short", args.short_len, short_params, step)
        outputs = engine.step()
        step += 1
        now = time.perf_counter()
        for out in outputs:
            r = live.get(out.request_id)
            if r is None:
                continue
            if "ttft" not in r and out.outputs[0].token_ids:
                r["ttft"], r["ttft_steps"] = now - r["t0"], step - r["s0"]
            if out.finished:
                r["e2e"], r["e2e_steps"] = now - r["t0"], step - r["s0"]
                done.append(live.pop(out.request_id))
    engine.abort_request(list(live))
    engine.shutdown()
    short = [r for r in done if r["kind"] == "short"]
    long_ = [r for r in done if r["kind"] == "long"]
    return {"options": options, "steps": step, "duration_s": args.duration,
            "short_ttft_s": _percentiles([r["ttft"] for r in short]),
            "short_ttft_steps": _percentiles([r["ttft_steps"] for r in short]),
            "short_e2e_s": _percentiles([r["e2e"] for r in short]),
            "long_ttft_s": _percentiles([r["ttft"] for r in long_]),
            "long_done": len(long_), "short_done": len(short)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--long-len", type=int, default=4000)
    p.add_argument("--long-inflight", type=int, default=2)
    p.add_argument("--short-len", type=int, default=8)
    p.add_argument("--short-out", type=int, default=8)
    p.add_argument("--short-every", type=int, default=4, help="steps between short arrivals")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE",
                   help="an engine option (LLM keyword), the value read as YAML (as bench --set reads it)")
    p.add_argument("--out", help="append the result as a JSON line to this file")
    args = p.parse_args(argv)
    result = run(args)
    text = json.dumps(result)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
