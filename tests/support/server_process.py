"""`python -m jaxserve serve` in a subprocess on a loopback port (through tests/support/fault_injection_server.py), for
the tests that drive the real server; ``smol_server`` is the small embedded-SmolLM2 server most of them share."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from support import ROOT, TESTS, XLA_CACHE_FLAGS
from support.server_fakes import free_port

MAX_MODEL_LEN = 512


class ServerProcess:
    def __init__(self, *flags: str, env: dict | None = None, startup_timeout: float = 600):
        self.port = free_port()
        self.api_key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, os.path.join(TESTS, "support", "fault_injection_server.py"), "serve", "--host",
               "127.0.0.1", "--port", str(self.port), *flags]
        self.log_path = os.path.join(ROOT, ".pytest_cache", f"server-{self.port}.log")
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not ready after {startup_timeout} s:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def smol_server(*flags: str, env: dict | None = None) -> ServerProcess:
    """The embedded SmolLM2 on CPU, served as "smol" with a small token budget (warm-up compiles a few buckets)
    and the tests' compilation cache when one is named (``support.XLA_CACHE_FLAGS``)."""
    return ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--max-num-batched-tokens",
                         "64", *XLA_CACHE_FLAGS, "--served-model-name",
                         "smol", *flags, env=env)


def stream_lines(url: str, body: dict, lines: list, timeout: float = 60) -> None:
    """POST a streamed /v1/completions ``body``, appending each SSE line to ``lines`` as it comes (a transport
    error as its last one): for the tests that kill part of a server mid-stream."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
    except httpx.HTTPError as e:
        lines.append(f"transport error {e!r}")


def start_long_streams(url: str, n: int, wait_s: float) -> tuple[list[threading.Thread], dict[int, list]]:
    """``n`` long streamed completions on threads, returned once each has its first chunks (or after
    ``wait_s``): ``(threads, {i: SSE lines so far})``, for the tests that then kill part of the server."""
    results: dict[int, list] = {}

    def stream(i):
        body = {"model": "smol", "prompt": f"Write a long story {i}", "max_tokens": 400, "stream": True,
                "ignore_eos": True}
        stream_lines(url, body, results.setdefault(i, []))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + wait_s
    while min((len(results.get(i, [])) for i in range(n)), default=0) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    return threads, results
