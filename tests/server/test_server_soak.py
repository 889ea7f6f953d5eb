"""The hostile soaks, stress tests run by `make test-slow`: `tests/server/soak.py` starts `python -m jaxserve serve`
(embedded SmolLM2, CPU) and mixes hostile requests into an ordinary load (20 % of the streams cancelled
mid-stream). They pass when there is no 5xx, no hung request, every hostile request got its expected answer,
nothing runs, waits or holds a KV block at the end, the server's RSS ends within 20 % of its warm value and the
ordinary streams' TTFT p99 is within 3x the same load alone.

- test_hostile_soak: 2,000 requests at concurrency 32, 10 % hostile or careless (nested JSON, huge prompts,
  prompt scoring, heavy templates, prompts x n bursts, slow bodies);
- test_grammar_hostile_soak: 800 requests at concurrency 16, 25 % structured-output kinds (tests/server/soak_grammars.py:
  deep rule chains and $ref chains, wide schemas and tools, huge choices, grammars past the parser's runtime
  limits, seeds past 2^64, and constrained requests whose every output must follow its constraint), for
  several minutes on a 2-core CPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from soak_grammars import GRAMMAR_HOSTILE
from support import ROOT, XLA_CACHE_FLAGS

SERVER_FLAGS = " ".join(("--max-model-len 512 --max-num-seqs 32 --max-num-batched-tokens 128 --trust-request-chat-template "
                         "--read-timeout 5", *XLA_CACHE_FLAGS))


def run_soak(tmp_path, *args: str) -> dict:
    out = tmp_path / "soak.md"
    cmd = [sys.executable, os.path.join(ROOT, "tests", "server", "soak.py"), "--cancel-fraction", "0.2", "--time-limit",
           "3600", "--max-ttft-ratio", "3", "--server-flags", SERVER_FLAGS, "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=5400)
    report = json.loads((tmp_path / "soak.json").read_text()) if (tmp_path / "soak.json").exists() else None
    assert proc.returncode == 0, (report, proc.stdout[-3000:], proc.stderr[-3000:])
    assert report["verdict"] == "PASS" and report["num_5xx"] == 0 and not report["hostile_wrong"]
    return report


@pytest.mark.slow
def test_hostile_soak(tmp_path):
    run_soak(tmp_path, "--requests", "2000", "--concurrency", "32", "--hostile-fraction", "0.1",
             "--baseline-requests", "500",
             "--hostile-kinds", "nested_json,huge_prompt,scoring,heavy_template,choices_burst,slow_body")


@pytest.mark.slow
def test_grammar_hostile_soak(tmp_path):
    # the grammar cache at 64 MiB: the RSS check allows the warm server 20 % more (the default 256 MiB would
    # fill up to more than that)
    report = run_soak(tmp_path, "--requests", "800", "--concurrency", "16", "--hostile-fraction", "0.25",
                      "--baseline-requests", "300", "--hostile-kinds", ",".join(sorted(GRAMMAR_HOSTILE)),
                      "--server-flags", SERVER_FLAGS + ' --structured-outputs-config {"grammar_cache_bytes":67108864}')
    assert not report["invalid_constrained"] and report["hung"] == 0
    assert sum(v for k, v in report["hostile"].items() if k.startswith(("big_choice 200", "json_schema 200"))) > 0
