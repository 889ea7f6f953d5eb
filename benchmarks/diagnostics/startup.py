"""Start-up time: how long until jaxserve answers, from a fresh compile cache (cold) and a warm one.

    generate   `python -m jaxserve generate --chat --prompt ...` one prompt, process start to exit, cold then
               warm, ``--rounds`` times (also `--enforce-eager`, cold); the answers must be the same
    serve      `python -m jaxserve serve MODEL ...` until /health is 200 and until a first completion returns,
               cold then warm (the second start reuses the first's cache folder)
    compile    the warm-up's planned variants compiled one by one and ``--workers`` at a time (cache off, each
               in its own process so no in-memory cache helps the second), wall seconds of each
    pad        pad or wait: a prompt's own bucket compiled (seconds) against its step run padded to the largest
               bucket (milliseconds more per step) — what a step does while its bucket compiles
    dummy      `--load-format dummy` weights of ``--model``: seconds and seconds per GB of the fill (first call
               with its compiles, then again), against ``jax.random.normal`` over the same shapes
    parity     greedy tokens of the same prompts with each step in its own bucket against only the smallest and
               largest compiled (steps padded up), in one process: the same ids, or where they part and the top-2
               logprob gap there (random weights give near-ties that a different program's rounding flips)

Every run is a fresh process with a fresh cache folder under a temporary directory. CPU time (user + sys of
the child) is reported next to wall time: on a shared machine wall time mostly measures the neighbours.

    .venv/bin/python benchmarks/diagnostics/startup.py generate --out benchmarks/results/2026-12-01-cpu-startup.json
    python benchmarks/diagnostics/startup.py serve --model llama-3.1-8b --load-format dummy   # on the GPU host
    python benchmarks/diagnostics/startup.py dummy --model llama-3.1-8b
    python benchmarks/diagnostics/startup.py parity --model llama-3.1-8b --load-format dummy
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # as a script
from benchmarks.envinfo import environment  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "What is the capital of France?"


TREE = ROOT          # the checkout whose jaxserve the children run (--tree: A/B against another one)


def _child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if TREE != ROOT:
        env["PYTHONPATH"] = TREE + os.pathsep + env.get("PYTHONPATH", "")
    return env


def timed(cmd: list[str]) -> dict:
    """Run ``cmd`` to completion: wall seconds, the child's CPU seconds, stdout, and the exit code."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=TREE, env=_child_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if p.returncode:
        sys.stderr.write(p.stderr[-3000:])
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "rc": p.returncode, "stdout": p.stdout}


