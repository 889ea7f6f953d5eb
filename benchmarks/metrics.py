"""Latency statistics and serving metrics (vLLM's `bench serve` definitions), pure functions of timings."""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (10, 25, 50, 75, 90, 99)


def summarize(values, percentiles=PERCENTILES) -> dict[str, float]:
    """mean, std, min, max, median and p<q> of a list of numbers (NaNs when empty)."""
    arr = np.asarray(list(values), dtype=np.float64)
    stat = (lambda f, *a: float(f(arr, *a))) if arr.size else (lambda f, *a: float("nan"))
    return {"count": int(arr.size), "mean": stat(np.mean), "std": stat(np.std), "min": stat(np.min),
            "max": stat(np.max), "median": stat(np.median), **{f"p{q}": stat(np.percentile, q) for q in percentiles}}


@dataclass
class RequestTiming:
    """What the load generator saw of one streamed request (times in seconds, perf_counter clock)."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    start: float = 0.0
    ttft: float | None = 0.0                           # first content chunk - start; None: no chunk had text
    e2e: float = 0.0                                   # last byte - start
    itl: list[float] = field(default_factory=list)     # gaps between content chunks
    success: bool = False
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for single-token outputs."""
        return None if self.output_tokens <= 1 or self.ttft is None else (self.e2e - self.ttft) / (self.output_tokens - 1)


def meets_slos(r: RequestTiming, slo_ms: dict[str, float]) -> bool:
    """True when a successful request is within every SLO given (ttft_ms, tpot_ms, e2el_ms)."""
    if not r.success:
        return False
    checks = {"ttft_ms": r.ttft, "tpot_ms": r.tpot, "e2el_ms": r.e2e}
    for key, limit in (slo_ms or {}).items():
        if key not in checks:
            raise ValueError(f"unknown SLO {key!r} (known: {', '.join(checks)})")
        value = checks[key]
        if key == "ttft_ms" and value is None:         # untimed: cannot be shown within the SLO
            return False
        if value is not None and value * 1000.0 > float(limit):
            return False
    return True


def serving_metrics(results: list[RequestTiming], duration_s: float, slo_ms: dict[str, float] | None = None,
                    percentiles=(50, 90, 99)) -> dict:
    """Aggregate metrics of one load run: throughput, TTFT/TPOT/ITL/E2E in ms, goodput, failures."""
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    dur = duration_s if duration_s > 0 else float("nan")

    def ms(values):
        s = summarize([v * 1000.0 for v in values], percentiles)
        return {k: s[k] for k in ("mean", "median", "std", *[f"p{q}" for q in percentiles])}

    good = [r for r in ok if meets_slos(r, slo_ms or {})] if slo_ms else ok
    errors = dict(collections.Counter(r.error[:200] for r in failed))
    return {"completed": len(ok), "failed": len(failed), "duration_s": duration_s,
            "untimed": sum(r.ttft is None for r in ok), "prompt_tokens": in_tok, "output_tokens": out_tok,
            "request_throughput": len(ok) / dur, "output_throughput": out_tok / dur,
            "total_token_throughput": (in_tok + out_tok) / dur,
            "goodput": len(good) / dur if slo_ms else None, "slo_ms": dict(slo_ms or {}),
            "ttft_ms": ms([r.ttft for r in ok if r.ttft is not None]),
            "tpot_ms": ms([r.tpot for r in ok if r.tpot is not None]),
            "itl_ms": ms([g for r in ok for g in r.itl]), "e2el_ms": ms([r.e2e for r in ok]), "errors": errors}


def fmt(x, digits: int = 1) -> str:
    """A number for a Markdown table: thousands separators, '-' for missing/NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and abs(x) >= 100:
        return f"{x:,.0f}"
    if isinstance(x, float):
        return f"{x:,.{digits}f}" if abs(x) >= 1 or x == 0 else f"{x:.3g}"
    return f"{x:,}" if isinstance(x, int) else str(x)
