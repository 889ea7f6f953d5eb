"""Compile a CUDA source of ``kernels/`` into a shared library on first use (the custom all-reduce, the
quantized decode GEMMs).

The machine's ``nvcc`` (``$JAXSERVE_NVCC``, ``$CUDA_HOME/bin``, ``PATH`` or ``/usr/local/cuda/bin``) builds it for
the given GPU architecture into a cache folder (``$JAXSERVE_KERNEL_CACHE``, else ``~/.cache/jaxserve/kernels``),
keyed by the source and the ``.cuh`` headers beside it, the compiler's version, the architecture and XLA's FFI
headers. The caller says where things are (a ``Toolchain``: jaxserve fills it from its environment registry,
``jaxserve.envs``); kernels/ itself reads no environment.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Toolchain:
    """Where the build finds its compiler and keeps its libraries."""
    cache_dir: Path                 # built libraries, one file per source/compiler/architecture/headers
    nvcc: str | None = None         # this nvcc, else $cuda_home/bin, PATH, /usr/local/cuda/bin
    cuda_home: str | None = None
    arch: str = "native"            # when the caller names no device's architecture

    def find_nvcc(self) -> str | None:
        for cand in (self.nvcc, os.path.join(self.cuda_home, "bin", "nvcc") if self.cuda_home else None,
                     shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
            if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
        return None


def nvcc_command(nvcc: str, source: Path, out: Path, arch: str) -> list[str]:
    import jax.ffi
    return [nvcc, "-O3", "-std=c++17", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC",
            "-isystem", jax.ffi.include_dir(), "-o", str(out), str(source)]


def build(source: Path, toolchain: Toolchain, *, arch: str | None = None,
          error: type[Exception] = RuntimeError) -> Path:
    """Compile ``source`` (once per source/compiler/architecture/headers) and return the library's path; raise
    ``error`` with the reason when it cannot."""
    import jax.ffi
    nvcc = toolchain.find_nvcc()
    if nvcc is None:
        raise error("no nvcc found (set JAXSERVE_NVCC or CUDA_HOME)")
    arch = arch or toolchain.arch
    try:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise error(f"{nvcc} --version failed: {e}") from e
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.cuh")))   # what the source may include
    key = hashlib.sha256(source.read_bytes() + headers + version.encode() + arch.encode()
                         + jax.ffi.include_dir().encode()).hexdigest()[:16]
    out = Path(toolchain.cache_dir) / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    proc = subprocess.run(nvcc_command(nvcc, source, tmp, arch), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise error(f"nvcc failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, out)            # atomic: concurrent builders (one per process) end with one good file
    return out


def device_arch(device) -> str | None:
    """``sm_XY`` of a ``jax.Device`` (not "native", so a cache shared by different GPUs keeps one build per kind)."""
    cc = str(getattr(device, "compute_capability", "") or "").replace(".", "")
    return f"sm_{cc}" if cc.isdigit() else None


def resource_usage(source: Path, toolchain: Toolchain, *, arch: str = "sm_90a") -> dict[str, tuple[int, int, int]]:
    """Per kernel of ``source`` compiled for ``arch`` (device code only, ``nvcc -cubin --resource-usage``):
    ``name<template args> -> (registers, spill store bytes, spill load bytes)``; the name is the mangled one's
    function and its template arguments as written in the mangling (``int4_gemv_kernel<bf16,0,4,4,2>``)."""
    import re
    import tempfile

    import jax.ffi
    nvcc = toolchain.find_nvcc()
    if nvcc is None:
        raise RuntimeError("no nvcc found (set JAXSERVE_NVCC or CUDA_HOME)")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([nvcc, "-O3", "-std=c++17", f"-arch={arch}", "-cubin", "--resource-usage",
                               "-isystem", jax.ffi.include_dir(), "-o", os.path.join(tmp, "out.cubin"),
                               str(source)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    types = {"f": "f32", "13__nv_bfloat16": "bf16", "6__half": "f16"}
    out = {}
    for m in re.finditer(r"Function properties for (\S+)\n\s+\d+ bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads\n[^\n]*Used (\d+) registers", proc.stdout + proc.stderr):
        out[_kernel_name(m.group(1), types)] = (int(m.group(4)), int(m.group(2)), int(m.group(3)))
    return out


def _kernel_name(mangled: str, types: dict[str, str]) -> str:
    """``_ZN<len><ns><len><name>I<args>E...`` -> ``name<args>`` (scale types by ``types``, literals bare)."""
    import re
    pos, name = mangled.find("N") + 1, mangled
    while pos and (m := re.match(r"(\d+)", mangled[pos:])):      # the nested name's parts; the last is the kernel
        start = pos + len(m.group(1))
        name, pos = mangled[start:start + int(m.group(1))], start + int(m.group(1))
    rest = mangled[pos:] if pos else ""
    if not rest.startswith("I"):
        return name
    args = re.match(r"I((?:f|13__nv_bfloat16|6__half)?)((?:L[bi]\d+E)*)E", rest)
    if not args:
        return name
    parts = ([types[args.group(1)]] if args.group(1) else []) + re.findall(r"L[bi](\d+)E", args.group(2))
    return f"{name}<{','.join(parts)}>"
