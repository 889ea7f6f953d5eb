"""Offline modes on `jaxserve.LLM`: `throughput` (like `vllm bench throughput`) and `latency`."""
from __future__ import annotations

import time

import numpy as np

from . import plots, roofline
from .metrics import summarize
from .report import Table
from .workloads import random_token_prompts, sample_lengths

HF_RATIO_NOTE = "jaxserve / HF > 1 means jaxserve is faster (for times: HF's time / jaxserve's)"


def _sampling_params(output_lens, wl: dict, seed: int):
    from jaxserve import SamplingParams
    return [SamplingParams(max_tokens=int(o), ignore_eos=bool(wl["ignore_eos"]),
                           temperature=float(wl["temperature"]), seed=seed + i)
            for i, o in enumerate(output_lens)]


class StepStats:
    """The engine's host-ms / device-ms per step over one measured window (raw runner counters diffed)."""

    COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")
    # MoE models: per step and layer, the busiest expert's tokens and the mean, summed (the runner's ExpertLoad)
    EXPERT_LOAD = ("moe_max_expert_tokens_total", "moe_mean_expert_tokens_total")

    # engine.stats() raw totals: the in-process engine's and the engine core's (a split engine) alike
    TOTALS = {"steps": "steps", "host_ms": "runner_host_ms_total", "device_ms": "device_ms_total",
              "tokens": "tokens_total", "step_ms": "step_ms_total"}

    def __init__(self, llm):
        self.engine_stats = getattr(getattr(llm, "engine", None), "stats", None)
        self.start = self._raw()

    def _raw(self):
        counters = self.engine_stats() if callable(self.engine_stats) else {}
        if "steps" not in counters:
            return None
        raw = {k: float(counters.get(key) or 0.0) for k, key in self.TOTALS.items()}
        raw.update({k: float(counters.get(k) or 0.0) for k in self.COUNTERS})
        if counters.get("moe_layers"):
            raw.update({k: float(counters[k]) for k in self.EXPERT_LOAD}, moe_layers=float(counters["moe_layers"]))
            raw["moe_expert_tokens"] = np.asarray(counters["moe_expert_tokens_total"], np.float64)
        return raw

    def window(self) -> dict | None:
        end = self._raw()
        if end is None or self.start is None:
            return None
        d = {k: end[k] - self.start[k] for k in end}
        n = max(d["steps"], 1.0)
        # host_ms_per_step: the runner's input building + dispatch; engine_host_ms_per_step: all of step()
        # but its waits for the device (scheduling, output processing; text work too when in one process)
        return {"steps": int(d["steps"]), "host_ms_per_step": d["host_ms"] / n,
                "device_ms_per_step": d["device_ms"] / n, "tokens_per_step": d["tokens"] / n,
                "engine_host_ms_per_step": (d["step_ms"] - d["device_ms"]) / n,
                **{k: int(d[k]) for k in self.COUNTERS}, **self._expert_load(d, n, end.get("moe_layers"))}

    @staticmethod
    def _expert_load(d: dict, steps: float, layers: float | None) -> dict:
        """An MoE model's expert load over the window: per step and layer the mean and the busiest expert's
        tokens, their ratio (imbalance, max / mean; vLLM's balancedness is its inverse) and the busiest
        expert's share of all routed tokens over the window against an even share (1 / experts)."""
        if not layers or not d["moe_mean_expert_tokens_total"]:
            return {}
        per = steps * layers
        tokens = d["moe_expert_tokens"]
        return {"expert_load": {"moe_layers": int(layers), "num_experts": len(tokens),
            "mean_expert_tokens_per_step": d["moe_mean_expert_tokens_total"] / per,
            "max_expert_tokens_per_step": d["moe_max_expert_tokens_total"] / per,
            "imbalance": d["moe_max_expert_tokens_total"] / d["moe_mean_expert_tokens_total"],
            "busiest_expert_share": float(tokens.max() / tokens.sum()), "even_share": 1.0 / len(tokens)}}


