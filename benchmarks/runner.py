"""`python -m jaxserve bench --config NAME [--config NAME ...] [--set key=value ...]` (`python -m benchmarks.runner`
from the repo root): each config runs its mode and writes benchmarks/results/<date>-<name>/; configs given together
share one engine when their options match, every HF baseline first (benchmarks/README.md)."""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import roofline
from .config import REPO_ROOT, ConfigError, engine_kwargs, load_configs, missing_configs, resolve_config_path
from .metrics import fmt
from .models import kv_dtype, resolve_model, weight_dtype
from .report import Table, results_dir, write_report


class _BaselinePhaseDone(Exception):
    """Raised by Run.llm() in the baseline phase: the mode has handed its prompts to the baseline."""


COMPILE_WAIT_S = 600.0   # a step variant still compiling after this is a bug worth seeing in the report


class EngineCache:
    """One live `jaxserve.LLM` at a time, reused by configs with the same model + engine options."""

    def __init__(self):
        self.key, self.llm = None, None

    def get(self, kwargs: dict):
        key = json.dumps(kwargs, sort_keys=True, default=str)
        if key != self.key:
            self.close()                      # two engines would each claim most of the accelerator
            from jaxserve import LLM
            print(f"[bench] loading the engine: {kwargs}", flush=True)
            t = time.perf_counter()
            self.llm = LLM(**kwargs)
            self.key, self.load_s = key, time.perf_counter() - t
            t = time.perf_counter()
            done = self.llm.wait_compiled(timeout=COMPILE_WAIT_S)   # measure the steady state, not compiles
            print(f"[bench] engine up in {self.load_s:.1f} s (load + warm-up compiles); background compiles "
                  f"{'done' if done else 'NOT done'} after {time.perf_counter() - t:.1f} s more", flush=True)
        return self.llm

    def close(self):
        if self.llm is not None:
            self.llm.shutdown()               # a split engine's core process lets go of the accelerator
        self.llm, self.key = None, None
        gc.collect()


@dataclass
class Run:
    """Everything one config's run needs and produces."""
    cfg: dict
    raw_workload: dict
    argv: list[str]
    engines: EngineCache
    phase: str = "main"                       # "baseline" (HF only, no JAX) or "main"
    base_url: str | None = None
    out_dir: Path | None = None
    env: dict = field(default_factory=dict)
    hw: roofline.Hardware | None = None
    model_config: object = None
    hf_config: dict | None = None
    dtype: str = "float32"
    cost: roofline.ModelCost | None = None
    baseline_result: dict | None = None
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    result: dict = field(default_factory=dict)

    def __post_init__(self):
        self.rng = np.random.default_rng(self.cfg["seed"])

    def llm(self):
        if self.phase == "baseline":
            raise _BaselinePhaseDone
        return self.engines.get(engine_kwargs(self.cfg))

    def tokenizer(self):
        """A tokenizer for ShareGPT lengths (serve mode: no engine in this process): an HF folder's, else None
        (≈ words)."""
        path = self.cfg["model"].get("path")
        if path and Path(path).is_dir():
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(path)
        return None

    def limits_note(self) -> str:
        hw, dt = self.hw, self.dtype
        return (f"limits from configs/hardware/{hw.source_file}: {hw.bandwidth / 1e12:.3g} TB/s read "
                f"({hw.bandwidth_source}), {hw.flops(dt) / 1e12:.4g} TFLOP/s {dt} "
                f"({hw.flops_source.get(dt, '')})" + (f", × {hw.num_devices} devices" if hw.num_devices > 1 else ""))

    def hf_baseline(self, kind: str, prompts: list[list[int]], output_lens: list[int]) -> dict | None:
        """The HF transformers numbers for the same prompts (run in the baseline phase, in a subprocess)."""
        base = self.cfg["baseline"]
        if not base.get("hf"):
            return None
        if self.phase == "main":
            return self.baseline_result
        try:
            self.baseline_result = run_hf_subprocess(self, kind, prompts, output_lens)
        except Exception as e:            # the baseline is a comparison, never a reason to lose the run
            print(f"[bench] HF baseline failed: {e}", file=sys.stderr, flush=True)
            self.baseline_result = {"error": str(e)[:500], "note": f"HF baseline failed: {str(e)[:200]}"}
        raise _BaselinePhaseDone


