"""The hostile soak, a stress test run by `make test-slow`: `tests/soak.py` starts
`python -m jaxserve serve` (embedded SmolLM2, CPU) and sends 2,000 requests at concurrency 32 (20 % of the
streams cancelled mid-stream, 10 % hostile or careless: nested JSON, huge prompts, prompt scoring, heavy
templates, prompts x n bursts, slow bodies). It passes when there is no 5xx, no hung request, every hostile
request got its expected answer, nothing runs, waits or holds a KV block at the end, the server's RSS
ends within 20 % of its warm value and the ordinary streams' TTFT p99 is within 3x the same load alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_FLAGS = ("--max-model-len 512 --max-num-seqs 32 --max-num-batched-tokens 128 --trust-request-chat-template "
                "--read-timeout 5 --compilation-cache-dir " + os.path.join(ROOT, ".jax_cache"))


@pytest.mark.slow
def test_hostile_soak(tmp_path):
    out = tmp_path / "soak.md"
    cmd = [sys.executable, os.path.join(ROOT, "tests", "soak.py"), "--requests", "2000",
           "--concurrency", "32", "--cancel-fraction", "0.2", "--hostile-fraction", "0.1",
           "--baseline-requests", "500", "--time-limit", "3600", "--server-flags", SERVER_FLAGS, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=5400)
    report = json.loads((tmp_path / "soak.json").read_text()) if (tmp_path / "soak.json").exists() else None
    assert proc.returncode == 0, (report, proc.stdout[-3000:], proc.stderr[-3000:])
    assert report["verdict"] == "PASS" and report["num_5xx"] == 0 and not report["hostile_wrong"]