def run_throughput(run) -> None:
    cfg, wl = run.cfg, run.cfg["workload"]
    n = int(wl["num_prompts"])
    ins, outs, prompts = _workload(run, n)
    run.result["workload_shape"] = {"num_prompts": n, "input_len_mean": float(ins.mean()),
                                    "output_len_mean": float(outs.mean())}
    baseline = run.hf_baseline("throughput", prompts, outs.tolist())      # before the engine holds the GPU
    llm = run.llm()
    params = _sampling_params(outs, wl, cfg["seed"])
    warm = int(wl.get("warmup_prompts") or 0)
    if warm:   # first-touch effects (allocator, lazy compiles) stay out of the timed run; other prompts,
        # so the prefix cache holds none of the timed ones
        llm.generate(_fresh(run, ins[:warm], np.random.default_rng(cfg["seed"] + 1)),
                     _sampling_params([min(8, int(o)) for o in outs[:warm]], wl, 0), use_tqdm=False)
    steps = StepStats(llm)
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    prompt_tok = sum(len(r.prompt_token_ids) for r in results)
    out_tok = sum(len(c.token_ids) for r in results for c in r.outputs)
    m = {"elapsed_s": elapsed, "num_requests": len(results), "prompt_tokens": prompt_tok,
         "output_tokens": out_tok, "requests_per_s": len(results) / elapsed,
         "output_tok_per_s": out_tok / elapsed, "total_tok_per_s": (prompt_tok + out_tok) / elapsed,
         "engine_steps": steps.window()}
    if wl["ignore_eos"] and out_tok != int(outs.sum()):
        run.notes.append(f"expected {int(outs.sum())} output tokens with ignore_eos, got {out_tok}")
    run.result["jaxserve"] = m

    max_batch = min(n, int(cfg["engine"].get("max_num_seqs") or 256))
    kv_seqs = _kv_capacity_seqs(llm, int(ins.max() + outs.max()))
    if kv_seqs is not None and kv_seqs < max_batch:
        run.notes.append(f"the KV cache holds {kv_seqs} sequences of {int(ins.max() + outs.max())} tokens, fewer "
                         f"than max_num_seqs: the roofline's waves are {kv_seqs} requests")
        max_batch = kv_seqs
    bound = roofline.generation_bound(run.cost, run.hw, n, float(ins.mean()), float(outs.mean()), max_batch)
    run.result["roofline"] = {**bound, "max_batch": max_batch}
    t, add = _vs_limit("Throughput (offline)", baseline)
    for key, label, limit in (("requests_per_s", "requests/s", bound["requests_s"]),
                              ("output_tok_per_s", "output tok/s", bound["output_tok_s"]),
                              ("total_tok_per_s", "total tok/s", bound["total_tok_s"])):
        add(label, m[key], limit, roofline.percent(m[key], limit, label), (baseline or {}).get(key), True)
    add("elapsed s", elapsed, bound["seconds"], roofline.percent(bound["seconds"], elapsed, "elapsed s"),
        (baseline or {}).get("elapsed_s"), None)
    run.tables.append(t)
    _steps_table(run, m["engine_steps"])
    run.notes.append(f"roofline: {n} requests in waves of {max_batch} (max_num_seqs), each wave's prefill "
                     f"against compute then {int(round(outs.mean())) - 1} decode steps against "
                     f"max(bandwidth, compute); {run.limits_note()}")
    run.notes += [baseline.get("note", ""), HF_RATIO_NOTE] if baseline else []
    if run.cfg["report"]["plots"]:
        plots.bars_vs_limit(run.out_dir / "throughput_vs_roofline.png", ["output tok/s", "total tok/s"],
                            [m["output_tok_per_s"], m["total_tok_per_s"]],
                            [bound["output_tok_s"], bound["total_tok_s"]], "tok/s", f"{cfg['name']}: measured vs limit")


def _vs_limit(title: str, baseline: dict | None):
    """(table, add): measured figures against their limits, with an HF baseline its figure and jaxserve / HF
    beside them (``higher_better``: jaxserve / HF, False: HF / jaxserve for times, None: no ratio)."""
    t = Table(title, ["metric", "jaxserve", "roofline limit", "% of limit"]
              + (["HF", "jaxserve / HF"] if baseline else []))

    def add(label, value, limit, pct, hf=None, higher_better=False):
        ratio = (value / hf if higher_better else hf / value) if hf and (value or higher_better) else None
        t.rows.append([label, value, limit, pct] + ([hf, None if higher_better is None else ratio] if baseline else []))
    return t, add