def run_hf_subprocess(run: Run, kind: str, prompts: list[list[int]], output_lens: list[int]) -> dict:
    base = run.cfg["baseline"]
    methods = base.get("methods") or (["generate"] if kind == "latency" else ["generate_batch"])
    n = int(base.get("num_prompts") or len(prompts))
    python = base.get("python") or sys.executable
    if "/" in python and not Path(python).is_absolute():
        python = str(REPO_ROOT / python)          # a path relative to the repo, e.g. .venv-oracle/bin/python
    dtype = weight_dtype(run.cfg, "cpu" if base.get("device") == "cpu" else "gpu")
    spec = {"hf_config": run.hf_config, "dtype": dtype, "device": base.get("device", "auto"),
            "prompts": prompts[:n], "output_lens": output_lens[:n], "methods": methods, "seed": run.cfg["seed"],
            "iters": int(base.get("iters") or run.cfg["workload"].get("iters", 3)),
            "warmup_iters": int(run.cfg["workload"].get("warmup_iters", 1))}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        print(f"[bench] HF transformers baseline ({', '.join(methods)}, {n} prompts) with {python}", flush=True)
        # run as a script: the baseline's interpreter needs torch and transformers, not jaxserve
        proc = subprocess.run([python, str(Path(__file__).with_name("hf_baseline.py")), str(spec_path), str(out_path)],
                              timeout=float(base.get("timeout_s") or 900), env={**os.environ, "JAX_PLATFORMS": "cpu"})
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"the HF baseline (benchmarks/hf_baseline.py) exited with {proc.returncode}")
        out = json.loads(out_path.read_text())
    res = {**out["results"][methods[0]], "all_methods": out["results"], "environment": out["environment"]}
    subset = f" on the first {n} of {len(prompts)} prompts" if n < len(prompts) else ""
    res["note"] = (f"HF baseline: transformers {out['environment']['transformers']} / torch "
                   f"{out['environment']['torch']} {methods[0]}"
                   f"{' (paged|sdpa attention)' if methods[0] == 'generate_batch' else ' (sdpa)'}{subset}, "
                   f"same model shape with random weights, {dtype}, eos disabled; device "
                   f"{out['environment']['device_name']}")
    return res


# mode -> (module, function), imported when a run of that mode starts
MODES = {"throughput": ("offline", "run_throughput"), "latency": ("offline", "run_latency"),
         "serve": ("serve", "run_serve"), "startup": ("startup", "run_startup"),
         "kernels": ("kernel_bench", "run_kernels"), "lora": ("lora", "run_lora")}
SERVER_MODES = ("serve", "startup")      # a server process of their own: it needs the accelerator first


def run_mode(run) -> None:
    module, fn = MODES[run.cfg["mode"]]
    getattr(importlib.import_module(f".{module}", __package__), fn)(run)


def prepare_model(run: Run) -> None:
    run.model_config, run.hf_config = resolve_model(run.cfg)


def prepare_main(run: Run, out_root: str | None) -> None:
    """Environment, hardware limits and the model's roofline counts (initialises JAX)."""
    from .envinfo import environment
    # this process must not initialise the devices the server (serve, startup), an mp engine or replicas own
    eng = run.cfg["engine"]
    spans_processes = eng.get("distributed_executor_backend") == "mp" or int(eng.get("data_parallel_size") or 1) > 1
    run.env = environment(run.argv, devices_in_subprocess=run.cfg["mode"] in SERVER_MODES or spans_processes)
    devices = int(eng.get("tensor_parallel_size") or 1) * int(eng.get("data_parallel_size") or 1)
    run.hw = roofline.resolve_hardware(run.cfg["hardware"], run.env["device_kind"], run.env["platform"], devices)
    mismatch = roofline.hardware_mismatch(run.cfg["hardware"], run.env["device_kind"], run.env["platform"])
    if mismatch:
        print(f"[bench] {mismatch}", file=sys.stderr, flush=True)
        run.notes.append(mismatch)
    if run.model_config is not None:
        run.dtype = weight_dtype(run.cfg, run.env["platform"])
        run.cost = roofline.model_cost(run.model_config, run.dtype, kv_dtype(run.cfg, run.dtype),
                                       quantization=run.cfg["engine"].get("quantization"))
    run.out_dir = results_dir(out_root, run.cfg["name"])


