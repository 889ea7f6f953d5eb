"""Soak test of the HTTP server over loopback: many requests at high concurrency, ~20 % of the streams
cancelled mid-stream, then the books are checked.

With --hostile-fraction F a share F of the requests are hostile or careless: deeply nested
JSON, multi-megabyte prompts, prompt scoring (echo + logprobs over a long prompt), heavy request chat
templates, prompts x n bursts past the limit, a body sent too slowly, and the structured-output kinds of
tests/server/soak_grammars.py (hostile constraints, and constrained requests whose outputs must follow their
constraint); each kind must get its expected answer.
The same ordinary load first runs alone (--baseline-requests of it), so the report compares the ordinary
streams' TTFT p99 with and without the hostile mix (it must stay within --max-ttft-ratio).

Reports 5xx count, hung requests (no answer within --request-timeout), leaked KV blocks (KV usage on
/metrics once nothing runs or waits, times the number of blocks) and the server's RSS at start, after
the first tenth of the load (warm) and at the end. Bounded: --requests and --time-limit; loopback only.

    .venv/bin/python tests/server/soak.py --requests 2000 --concurrency 64 --out soak.md
starts `python -m jaxserve serve` itself (embedded SmolLM2, flags from --server-flags); --url uses a
server that is already running (then RSS is read only if --server-pid is given).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import Counter

import httpx

from soak_grammars import GRAMMAR_HOSTILE, grammar_request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["Tell me a story about a dragon.", "What is 17 times 23?", "List three fruits.",
           "Explain gravity to a child.", "Write a haiku about the sea.", "Translate 'good morning' to French.",
           "Why is the sky blue?", "Name the planets of the solar system."]


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return out or "?"


# hostile request kinds -> the statuses that are a correct answer
HOSTILE = {
    "nested_json": {400},
    "huge_prompt": {400, 413},
    "scoring": {200},
    "heavy_template": {200, 400},
    "choices_burst": {400},
    "slow_body": {408},
    **GRAMMAR_HOSTILE,
}
HEAVY_TEMPLATE = ("{% for i in range(20000) %}{% for j in range(100) %}{% endfor %}{% endfor %}"
                  "{{ messages[0].content }}")


def _descendants(pid: int) -> list[int]:
    """pid and every process under it (the split engine's core is the server's child)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def rss_mb(pid: int | None) -> float | None:
    """The resident memory of the server and its child processes (the engine core), summed."""
    if pid is None:
        return None
    total = None
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total = (total or 0.0) + int(line.split()[1]) / 1024
        except OSError:
            continue
    return total


def read_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
            out[name] = float(value)
    return out


