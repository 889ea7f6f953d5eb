"""`startup` mode: seconds from `python -m jaxserve serve` to /health answering 200 and to its first completion,
with a fresh compilation cache (cold), then again on the cache the first start filled (warm). With
`model.write_checkpoint` the server loads a random safetensors checkpoint written to the disk, the cold start
with its files dropped from the page cache (`disk_checkpoint`)."""
from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

import httpx

from jaxserve.utils import startup_timeline

from . import disk_checkpoint
from .config import server_flags
from .metrics import fmt
from .report import Table
from .serve import running_server

def run_startup(run) -> None:
    cfg, wl = run.cfg, run.cfg["workload"]
    timeout = float(cfg["serve"]["startup_timeout_s"])
    starts = {}
    with tempfile.TemporaryDirectory(prefix="jaxserve-startup-") as tmp, disk_checkpoint.served_config(run) as served:
        for start in ("cold", "warm"):
            log = run.out_dir / f"server-{start}.log"
            flags = server_flags(served) + ["--compilation-cache-dir", str(Path(tmp) / "xla")]
            print(f"[bench] {start} start (log: {log})", flush=True)
            t0 = time.perf_counter()
            with running_server(flags, log, timeout) as url:
                health = time.perf_counter() - t0
                r = httpx.post(f"{url}/v1/completions", timeout=timeout,
                               json={"prompt": wl["prompt"], "max_tokens": int(wl["max_tokens"]), "temperature": 0})
                r.raise_for_status()
                first = time.perf_counter() - t0
            starts[start] = {"health_s": health, "first_completion_s": first, "text": r.json()["choices"][0]["text"]}
            phases = starts[start]["phases_s"] = {}     # the server's start-up timeline (both processes log it)
            for name, seconds in re.findall(startup_timeline.LINE, log.read_text(errors="replace")):
                phases[name] = phases.get(name, 0.0) + float(seconds)
    run.result["jaxserve"] = starts
    if "disk" in run.result:
        disk_checkpoint.report(run, starts)
    rows = [[k, s["health_s"], s["first_completion_s"], *map(s["phases_s"].get, startup_timeline.PHASES)]
            for k, s in starts.items()]
    run.tables.append(Table("Start-up (seconds from the process start)",
                            ["start", "/health 200", "first completion", *startup_timeline.PHASES], rows))
    run.notes.append("cold: a fresh compilation cache folder; warm: the same folder again. The phases are the "
                     "server's start-up timeline from its log (server-cold.log, server-warm.log)")
    if starts["cold"]["text"] != starts["warm"]["text"]:
        run.notes.append("WARNING: the cold and the warm server answered the greedy prompt differently")


def summary(run) -> str:
    s, disk = run.result["jaxserve"], run.result.get("disk")
    line = (f"{run.cfg['name']}: /health cold {fmt(s['cold']['health_s'])} s, warm {fmt(s['warm']['health_s'])} s; "
            f"first completion {fmt(s['cold']['first_completion_s'])} / {fmt(s['warm']['first_completion_s'])} s")
    if disk and s["cold"].get("weights_of_disk"):
        line += (f"; weights cold {fmt(s['cold']['weights_GBps'])} GB/s = {fmt(100 * s['cold']['weights_of_disk'])} % "
                 f"of the disk's read, warm {fmt(s['warm']['weights_GBps'])} GB/s")
    return line
