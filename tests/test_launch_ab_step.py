"""run_h200.sh's launch-ab step without a GPU: its runner replaced by a script that records what each variant
ran with (XLA_FLAGS, tree, the --set words) and writes a result, then the step's table."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from jaxserve.benchmarks.config import engine_kwargs, load_configs

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = r"""#!/bin/bash
# stands in for python: `-m benchmarks.runner --out DIR ARGS` records its environment and writes one result
if [ "$1" = "-m" ] && [ "$2" = "benchmarks.runner" ]; then
  mkdir -p "$4/run"
  printf '%s\n' "flags=${XLA_FLAGS-<unset>}" "cwd=$PWD" "path=$PYTHONPATH" "args=${*:5}" > "$4/run/seen.txt"
  echo '{"jaxserve": {"output_tok_per_s": 200.0, "decode_step_s": 0.005,
         "engine_steps": {"host_ms_per_step": 3.0, "device_ms_per_step": 1.5}}}' > "$4/run/result.json"
  exit 0
fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then exit 0; fi
exec "$REAL_PYTHON" "$@"
"""


def test_launch_ab_variants(tmp_path):
    import sys
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    old = tmp_path / "old-tree"
    old.mkdir()
    out = tmp_path / "out"
    env = {"PATH": os.environ["PATH"], "OUT": str(out), "PYTHON": str(fake), "REAL_PYTHON": sys.executable,
           "LAUNCH_AB_OLD": str(old), "LAUNCH_AB_ROUNDS": "2", "XLA_FLAGS": "--xla_dump_to=/tmp/d",
           "LAUNCH_AB_VARIANTS": "default= old= nocache= skiptemp=--xla_gpu_command_buffer_update_mode=SKIP_TEMP"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "run_h200.sh"), "launch-ab"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = {}
    for f in (out / "results" / "launch-ab").glob("*/run/seen.txt"):
        seen[f.parent.parent.name] = dict(line.split("=", 1) for line in f.read_text().splitlines())
    assert sorted(seen) == sorted(f"{v}-{r}" for v in ("default", "old", "nocache", "skiptemp") for r in (1, 2))
    assert seen["default-1"]["flags"] == "--xla_dump_to=/tmp/d"           # the caller's flags stay
    assert seen["skiptemp-2"]["flags"] == "--xla_dump_to=/tmp/d --xla_gpu_command_buffer_update_mode=SKIP_TEMP"
    assert seen["old-1"]["cwd"] == str(old) and seen["old-1"]["path"].startswith("/") and \
        seen["old-1"]["path"].split(":")[0].endswith("/ab-site/old")
    assert seen["default-1"]["cwd"] == str(ROOT)
    assert "engine.compilation_cache_dir=" in seen["nocache-1"]["args"].split()
    assert "engine.compilation_cache_dir=" not in seen["default-1"]["args"].split()
    # the --set words are a valid engine for the model's batch-1 config
    args = seen["default-1"]["args"].split()
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    cfg, = load_configs([args[args.index("--config") + 1]], sets)
    assert engine_kwargs(cfg)["token_buckets"] == [4, 256] and cfg["workload"]["batch_size"] == 1
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| variant-round |") and table[:9] == table[9:]   # printed, then the summary
    assert "| default-1 | 200.0 | 5.00 | 3.00 | 1.50 |" in table


def test_launch_ab_blank_flags_leave_xla_flags_unset(tmp_path):
    """XLA reads a blank XLA_FLAGS as a file name and aborts: a variant without flags, and none from the caller,
    runs with the variable unset."""
    import sys
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "OUT": str(tmp_path / "out"), "PYTHON": str(fake),
           "REAL_PYTHON": sys.executable, "LAUNCH_AB_ROUNDS": "1", "LAUNCH_AB_VARIANTS": "default="}
    subprocess.run(["bash", str(ROOT / "benchmarks" / "run_h200.sh"), "launch-ab"], env=env, cwd=ROOT,
                   check=True, capture_output=True, timeout=120)
    seen, = (tmp_path / "out" / "results" / "launch-ab").glob("*/run/seen.txt")
    assert "flags=<unset>" in seen.read_text().splitlines()
    json.loads((seen.parent / "result.json").read_text())
