"""Running checks on several fake CPU devices: XLA fixes the device count when JAX starts, so a test that
needs a mesh runs its checks in a subprocess started with ``--xla_force_host_platform_device_count``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from support import TESTS, xla_flags


def run_on_fake_devices(args: list[str], num_devices: int, timeout: float = 900) -> str:
    """Runs ``python *args`` (a script path and its arguments, or ``-c`` and a program) on ``num_devices``
    fake CPU devices, tests/ importable; fails the test with the end of its stderr unless it exits 0.
    Returns its stdout."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(f"--xla_force_host_platform_device_count={num_devices}"),
               JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def fake_device_report(args: list[str], num_devices: int, timeout: float = 900) -> dict:
    """``run_on_fake_devices`` for a worker that prints its findings as JSON on its last line."""
    return json.loads(run_on_fake_devices(args, num_devices, timeout).strip().splitlines()[-1])