def _kv_capacity_seqs(llm, seq_len: int) -> int | None:
    """How many sequences of ``seq_len`` tokens the engine's KV cache holds at once (None if not known): a
    model whose cache is smaller than max_num_seqs sequences runs smaller batches, and its roofline must too."""
    kv = getattr(getattr(llm, "engine", None), "kv_manager", None)
    if kv is None:
        return None
    return max(int(kv.num_usable_blocks) // -(-seq_len // kv.block_size), 1)


STEP_COLUMNS = {"steps": "steps", "host_ms_per_step": "host ms/step", "device_ms_per_step": "device ms/step",
                "engine_host_ms_per_step": "engine host ms/step", "tokens_per_step": "tokens/step",
                "prefix_cache_hits": "prefix-cache hits", "num_preemptions": "preemptions"}
LOAD_COLUMNS = {"moe_layers": "MoE layers", "num_experts": "experts",
                "mean_expert_tokens_per_step": "mean tokens/expert", "max_expert_tokens_per_step": "max tokens/expert",
                "imbalance": "imbalance (max / mean)", "busiest_expert_share": "busiest expert's share",
                "even_share": "even share"}


def _steps_table(run, steps: dict | None) -> None:
    for title, d, columns in (("Engine steps (measured window)", steps if steps and steps["steps"] else None,
                               STEP_COLUMNS), ("Expert load (measured window; per step and MoE layer)",
                                               (steps or {}).get("expert_load"), LOAD_COLUMNS)):
        if d:
            run.tables.append(Table(title, list(columns.values()), [[d[k] for k in columns]]))


def _workload(run, n: int):
    """``n`` input and output lengths drawn from the workload's specs, and random prompts of those inputs."""
    wl = run.cfg["workload"]
    ins = sample_lengths(wl["input_len"], n, run.rng, "input_len")
    outs = sample_lengths(wl["output_len"], n, run.rng, "output_len")
    return ins, outs, _fresh(run, ins)


def _fresh(run, lengths, rng=None):
    """New random prompts of the same lengths: a repeated prompt would be served from the prefix cache."""
    return random_token_prompts(rng or run.rng, lengths, run.model_config.vocab_size)


def _timed(llm, prompts, params, lora=None) -> float:
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    return time.perf_counter() - t


def timed_batches(run, llm, ins, outs, prompts, lora=None) -> tuple[list, list, dict | None, float]:
    """One batch's latency runs (``lora``: its adapters): (e2e seconds per timed run, seconds per prefill-only run,
    the step window, the decode step's seconds)."""
    from tqdm.auto import tqdm
    wl, b = run.cfg["workload"], len(prompts)
    params = _sampling_params(outs, wl, run.cfg["seed"])
    prefill_params = _sampling_params([1] * b, wl, run.cfg["seed"])
    for _ in tqdm(range(int(wl["warmup_iters"])), desc="warm-up"):
        _timed(llm, _fresh(run, ins), params, lora)
    steps = StepStats(llm)
    # the first measured batch is the one HF gets; every later run draws fresh prompts (no prefix-cache hits)
    e2e = [_timed(llm, prompts if i == 0 else _fresh(run, ins), params, lora)
           for i in tqdm(range(int(wl["iters"])), desc="measured")]
    step_window = steps.window()
    prefill = [_timed(llm, _fresh(run, ins), prefill_params, lora)
               for _ in tqdm(range(int(wl["prefill_iters"])), desc="prefill only")]
    decode_steps = max(int(round(float(outs.mean()))) - 1, 1)
    step_s = (np.mean(e2e) - np.mean(prefill)) / decode_steps if prefill else float("nan")
    return e2e, prefill, step_window, float(step_s)


def run_latency(run) -> None:
    cfg, wl = run.cfg, run.cfg["workload"]
    b = int(wl["batch_size"])
    ins, outs, prompts = _workload(run, b)
    baseline = run.hf_baseline("latency", prompts, outs.tolist())
    e2e, prefill, step_window, step_s = timed_batches(run, run.llm(), ins, outs, prompts)
    s_e2e, s_pre = summarize(e2e), summarize(prefill)
    out_mean, in_mean = float(outs.mean()), float(ins.mean())
    decode_steps = max(int(round(out_mean)) - 1, 1)
    m = {"batch_size": b, "input_len_mean": in_mean, "output_len_mean": out_mean, "e2e_s": s_e2e,
         "prefill_s": s_pre, "decode_step_s": step_s, "output_tok_per_s": b * out_mean / s_e2e["mean"],
         "decode_tok_per_s": b / step_s if step_s > 0 else float("nan"), "engine_steps": step_window,
         "e2e_samples_s": e2e, "prefill_samples_s": prefill}
    run.result["jaxserve"] = m

    cost, hw = run.cost, run.hw
    pre_bound = roofline.prefill_bound(cost, hw, b, in_mean)
    dec_bound = roofline.decode_steps_bound(cost, hw, b, in_mean, decode_steps)
    step_bound = dec_bound / decode_steps
    mid_ctx = in_mean + 1 + (decode_steps - 1) / 2            # mean context over the decode steps
    step_bytes, step_flops = cost.decode_bytes(mid_ctx, b), cost.decode_flops(mid_ctx, b)
    r = {"e2e_bound_s": pre_bound + dec_bound, "prefill_bound_s": pre_bound, "decode_step_bound_s": step_bound,
         "decode_step_bytes": step_bytes, "decode_step_flops": step_flops,
         "achieved_bandwidth_Bps": step_bytes / step_s if step_s > 0 else float("nan"),
         "prefill_achieved_flops": cost.prefill_flops(in_mean, b) / s_pre["mean"] if prefill else float("nan")}
    run.result["roofline"] = r

    t, add = _vs_limit(f"Latency: batch {b}, {in_mean:g} in / {out_mean:g} out, {len(e2e)} iterations", baseline)
    hf_e2e = (baseline or {}).get("e2e_s", {})
    add("e2e mean s", s_e2e["mean"], r["e2e_bound_s"], roofline.percent(r["e2e_bound_s"], s_e2e["mean"], "e2e mean s"), hf_e2e.get("mean"))
    for q in (10, 25, 50, 75, 90, 99):
        add(f"e2e p{q} s", s_e2e[f"p{q}"], None, None, hf_e2e.get(f"p{q}"))
    add("output tok/s", m["output_tok_per_s"], b * out_mean / r["e2e_bound_s"],
        roofline.percent(m["output_tok_per_s"], b * out_mean / r["e2e_bound_s"], "output tok/s"),
        (baseline or {}).get("output_tok_per_s"), higher_better=True)
    add("prefill s (max_tokens=1)", s_pre["mean"], pre_bound, roofline.percent(pre_bound, s_pre["mean"], "prefill s"))
    add("decode step ms", step_s * 1e3, step_bound * 1e3, roofline.percent(step_bound, step_s, "decode step ms"))
    add("decode bandwidth TB/s", r["achieved_bandwidth_Bps"] / 1e12, hw.bandwidth / 1e12,
        roofline.percent(r["achieved_bandwidth_Bps"], hw.bandwidth, "decode bandwidth"))
    run.tables.append(t)
    _steps_table(run, step_window)
    run.notes.append("decode step = (e2e mean - prefill-only mean) / (output_len - 1); its bytes = weights + "
                     f"KV of {b} sequences at their mean context ({mid_ctx:.0f}); {run.limits_note()}")
    run.notes += [baseline.get("note", ""), HF_RATIO_NOTE] if baseline else []
    if cfg["report"]["plots"]:
        series = {"jaxserve e2e": e2e}
        if baseline and baseline.get("e2e_samples_s"):
            series["HF generate e2e"] = baseline["e2e_samples_s"]
        plots.cdf(run.out_dir / "latency_cdf.png", series, "seconds", f"{cfg['name']}: end-to-end latency")
