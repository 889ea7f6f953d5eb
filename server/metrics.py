"""Prometheus metrics with vLLM's names after the prefix (`jaxserve:` or `vllm:`), labelled model_name.

Gauges and engine counters are read from `engine.stats()` at scrape time (a custom collector), so they
are never stale; token counters, finish reasons and latency histograms are fed per request by the
server as outputs stream (`RequestTracker`). Time to first token and end-to-end latency are the server's
clock from the request's arrival (``REQUEST_ARRIVAL``, stamped by ``arrival_middleware`` before the body is
read) to the output reaching the server's loop, as vLLM measures them: what a client sees, tokenizing,
template rendering and the hop to the engine included. Queue time is the engine's own span.
"""
from __future__ import annotations

import bisect
import contextvars
import logging
import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

log = logging.getLogger("jaxserve.server")

disable_created_metrics()  # vLLM does too: *_created series only add noise to dashboards

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# time.monotonic() when the HTTP request being handled arrived (the request's task sees its own value)
REQUEST_ARRIVAL: contextvars.ContextVar[float | None] = contextvars.ContextVar("request_arrival", default=None)


def arrival_middleware(app):
    """Stamps ``REQUEST_ARRIVAL`` for each HTTP request as it arrives (before its body is read)."""
    async def middleware(scope, receive, send):
        if scope["type"] == "http":
            REQUEST_ARRIVAL.set(time.monotonic())
        await app(scope, receive, send)
    return middleware

# vLLM's buckets, so dashboards' quantiles line up
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]

REQUEST_N_BUCKETS = [1, 2, 5, 10, 20]


def one_two_five_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's buckets for token-count histograms)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exponent
            if v > max_value:
                return out
            out.append(v)
        exponent += 1


# name after the prefix -> keys engine.stats() may use for it (first present wins)
GAUGES = {
    "num_requests_running": ("num_requests_running", "num_running"),
    "num_requests_waiting": ("num_requests_waiting", "num_waiting"),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "kv_cache_usage", "gpu_cache_usage_perc"),
    # step variants queued or compiling in the background (the server answers before all are compiled)
    "step_variants_pending": ("step_variants_pending",),
    # the engine's compiled grammars kept for reuse (bounded by --structured-outputs-config grammar_cache_bytes)
    "structured_output_grammar_cache_bytes": ("structured_grammar_cache_bytes",),
}
ENGINE_COUNTERS = {
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    "num_preemptions": ("num_preemptions", "num_preemptions_total"),
    # structured outputs: steps that filled a token bitmask, the host ms spent filling them (beside the output
    # processing) and the ms the engine's step waited for them
    "structured_output_mask_steps": ("structured_steps",),
    "structured_output_mask_ms": ("structured_mask_ms",),
    "structured_output_mask_wait_ms": ("structured_mask_wait_ms",),
    # grammars compiled by the engine (once per distinct constraint while cached), those compiled on a thread
    # other than a grammar worker (0: never on the step loop), and the verdicts a front end whose engine
    # core runs in its own process compiled before accepting requests
    "structured_output_compilations": ("structured_compilations",),
    "structured_output_compilations_off_workers": ("structured_compilations_off_workers",),
    "structured_output_verdict_compilations": ("structured_verdict_compilations",),
    # images: in the requests (images per request = images / requests_with_images), encoded by the vision
    # encoder and found in its cache, and the encoder's time (host time of its dispatches)
    "images": ("request_images_total",),
    "requests_with_images": ("requests_with_images_total",),
    "images_encoded": ("images_encoded_total",),
    "images_reused": ("images_reused_total",),
    "encoder_seconds": ("encoder_seconds_total",),
    # (jaxserve's own) the engine loop's time: steps run, ms inside its step() (host work and device waits), of
    # which ms waiting for a step's results: busy = step_ms / wall time, host = step_ms - device_wait_ms
    "engine_steps": ("steps",),
    "engine_step_ms": ("step_ms_total",),
    "engine_device_wait_ms": ("device_ms_total",),
    # (jaxserve's own) tokens the steps computed, and the token rows their forwards ran (a step pads up to its
    # compiled bucket): padding = 1 - tokens / padded tokens
    "engine_tokens": ("tokens_total",),
    "engine_padded_tokens": ("padded_tokens_total",),
    # speculative decoding (vLLM's names): requests' draft runs verified, their tokens, the tokens accepted
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
    # (jaxserve's own) host milliseconds the speculator spent proposing drafts
    "spec_decode_propose_ms": ("spec_decode_propose_ms",),
}


