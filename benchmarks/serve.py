"""`serve` mode: start `python -m jaxserve serve` (or target --base-url) and drive it with the load generator, once
per value of a `workload.sweep` (benchmarks/README.md's "serve")."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from . import plots, roofline
from .config import REPO_ROOT, server_flags
from .loadgen import run_load
from .metrics import fmt, serving_metrics
from .report import Table
from .workloads import add_structured_outputs, image_requests, prefix_requests, random_requests, sharegpt_requests

SWEEP_PARAMS = ("max_concurrency", "request_rate", "structured_fraction")


@contextlib.contextmanager
def running_server(args: list[str], log_path: Path, timeout_s: float, env: dict | None = None):
    """`python -m jaxserve serve ARGS --host 127.0.0.1 --port P` until /health answers 200; yields the base
    URL; SIGTERM (then SIGKILL) on exit. A server that dies or never gets ready is one clear error."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:            # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "jaxserve", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    base_url = f"http://127.0.0.1:{port}"
    log = open(log_path, "w")
    log.write(" ".join(cmd) + "\n")
    log.flush()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready; "
                                   f"its log: {log_path}\n{_tail(log_path)}")
            try:
                if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s; its log: {log_path}")
            time.sleep(0.5)
        yield base_url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


_COUNTER = re.compile(r"^\w+:(prefix_cache_queries|prefix_cache_hits|num_preemptions|structured_output_mask_steps"
                      r"|structured_output_mask_ms|structured_output_mask_wait_ms|step_variants_pending|images_encoded"
                      r"|encoder_seconds|engine_steps|engine_step_ms|engine_device_wait_ms|engine_tokens"
                      r"|engine_padded_tokens|spec_decode_\w+?)"
                      r"(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)$")


