"""Named suites: `jaxserve bench --suite NAME` runs a list of configs, `--suite` alone lists the suites;
``--ab OLD_TREE`` runs a suite at an old checkout and at this tree, interleaved. A suite is
configs/bench/suites/NAME.yaml (``runs``: each one `jaxserve bench` process); its keys and ``--ab``:
benchmarks/README.md, "Suites"."""
from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from .config import BENCH_CONFIG_DIR, REPO_ROOT, ConfigError, resolve_config_path
from .report import RESULTS_DIR

SUITE_DIR = BENCH_CONFIG_DIR / "suites"
RUN_KEYS = {"configs", "set", "env", "gpus", "timeout_s"}


def suite_names() -> list[str]:
    return sorted(p.stem for p in SUITE_DIR.glob("*.yaml"))


def load_suite(name: str) -> dict:
    """The suite's description and its runs, each ``{configs, set, env, gpus, timeout_s}``; every config named
    must exist."""
    path = SUITE_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"suite {name!r} not found (known in configs/bench/suites: {', '.join(suite_names())})")
    raw = yaml.safe_load(path.read_text()) or {}
    runs = []
    for i, entry in enumerate(raw.get("runs") or []):
        run = {"configs": entry} if isinstance(entry, list) else dict(entry)
        if set(run) - RUN_KEYS or not run.get("configs"):
            raise ConfigError(f"{path}: run {i + 1} needs configs and may have {', '.join(sorted(RUN_KEYS))}")
        for c in run["configs"]:
            resolve_config_path(c)
        runs.append({"set": [], "env": {}, "gpus": 1, "timeout_s": None, **run})
    if not runs:
        raise ConfigError(f"{path}: no runs")
    return {"name": name, "description": raw.get("description", ""), "runs": runs}


def list_suites() -> int:
    for name in suite_names():
        s = load_suite(name)
        n, runs = sum(len(r["configs"]) for r in s["runs"]), len(s["runs"])
        print(f"{name:34s} {s['description']} ({n} config{'s' * (n != 1)}, {runs} run{'s' * (runs != 1)})")
        for r in s["runs"]:
            extra = "".join(f" --set {w}" for w in r["set"]) + (f" [{r['gpus']} GPUs]" if r["gpus"] > 1 else "")
            print(f"{'':36s}{' '.join(r['configs'])}{extra}")
    return 0


def visible_gpus() -> int:
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    n = sum(line.startswith("GPU ") for line in listed.splitlines())
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    return n if chosen is None else min(n, len([d for d in chosen.split(",") if d.strip()]))


def run_command(run: dict, overrides: list[str], out: str | None) -> list[str]:
    """The bench arguments of one run (after `python -m jaxserve bench` or `python -m benchmarks.runner`)."""
    args = [w for c in run["configs"] for w in ("--config", c)]
    args += [w for s in [*run["set"], *overrides] for w in ("--set", str(s))]
    return args + (["--out", out] if out else [])


def run_once(cmd: list[str], env: dict, cwd: Path, timeout_s: float | None) -> tuple[int, list[str]]:
    """Runs ``cmd``, its output passed through; (exit code, the lines after its "== summary ==")."""
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **{k: str(v) for k, v in env.items()}},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    # SIGTERM at the limit: the runner unwinds on it (a started server is stopped, finished configs are kept)
    timer = threading.Timer(timeout_s or 0, proc.terminate)
    if timeout_s:
        timer.start()
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    timed_out = timer.finished.is_set()       # set once it fired (cancel, which sets it too, comes after)
    timer.cancel()
    summary = lines[lines.index("== summary ==") + 1:] if "== summary ==" in lines else []
    return rc, summary + ([f"TIMED OUT after {timeout_s:.0f} s"] if timed_out else [])


def run_suite(name: str, overrides: list[str], out: str | None, ab: str | None = None, rounds: int = 2) -> int:
    suite = load_suite(name)
    gpus = visible_gpus()
    sides = [("old", Path(ab).resolve()), ("new", REPO_ROOT)] if ab else [("", None)]
    if ab and not (Path(ab) / "benchmarks" / "runner.py").is_file():
        raise ConfigError(f"--ab {ab}: not a jaxserve checkout (no benchmarks/runner.py)")
    root = Path(out or RESULTS_DIR).resolve()
    summary, failed = [], 0
    for rnd in range(1, (rounds if ab else 1) + 1):
        for side, tree in sides:
            for i, run in enumerate(suite["runs"]):
                what = f"{name} run {i + 1}/{len(suite['runs'])}" + (f", round {rnd} {side} ({tree})" if ab else "")
                if run["gpus"] > max(gpus, 1):        # a run of one device runs on a CPU host too
                    summary.append(f"{what}: skipped, needs {run['gpus']} GPUs ({gpus} visible)")
                    continue
                if ab:      # each tree's own runner from its own root: its jaxserve, benchmarks and configs
                    cmd = [sys.executable, "-m", "benchmarks.runner",
                           *run_command(run, overrides, str(root / "ab" / f"{side}-{rnd}"))]
                else:
                    cmd = [sys.executable, "-m", "jaxserve", "bench", *run_command(run, overrides, out)]
                print(f"\n=== {what}: {' '.join(cmd[1:])}", flush=True)
                t0 = time.monotonic()
                rc, lines = run_once(cmd, run["env"], tree or Path.cwd(), run["timeout_s"])
                failed += rc != 0
                summary += [f"=== {what}: exit {rc}, {time.monotonic() - t0:.0f} s", *lines]
        if ab:          # after every round: a suite cut short still shows the rounds it finished
            summary.append(ab_table(root / "ab", [c for r in suite["runs"] for c in r["configs"]]))
            print(f"\n== after round {rnd} ==\n{summary[-1]}", flush=True)
    print(f"\n== suite {name} summary ==")
    print("\n".join(summary))
    return 1 if failed else 0


def ab_table(root: Path, configs: list[str]) -> str:
    """Each config's output tok/s at the old and the new tree: the median over the rounds so far."""
    rows = ["| config | old output tok/s | new output tok/s | new / old | runs |", "|---|---|---|---|---|"]
    for name in dict.fromkeys(configs):
        got = {side: [json.loads(Path(f).read_text()).get("jaxserve", {}).get("output_tok_per_s")
                      for f in sorted(glob.glob(str(root / f"{side}-*" / f"????-??-??-{name}" / "result.json")))]
               for side in ("old", "new")}
        got = {side: [v for v in vals if v] for side, vals in got.items()}
        if not all(got.values()):
            continue
        old, new = (statistics.median(got[s]) for s in ("old", "new"))
        runs = "; ".join(f"{s}: {', '.join(f'{v:.1f}' for v in vals)}" for s, vals in got.items())
        rows.append(f"| {name} | {old:.1f} | {new:.1f} | {new / old:.3f} | {runs} |")
    return "\n".join(rows)
