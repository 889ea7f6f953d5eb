"""Summarise a ``jax.profiler`` trace directory: GPU kernel time by kernel, host time by span.

    python benchmarks/diagnostics/profile_summary.py TRACE_DIR [--per N]

``summarize(trace_dir, per=N)`` reads the newest ``*.xplane.pb`` under ``trace_dir`` with
``jax.profiler.ProfileData`` (no TensorBoard needed) and returns, divided by ``per`` (e.g. the number of
forwards or steps traced):

* ``gpu``: per kernel group (the kernel name with its numeric suffixes dropped, so ``loop_fusion_12`` and
  ``loop_fusion_40`` pool), launches and microseconds, largest first, over every ``/device:GPU:*`` plane's
  stream lines;
* ``gpu_busy_us`` / ``gpu_span_us`` per device: the union of kernel intervals and first-start-to-last-end,
  so ``busy / span`` says how much of the traced window the GPU was running kernels (the rest is idle:
  launch gaps, host waits);
* ``host``: per span name on the host planes (inclusive times, so nested spans both count), largest first.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from collections import defaultdict

_SUFFIX = re.compile(r"(_\d+)+$|\.\d+$")


def kernel_group(name: str) -> str:
    """``loop_fusion_12`` -> ``loop_fusion``; long (mangled) names are cut to 80 characters."""
    base = _SUFFIX.sub("", name.split("(")[0])
    return base[:80]


def _intervals_union(iv: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for s, e in sorted(iv):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def latest_xspace(trace_dir: str) -> str:
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}")
    return max(files, key=os.path.getmtime)


def summarize(trace_dir: str, *, per: float = 1.0, top: int = 25) -> dict:
    from jax.profiler import ProfileData

    data = ProfileData.from_file(latest_xspace(trace_dir))
    gpu = defaultdict(lambda: [0, 0])          # group -> [launches, ns]
    host = defaultdict(lambda: [0, 0])
    devices = {}
    for plane in data.planes:
        if plane.name.startswith("/device:GPU:"):
            iv = []
            for line in plane.lines:
                if not line.name.startswith("Stream"):
                    continue               # derived lines (XLA Ops/Modules) would count kernels twice
                for ev in line.events:
                    g = gpu[kernel_group(ev.name)]
                    g[0] += 1
                    g[1] += ev.duration_ns
                    iv.append((ev.start_ns, ev.end_ns))
            if iv:
                devices[plane.name] = {"busy_us": _intervals_union(iv) / 1e3 / per,
                                       "span_us": (max(e for _, e in iv) - min(s for s, _ in iv)) / 1e3 / per,
                                       "kernels": len(iv) / per}
        elif plane.name.startswith("/host:") and plane.name != "/host:metadata":
            for line in plane.lines:
                for ev in line.events:
                    if ev.duration_ns <= 0 or ev.name.startswith("$profiler.py"):
                        continue
                    h = host[ev.name[:100]]
                    h[0] += 1
                    h[1] += ev.duration_ns

    def table(d):
        rows = sorted(d.items(), key=lambda kv: -kv[1][1])[:top]
        return [{"name": k, "count": c / per, "us": ns / 1e3 / per} for k, (c, ns) in rows]

    return {"per": per, "gpu": table(gpu), "gpu_total_us": sum(ns for _, ns in gpu.values()) / 1e3 / per,
            "devices": devices, "host": table(host)}


def format_summary(s: dict, *, title: str = "", top: int = 15) -> str:
    out = []
    if title:
        out.append(f"#### {title} (per {s['per']:g})")
    for dev, d in sorted(s["devices"].items()):
        out.append(f"- {dev}: {d['kernels']:.0f} kernels, busy {d['busy_us']:.1f} us of a {d['span_us']:.1f} us "
                   f"span ({100 * d['busy_us'] / max(d['span_us'], 1e-9):.0f}%)")
    if s["gpu"]:
        out += ["", "| kernel group | launches | us | % of kernel time |", "|---|---|---|---|"]
        tot = max(s["gpu_total_us"], 1e-9)
        out += [f"| `{r['name']}` | {r['count']:.1f} | {r['us']:.1f} | {100 * r['us'] / tot:.1f}% |"
                for r in s["gpu"][:top]]
    if s["host"]:
        out += ["", "| host span (inclusive) | count | us |", "|---|---|---|"]
        out += [f"| `{r['name']}` | {r['count']:.1f} | {r['us']:.1f} |" for r in s["host"][:top]]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace_dir")
    p.add_argument("--per", type=float, default=1.0)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    print(format_summary(summarize(a.trace_dir, per=a.per, top=a.top), top=a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
