"""What a result was measured on: versions, device, commit, date, command line."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from importlib import metadata

from .config import REPO_ROOT


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def device_info() -> dict:
    """JAX's view of the accelerators (imports jax; call it only where JAX may initialise the backend)."""
    import jax
    devs = jax.devices()
    return {"platform": devs[0].platform, "device_kind": devs[0].device_kind, "device_count": len(devs),
            "jax_backend": jax.default_backend()}


def device_info_subprocess() -> dict:
    """The same, asked of a child process, so this one never claims accelerator memory (the serve mode's
    server needs it all)."""
    import json
    code = "import json; from jaxserve.benchmarks.envinfo import device_info; print(json.dumps(device_info()))"
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"could not list the JAX devices: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def environment(argv: list[str], with_devices: bool = True, devices_in_subprocess: bool = False) -> dict:
    from jaxserve import envs      # its registered switches that are set (e.g. JAXSERVE_MOE_GROUPED_GEMM), no secrets
    env = {"date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(["python -m jaxserve bench", *argv]),
           "python": sys.version.split()[0], "host": platform.node(), "cpu_count": os.cpu_count(),
           "jax": _version("jax"), "jaxlib": _version("jaxlib"), "flax": _version("flax"),
           "jaxserve": _version("jaxserve"), "transformers": _version("transformers"), "torch": _version("torch"),
           **git_commit(), "env": {k: os.environ[k] for k in ("XLA_FLAGS", "JAX_PLATFORMS", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                              "CUDA_VISIBLE_DEVICES", *envs.non_secret_names())
                                   if k in os.environ}}
    if with_devices:
        env.update(device_info_subprocess() if devices_in_subprocess else device_info())
    return env