def scrape_counters(base_url: str, api_key: str | None = None) -> dict[str, float]:
    """The counters ``_COUNTER`` names, from the server's /metrics (empty if it has none)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10.0, headers=headers).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if m := _COUNTER.match(line.strip()):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def counter_delta(before: dict, after: dict) -> dict:
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    q = d.get("prefix_cache_queries")
    d["prefix_cache_hit_rate"] = d.get("prefix_cache_hits", 0.0) / q if q else None
    images = d.get("images_encoded")
    d["encoder_ms_per_image"] = d.get("encoder_seconds", 0.0) * 1e3 / images if images else None
    steps = d.get("engine_steps")
    if steps:   # the engine loop's ms per step: inside step(), and of that waiting for the device
        d["engine_ms_per_step"] = d.get("engine_step_ms", 0.0) / steps
        d["engine_device_wait_ms_per_step"] = d.get("engine_device_wait_ms", 0.0) / steps
    padded = d.get("engine_padded_tokens")
    # the share of the forwards' token rows that were padding (the steps' buckets over their tokens)
    d["engine_padding_fraction"] = 1.0 - d.get("engine_tokens", 0.0) / padded if padded else None
    masked = d.get("structured_output_mask_steps")
    d["structured_mask_ms_per_step"] = d.get("structured_output_mask_ms", 0.0) / masked if masked else None
    d["structured_mask_wait_ms_per_step"] = d.get("structured_output_mask_wait_ms", 0.0) / masked if masked else None
    return d


def build_requests(run, num_prompts: int, seed_offset: int = 0, structured_fraction: float | None = None):
    """The dataset's requests, ``structured_fraction`` (default the workload's) with a JSON-schema constraint."""
    import numpy as np
    wl = run.cfg["workload"]
    rng = np.random.default_rng(run.cfg["seed"] + seed_offset)
    fraction = float(wl["structured_fraction"] if structured_fraction is None else structured_fraction)
    reqs = _dataset_requests(run, rng, num_prompts)
    return add_structured_outputs(np.random.default_rng(run.cfg["seed"] + seed_offset + 1), reqs, fraction,
                                  wl["structured_schema"]) if fraction else reqs


def _dataset_requests(run, rng, num_prompts: int):
    wl, vocab = run.cfg["workload"], run.model_config.vocab_size
    kind = wl["dataset"]
    if kind == "random":
        return random_requests(rng, num_prompts, wl["input_len"], wl["output_len"], vocab)
    if kind == "prefix":
        return prefix_requests(rng, num_prompts, int(wl["num_prefixes"]), int(wl["prefix_len"]),
                               wl["input_len"], wl["output_len"], vocab)
    if kind == "images":
        return image_requests(rng, num_prompts, int(wl["image_size"]), wl["input_len"], wl["output_len"])
    if kind == "sharegpt":
        if not wl.get("dataset_path"):
            raise ValueError("workload.dataset is sharegpt but workload.dataset_path is not set")
        out = wl["output_len"] if "output_len" in run.raw_workload else None
        return sharegpt_requests(rng, wl["dataset_path"], num_prompts, out, tokenizer=run.tokenizer(),
                                 max_len=run.cfg["engine"].get("max_model_len"))
    raise ValueError(f"workload.dataset is {kind!r}; expected random, sharegpt, prefix or images")


def sweep_points(wl: dict) -> tuple[str | None, list]:
    sweep = wl.get("sweep")
    if not sweep:
        return None, [None]
    if not isinstance(sweep, dict) or len(sweep) != 1 or next(iter(sweep)) not in SWEEP_PARAMS:
        raise ValueError(f"workload.sweep: expected {{max_concurrency: [..]}}, {{request_rate: [..]}} or {{structured_fraction: [..]}}, got {sweep!r}")
    param, values = next(iter(sweep.items()))
    return param, list(values)


def prompt_counts(wl: dict, values: list) -> list[int]:
    """Requests per sweep point: workload.num_prompts, or a list of one count per sweep value."""
    n = wl["num_prompts"]
    if isinstance(n, (list, tuple)):
        if len(n) != len(values):
            raise ValueError(f"workload.num_prompts has {len(n)} counts for {len(values)} sweep values")
        return [int(x) for x in n]
    return [int(n)] * len(values)


def run_serve(run) -> None:
    cfg, wl = run.cfg, run.cfg["workload"]
    param, values = sweep_points(wl)
    counts = prompt_counts(wl, values)
    base_url = run.base_url or cfg["serve"]["base_url"]
    with contextlib.ExitStack() as stack:
        if not base_url:
            log_path = run.out_dir / "server.log"
            print(f"[bench] starting the server (log: {log_path})", flush=True)
            base_url = stack.enter_context(running_server(server_flags(cfg), log_path,
                                                          float(cfg["serve"]["startup_timeout_s"])))
        run.result["base_url"] = base_url
        warm = int(wl["warmup_requests"] or 0)
        if warm:
            # the warm-up asks for what the points will (a grammar: its bitmask sampler compiles on first use),
            # then waits for the server's background compiles: the points measure the compiled steady state
            fraction = max(float(v) for v in values) if param == "structured_fraction" else None
            reqs = build_requests(run, warm, seed_offset=10_000, structured_fraction=fraction)
            api_key = cfg["serve"]["api_key"]
            deadline = time.monotonic() + float(cfg["serve"]["startup_timeout_s"])
            while True:
                asyncio.run(run_load(base_url, reqs, max_concurrency=warm, api_key=api_key,
                                     ignore_eos=wl["ignore_eos"], progress=False))
                if not scrape_counters(base_url, api_key).get("step_variants_pending") or time.monotonic() > deadline:
                    break
                time.sleep(2.0)
        points = []
        for i, value in enumerate(values):
            rate = float(value if param == "request_rate" else wl["request_rate"])
            conc = int(value) if param == "max_concurrency" else wl["max_concurrency"]
            fraction = float(value) if param == "structured_fraction" else None
            reqs = build_requests(run, counts[i], seed_offset=i, structured_fraction=fraction)
            label = f"{param}={value}" if param else "requests"
            before = scrape_counters(base_url, cfg["serve"]["api_key"])
            timings, duration = asyncio.run(run_load(
                base_url, reqs, request_rate=rate, burstiness=float(wl["burstiness"]), max_concurrency=conc,
                seed=cfg["seed"] + i, ignore_eos=wl["ignore_eos"], api_key=cfg["serve"]["api_key"],
                timeout_s=float(cfg["serve"]["request_timeout_s"]), desc=label))
            m = serving_metrics(timings, duration, wl.get("slo") or None)
            m["server_counters"] = sc = counter_delta(before, scrape_counters(base_url, cfg["serve"]["api_key"]))
            # a gauge, not a counter: what was still compiling when the point began (its figures include it)
            sc["compiles_pending_at_start"] = before.get("step_variants_pending", 0.0)
            sc.pop("step_variants_pending", None)
            if sc.get("engine_step_ms") is not None and duration:
                sc["engine_busy_fraction"] = sc["engine_step_ms"] / (duration * 1e3)
            m.update({"sweep_value": value, "request_rate": rate, "max_concurrency": conc,
                      "roofline": _limit(run, reqs, conc)})
            m.update({f"{k}_samples_ms": [v * 1e3 for t in timings if t.success and (v := getattr(t, a)) is not None]
                      for k, a in (("ttft", "ttft"), ("e2el", "e2e"), ("tpot", "tpot"))})
            points.append(m)
            # kept as it goes: a run cut short by a time limit still leaves the points it finished
            (run.out_dir / "points_partial.json").write_text(json.dumps(
                [{k: v for k, v in p.items() if not k.endswith("_samples_ms")} for p in points], default=str))
            busy = sc.get("engine_busy_fraction")
            print(f"[bench] {label}: {fmt(m['output_throughput'])} output tok/s, "
                  f"TTFT median {fmt(m['ttft_ms']['median'])} ms, {m['failed']} failed"
                  + (f"; engine loop busy {busy:.0%}, {fmt(sc.get('engine_ms_per_step'))} ms a step "
                     f"({fmt(sc.get('engine_device_wait_ms_per_step'))} waiting for the device)" if busy else "")
                  + (f", {sc['engine_padding_fraction']:.0%} of its token rows padding"
                     if sc.get("engine_padding_fraction") is not None else ""),
                  flush=True)
    (run.out_dir / "points_partial.json").unlink(missing_ok=True)
    run.result["points"] = points
    run.result["sweep_param"] = param
    _tables(run, points, param)
    if cfg["report"]["plots"]:
        _plots(run, points, param)


def pending_compile_notes(points: list[dict], param: str | None) -> list[str]:
    """A note for each point that began while the server still had background compiles (the warm-up waits for
    them up to its time limit): its figures include their host and GPU time."""
    return [f"{param or 'the run'}={p['sweep_value']}: {n:.0f} background compiles were still pending when the "
            "point began: its figures include them"
            for p in points if (n := p["server_counters"].get("compiles_pending_at_start"))]


def _limit(run, reqs, conc) -> dict:
    """The roofline for this point: the same requests at the concurrency the load allows."""
    n = len(reqs)
    batch = min(n, int(conc or n), int(run.cfg["engine"].get("max_num_seqs") or 256))
    return roofline.generation_bound(run.cost, run.hw, n, sum(r.prompt_len for r in reqs) / n,
                                     sum(r.output_len for r in reqs) / n, batch)


def _tables(run, points: list[dict], param: str | None) -> None:
    slo = bool(run.cfg["workload"].get("slo"))
    head = ([param] if param else []) + ["req/s", "output tok/s", "total tok/s", "limit output tok/s",
                                         "% of limit", "TTFT mean/median/p99 ms", "TPOT mean/median/p99 ms",
                                         "ITL mean/median/p99 ms", "E2E mean/median/p99 ms"] \
        + (["goodput req/s"] if slo else []) + ["prefix-cache hit %", "preemptions", "failed"]
    t = Table(f"Serving: {run.cfg['workload']['dataset']} dataset, {run.cfg['workload']['num_prompts']} requests"
              + (" per point" if param else ""), head)
    for p in points:
        trio = lambda k: " / ".join(fmt(p[k][s]) for s in ("mean", "median", "p99"))
        lim = p["roofline"]["output_tok_s"]
        row = ([p["sweep_value"]] if param else []) + [
            p["request_throughput"], p["output_throughput"], p["total_token_throughput"], lim,
            roofline.percent(p["output_throughput"], lim, f"output tok/s at {p['sweep_value']}"), trio("ttft_ms"), trio("tpot_ms"), trio("itl_ms"),
            trio("e2el_ms")] + ([p["goodput"]] if slo else []) + [
            None if p["server_counters"].get("prefix_cache_hit_rate") is None
            else 100 * p["server_counters"]["prefix_cache_hit_rate"],
            p["server_counters"].get("num_preemptions"), p["failed"]]
        t.rows.append(row)
    run.tables.append(t)
    run.notes += pending_compile_notes(points, param)
    errors = {e: c for p in points for e, c in p["errors"].items()}
    for e, c in list(errors.items())[:5]:
        run.notes.append(f"{c} failed: {e}")
    if run.cfg["model"].get("load_format") == "dummy":
        v = run.model_config.vocab_size
        run.notes.append(
            f"dummy weights: the server detokenizes with the embedded SmolLM2 tokenizer (49,152 ids); the other "
            f"{max(v - 49152, 0):,} of the model's {v:,} ids decode to no text and get no stream chunk, so TTFT "
            f"and ITL (timed on text chunks, as vLLM's bench does) are stretched — TTFT by ~{max(v / 49152 - 1, 0):.1f} "
            "decode steps on average; TPOT and tok/s use the usage token counts and are exact")
    untimed = {p["sweep_value"]: p["untimed"] for p in points if p.get("untimed")}
    if untimed:
        run.notes.append(f"requests that streamed no text at all (every token beyond the tokenizer), per point "
                         f"{untimed}: completed by their usage counts, left out of TTFT / TPOT / ITL and goodput")
    run.notes.append("prefix-cache hit % and preemptions: the server's /metrics counters over each point "
                     "(hits / queries, in the engine's units)")
    for v, c in ((p["sweep_value"], p["server_counters"]) for p in points if p["server_counters"].get("spec_decode_num_drafts")):
        acc, drafted, runs = (c[f"spec_decode_num_{k}"] for k in ("accepted_tokens", "draft_tokens", "drafts"))
        run.notes.append(f"speculative decoding{'' if v is None else f' at {v}'}: {acc:.0f} of {drafted:.0f} draft tokens "
                         f"accepted ({100 * acc / drafted:.1f} %), {acc / runs:.2f} per draft")
    if slo:
        run.notes.append(f"goodput = successful requests within every SLO {run.cfg['workload']['slo']} per second")
    run.notes.append("limit output tok/s: the same requests in waves of min(concurrency, max_num_seqs), "
                     f"prefill against compute, decode steps against bandwidth; {run.limits_note()}")


def _plots(run, points: list[dict], param: str | None) -> None:
    name = run.cfg["name"]
    label = (lambda p: f"{param}={p['sweep_value']}") if param else (lambda p: "all")
    for key, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E latency")):
        plots.cdf(run.out_dir / f"{key}_cdf.png", {label(p): p[f"{key}_samples_ms"] for p in points},
                  "ms", f"{name}: {title}")
    if param and len(points) > 1:
        plots.sweep(run.out_dir / "throughput_vs_latency.png", points, param, f"{name}: sweep over {param}")
