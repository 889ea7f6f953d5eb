"""PNG plots (matplotlib, optional: without it the report just has no pictures)."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def available() -> bool:
    return _pyplot() is not None


def cdf(path: Path, series: dict[str, list[float]], xlabel: str, title: str) -> bool:
    """Empirical CDFs of one or more latency samples on one axis."""
    plt = _pyplot()
    if plt is None or not any(len(v) for v in series.values()):
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, values in series.items():
        v = np.sort(np.asarray(values, dtype=float))
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label)
    ax.set(xlabel=xlabel, ylabel="fraction of requests", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def bars_vs_limit(path: Path, labels: list[str], measured: list[float], limits: list[float], unit: str,
                  title: str) -> bool:
    """Measured values next to their roofline limits."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.arange(len(labels))
    ax.bar(x - 0.2, measured, 0.4, label="measured")
    ax.bar(x + 0.2, limits, 0.4, label="roofline limit", alpha=0.6)
    for i, (m, lim) in enumerate(zip(measured, limits)):
        if lim:
            ax.annotate(f"{100 * m / lim:.0f}%", (i - 0.2, m), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, labels)
    ax.set(ylabel=unit, title=title)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def sweep(path: Path, points: list[dict], param: str, title: str) -> bool:
    """Throughput vs latency over a sweep: output tok/s on x, median TTFT / TPOT / E2E on y."""
    plt = _pyplot()
    if plt is None or not points:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    x = [p["output_throughput"] for p in points]
    for ax, key, label in zip(axes, ("ttft_ms", "tpot_ms", "e2el_ms"), ("TTFT", "TPOT", "E2E latency")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(x, [p[key][stat] for p in points], style, label=stat)
        for p, xi in zip(points, x):
            ax.annotate(f"{param}={p['sweep_value']}", (xi, p[key]["median"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
        ax.set(xlabel="output tok/s", ylabel=f"{label} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(plt, fig, path)


def _save(plt, fig, path: Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
