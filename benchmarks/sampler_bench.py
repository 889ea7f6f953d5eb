"""Cost of the on-device sampler per call, by kind of batch (jaxserve/runner/sampler.py).

    .venv/bin/python benchmarks/sampler_bench.py [--rows 64] [--vocab 49152] [--repeats 10]
        [--out benchmarks/results/DATE-<platform>-sampler.md]

Each case is one jitted `sample` call on random logits (compiled first, then the median and the minimum
of `repeats` timed calls). Also times the two ways to draw from the filtered distribution (Gumbel-max with
R*V random numbers vs the inverse-CDF draw with R) and the top-k/top-p candidate path vs a full sort.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxserve.runner import sampler as S  # noqa: E402
from jaxserve.sampling_params import SamplingParams  # noqa: E402


def timed(fn, *args, repeats: int, **kwargs) -> tuple[float, float]:
    jax.block_until_ready(fn(*args, **kwargs))          # compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args, **kwargs))
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), min(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    R, V = args.rows, args.vocab
    logits = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (R, V)) * 4.0, np.float32)
    sample = jax.jit(S.sample, static_argnames=("num_logprobs", "max_candidates"))
    history = [list(range(100))] * R
    cases = [
        ("greedy", SamplingParams(temperature=0), {}),
        ("greedy, 20 top logprobs", SamplingParams(temperature=0), {"num_logprobs": 20}),
        ("random T=0.8", SamplingParams(temperature=0.8), {}),
        ("random T=0.8, top_k=50 + top_p=0.9 (256 candidates)", SamplingParams(temperature=0.8, top_k=50, top_p=0.9), {}),
        ("random T=0.8, top_k=50 + top_p=0.9 (full sort)", SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
         {"max_candidates": V}),
        ("random T=0.8, min_p=0.05", SamplingParams(temperature=0.8, min_p=0.05), {}),
        ("random, presence+frequency penalties, 100 output ids",
         SamplingParams(presence_penalty=0.5, frequency_penalty=0.5), {}),
        ("random, repetition penalty, 100 output + 100 prompt ids", SamplingParams(repetition_penalty=1.2), {}),
    ]
    rows = []
    for name, params, kwargs in cases:
        meta = S.make_sampling_metadata([params] * R, history, history, [100] * R, V, R)
        rows.append((name, *timed(sample, logits, meta, repeats=args.repeats, **kwargs)))

    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(0), i))(jnp.arange(R))
    gumbel = jax.jit(lambda k, x: jnp.argmax(
        x + jax.vmap(lambda key: jax.random.gumbel(key, (V,), jnp.float32))(k), axis=1))
    rows.append(("draw only: Gumbel-max (R*V random numbers)", *timed(gumbel, keys, logits, repeats=args.repeats)))
    rows.append(("draw only: inverse CDF (R random numbers)",
                 *timed(jax.jit(S.sample_inverse_cdf), logits, keys, repeats=args.repeats)))

    env = f"{jax.devices()[0].device_kind} ({jax.default_backend()}), {os.cpu_count()} CPUs, jax {jax.__version__}"
    commit = os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip()
    lines = [f"# Sampler cost per call, R={R} rows, V={V}",
             "", f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC", f"- commit: {commit}",
             f"- device: {env}", f"- load average at the end: {os.getloadavg()}",
             f"- command: {shlex.join([sys.executable, *sys.argv])}", "",
             "| case | median ms | min ms |", "|---|---|---|"]
    lines += [f"| {name} | {med:.2f} | {best:.2f} |" for name, med, best in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
