"""Where a steady-state decode step's time goes: N requests all decoding, the step's wall time by host phase,
the GPU's busy time and span per step, and the host's functions by own time.

    python benchmarks/diagnostics/decode_phases.py --batch 256 --prompt-len 128 --steps 40 --profile --cprofile
    python benchmarks/diagnostics/decode_phases.py --model qwen3-30b-a3b --batch 1 --steps 100 --profile
    python benchmarks/diagnostics/decode_phases.py --model CHECKPOINT_DIR --batch 64 --num-scheduler-steps 8
    python benchmarks/diagnostics/decode_phases.py --smoke --profile --cprofile    # CPU, tiny-llama3 (checks it)

The engine runs in this process (``LLM(multiprocess=False)``: the timers wrap its objects). ``--batch``
requests of ``--prompt-len`` random tokens (greedy, ``ignore_eos``, long enough never to finish in the run)
are added at once; the engine steps until every one of them decodes in the same step (all prefills done), a
few more warm-up steps, then ``--steps`` steps are timed. Every timed step schedules exactly ``--batch``
decodes, so its figure is the N-row decode step itself, not an ``LLM.generate`` run whose prefills and
decodes overlap.

Phases (ms per step; ``host_overhead.PhaseTimer``'s, which together are the step's wall time):
``schedule``; ``prepare`` and ``sampling_metadata`` (the step's host arrays); ``exe:forward`` /
``exe:sample`` / ``exe:decode-loop`` (multi-step), the calls of the compiled executables: host time to hand
the arguments over and launch, on a GPU including XLA's command-buffer update; ``dispatch_other`` (the rest of
the runner's dispatch); ``device_wait`` (the wait for the previous step's tokens inside ``collect``: with async
scheduling the device time the host did not cover); ``collect_other``; ``update_from_output``;
``postprocess`` (the output processor: stop checks, detokenization, RequestOutputs); ``mask`` (structured
outputs); ``step_other`` (the engine's own code between them). ``host`` = wall - device_wait.

``--profile`` traces ``--profile-steps`` more steps with ``jax.profiler`` and summarises them with
``profile_summary.py``: the GPU's busy time (the union of its kernels) against its span per step, the
kernel table and the host spans. The tracer slows the host down (its step wall is printed beside it), so read
the busy time against the untraced step wall. ``--cprofile`` runs ``--cprofile-steps`` more under cProfile
and prints the functions by own time per step (cProfile inflates every figure: compare rows with each other).
``--json FILE`` writes the figures with the command and commit.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)        # benchmarks.diagnostics.* when run as a script

from benchmarks.diagnostics.host_overhead import (  # noqa: E402
    PHASES, TINY, PhaseTimer, function_table, short_commit, write_json)

SMOKE = dict(batch=8, prompt_len=16, steps=6, warmup=2, max_model_len=128, token_buckets="8,64",
             profile_steps=3, cprofile_steps=3)


class DecodePhaseTimer(PhaseTimer):
    """host_overhead's phase timers with the executables' calls also split by kind (``exe:forward``,
    ``exe:sample``, ``exe:decode-loop``): the forward's call is where a GPU step's host time goes into XLA."""

    def _wrap_result(self, obj, attr, name):
        fn = getattr(obj, attr)
        self.wrapped.append((obj, attr, fn))

        def wrapper(key, *a, **k):
            exe = fn(key, *a, **k)
            kind = key[0] if isinstance(key, tuple) else str(key)
            return None if exe is None else self._timed(self._timed(exe, f"exe:{kind}"), name)
        setattr(obj, attr, wrapper)

    def step(self):
        n = len(self.steady)
        outs = super().step()
        if len(self.steady) > n:
            self.steady[-1].update((k, v) for k, v in self.cur.items() if k.startswith("exe:"))
        return outs


def phase_names(recs: list[dict]) -> list[str]:
    """The phases to print, in step order: ``dispatch_jit`` replaced by its executables, which sum to it."""
    exes = sorted({k for r in recs for k in r if k.startswith("exe:")}, key=lambda k: (k != "exe:forward", k))
    out = []
    for p in PHASES:
        out += exes if p == "dispatch_jit" else [p]
    return out


def token_buckets(a) -> tuple[int, ...]:
    """``--token-buckets``, or the batch (its decode step's bucket) and 2048 (the prefill chunks')."""
    if a.token_buckets:
        return tuple(int(b) for b in a.token_buckets.split(","))
    return max(a.batch, 4), max(2048, a.batch)


def make_llm(a):
    from jaxserve.llm import LLM

    buckets = token_buckets(a)
    model = TINY if a.smoke else a.model
    load_format = a.load_format or ("auto" if os.path.isdir(model) else "dummy")
    # max_num_seqs: a batch-1 run keeps the engine's usual 4-row decode step
    return LLM(model, load_format=load_format, dtype=a.dtype, max_model_len=a.max_model_len,
               max_num_seqs=max(a.batch, 4), max_num_batched_tokens=max(buckets), token_buckets=buckets,
               enable_prefix_caching=False, num_scheduler_steps=a.num_scheduler_steps, multiprocess=False,
               use_tqdm_on_load=False)


def mean_context(eng) -> float:
    s = eng.core.scheduler
    lens = [s.get_request(rid).num_tokens for rid in s.request_ids()]
    return float(np.mean(lens)) if lens else 0.0


def window(timer: DecodePhaseTimer, steps: int, around=None) -> dict:
    """``steps`` engine steps (inside the context manager ``around``: a tracer, a profiler), each of which
    must be a steady one (every request decoding); the per-step means of the phases (ms), the loop's own wall
    per step (``loop_ms``: the steps and the timers' bookkeeping) and the mean context before and after."""
    eng = timer.eng
    timer.steady.clear()
    ctx0 = mean_context(eng)
    with around or contextlib.nullcontext():
        t0 = time.perf_counter()
        for _ in range(steps):
            timer.step()
        loop_ms = (time.perf_counter() - t0) * 1e3 / steps
    if len(timer.steady) != steps:
        raise RuntimeError(f"only {len(timer.steady)} of {steps} steps had all {timer.want} requests decoding "
                           f"(a request finished or was preempted): raise --max-model-len or lower --batch")
    keys = {k for r in timer.steady for k in r}
    res = {k: 1e3 * float(np.mean([r.get(k, 0.0) for r in timer.steady])) for k in keys}
    return {**res, "loop_ms": loop_ms, "context": [round(ctx0, 1), round(mean_context(eng), 1)]}


def measure(a) -> dict:
    """Load, reach the steady state, time the window; then the traced and the cProfiled windows if asked."""
    import jax

    from jaxserve.sampling_params import SamplingParams

    nss = a.num_scheduler_steps
    prefill_steps = -(-a.batch * a.prompt_len // max(token_buckets(a))) + 2
    needed = (prefill_steps + a.warmup + a.steps + (a.profile_steps if a.profile else 0)
              + (a.cprofile_steps if a.cprofile else 0)) * nss + 1
    if a.prompt_len + needed > a.max_model_len:
        raise SystemExit(f"--max-model-len {a.max_model_len} leaves a {a.prompt_len}-token prompt "
                         f"{a.max_model_len - a.prompt_len} tokens, and this run decodes up to {needed}: pass "
                         f"--max-model-len {a.prompt_len + needed} or more (or fewer --steps)")
    t_load = time.perf_counter()
    llm = make_llm(a)
    eng = llm.engine
    eng.core.runner.wait_compiled()        # the steady state: no background compile competes with the steps
    load_s = time.perf_counter() - t_load
    vocab = eng.model_config.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=a.max_model_len - a.prompt_len, ignore_eos=True)
    timer = DecodePhaseTimer(eng)
    timer.want = a.batch
    for i in range(a.batch):
        eng.add_request(f"decode-phases-{i}", rng.integers(3, min(vocab, 30000), size=a.prompt_len).tolist(),
                        params)
    limit = prefill_steps + a.batch + 8
    for n in range(limit):
        timer.step()
        if timer.steady:
            break
    else:
        raise RuntimeError(f"{limit} steps and never all {a.batch} requests decoding in one step: is the KV "
                           f"cache too small for them (preemption)? Lower --batch or --max-model-len")
    for _ in range(a.warmup):
        timer.step()
    res = {"model": "tiny-llama3" if a.smoke else a.model, "backend": jax.default_backend(), "batch": a.batch,
           "prompt_len": a.prompt_len, "num_scheduler_steps": nss, "steps": a.steps, "token_buckets":
           list(eng.core.runner.buckets), "load_s": round(load_s, 1), "steps_to_steady": n + 1}
    w = window(timer, a.steps)
    res.update(w, output_tok_s=a.batch * nss * 1e3 / w["wall"])
    if a.profile:
        from benchmarks.diagnostics.profile_summary import summarize
        with tempfile.TemporaryDirectory() as d:
            res["traced_wall_ms"] = window(timer, a.profile_steps, around=jax.profiler.trace(d))["wall"]
            res["profile"] = summarize(d, per=a.profile_steps, top=a.top)
    if a.cprofile:
        prof = cProfile.Profile()
        res["cprofile_wall_ms"] = window(timer, a.cprofile_steps, around=prof)["wall"]
        res["cprofile_table"] = function_table(prof, a.cprofile_steps, top=a.top)
    timer.restore()
    eng.abort_request(eng.request_ids())
    llm.shutdown()
    res["phases"] = phase_names([w])
    return res


def format_table(r: dict) -> str:
    """The step's wall time, tok/s, each phase's ms per step and share of the step, the GPU's per step."""
    wall = r["wall"]
    out = [f"{r['model']} ({r['backend']}): {r['batch']} requests decoding, {r['num_scheduler_steps']} token(s) "
           f"a step, context {r['context'][0]:g} -> {r['context'][1]:g}; {r['steps']} steps, means",
           "", "| per step | ms | % of the step |", "|---|---|---|",
           f"| **wall** | {wall:.3f} | 100 |"]
    out += [f"| {p} | {r.get(p, 0.0):.3f} | {100 * r.get(p, 0.0) / wall:.1f} |" for p in r["phases"]]
    out.append(f"| host (wall - device_wait) | {r['host']:.3f} | {100 * r['host'] / wall:.1f} |")
    for dev, d in sorted(r.get("profile", {}).get("devices", {}).items()):
        out.append(f"| {dev} busy (traced) | {d['busy_us'] / 1e3:.3f} | {100 * d['busy_us'] / 1e3 / wall:.1f} |")
        out.append(f"| {dev} span (traced; step wall under the tracer {r['traced_wall_ms']:.3f}) | "
                   f"{d['span_us'] / 1e3:.3f} | |")
    out.append(f"\noutput tok/s: {r['output_tok_s']:,.1f} (the loop, with the timers' bookkeeping: "
               f"{r['loop_ms']:.3f} ms per step)")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b",
                   help="a configs/models name (dummy weights) or a checkpoint directory")
    p.add_argument("--load-format", default=None, help="default: dummy for a name, auto for a directory")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=256, help="requests decoding together")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=40, help="steady-state steps timed")
    p.add_argument("--warmup", type=int, default=5, help="steady-state steps run before the timed ones")
    p.add_argument("--token-buckets", default=None,
                   help="comma-separated; default: the batch (its decode step) and 2048 (the prefills)")
    p.add_argument("--num-scheduler-steps", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--profile", action="store_true", help="trace more steps: GPU busy / span, kernels, host spans")
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--cprofile", action="store_true", help="cProfile more steps: functions by own time per step")
    p.add_argument("--cprofile-steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25, help="rows of the kernel, host span and function tables")
    p.add_argument("--smoke", action="store_true",
                   help="CPU-sized run of tests/fixtures/models/tiny-llama3 (checks the script)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.dtype = "float32"
        given = {x.split("=")[0] for x in (argv if argv is not None else sys.argv[1:])}
        for k, v in SMOKE.items():      # the small sizes, unless given on the command line
            if f"--{k.replace('_', '-')}" not in given:
                setattr(a, k, v)
    r = measure(a)
    print(format_table(r))
    if "profile" in r:
        from benchmarks.diagnostics.profile_summary import format_summary
        print()
        print(format_summary(r["profile"], title=f"traced steps ({r['batch']} decodes each)", top=a.top))
    if "cprofile_table" in r:
        print(f"\ncProfile of {a.cprofile_steps} steps (step wall {r['cprofile_wall_ms']:.3f} ms under it), "
              f"functions by own time:")
        print(r["cprofile_table"])
    if a.json:
        commit = short_commit()
        write_json(a.json, __file__, argv, commit, [r])
    return 0


if __name__ == "__main__":
    sys.exit(main())
