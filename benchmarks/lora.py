"""`lora` mode: the decode step with LoRA adapters in the batch against the base model alone, and adapter load time
(benchmarks/README.md's "lora")."""
from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from . import roofline
from .config import engine_kwargs
from .metrics import fmt
from .offline import _workload, timed_batches
from .report import Table


def run_lora(run) -> None:
    from jaxserve.lora import LoRARequest
    from jaxserve.lora.peft import write_random_adapter
    wl, kw = run.cfg["workload"], engine_kwargs(run.cfg)
    counts, rank, sizes = [int(n) for n in wl["adapters"]], int(wl["rank"]), [int(b) for b in wl["batch_sizes"]]
    base_kw = {k: v for k, v in kw.items() if k not in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")}
    engines = [(None, base_kw)] + [(n, {**base_kw, "enable_lora": True, "max_loras": kw.get("max_loras") or max(n, 1),
                                        "max_lora_rank": max(rank, kw.get("max_lora_rank") or 0)}) for n in counts]
    points, base = [], {}
    with tempfile.TemporaryDirectory(prefix="jaxserve-lora-") as tmp:
        folders = [write_random_adapter(os.path.join(tmp, f"a{i}"), run.model_config, rank, seed=i)
                   for i in range(max(counts + [int(wl["load_iters"])]))]
        for n, engine in engines:
            llm = None              # the last engine's only other reference: let it go before the next loads
            llm = run.engines.get(engine)
            if n is not None and "adapter_load" not in run.result:
                run.result["adapter_load"] = _load_times(llm, folders[:int(wl["load_iters"])], rank)
            for b in (b for b in sizes if n is None or n <= b):
                ins, outs, prompts = _workload(run, b)
                loras = [LoRARequest(f"bench-{i % n}", i % n + 1, folders[i % n]) for i in range(b)] if n else None
                e2e, prefill, _, step_s = timed_batches(run, llm, ins, outs, prompts, loras)
                base.setdefault(b, step_s)
                bound = roofline.decode_steps_bound(run.cost, run.hw, b, float(ins.mean()), 1)
                points.append({"batch_size": b, "adapters": n, "max_loras": engine.get("max_loras"),
                               "decode_step_s": step_s, "vs_base": step_s / base[b], "base_bound_s": bound,
                               "e2e_s": float(np.mean(e2e)), "prefill_s": float(np.mean(prefill)),
                               "output_tok_per_s": b * float(outs.mean()) / float(np.mean(e2e))})
    run.result["jaxserve"] = {"points": points, "rank": rank}
    run.tables.append(Table(f"Decode step with LoRA adapters (rank {rank}, all 7 projections) against the base model",
                            ["batch", "adapters", "max_loras", "decode step ms", "× base", "base limit ms",
                             "e2e mean s", "prefill s", "output tok/s"], [[
                                p["batch_size"], "base (no LoRA)" if p["adapters"] is None else p["adapters"],
                                p["max_loras"], p["decode_step_s"] * 1e3, f"{p['vs_base']:.3f}",
                                p["base_bound_s"] * 1e3, p["e2e_s"], p["prefill_s"], p["output_tok_per_s"]]
                                for p in points]))
    if load := run.result.get("adapter_load"):
        run.tables.append(Table(f"Adapter load (rank {rank}, median of {load['count']})", ["MB on disk",
                                "read the folder ms", "write a device slot ms"],
                                [[load["mb"], load["read_s"] * 1e3, load["write_s"] * 1e3]]))
    run.notes.append("decode step = (e2e mean - prefill-only mean) / (output_len - 1); × base: against the same batch "
                     "on the engine without LoRA; base limit: the base model's decode step at the roofline, "
                     f"{run.limits_note()}")


def _load_times(llm, folders: list[str], rank: int) -> dict:
    """Median seconds to read an adapter folder and to write it into slot 1 (in-process engines), which then gets
    back what the engine's manager put there."""
    import jax
    from jaxserve.lora import read_adapter
    core = getattr(llm.engine, "core", None)
    runner = getattr(core, "runner", None)
    if runner is None or runner.lora is None:
        return {}
    runner.write_lora_slot(1, None)             # compiles the slot write outside the timing
    times = []
    for folder in folders:
        t0 = time.perf_counter()
        adapter = read_adapter(folder, runner.cfg, rank)
        t1 = time.perf_counter()
        runner.write_lora_slot(1, adapter)
        jax.block_until_ready(runner.lora.stacks)
        times.append((t1 - t0, time.perf_counter() - t1))
    held = core.lora.slots[1]
    runner.write_lora_slot(1, core.lora.read(held) if held is not None else None)
    read_s, write_s = np.median(times, axis=0).tolist()
    return {"count": len(folders), "mb": os.path.getsize(os.path.join(folders[0], "adapter_model.safetensors")) / 1e6,
            "read_s": read_s, "write_s": write_s}


def summary(run) -> str:
    load = run.result.get("adapter_load") or {}
    ratios = ", ".join(f"batch {p['batch_size']} {p['adapters']} adapters ×{p['vs_base']:.3f}"
                       for p in run.result["jaxserve"]["points"] if p["adapters"] is not None)
    return f"{run.cfg['name']}: decode step / base: {ratios}" + (
        f"; adapter load {fmt(load['read_s'] * 1e3)} ms read + {fmt(load['write_s'] * 1e3)} ms slot write" * bool(load))