def num_blocks(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("jaxserve:cache_config_info{") or line.startswith("vllm:cache_config_info{"):
            for part in line.split("{", 1)[1].split("}", 1)[0].split(","):
                k, _, v = part.partition("=")
                if k == "num_gpu_blocks":
                    return int(v.strip('"'))
    return None


class Tally:
    def __init__(self):
        self.status = Counter()
        self.outcome = Counter()
        self.hung = 0
        self.errors: list[str] = []
        self.done = 0
        self.ttft: list[float] = []               # ordinary, uncancelled streams: seconds to the first event
        self.hostile = Counter()                  # "kind status" -> count
        self.hostile_wrong: list[str] = []
        self.invalid_constrained: list[str] = []   # constrained outputs that do not follow their constraint


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


async def slow_body(url: str, path: str, headers: dict, timeout: float) -> int:
    """A client that sends its headers and half its body, then stalls: the server must answer 408."""
    u = httpx.URL(url)
    reader, writer = await asyncio.open_connection(u.host, u.port)
    try:
        head = [f"POST {path} HTTP/1.1", f"Host: {u.host}", "Content-Type: application/json", "Content-Length: 64",
                *[f"{k}: {v}" for k, v in headers.items()], "", ""]
        writer.write("\r\n".join(head).encode() + b'{"prompt": "stalled')
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
        return int(line.split()[1]) if line else 0
    finally:
        writer.close()


async def hostile_request(client: httpx.AsyncClient, url: str, args, rng: random.Random, tally: Tally) -> None:
    kind = rng.choice(args.hostile_kinds)
    chat_msgs = [{"role": "user", "content": "hello"}]
    if kind == "slow_body":
        status = await slow_body(url, "/v1/completions", dict(client.headers), args.request_timeout)
    else:
        if kind in GRAMMAR_HOSTILE:
            path, body, check = grammar_request(kind, rng)
            r = await client.post(path, json=body)
            problem = check(r.json()) if r.status_code == 200 else None
            if problem is not None:
                tally.invalid_constrained.append(f"{kind}: {problem}")
        elif kind == "nested_json":
            depth = 3000
            r = await client.post("/v1/completions", content=b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}",
                                  headers={"content-type": "application/json"})
        elif kind == "huge_prompt":
            r = await client.post("/v1/completions", json={"prompt": "hello " * 1_300_000, "max_tokens": 4})
        elif kind == "scoring":   # lm-eval's loglikelihood request: score the prompt, generate nothing
            r = await client.post("/v1/completions", json={"prompt": " ".join(["word"] * args.scoring_words),
                                                           "max_tokens": 0, "echo": True, "logprobs": 1})
        elif kind == "heavy_template":
            r = await client.post("/v1/chat/completions", json={"messages": chat_msgs, "max_tokens": 4,
                                                                "chat_template": HEAVY_TEMPLATE})
        else:                     # choices_burst: prompts x n past --max-request-choices
            r = await client.post("/v1/completions", json={"prompt": ["x"] * 40, "n": 64, "max_tokens": 4})
        status = r.status_code
        if status >= 500:
            tally.errors.append(f"{kind}: {r.text[:300]}")
    tally.status[status] += 1
    tally.hostile[f"{kind} {status}"] += 1
    if status not in HOSTILE[kind]:
        tally.hostile_wrong.append(f"{kind} -> {status}")


async def one_request(client: httpx.AsyncClient, i: int, args, rng: random.Random, tally: Tally,
                      hostile_fraction: float = 0.0) -> None:
    if rng.random() < hostile_fraction:
        try:
            await asyncio.wait_for(hostile_request(client, str(client.base_url), args, rng, tally),
                                   timeout=args.request_timeout)
        except asyncio.TimeoutError:
            tally.hung += 1
        except (httpx.HTTPError, OSError) as e:
            tally.outcome[f"hostile_transport_error:{type(e).__name__}"] += 1
        finally:
            tally.done += 1
        return
    chat = rng.random() < 0.5
    stream = rng.random() < 0.7
    cancel = stream and rng.random() < args.cancel_fraction / 0.7
    max_tokens = rng.randint(4, args.max_tokens)
    prompt = rng.choice(PROMPTS) + f" ({i})"
    common = {"max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8]), "stream": stream,
              "seed": i if rng.random() < 0.5 else None}
    if cancel:
        common["max_tokens"] = args.max_tokens * 4  # long enough to still be running when we leave
        common["ignore_eos"] = True
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}
    else:
        path, body = "/v1/completions", {"prompt": prompt, **common}

    async def go():
        if not stream:
            r = await client.post(path, json=body)
            tally.status[r.status_code] += 1
            if r.status_code >= 500:
                tally.errors.append(r.text[:300])
            tally.outcome["complete"] += 1
            return
        async with client.stream("POST", path, json=body) as r:
            tally.status[r.status_code] += 1
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                if r.status_code >= 500:
                    tally.errors.append(text[:300])
                return
            events = 0
            stop_after = rng.randint(1, 4) if cancel else None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if events == (1 if chat else 0) and not cancel:    # chat's first event is the role alone
                    tally.ttft.append(time.monotonic() - t_start)
                if '"error"' in line:
                    tally.outcome["error_event"] += 1
                    tally.errors.append(line[:300])
                if line == "data: [DONE]":
                    tally.outcome["complete"] += 1
                    return
                events += 1
                if stop_after is not None and events >= stop_after:
                    tally.outcome["cancelled"] += 1
                    return  # leaving the context closes the connection mid-stream
            tally.outcome["stream_ended_without_done"] += 1

    t_start = time.monotonic()
    try:
        await asyncio.wait_for(go(), timeout=args.request_timeout)
    except asyncio.TimeoutError:
        tally.hung += 1
    except httpx.HTTPError as e:
        tally.outcome[f"transport_error:{type(e).__name__}"] += 1
    finally:
        tally.done += 1


