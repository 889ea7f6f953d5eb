"""The startup mode's `model.write_checkpoint: {shards, dir}`: a random-valued safetensors checkpoint of the
model's shape written to the host's disk (`jaxserve.models.random_checkpoint`), the disk's read rate of its files,
and the weights phase of the server that loads them against it.

A cold read drops the files' pages from the page cache first (fsync'd when written, then posix_fadvise DONTNEED
per file: no privileges needed). That cannot drop pages another process maps, nor a cache below the kernel (a
virtual disk's host cache): a cold read as fast as a cached one says so."""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import tempfile
import time
from pathlib import Path

from .report import Table


def drop_from_page_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def read_rate(files: list[Path], per_file: bool, cold: bool = True) -> float:
    """GB/s reading ``files`` whole in 64 MiB calls: one stream through them all, or ``per_file`` one each."""
    if cold:
        drop_from_page_cache(files)

    def read(paths):
        buf = bytearray(64 << 20)
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(files)) as pool:
        list(pool.map(read, [[p] for p in files] if per_file else [files]))
    return sum(p.stat().st_size for p in files) / 1e9 / (time.perf_counter() - t0)


@contextlib.contextmanager
def served_config(run):
    """The config the server runs: ``run.cfg``, or with `model.write_checkpoint` the checkpoint's folder as its
    model, the files dropped from the page cache and the disk's figures in run.result["disk"]; the folder is
    removed afterwards."""
    spec = run.cfg["model"].get("write_checkpoint")
    if not spec:
        yield run.cfg
        return
    root = Path(spec.get("dir") or tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jaxserve-checkpoint-", dir=root) as tmp:
        from jaxserve.models.random_checkpoint import write_random_checkpoint
        print(f"[bench] writing a random checkpoint of the model's shape in {tmp}", flush=True)
        t0 = time.perf_counter()
        files = [Path(p) for p in write_random_checkpoint(tmp, run.hf_config, int(spec.get("shards") or 4),
                                                          seed=run.cfg["seed"])]
        gb = sum(p.stat().st_size for p in files) / 1e9
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
        run.result["disk"] = {
            "folder": tmp, "files": len(files), "GB": gb, "write_GBps": gb / (time.perf_counter() - t0),
            "filesystem": max((len(m), t) for m, t in mounts if f"{tmp}/".startswith(f"{m.rstrip('/')}/"))[1],
            "cold_one_stream_GBps": read_rate(files, False), "cold_stream_per_file_GBps": read_rate(files, True),
            "page_cache_GBps": read_rate(files, True, cold=False)}
        drop_from_page_cache(files)
        yield {**run.cfg, "model": {"path": tmp, "load_format": "safetensors"}}


def report(run, starts: dict) -> None:
    """Each start's weights phase, as the checkpoint's bytes a second, against the disk's cold read rate (the
    better of one stream and a stream per file)."""
    d = run.result["disk"]
    disk = d["disk_GBps"] = max(d["cold_one_stream_GBps"], d["cold_stream_per_file_GBps"])
    for s in starts.values():
        s["weights_GBps"] = d["GB"] / s["phases_s"]["weights"] if s["phases_s"].get("weights") else None
        s["weights_of_disk"] = s["weights_GBps"] and s["weights_GBps"] / disk
    rows = [["write", d["write_GBps"]], ["cold read, one stream", d["cold_one_stream_GBps"]],
            ["cold read, a stream per file", d["cold_stream_per_file_GBps"]],
            ["page cache read, a stream per file", d["page_cache_GBps"]]]
    rows += [[f"serve's weights phase, {k} start", s["weights_GBps"],
              s["weights_of_disk"] and 100 * s["weights_of_disk"]] for k, s in starts.items()]
    run.tables.append(Table(f"{d['GB']:.2f} GB of safetensors in {d['files']} files on the disk ({d['filesystem']})",
                            ["read by", "GB/s", "% of the disk's cold read (target 70)"], rows))
    run.notes.append("cold: the files dropped from the page cache (posix_fadvise DONTNEED) before the read and before "
                     "the cold start; the warm start reads them as the cold one left them")
    if disk > 0.8 * d["page_cache_GBps"]:
        run.notes.append(f"WARNING: the cold reads ran at the page cache's speed: the files on {d['filesystem']} "
                         "were not read from a disk (RAM-backed, or a cache below the kernel): set "
                         "model.write_checkpoint.dir")
