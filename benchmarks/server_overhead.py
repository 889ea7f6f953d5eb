"""What the HTTP layer costs per token: the server (uvicorn + uvloop + httptools + Litestar + SSE) in a
subprocess over a scripted engine that emits tokens as fast as it is asked (tests/test_server_fakes.py),
driven over loopback; the server process's CPU time divided by the tokens it streamed.

The scripted engine's own work is included, so the numbers are an upper bound on the server's share.
Compare with the engine's token rate: if one core of server time per second is less than the tokens a
GPU step loop makes per second, the server is not the bottleneck.

    .venv/bin/python benchmarks/server_overhead.py --streams 64 --tokens 256 \\
        --out benchmarks/results/2026-11-29-cpu-server-overhead.md
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def serve(port: int) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import uvicorn
    from test_server_fakes import FakeEngine

    from jaxserve.server.app import build_app
    from jaxserve.server.args import ServerArgs

    engine = FakeEngine(max_model_len=100_000)
    app = build_app(engine, ServerArgs(port=port))
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning",
                access_log=False, lifespan="off")


async def load(url: str, streams: int, tokens: int, stream: bool) -> tuple[int, float]:
    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"p{i}", "max_tokens": tokens, "stream": stream}
        if not stream:
            r = await client.post("/v1/completions", json=body)
            return r.json()["usage"]["completion_tokens"]
        n = 0
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    n += 1
        return n

    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(client, i) for i in range(streams)))
        return sum(counts), time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_server_fakes import free_port
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        asyncio.run(load(url, 4, 16, True))  # warm: imports, first connections
        rows = []
        for stream in (True, False):
            c0 = cpu_seconds(proc.pid)
            n, wall = asyncio.run(load(url, args.streams, args.tokens, stream))
            cpu = cpu_seconds(proc.pid) - c0
            rows.append({"mode": "stream (SSE, one event per token)" if stream else "non-stream",
                         "tokens": n, "wall_s": round(wall, 2), "tokens_per_s": round(n / wall),
                         "server_cpu_s": round(cpu, 2), "server_cpu_us_per_token": round(cpu / n * 1e6, 1)})
    finally:
        proc.terminate()
        proc.wait(30)
    meta = {"date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True).stdout.strip(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores visible (shared with other jobs)",
            "command": "python " + " ".join(sys.argv)}
    print(json.dumps({**meta, "rows": rows}, indent=2))
    if args.out:
        lines = [f"# Server overhead per token: {args.streams} concurrent requests x {args.tokens} tokens",
                 "", *(f"- {k}: {v}" for k, v in meta.items()), "",
                 "| mode | tokens | wall s | tokens/s (client-bound) | server CPU s | server CPU us/token |",
                 "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['mode']} | {r['tokens']} | {r['wall_s']} | {r['tokens_per_s']} | {r['server_cpu_s']} | "
                  f"{r['server_cpu_us_per_token']} |" for r in rows]
        lines += ["", "Scripted engine (no model): the server process's CPU time covers uvicorn, Litestar, the "
                  "request/response mapping, msgspec encoding and the scripted engine itself; the client runs "
                  "in another process on the same 2 cores, so wall-clock rates are bounded by it."]
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