async def soak(args, url: str, server_pid: int | None) -> dict:
    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    tally = Tally()
    rss = {"start": rss_mb(server_pid)}
    async with httpx.AsyncClient(base_url=url, limits=limits, headers=headers,
                                 timeout=httpx.Timeout(args.request_timeout)) as client:

        async def phase(num: int, hostile_fraction: float, tally: Tally, trend: list | None) -> float:
            rng = random.Random(args.seed)        # the same ordinary requests in both phases
            sem = asyncio.Semaphore(args.concurrency)
            tenth = max(1, num // 10)
            t0 = time.monotonic()

            async def guarded(i):
                async with sem:
                    if time.monotonic() - t0 > args.time_limit:
                        tally.outcome["skipped_time_limit"] += 1
                        return
                    await one_request(client, i, args, random.Random(rng.random()), tally, hostile_fraction)
                    if trend is not None and tally.done % tenth == 0:
                        mb = rss_mb(server_pid)
                        trend.append(None if mb is None else round(mb))
                        if tally.done == tenth and "warm" not in rss:
                            rss["warm"] = mb
            await asyncio.gather(*(guarded(i) for i in range(num)))
            return time.monotonic() - t0

        baseline = None
        if args.hostile_fraction > 0:             # the ordinary load alone first: TTFT's reference (and warm-up)
            if "scoring" in args.hostile_kinds:   # the first scoring request compiles the prompt scorer (once)
                t_warm = time.monotonic()
                await client.post("/v1/completions", json={"prompt": " ".join(["word"] * args.scoring_words),
                                                           "max_tokens": 0, "echo": True, "logprobs": 1})
                rss["scorer_warmup_s"] = round(time.monotonic() - t_warm, 1)
            if set(args.hostile_kinds) & set(GRAMMAR_HOSTILE):   # the grammar machinery (its tokenizers) first
                path, body, _ = grammar_request("json_schema", random.Random(0))
                await client.post(path, json=body)
            if args.warmup_requests:              # first uses (the step variants' compiles) out of the reference
                await phase(args.warmup_requests, 0.0, Tally(), None)
            baseline = Tally()
            await phase(args.baseline_requests, 0.0, baseline, None)
            rss["warm"] = rss_mb(server_pid)
        rss["trend"] = []  # RSS after each tenth of the requests: a leak climbs, a warm cache flattens
        elapsed = await phase(args.requests, args.hostile_fraction, tally, rss["trend"])
        # the books: once nothing runs or waits, no KV block may be held
        deadline = time.monotonic() + 60
        while True:
            text = (await client.get("/metrics")).text
            m = read_metrics(text)
            busy = m.get("jaxserve:num_requests_running", 0) + m.get("jaxserve:num_requests_waiting", 0)
            if busy == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)
        text = (await client.get("/metrics")).text
        m = read_metrics(text)
        health = (await client.get("/health")).status_code
    rss["end"] = rss_mb(server_pid)
    usage = m.get("jaxserve:kv_cache_usage_perc", 0.0)
    blocks = num_blocks(text)
    ttft_p99 = percentile(tally.ttft, 99)
    base_p99 = percentile(baseline.ttft, 99) if baseline is not None else None
    return {
        "requests": args.requests, "concurrency": args.concurrency, "elapsed_s": round(elapsed, 1),
        "status_counts": dict(sorted(tally.status.items())), "outcomes": dict(tally.outcome),
        "num_5xx": sum(v for k, v in tally.status.items() if k >= 500), "hung": tally.hung,
        "running_after": m.get("jaxserve:num_requests_running"), "waiting_after": m.get("jaxserve:num_requests_waiting"),
        "kv_usage_after": usage, "kv_blocks": blocks,
        "leaked_blocks": round(usage * blocks) if blocks else None,
        "aborts_counted": sum(v for k, v in m.items()
                              if k.startswith("jaxserve:request_success_total{") and 'finished_reason="abort"' in k),
        "generation_tokens": m.get("jaxserve:generation_tokens_total"),
        "health_after": health, "rss_mb": rss, "errors_sample": tally.errors[:5],
        "hostile": dict(sorted(tally.hostile.items())), "hostile_wrong": tally.hostile_wrong[:10],
        "invalid_constrained": tally.invalid_constrained[:10],
        "ttft_p50_s": _round(percentile(tally.ttft, 50)), "ttft_p99_s": _round(ttft_p99),
        "baseline_ttft_p50_s": _round(percentile(baseline.ttft, 50)) if baseline is not None else None,
        "baseline_ttft_p99_s": _round(base_p99),
        "ttft_p99_ratio": round(ttft_p99 / base_p99, 2) if ttft_p99 and base_p99 else None,
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    log = open(os.path.join(ROOT, ".pytest_cache", f"soak-server-{port}.log"), "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > 900:
            proc.kill()
            raise SystemExit("server not ready after 900 s")
        time.sleep(0.5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: the server's pid, for RSS")
    p.add_argument("--server-flags", default="--max-model-len 512 --max-num-seqs 32 --max-num-batched-tokens 128",
                   help="flags for the server this script starts")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request counts as hung")
    p.add_argument("--time-limit", type=float, default=1800.0, help="stop starting requests after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hostile-fraction", type=float, default=0.0,
                   help="share of hostile/careless requests (nested JSON, huge prompts, scoring, heavy templates, "
                        "choice bursts, slow bodies); > 0 runs the ordinary load alone first as the TTFT reference")
    p.add_argument("--hostile-kinds", default=",".join(sorted(HOSTILE)),
                   help="comma-separated hostile kinds to mix in (default all): one at a time shows which one "
                        "slows the ordinary requests")
    p.add_argument("--baseline-requests", type=int, default=500, help="with --hostile-fraction: the reference run")
    p.add_argument("--warmup-requests", type=int, default=64,
                   help="with --hostile-fraction: ordinary requests run and not counted before the reference run "
                        "(its TTFT p99 would otherwise hold the server's first-use compiles)")
    p.add_argument("--scoring-words", type=int, default=300, help="prompt length of the scoring requests")
    p.add_argument("--max-ttft-ratio", type=float, default=3.0,
                   help="with --hostile-fraction: ordinary streams' TTFT p99 may grow this much at most")
    p.add_argument("--max-rss-growth", type=float, default=0.2,
                   help="the server's RSS at the end may exceed its warm value by this share at most")
    p.add_argument("--out", default=None, help="write a markdown report here (and .json beside it)")
    args = p.parse_args()
    args.hostile_kinds = sorted(set(args.hostile_kinds.split(",")))
    unknown = set(args.hostile_kinds) - set(HOSTILE)
    if unknown:
        p.error(f"unknown --hostile-kinds {', '.join(sorted(unknown))}; known: {', '.join(sorted(HOSTILE))}")
    os.makedirs(os.path.join(ROOT, ".pytest_cache"), exist_ok=True)
    proc = None
    startup = None
    if args.url:
        url, pid = args.url, args.server_pid
        host = httpx.URL(url).host
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit("soak.py drives loopback servers only")
    else:
        proc, url, startup = start_server(args.server_flags.split())
        pid = proc.pid
    load_start = os.getloadavg()     # the machine's load: a shared machine slows both phases
    try:
        result = asyncio.run(soak(args, url, pid))
    finally:
        exit_code = None
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                exit_code = proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
    result["server_startup_s"] = round(startup, 1) if startup else None
    result["server_exit_code_after_sigterm"] = exit_code
    rss = result["rss_mb"]
    rss_ok = rss.get("warm") is None or rss.get("end") is None or rss["end"] <= rss["warm"] * (1 + args.max_rss_growth)
    ttft_ok = result["ttft_p99_ratio"] is None or result["ttft_p99_ratio"] <= args.max_ttft_ratio
    ok = (result["num_5xx"] == 0 and result["hung"] == 0 and result["leaked_blocks"] in (0, None)
          and result["kv_usage_after"] == 0 and not result["outcomes"].get("stream_ended_without_done")
          and not result["hostile_wrong"] and not result["invalid_constrained"]
          and result["running_after"] == 0 and result["waiting_after"] == 0
          and rss_ok and ttft_ok)
    result["verdict"] = "PASS" if ok else "FAIL"
    meta = {"date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"), "commit": _commit(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores visible, {platform.system()} "
                       f"{platform.release()} (CPU JAX; shared with other jobs)",
            "command": "python " + shlex.join(sys.argv),
            "load": f"{' / '.join(f'{x:.2f}' for x in load_start)} at the start, "
                    f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())} at the end (1 / 5 / 15-min load averages)"}
    print(json.dumps({**meta, **result}, indent=2))
    if args.out:
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({**meta, **result}, f, indent=2)
        with open(args.out, "w") as f:
            f.write(render_md(meta, result, args))
    return 0 if ok else 1


def render_md(meta: dict, r: dict, args) -> str:
    rss = r["rss_mb"]
    fmt = lambda v: "n/a" if v is None else f"{v:.0f} MB"  # noqa: E731
    return f"""# Server soak: {r['requests']} requests, concurrency {r['concurrency']}, ~{args.cancel_fraction:.0%} cancelled mid-stream

- date: {meta['date_utc']} UTC
- commit: {meta['commit']}
- machine: {meta['machine']}
- machine load: {meta['load']}
- model: embedded SmolLM2-135M-Instruct (Q4_1 GGUF), server flags `{args.server_flags if not args.url else 'external server'}`
- command: `{meta['command']}`

| what | result |
|---|---|
| verdict | **{r['verdict']}** |
| elapsed (load phase) | {r['elapsed_s']} s |
| HTTP status counts | {r['status_counts']} |
| outcomes | {r['outcomes']} |
| 5xx responses | {r['num_5xx']} |
| hung requests (> {args.request_timeout:.0f} s) | {r['hung']} |
| running / waiting after | {r['running_after']} / {r['waiting_after']} |
| KV usage after / blocks | {r['kv_usage_after']} of {r['kv_blocks']} blocks |
| leaked KV blocks | {r['leaked_blocks']} |
| aborts counted by the server | {r['aborts_counted']} |
| generation tokens | {r['generation_tokens']} |
| /health after | {r['health_after']} |
| server RSS start / warm (after the first 10 %, or after the baseline run) / end | {fmt(rss.get('start'))} / {fmt(rss.get('warm'))} / {fmt(rss.get('end'))} |
| server RSS after each 10 % of the requests (MB) | {rss.get('trend')} |
| first scoring request (compiles the prompt scorer) | {rss.get('scorer_warmup_s', 'n/a')} s |
| server exit code after SIGTERM | {r['server_exit_code_after_sigterm']} |
| hostile requests (kind status: count) | {r['hostile'] or 'none'} |
| hostile requests with a wrong answer | {r['hostile_wrong'] or 'none'} |
| constrained outputs that break their constraint | {r['invalid_constrained'] or 'none'} |
| ordinary streams' TTFT p50 / p99 | {r['ttft_p50_s']} / {r['ttft_p99_s']} s |
| the same ordinary load alone (after {args.warmup_requests} uncounted warm-up requests): TTFT p50 / p99 | {r['baseline_ttft_p50_s']} / {r['baseline_ttft_p99_s']} s |
| TTFT p99 ratio (limit {args.max_ttft_ratio:g}) | {r['ttft_p99_ratio']} |

Mix: half chat, half completions; 70 % streamed; greedy or temperature 0.8, half seeded; max_tokens 4..{args.max_tokens};
the cancelled streams ask for {args.max_tokens * 4} tokens with ignore_eos and the client closes the connection after 1-4 events.
Hostile share {args.hostile_fraction:.0%}: an equal mix of {', '.join(args.hostile_kinds)}
(scoring: echo + logprobs, max_tokens 0, {args.scoring_words} words).
"""


if __name__ == "__main__":
    sys.exit(main())