def _pick(stats: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    for k in keys:
        v = stats.get(k)
        if v is not None:
            return float(v)
    return None


class _EngineStatsCollector:
    """The engine's gauges and counters at scrape time, ``engine_healthy`` (1, or 0 once the engine loop is
    dead or stuck) and ``engine_dead`` (1 once it is dead: the server then ends). A dead engine has failed
    every request it held and runs none, so its gauges (running, waiting, KV usage, pending compiles) read 0
    rather than the last figures it reported; its counters keep their totals."""

    def __init__(self, prefix: str, model_name: str, stats: Callable[[], dict[str, Any]], block_size: Any,
                 healthy: Callable[[], bool] | None = None, dead: Callable[[], bool] | None = None):
        self.prefix, self.model_name, self.stats, self.block_size = prefix, model_name, stats, block_size
        self.healthy = healthy
        self.dead = dead

    def describe(self):  # no scrape at registration time
        return []

    def collect(self):
        try:
            stats = self.stats() or {}
        except Exception as e:  # a scrape must not fail because the engine is in trouble
            log.warning("engine.stats() failed: %s", e)
            stats = {}
        try:
            healthy = self.healthy() if self.healthy is not None else True
        except Exception:   # noqa: BLE001 - a health check that raises is an unhealthy engine
            healthy = False
        h = GaugeMetricFamily(f"{self.prefix}engine_healthy", "1 while the engine loop runs, 0 once it is dead "
                              "or stuck (the other engine figures then stop moving)", labels=["model_name"])
        h.add_metric([self.model_name], 1.0 if healthy else 0.0)
        yield h
        try:
            dead = bool(self.dead()) if self.dead is not None else False
        except Exception:   # noqa: BLE001 - an engine that cannot say it is alive is not
            dead = True
        d = GaugeMetricFamily(f"{self.prefix}engine_dead", "1 once the engine loop or core process has died (the "
                              "server fails every request and exits; restart it)", labels=["model_name"])
        d.add_metric([self.model_name], 1.0 if dead else 0.0)
        yield d
        # data-parallel replicas: a series per replica, labelled engine="i" as vLLM's (a figure only the front
        # end keeps, on the series with engine="")
        replicas = stats.get("replicas")
        labels = ["model_name"] if replicas is None else ["model_name", "engine"]
        for name, keys in GAUGES.items():
            g = GaugeMetricFamily(f"{self.prefix}{name}", name.replace("_", " "), labels=labels)
            for values, s in self._rows(stats, replicas, keys):
                v = None if dead else _pick(s, keys)
                g.add_metric(values, 0.0 if v is None else v)
            yield g
        for name, keys in ENGINE_COUNTERS.items():
            c = CounterMetricFamily(f"{self.prefix}{name}", name.replace("_", " "), labels=labels)
            for values, s in self._rows(stats, replicas, keys):
                v = _pick(s, keys)
                c.add_metric(values, 0.0 if v is None else v)
            yield c
        hist = stats.get("iteration_tokens")
        if hist is not None:    # (bounds, per-bucket step counts with one more for "above", tokens summed)
            bounds, counts, total = hist
            h = HistogramMetricFamily(f"{self.prefix}iteration_tokens_total", "tokens computed per engine step",
                                      labels=["model_name"])
            cumulative, buckets = 0, []
            for bound, n in zip([*(floatToGoString(b) for b in bounds), "+Inf"], counts):
                cumulative += n
                buckets.append((bound, cumulative))
            h.add_metric([self.model_name], buckets, float(total))
            yield h
        yield from self._expert_load(stats)
        per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos")
        if per_pos is not None:     # vLLM's: drafts accepted at each position
            c = CounterMetricFamily(f"{self.prefix}spec_decode_num_accepted_tokens_per_pos",
                                    "speculative tokens accepted at each position", labels=["model_name", "position"])
            for pos, n in enumerate(per_pos):
                c.add_metric([self.model_name, str(pos)], float(n))
            yield c
        if self.prefix == "vllm:":     # vLLM V0's names, which its Grafana dashboard still queries
            for name, keys in (("gpu_cache_usage_perc", GAUGES["kv_cache_usage_perc"]),
                               ("gpu_prefix_cache_hit_rate", ("prefix_cache_hit_rate",))):
                g = GaugeMetricFamily(f"{self.prefix}{name}", f"{name.replace('_', ' ')} (vLLM V0's name)",
                                      labels=["model_name"])
                v = None if dead and name == "gpu_cache_usage_perc" else _pick(stats, keys)
                g.add_metric([self.model_name], 0.0 if v is None else v)
                yield g
        if stats.get("num_kv_blocks") is not None:  # vLLM's info gauge: the KV pool's size, for dashboards
            info = GaugeMetricFamily(f"{self.prefix}cache_config_info", "KV cache configuration",
                                     labels=["model_name", "num_gpu_blocks", "block_size"])
            info.add_metric([self.model_name, str(stats["num_kv_blocks"]), str(self.block_size)], 1.0)
            yield info
        if "lora_running" in stats:       # vLLM's: the adapters of running and waiting requests, as labels
            lora = GaugeMetricFamily(f"{self.prefix}lora_requests_info", "Running stats on lora requests.",
                                     labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            lora.add_metric([str(stats["max_loras"]), stats["lora_waiting"], stats["lora_running"]], time.time())
            yield lora


    def _rows(self, stats: dict[str, Any], replicas: list[dict] | None, keys: tuple[str, ...]):
        """(label values, stats) of each series of a figure: the engine's, or each replica's."""
        if replicas is None:
            return [([self.model_name], stats)]
        if all(_pick(r, keys) is None for r in replicas):
            return [([self.model_name, ""], stats)]
        return [([self.model_name, str(i)], r) for i, r in enumerate(replicas)]

    def _expert_load(self, stats: dict[str, Any]):
        """MoE models: tokens routed to each expert (summed over the MoE layers) and the routing's
        balancedness, mean / max tokens per expert per step and layer (vLLM's EPLB measure; 1 = even)."""
        tokens = stats.get("moe_expert_tokens_total")
        if not tokens:
            return
        c = CounterMetricFamily(f"{self.prefix}moe_expert_tokens", "tokens routed to each expert, summed over "
                                "the MoE layers", labels=["model_name", "expert"])
        for expert, n in enumerate(tokens):
            c.add_metric([self.model_name, str(expert)], float(n))
        yield c
        g = GaugeMetricFamily(f"{self.prefix}moe_expert_balancedness", "mean over max tokens per expert per step "
                              "and MoE layer, since start (1: every expert equally loaded)", labels=["model_name"])
        g.add_metric([self.model_name], float(stats.get("moe_expert_balancedness", 1.0)))
        yield g


class _Tally:
    """A histogram's bucket counts and sum as plain numbers: the per-token series are fed once per output of
    every stream (256 streams: 25,000 observations a second), where prometheus_client's lock and per-call
    work cost more than the rest of a token's bookkeeping. Only the server's event loop adds to it (the
    trackers run there), and a scrape reads it there too."""
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: list[float]):
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)     # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        """``n`` observations of ``value`` (a bucket's bound is inclusive: Prometheus' ``le``)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def buckets(self) -> list[tuple[str, float]]:
        cumulative, out = 0, []
        for bound, n in zip([*(floatToGoString(b) for b in self.bounds), "+Inf"], self.counts):
            cumulative += n
            out.append((bound, float(cumulative)))
        return out