def run_generate(a) -> dict:
    base = [sys.executable, "-m", "jaxserve", "generate", "--chat", "--prompt", a.prompt,
            "--max-tokens", str(a.max_tokens), *a.flags]
    rounds = []
    for _ in range(a.rounds):
        tmp = tempfile.mkdtemp(prefix="jaxserve-startup-")
        try:
            cache = os.path.join(tmp, "xla")
            cold = timed(base + ["--compilation-cache-dir", cache])
            warm = timed(base + ["--compilation-cache-dir", cache])
            r = {"cold": cold, "warm": warm}
            if not a.skip_eager:
                r["enforce_eager_cold"] = timed(base + ["--compilation-cache-dir", os.path.join(tmp, "xla-eager"),
                                                        "--enforce-eager"])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        rounds.append(r)
        print(", ".join(f"{k} {v['wall_s']} s (cpu {v['cpu_s']})" for k, v in r.items()), file=sys.stderr)
    answers = {r[k]["stdout"] for r in rounds for k in r}
    return {"rounds": [{k: {x: v for x, v in r[k].items() if x != "stdout"} for k in r} for r in rounds],
            "same_output": len(answers) == 1, "output": sorted(answers)[0]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_once(a, cache: str) -> dict:
    import httpx
    port = _free_port()
    cmd = [sys.executable, "-m", "jaxserve", "serve", *([a.model] if a.model else []), "--port", str(port),
           "--host", "127.0.0.1", "--compilation-cache-dir", cache, *a.flags]
    if a.load_format:
        cmd += ["--load-format", a.load_format]
    log = open(os.path.join(os.path.dirname(cache), f"serve-{port}.log"), "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=TREE, env=_child_env(), stdout=log, stderr=subprocess.STDOUT)
    out = {}
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}) before /health answered: {log.name}")
            if time.perf_counter() - t0 > a.timeout:
                raise RuntimeError(f"no /health 200 within {a.timeout} s")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        out["health_s"] = round(time.perf_counter() - t0, 2)
        r = httpx.post(url + "/v1/completions", json={"prompt": a.prompt, "max_tokens": a.max_tokens,
                                                      "temperature": 0}, timeout=a.timeout)
        r.raise_for_status()
        out["first_completion_s"] = round(time.perf_counter() - t0, 2)
        out["text"] = r.json()["choices"][0]["text"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    with open(log.name) as f:
        out["startup_log"] = [line.rstrip() for line in f if "compiled" in line or "loaded" in line][:6]
    return out


def run_serve(a) -> dict:
    tmp = tempfile.mkdtemp(prefix="jaxserve-startup-")
    try:
        cache = os.path.join(tmp, "xla")
        cold = _serve_once(a, cache)
        print(f"cold: /health {cold['health_s']} s, first completion {cold['first_completion_s']} s", file=sys.stderr)
        warm = _serve_once(a, cache)
        print(f"warm: /health {warm['health_s']} s, first completion {warm['first_completion_s']} s", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"cold": cold, "warm": warm, "same_output": cold["text"] == warm["text"]}


def compile_child(workers: int, model: str | None, load_format: str | None) -> None:
    """In a fresh process: the engine without its warm-up, then every planned variant, timed."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.core import EngineCore
    from jaxserve.runner.step_compiler import StepCompiler
    eng = EngineCore(EngineConfig(model=model, load_format=load_format or "auto", enforce_eager=True,
                                 compilation_cache_dir=""), progress=False)
    runner = eng.runner
    first, rest = runner.planned_variants()
    compiler = StepCompiler(runner._lower_variant, workers=max(workers - 1, 1))
    t0 = time.perf_counter()
    if workers == 1:            # one after the other, on this thread (the warm-up before the thread pool)
        for k in first + rest:
            compiler.need(k, "the serial baseline")
    else:                       # workers - 1 threads and this one
        compiler.compile_now(first + rest)
    print(json.dumps({"workers": workers, "variants": len(first) + len(rest), "first": len(first),
                      "wall_s": round(time.perf_counter() - t0, 2),
                      "sum_of_compiles_s": round(sum(compiler.seconds.values()), 2)}))


def run_pad(a) -> dict:
    import numpy as np

    from jaxserve.config import EngineConfig
    from jaxserve.engine.core import EngineCore
    eng = EngineCore(EngineConfig(model=a.model, load_format=a.load_format or "auto", enforce_eager=True,
                                 compilation_cache_dir=""), progress=False)
    runner = eng.runner
    text = eng.tokenizer.apply_chat_template([{"role": "user", "content": a.prompt}], add_generation_prompt=True,
                                             tokenize=False)
    n = len(eng.tokenizer.encode(text, add_special_tokens=False))
    own, largest = runner.bucket_for(n), runner.buckets[-1]
    out = {"prompt_tokens": n, "own_bucket": own, "largest_bucket": largest}
    for T in (own, largest):
        t0 = time.perf_counter()
        exe = runner.variants.need(("forward", T, False), "pad mode")
        out[f"compile_{T}_s"] = round(time.perf_counter() - t0, 2)
        ints, _ = runner._forward_inputs(T)
        times = []
        for _ in range(a.rounds + 1):
            t0 = time.perf_counter()
            runner.kv_caches, logits = exe(runner.model.params, runner.kv_caches, ints, runner._no_prev)
            logits.block_until_ready()
            times.append(time.perf_counter() - t0)
        out[f"step_{T}_ms"] = round(1e3 * float(np.median(times[1:])), 1)
    out["padding_costs_ms_per_step"] = round(out[f"step_{largest}_ms"] - out[f"step_{own}_ms"], 1)
    print(out, file=sys.stderr)
    return out


def run_dummy(a) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxserve.models import load_model
    from jaxserve.runner import compile_cache
    compile_cache.enable("")        # nothing from an earlier run: the first load pays its compiles
    model = a.model or "llama-3.2-1b"
    out = {"model": model}
    for run in ("first", "again"):
        t0 = time.perf_counter()
        m = load_model(model, load_format="dummy")
        leaves = jax.tree.leaves(m.params)
        jax.block_until_ready(leaves)
        out[f"{run}_s"] = round(time.perf_counter() - t0, 3)
    gb = sum(x.size * x.dtype.itemsize for x in leaves) / 1e9
    out["gb"] = round(gb, 3)
    out["again_s_per_gb"] = round(out["again_s"] / gb, 3)
    shapes = sorted({(x.shape, x.dtype) for x in leaves if x.ndim > 1}, key=str)
    normal = {s: jax.jit(lambda k, s=s: jax.random.normal(k, s[0], s[1]) * jnp.asarray(0.02, s[1])) for s in shapes}
    key = jax.random.key(0)
    for s in shapes:                                   # compiled outside the timing
        jax.block_until_ready(normal[s](key))
    t0 = time.perf_counter()                           # one array of each shape (it is slow on a CPU)
    jax.block_until_ready([normal[s](key) for s in shapes])
    shapes_gb = sum(math.prod(s[0]) * s[1].itemsize for s in shapes) / 1e9
    out["jax_random_normal_s_per_gb"] = round((time.perf_counter() - t0) / shapes_gb, 3)
    print(out, file=sys.stderr)
    return out


def run_parity(a) -> dict:
    import jax

    from jaxserve import LLM, SamplingParams
    from jaxserve.config import EngineConfig
    from jaxserve.runner.model_runner import token_buckets

    kw = dict(use_tqdm_on_load=False, max_model_len=1024)
    if a.model:
        kw.update(model=a.model, load_format=a.load_format or "auto")
    prompts = [a.prompt, "Once upon a time in a land far away there lived a king who had three daughters and"]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, logprobs=2, ignore_eos=True)
    sched = EngineConfig().resolved(jax.default_backend()).scheduler
    default = token_buckets(sched.max_num_batched_tokens)
    # the buckets these short prompts' steps use (every one up to 64 tokens) and the largest: each step in
    # its own bucket, against only the smallest and largest compiled (every prefill padded to the largest)
    every = tuple(b for b in default if b <= 64) + (default[-1],)
    runs = {}
    for name, buckets in (("every bucket", every), ("smallest and largest", (every[0], every[-1]))):
        llm = LLM(token_buckets=buckets, **kw)
        llm.wait_compiled()
        runs[name] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
        del llm
        gc.collect()                   # the first engine's weights and KV cache go before the second's
    out = {"buckets": list(every), "prompts": []}
    for i, p in enumerate(prompts):
        x, y = runs["every bucket"][i], runs["smallest and largest"][i]
        entry = {"prompt": p, "same_ids": x.token_ids == y.token_ids, "text": [x.text, y.text]}
        if not entry["same_ids"]:
            at = next(j for j, (u, v) in enumerate(zip(x.token_ids, y.token_ids)) if u != v)
            top = sorted(x.logprobs[at].values(), key=lambda lp: -lp.logprob)
            entry |= {"first_differs_at": at, "top2_logprob_gap_there": round(top[0].logprob - top[1].logprob, 5)}
        out["prompts"].append(entry)
    print(out, file=sys.stderr)
    return out


def run_compile(a) -> dict:
    out = []
    for w in (1, a.workers):
        r = timed([sys.executable, os.path.abspath(__file__), "compile-child", "--workers", str(w),
                   *(["--model", a.model] if a.model else []), *(["--load-format", a.load_format] if a.load_format else [])])
        res = json.loads(r["stdout"].strip().splitlines()[-1])
        res["cpu_s"] = r["cpu_s"]
        out.append(res)
        print(res, file=sys.stderr)
    return {"runs": out, "speedup": round(out[0]["wall_s"] / out[1]["wall_s"], 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["generate", "serve", "compile", "pad", "dummy", "parity", "compile-child"])
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default=None, help="serve: the model argument (default: the embedded SmolLM2)")
    p.add_argument("--load-format", default=None)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--flags", nargs=argparse.REMAINDER, default=[], help="more jaxserve flags (last)")
    p.add_argument("--skip-eager", action="store_true", help="generate: no --enforce-eager run")
    p.add_argument("--tree", default=None, help="run the jaxserve of this checkout instead (A/B)")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    a = p.parse_args(argv)
    global TREE
    TREE = os.path.abspath(a.tree) if a.tree else ROOT
    if a.mode == "compile-child":
        compile_child(a.workers, a.model, a.load_format)
        return 0
    result = {"generate": run_generate, "serve": run_serve, "compile": run_compile, "pad": run_pad,
              "dummy": run_dummy, "parity": run_parity}[a.mode](a)
    result = {"mode": a.mode, "argv": sys.argv, "tree": os.path.relpath(TREE, ROOT), "environment": environment(sys.argv, devices_in_subprocess=True),
              **result}
    text = json.dumps(result, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