def finish(run: Run, elapsed: float) -> Path:
    c = run.cost
    run.result["hardware"] = run.hw.describe(run.dtype) if run.hw else None
    if c is not None:
        run.result["model"] = {"config": {k: v for k, v in vars(run.model_config).items()},
                               "params": c.params, "weight_bytes": c.weight_bytes,
                               "kv_bytes_per_token": c.kv_bytes_per_token, "dtype": run.dtype}
        run.tables.append(Table("Model and limits", ["params", "weights read per step GB", "KV bytes/token", "dtype",
                                                     "read TB/s", "peak TFLOP/s", "hardware"],
                                [[c.params, c.weight_bytes / 1e9, c.kv_bytes_per_token, run.dtype,
                                  run.hw.bandwidth / 1e12, run.hw.flops(run.dtype) / 1e12,
                                  f"{run.hw.name} × {run.hw.num_devices}"]]))
    if run.baseline_result:
        run.result["hf_baseline"] = run.baseline_result
    run.result["bench_seconds"] = elapsed
    run.notes += [f"WARNING: {m}" for m in roofline.take_exceeded()]
    return write_report(run.out_dir, run.cfg, run.env, run.result, run.tables, [n for n in run.notes if n])


def summary_line(run: Run) -> str:
    """One line of headline numbers per config, for the summary at the end (and a suite's)."""
    r, name = run.result, run.cfg["name"]
    j = r.get("jaxserve") or {}
    hf = run.baseline_result if run.baseline_result and "error" not in run.baseline_result else None
    if run.cfg["mode"] == "throughput" and j:
        lim = r["roofline"]["output_tok_s"]
        s = (f"{name}: {fmt(j['output_tok_per_s'])} output tok/s ({fmt(roofline.percent(j['output_tok_per_s'], lim))}% "
             f"of {fmt(lim)}), {fmt(j['total_tok_per_s'])} total tok/s, {fmt(j['requests_per_s'], 2)} req/s")
        if hf and hf.get("output_tok_per_s"):
            s += f"; HF {hf['method']} {fmt(hf['output_tok_per_s'])} → ×{j['output_tok_per_s'] / hf['output_tok_per_s']:.2f}"
        return s
    if run.cfg["mode"] == "latency" and j:
        ro, bps = r["roofline"], r["roofline"]["achieved_bandwidth_Bps"]
        s = (f"{name}: e2e mean {j['e2e_s']['mean']:.3f} s ({fmt(roofline.percent(ro['e2e_bound_s'], j['e2e_s']['mean']))}% "
             f"of limit), {fmt(j['output_tok_per_s'])} output tok/s, decode step {j['decode_step_s'] * 1e3:.2f} ms = "
             f"{f'{bps / 1e12:.2f} TB/s' if bps >= 1e11 else f'{bps / 1e9:.2f} GB/s'} "
             f"({fmt(roofline.percent(bps, run.hw.bandwidth))}%)")
        if hf and hf.get("e2e_s"):
            s += f"; HF generate {hf['output_tok_per_s']:.1f} tok/s → ×{hf['e2e_s']['mean'] / j['e2e_s']['mean']:.2f}"
        return s
    if run.cfg["mode"] == "serve" and r.get("points"):
        parts = [f"{(str(p['sweep_value']) + ': ') if r['sweep_param'] else ''}{fmt(p['output_throughput'])} tok/s "
                 f"TTFT p50 {fmt(p['ttft_ms']['median'])} ms TPOT p50 {fmt(p['tpot_ms']['median'])} ms"
                 f"{' (' + str(p['failed']) + ' failed)' if p['failed'] else ''}" for p in r["points"]]
        return f"{name} ({r['sweep_param'] or 'one load'}): " + "; ".join(parts)
    if run.cfg["mode"] in ("startup", "lora") and j:
        return importlib.import_module(f".{MODES[run.cfg['mode']][0]}", __package__).summary(run)
    if run.cfg["mode"] == "kernels" and r.get("summary"):
        return f"{name}: " + "; ".join(f"{what}: {res}" for what, res in r["summary"][:4])
    return f"{name}: done ({run.cfg['mode']})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxserve bench",
                                description="Config-driven benchmarks (configs/bench/*.yaml); see benchmarks/README.md")
    p.add_argument("--config", action="append",
                   help="a configs/bench name or a YAML path (repeat to run several in one process)")
    p.add_argument("--suite", nargs="?", const="", default=None, metavar="NAME",
                   help="run a named suite of configs (configs/bench/suites/NAME.yaml), a process per run; "
                        "without NAME: list the suites")
    p.add_argument("--ab", default=None, metavar="OLD_TREE",
                   help="with --suite: also run it at OLD_TREE (a checkout of the old commit), interleaved old / "
                        "new, and print each config's new / old output tok/s")
    p.add_argument("--rounds", type=int, default=2, help="--ab: old / new rounds (default 2)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value by dotted key, e.g. --set workload.num_prompts=10 (applies to every "
                        "--config, and every run of a --suite)")
    p.add_argument("--base-url", default=None, help="serve mode: benchmark a running server instead of starting one")
    p.add_argument("--out", default=os.environ.get("JAXSERVE_BENCH_RESULTS"),
                   help="results root (default: benchmarks/results)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--hf-baseline", action="store_true", help="also run the HF transformers baseline (baseline.hf)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if missing_configs():
        print(f"bench: {missing_configs()}", file=sys.stderr)
        return 2
    if args.suite is not None:
        return _run_suite(args)
    if args.ab:
        parser.error("--ab compares a suite's runs: give --suite NAME")
    if not args.config:
        parser.error("give --config NAME (repeatable) or --suite NAME (--suite alone lists the suites)")
    if threading.current_thread() is not threading.main_thread():
        return _run(args, argv)
    # SIGTERM (a time limit) unwinds like Ctrl-C, so a started server is stopped, not orphaned
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _run(args, argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_suite(args) -> int:
    from . import suites
    if args.config or args.base_url:
        print("bench: --suite runs its own configs (no --config or --base-url with it)", file=sys.stderr)
        return 2
    try:
        if not args.suite:
            return suites.list_suites()
        return suites.run_suite(args.suite, _overrides(args), args.out, ab=args.ab, rounds=args.rounds)
    except ConfigError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2


def _overrides(args) -> list[str]:
    """--set words, with --no-plots and --hf-baseline as the settings they stand for."""
    return args.overrides + (["report.plots=false"] if args.no_plots else []) + \
        (["baseline.hf=true"] if args.hf_baseline else [])


def _run(args, argv: list[str]) -> int:
    overrides = _overrides(args)
    try:
        configs = load_configs(args.config, overrides)
    except (ConfigError, ValueError) as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    engines = EngineCache()
    set_workload = {o.split("=", 1)[0][len("workload."):]: True for o in overrides if o.startswith("workload.")}
    runs = [Run(cfg, {**_raw_workload(c), **set_workload}, argv, engines, base_url=args.base_url)
            for c, cfg in zip(args.config, configs)]
    failures = 0
    for run in runs:                                   # phase 1: HF baselines, before JAX claims the GPU
        if run.cfg["baseline"].get("hf") and run.cfg["mode"] in ("throughput", "latency"):
            run.phase = "baseline"
            try:
                prepare_model(run)
                run_mode(run)
            except _BaselinePhaseDone:
                pass
            except Exception as e:                 # phase 2 meets the same error and reports it
                print(f"[bench] {run.cfg['name']}: no HF baseline ({type(e).__name__}: {e})", file=sys.stderr)
            run.phase = "main"
    summaries = []
    # phase 2: jaxserve. Serve and startup configs first: their server needs the accelerator before this
    # process's JAX (offline engine, kernels) claims it.
    runs.sort(key=lambda r: r.cfg["mode"] not in SERVER_MODES)
    for run in runs:
        t0 = time.perf_counter()
        run.rng = np.random.default_rng(run.cfg["seed"])   # same prompts as the baseline phase drew
        try:
            if run.cfg["mode"] != "kernels":
                prepare_model(run)
            prepare_main(run, args.out)
            print(f"[bench] {run.cfg['name']} ({run.cfg['mode']}) → {run.out_dir}", flush=True)
            run_mode(run)
            md = finish(run, time.perf_counter() - t0)
            print(md.read_text(), flush=True)
            summaries.append(summary_line(run))
            roofline.take_exceeded()          # its figures warn again; the report's notes already carry them
        except Exception as e:                         # one config failing does not stop the others
            failures += 1
            traceback.print_exc()
            print(f"bench: {run.cfg['name']} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            summaries.append(f"{run.cfg['name']}: FAILED ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")
            if run.out_dir is not None:
                (run.out_dir / "error.txt").write_text(traceback.format_exc())
    engines.close()
    print("\n== summary ==")
    for s in summaries:
        print(s)
    return 1 if failures else 0


def _raw_workload(name_or_path: str) -> dict:
    """The workload keys the file itself sets (defaults excluded): ShareGPT keeps its reply lengths
    unless output_len is given explicitly."""
    import yaml
    try:
        return dict((yaml.safe_load(resolve_config_path(name_or_path).read_text()) or {}).get("workload") or {})
    except (ConfigError, OSError):
        return {}


if __name__ == "__main__":
    sys.exit(main())