class _PerTokenCollector:
    """The series fed per output token: generation_tokens, inter_token_latency_seconds and its older name
    time_per_output_token_seconds (one tally, the same observations)."""

    def __init__(self, prefix: str, model_name: str):
        self.prefix, self.model_name = prefix, model_name
        self.generation_tokens = 0
        self.itl = _Tally(ITL_BUCKETS)

    def describe(self):
        return []

    def collect(self):
        p, labels = self.prefix, [self.model_name]
        c = CounterMetricFamily(f"{p}generation_tokens", "tokens generated", labels=["model_name"])
        c.add_metric(labels, float(self.generation_tokens))
        yield c
        for name, doc in (("inter_token_latency_seconds", "time between output tokens"),
                          ("time_per_output_token_seconds", "time between output tokens (vLLM's older name for "
                           "inter_token_latency_seconds)")):
            h = HistogramMetricFamily(f"{p}{name}", doc, labels=["model_name"])
            h.add_metric(labels, self.itl.buckets(), self.itl.sum)
            yield h


class ServerMetrics:
    def __init__(self, engine: Any, model_name: str, prefix: str = "jaxserve"):
        self.prefix = prefix.rstrip(":") + ":"
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        p, labels = self.prefix, ["model_name"]
        cache_config = getattr(getattr(engine, "config", None), "cache", None)
        block_size = getattr(cache_config, "block_size", "")
        self.registry.register(_EngineStatsCollector(p, model_name, engine.stats, block_size,
                                                     getattr(engine, "is_healthy", None),
                                                     lambda: getattr(engine, "dead", False)))
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "prompt tokens processed", labels, registry=self.registry)
        self.per_token = _PerTokenCollector(p, model_name)
        self.registry.register(self.per_token)
        self.request_success = Counter(f"{p}request_success", "finished requests by reason",
                                       labels + ["finished_reason"], registry=self.registry)
        self.ttft = Histogram(f"{p}time_to_first_token_seconds", "time to first token", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.e2e = Histogram(f"{p}e2e_request_latency_seconds", "arrival to finish", labels,
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue_time = Histogram(f"{p}request_queue_time_seconds", "time waiting before first schedule",
                                    labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        # vLLM's per-request histograms (the names its dashboards query)
        tokens = one_two_five_buckets(int(getattr(engine, "max_model_len", 0) or 1 << 20))

        def hist(name: str, doc: str, buckets) -> Any:
            return Histogram(f"{p}{name}", doc, labels, buckets=buckets, registry=self.registry).labels(model_name)
        self._req_tpot = hist("request_time_per_output_token_seconds", "a request's mean time per output token "
                              "after the first", ITL_BUCKETS)
        self._req_prompt = hist("request_prompt_tokens", "prompt tokens per request", tokens)
        self._req_gen = hist("request_generation_tokens", "generated tokens per request", tokens)
        self._req_max_tokens = hist("request_params_max_tokens", "max_tokens per request", tokens)
        self._req_n = hist("request_params_n", "n (choices per prompt) per request", REQUEST_N_BUCKETS)
        self._req_max_gen = hist("request_max_num_generation_tokens", "the most tokens any choice of a prompt "
                                 "generated", tokens)
        self._prefill = hist("request_prefill_time_seconds", "first schedule to first token", LATENCY_BUCKETS)
        self._decode = hist("request_decode_time_seconds", "first token to finish", LATENCY_BUCKETS)
        self._inference = hist("request_inference_time_seconds", "first schedule to finish", LATENCY_BUCKETS)
        # children bound once: labels() costs a dict lookup and a lock per call
        self._prompt = self.prompt_tokens.labels(model_name)
        self._ttft = self.ttft.labels(model_name)
        self._e2e = self.e2e.labels(model_name)
        self._queue = self.queue_time.labels(model_name)
        for reason in ("stop", "length", "abort"):  # present at 0 so rate() works from the start
            self.request_success.labels(model_name, reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, num_prompt_tokens: int, max_tokens: int | None = None) -> "RequestTracker":
        return RequestTracker(self, num_prompt_tokens, max_tokens)

    def on_prompt_finished(self, trackers: list["RequestTracker"]) -> None:
        """All n choices of one prompt finished (none aborted): vLLM's per-sequence-group histograms."""
        self._req_n.observe(len(trackers))
        self._req_max_gen.observe(max(t.num_generated for t in trackers))


class RequestTracker:
    """Per engine request: feeds token counters and latency histograms from its outputs."""
    __slots__ = ("m", "num_prompt_tokens", "max_tokens", "start", "first", "last", "num_generated", "done",
                 "aborted")

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, max_tokens: int | None = None):
        self.m = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.first: float | None = None
        self.aborted = False
        arrival = REQUEST_ARRIVAL.get()
        self.start = arrival if arrival is not None else time.monotonic()
        self.last: float | None = None
        self.num_generated = 0
        self.done = False

    def on_output(self, num_new_tokens: int, engine_metrics: Any = None) -> None:
        if num_new_tokens <= 0:
            return
        t = time.monotonic()
        if self.last is None:
            self.first = t
            self.m._ttft.observe(t - self.start)
            self.m._prompt.inc(self.num_prompt_tokens)
            num_new_tokens_after_first = num_new_tokens - 1
        else:
            num_new_tokens_after_first = num_new_tokens
        per_token = self.m.per_token
        if num_new_tokens_after_first > 0 and self.last is not None:
            per_token.itl.observe((t - self.last) / num_new_tokens_after_first, num_new_tokens_after_first)
        self.last = t
        self.num_generated += num_new_tokens
        per_token.generation_tokens += num_new_tokens

    def on_finish(self, finish_reason: str | None, engine_metrics: Any = None) -> None:
        if self.done:
            return
        self.done = True
        reason = finish_reason or "abort"
        self.m.request_success.labels(self.m.model_name, reason).inc()
        if reason == "abort":
            self.aborted = True
            return
        m = self.m
        m._e2e.observe(time.monotonic() - self.start)
        m._req_prompt.observe(self.num_prompt_tokens)
        m._req_gen.observe(self.num_generated)
        if self.max_tokens is not None:
            m._req_max_tokens.observe(self.max_tokens)
        if self.num_generated > 1 and self.first is not None:
            m._req_tpot.observe((self.last - self.first) / (self.num_generated - 1))
        for hist, start, end in ((m._queue, "arrival_time", "first_scheduled_time"),
                                 (m._prefill, "first_scheduled_time", "first_token_time"),
                                 (m._decode, "first_token_time", "finished_time"),
                                 (m._inference, "first_scheduled_time", "finished_time")):
            span = _span(engine_metrics, start, end)
            if span is not None:
                hist.observe(span)


def _span(engine_metrics: Any, start: str, end: str) -> float | None:
    if engine_metrics is None:
        return None
    a, b = getattr(engine_metrics, start, None), getattr(engine_metrics, end, None)
    if a is None or b is None or b < a:
        return None
    return float(b - a)
