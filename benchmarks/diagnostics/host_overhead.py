"""Host (Python) time per engine step at many concurrent decodes, broken down by phase.

    .venv/bin/python benchmarks/diagnostics/host_overhead.py [--seqs 256] [--input-len 128] [--output-len 120]
        [--layers N] [--vocab N] [--mode sync|async|both] [--sampling greedy|random|both] [--structured]
        [--stub-device] [--engine inproc|core|split|both] [--profile FILE]

A tiny Llama (tests/fixtures/models/tiny-llama3, or the same shape with --layers N and random weights, so
the jitted step takes as many argument arrays as a real model) makes the device time negligible, so what
a step costs is what the host spends on it: schedule, building the input arrays, dispatching the jitted
calls, reading back the previous step's tokens, stop checks, incremental detokenization (the committed
SmolLM2 tokenizer), building RequestOutputs. Only steady-state steps count: every running request decodes
(no prefill chunk) and all --seqs of them are running. ``--structured`` constrains every request to the
serving benchmark's JSON schema (a string longer than any run writes) and gives the model random weights
and Llama-3's 128,256 ids (the fixture's 256 hold no ``{``): ``mask`` is then the host's bitmask fill per
step and ``postprocess`` includes the matchers taking each token.

host ms/step = wall time of ``LLMEngine.step()`` minus the time it blocked waiting for the device (the
runner's ``stats.device_ms``, the wait inside ``collect``). ``sync`` drives ``LLMEngine.step()`` as
``LLM.generate`` does (FINAL_ONLY outputs); ``async`` goes through ``AsyncLLMEngine`` as the server does
(DELTA outputs, one asyncio queue per request, consumed by 256 coroutines).

``--engine core`` is the engine core's own per-step work in this process, without its sockets: an
``EngineCore`` driven by ``EngineCoreLoop.step_and_send`` (step, stats, msgpack encoding of
the EngineCoreOutputs; the bytes go nowhere), sync mode only (a core has no output kinds of its own to
stream). ``core host`` = its host ms/step plus ``stats_send`` (stats + encoding + send); ``core_host_cpu`` is the
engine thread's CPU time per step (``time.thread_time``), the figure least moved by a loaded machine. With ``--profile FILE``
one more run of the first engine given is cProfiled over its steady-state steps and a table of the functions
by own time per step (ms) is printed (cProfile's overhead inflates every figure: compare its rows with each
other, and the untimed tables before and after a change).

``--engine split`` runs the same workloads with the engine core in its own process (``multiprocess=True``):
its host ms/step is measured in the core from the raw totals each step's outputs carry (``step_ms_total``
minus ``device_ms_total``, per steady-state step; ``loop`` adds the core's message handling, encoding and
sending), and ``front`` is what the front end spends per step turning the core's outputs into
RequestOutputs (detokenization, stop strings), in its own process, overlapped with the core's next step.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import os
import platform
import pstats
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)        # benchmarks.workloads when run as a script
TINY = os.path.join(ROOT, "tests", "fixtures", "models", "tiny-llama3")
TOKENIZER = os.path.join(ROOT, "configs", "tokenizers", "smollm2")

PHASES = ("schedule", "prepare", "sampling_metadata", "dispatch_jit", "dispatch_other", "device_wait",
          "collect_other", "update_from_output", "postprocess", "mask", "step_other")


def model_folder(layers: int | None, max_len: int, vocab: int | None = None) -> tuple[str, str]:
    """(folder, load_format): the fixture itself, or a temp copy of its config with ``layers`` layers and a
    ``vocab``-sized vocabulary (random weights)."""
    if not layers and not vocab:
        return TINY, "auto"
    with open(os.path.join(TINY, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers or cfg["num_hidden_layers"]
    cfg["vocab_size"] = vocab or cfg["vocab_size"]
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], max_len)
    folder = tempfile.mkdtemp(prefix="host-overhead-model-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder, "dummy"


class PhaseTimer:
    """Wraps the engine's phases (instance attributes only) with perf_counter timers."""

    def __init__(self, eng):
        self.eng = eng
        self.acc: dict[str, float] = defaultdict(float)
        self.steady: list[dict[str, float]] = []
        self.cur: dict[str, float] = {}
        self._is_steady = False
        self.want = 0
        self._step = eng.step
        self.wrapped: list[tuple[object, str, object]] = []     # (object, attribute, original): for restore
        # an LLMEngine with its core in this process, or an EngineCore
        core = self.core = eng.core if getattr(eng, "core", None) is not None else eng
        r, s = core.runner, core.scheduler
        self._wrap(s, "schedule", "schedule", after=self._check_steady)
        self._wrap(r, "prepare", "prepare")
        self._wrap(r, "sampling_metadata", "sampling_metadata")
        # the compiled executables a step calls (forward, sampler, decode loop) come from the runner's
        # StepCompiler: time each call of what it hands out (the jitted functions themselves only lower)
        v = r.variants
        for attr in ("get", "need"):
            self._wrap_result(v, attr, "dispatch_jit")
        # a structured-output step calls the two halves itself; ``dispatch`` calls them too
        self._wrap(r, "dispatch_forward", "dispatch")
        self._wrap(r, "dispatch_sample", "dispatch")
        self._wrap(r, "collect", "collect")
        self._wrap(s, "update_from_output", "update_from_output")
        self._wrap(core, "_process_read", "postprocess")
        if hasattr(eng, "output_processor"):
            self._wrap(eng.output_processor, "process_outputs", "postprocess")
        # the mask: filled in place (fill_bitmask), or started on a worker (start_fill) and waited for
        self.mask_calls = [a for a in ("fill_bitmask", "start_fill") if hasattr(eng.structured_output, a)]
        for a in self.mask_calls:
            self._wrap(eng.structured_output, a, "mask")

    def _timed(self, fn, name, after=None):
        cur = self

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            cur.cur[name] = cur.cur.get(name, 0.0) + time.perf_counter() - t0
            if after is not None:
                after(out)
            return out
        return wrapper

    def _wrap(self, obj, attr, name, after=None):
        self.wrapped.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, self._timed(getattr(obj, attr), name, after))

    def _wrap_result(self, obj, attr, name):
        """``obj.attr`` returns a callable: time the calls of what it returns."""
        fn = getattr(obj, attr)
        self.wrapped.append((obj, attr, fn))

        def wrapper(*a, **k):
            out = fn(*a, **k)
            return None if out is None else self._timed(out, name)
        setattr(obj, attr, wrapper)

    def restore(self) -> None:
        """Put the wrapped attributes back, so the next run starts clean."""
        for obj, attr, original in reversed(self.wrapped):
            setattr(obj, attr, original)

    def _check_steady(self, sched):
        self._is_steady = (len(sched.scheduled) == self.want
                           and all(e.num_new_tokens == 1 for e in sched.scheduled))

    def step(self):
        st = self.core.runner.stats
        self.cur = {}
        dev0 = st.device_ms
        so = self.eng.structured_output
        wait0 = getattr(so, "mask_wait_ms", 0.0)
        c0, t0 = time.thread_time(), time.perf_counter()
        outs = self._step()
        wall = time.perf_counter() - t0
        cpu = time.thread_time() - c0
        self.cur["mask"] = self.cur.get("mask", 0.0) + (getattr(so, "mask_wait_ms", 0.0) - wait0) / 1e3
        if self._is_steady:
            c = self.cur
            dev = (st.device_ms - dev0) / 1e3
            rec = {
                "wall": wall, "device_wait": dev, "host": wall - dev, "host_cpu": cpu,
                "schedule": c.get("schedule", 0.0),
                "prepare": c.get("prepare", 0.0),
                "sampling_metadata": c.get("sampling_metadata", 0.0),
                "dispatch_jit": c.get("dispatch_jit", 0.0),
                "collect_other": c.get("collect", 0.0) - dev,
                "update_from_output": c.get("update_from_output", 0.0),
                "postprocess": c.get("postprocess", 0.0),
                "mask": c.get("mask", 0.0),
            }
            rec["dispatch_other"] = c.get("dispatch", 0.0) - rec["prepare"] - rec["sampling_metadata"] \
                - rec["dispatch_jit"]
            rec["step_other"] = wall - sum(rec[p] for p in PHASES if p != "step_other")
            self.steady.append(rec)
        return outs

    def summary(self, skip: int = 3) -> dict:
        recs = self.steady[skip:] or self.steady
        med = {k: float(np.median([r[k] for r in recs])) * 1e3 for k in recs[0]}
        return {"steady_steps": len(recs), **{k: round(v, 3) for k, v in med.items()}}


STRUCTURED = False     # --structured: every request constrained to the serving benchmark's JSON schema
STUB_DEVICE = False    # --stub-device: no jitted step at all (StubDevice)


class StubDevice:
    """``--stub-device``: the runner's dispatches return at once and reading a step picks, per sampling row,
    a random token its structured-output bitmask allows (any token without one). The picking is counted as
    device wait, so host ms is the engine's own work even where the CPU "device" would dominate (a
    128,256-id vocabulary) or compete with the host for the cores."""

    def __init__(self, runner, seed: int = 0):
        self.runner, self.rng, self.num_rows = runner, np.random.default_rng(seed), runner.max_num_seqs
        runner.dispatch_forward, runner.dispatch_sample = self.dispatch_forward, self.dispatch_sample
        runner.dispatch, runner.collect = self.dispatch, self.collect

    def dispatch_forward(self, scheduled, prev=None):
        from types import SimpleNamespace
        return SimpleNamespace(num_rows=max(len(scheduled), self.num_rows), scheduled=scheduled)

    def dispatch_sample(self, forward, bitmask=None):
        forward.bitmask = bitmask
        return forward

    def dispatch(self, scheduled, prev=None):
        return self.dispatch_sample(self.dispatch_forward(scheduled, prev))

    def collect(self, pending):
        from jaxserve.runner.model_runner import StepResult
        t0 = time.perf_counter()
        vocab, toks = self.runner.vocab_size, {}
        for i, s in enumerate(pending.scheduled):
            if s.samples:
                toks[s.request.request_id] = (self._allowed(pending.bitmask[i], vocab) if pending.bitmask is not None
                                              else int(self.rng.integers(3, vocab)))
        self.runner.stats.device_ms += (time.perf_counter() - t0) * 1e3
        return StepResult(toks, {})

    def _allowed(self, row: np.ndarray, vocab: int) -> int:
        words = row.view(np.uint32)[:(vocab + 31) // 32]
        w = int(self.rng.choice(np.flatnonzero(words)))
        bits = [b for b in range(32) if int(words[w]) >> b & 1 and w * 32 + b < vocab]
        return w * 32 + int(self.rng.choice(bits))


def make_params(kind: str, output_len: int, output_kind):
    from jaxserve import SamplingParams
    from jaxserve.sampling_params import StructuredOutputsParams
    extra = {}
    if STRUCTURED:
        from benchmarks.workloads import DEFAULT_STRUCTURED_SCHEMA
        extra["structured_outputs"] = StructuredOutputsParams(json=DEFAULT_STRUCTURED_SCHEMA)
    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True, output_kind=output_kind,
                              **extra)
    return SamplingParams(temperature=0.8, top_p=0.9, max_tokens=output_len, ignore_eos=True,
                          output_kind=output_kind, **extra)


def run_sync(llm, prompts, kind, output_len, profile=None) -> dict:
    from jaxserve.sampling_params import RequestOutputKind
    eng = llm.engine
    if STUB_DEVICE:
        StubDevice(eng.core.runner)
    timer = PhaseTimer(eng)
    timer.want = len(prompts)
    for p in prompts:
        eng.add_request(eng.new_request_id(), p, make_params(kind, output_len, RequestOutputKind.FINAL_ONLY))
    prof = cProfile.Profile() if profile else None
    n_out = profiled = 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        on = prof is not None and timer.steady
        if on:
            prof.enable()
        for o in timer.step():
            n_out += len(o.outputs[0].token_ids)
        if on:
            prof.disable()
            profiled += 1
    dt = time.perf_counter() - t0
    if prof is not None:
        prof.dump_stats(profile)
    res = timer.summary()
    res["output_tok_s"] = round(n_out / dt, 1)
    res["profiled_steps"] = profiled
    timer.restore()
    return res


def stream_all(front, prompts, kind, output_len) -> float:
    """Every prompt as its own DELTA stream through the async front ``front``, all at once (as 256 server
    clients would); returns output tok/s."""
    from jaxserve.sampling_params import RequestOutputKind

    async def one(i, p):
        n = 0
        async for out in front.generate(p, make_params(kind, output_len, RequestOutputKind.DELTA), f"a{i}"):
            n += len(out.outputs[0].token_ids)
        return n

    async def main():
        return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    t0 = time.perf_counter()
    n_out = asyncio.run(main())
    return round(n_out / (time.perf_counter() - t0), 1)


def run_async(llm, prompts, kind, output_len) -> dict:
    from jaxserve.engine.async_engine import AsyncLLMEngine
    eng = llm.engine
    if STUB_DEVICE:
        StubDevice(eng.core.runner)
    timer = PhaseTimer(eng)
    timer.want = len(prompts)
    eng.step = timer.step                           # the loop thread calls eng.step()
    front = AsyncLLMEngine(eng.config, engine=eng)
    tok_s = stream_all(front, prompts, kind, output_len)
    front.shutdown(drain_timeout=1)
    del eng.step
    res = timer.summary()
    res["output_tok_s"] = tok_s
    timer.restore()
    return res


class NullOutbox:
    """The core's output socket for ``--engine core``: counts what would be sent."""

    def __init__(self):
        self.bytes = 0

    def send(self, data, copy=True):
        self.bytes += len(data)


def run_core(eng, prompts, kind, output_len, profile=None) -> dict:
    """The engine core's per-step work (``EngineCoreLoop.step_and_send``) with no sockets, on an
    ``EngineCore`` in this process; ``profile``: cProfile its steady-state steps into
    this file."""
    import msgspec

    from jaxserve.engine.core_process import EngineCoreLoop
    from jaxserve.engine.gc_heap import prepare_gc_for_serving
    from jaxserve.sampling_params import RequestOutputKind
    if STUB_DEVICE:
        StubDevice(eng.runner)
    timer = PhaseTimer(eng)
    timer.want = len(prompts)
    eng.step = timer.step                           # step_and_send calls eng.step()
    outbox = NullOutbox()
    loop = EngineCoreLoop(eng, None, outbox, msgspec.msgpack.Encoder())
    params = make_params(kind, output_len, RequestOutputKind.FINAL_ONLY)
    for i, p in enumerate(prompts):
        eng.add_request(f"core-{time.monotonic_ns()}-{i}", p, params, time.time(), i)
    thresholds = gc.get_threshold()
    prepare_gc_for_serving()                           # as the core process does once loaded
    prof = cProfile.Profile() if profile else None
    profiled = 0
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        n_steady = len(timer.steady)
        on = prof is not None and n_steady > 0
        if on:
            prof.enable()
        c1, t1 = time.thread_time(), time.perf_counter()
        loop.step_and_send()
        dt, cpu = time.perf_counter() - t1, time.thread_time() - c1
        if on:
            prof.disable()
            profiled += 1
        if len(timer.steady) > n_steady:        # a steady step: what the loop spent beyond step()
            rec = timer.steady[-1]
            rec["stats_send"] = dt - rec["wall"]
            rec["core_host"] = rec["host"] + rec["stats_send"]
            rec["core_host_cpu"] = cpu          # this thread's CPU time: what other processes' load leaves out
    dt = time.perf_counter() - t0
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    del eng.step
    if prof is not None:
        prof.dump_stats(profile)
    res = timer.summary()
    res["output_tok_s"] = round(timer.want * output_len / dt, 1)
    res["bytes_per_step"] = round(outbox.bytes / max(1, eng.runner.stats.steps))
    res["profiled_steps"] = profiled
    timer.restore()
    return res


def function_table(profile: str, per: int, top: int = 30, unit: str = "step", time_unit: str = "ms") -> str:
    """The profile's functions by own time: ``time_unit`` (ms or µs) per ``unit`` (own, and with what they
    call) and calls per ``unit``, over ``per`` units, as a markdown table."""
    scale, digits = {"ms": (1e3, 3), "µs": (1e6, 2)}[time_unit]
    st = pstats.Stats(profile).stats
    rows = sorted(st.items(), key=lambda kv: -kv[1][2])[:top]
    out = [f"| function | own {time_unit}/{unit} | cum {time_unit}/{unit} | calls/{unit} |", "|---|---|---|---|"]
    for (path, line, name), (_cc, nc, tt, ct, _callers) in rows:
        where = name if path == "~" else f"{os.path.relpath(path, ROOT) if path.startswith(ROOT) else os.path.basename(path)}:{line}({name})"
        out.append(f"| `{where}` | {tt * scale / per:.{digits}f} | {ct * scale / per:.{digits}f} | {nc / per:.2f} |")
    return "\n".join(out)


def short_commit() -> str:
    """HEAD's abbreviated hash for a run's header and JSON (``envinfo.git_commit``; empty outside a checkout)."""
    from benchmarks.envinfo import git_commit
    return (git_commit()["commit"] or "")[:7]


def write_json(path: str, script: str, argv, commit: str, rows: list) -> None:
    """The run's rows with the command that made them (``script``'s path from the repository root)."""
    with open(path, "w") as f:
        json.dump({"command": "python " + " ".join([os.path.relpath(script, ROOT)]
                                                   + (argv if argv is not None else sys.argv[1:])),
                   "commit": commit, "rows": rows}, f, indent=2)


class CoreStepRecorder:
    """Records the raw totals every EngineCoreOutputs carries (a split engine) and the front end's time per
    step; ``summary`` takes the steady-state steps (all ``want`` requests decoding: ``want`` tokens)."""

    def __init__(self, eng, want: int):
        self.eng, self.want = eng, want
        self.snaps: list[dict] = []
        self.front: list[float] = []
        self._recv = eng.client.recv
        self._process = eng.output_processor.process_outputs
        eng.client.recv = self.recv
        eng.output_processor.process_outputs = self.process

    def recv(self, timeout_s):
        msg = self._recv(timeout_s)
        st = getattr(msg, "stats", None)
        if st and "tokens_total" in st:     # every step's message (FINAL_ONLY requests: often no outputs)
            self.snaps.append(dict(st))
        return msg

    def process(self, outs):
        t0 = time.perf_counter()
        res = self._process(outs)
        if len(outs) == self.want:
            self.front.append(time.perf_counter() - t0)
        return res

    def restore(self):
        del self.eng.client.recv
        del self.eng.output_processor.process_outputs

    def summary(self, skip: int = 3) -> dict:
        recs = []
        for a, b in zip(self.snaps, self.snaps[1:]):
            if b["steps"] - a["steps"] == 1 and b["tokens_total"] - a["tokens_total"] == self.want \
                    and b["num_running"] == self.want:
                dev = b["device_ms_total"] - a["device_ms_total"]
                wall = b["step_ms_total"] - a["step_ms_total"]
                recs.append({"wall": wall, "device_wait": dev, "host": wall - dev,
                             "loop_host": b["core_loop_ms_total"] - a["core_loop_ms_total"] - dev})
        recs = recs[skip:] or recs
        if not recs:
            return {"steady_steps": 0}
        med = {k: round(float(np.median([r[k] for r in recs])), 3) for k in recs[0]}
        # loop_host lags one step (each message carries the loop time up to the previous step): fine in steady state
        med["front"] = round(float(np.median(self.front[skip:] or self.front)) * 1e3, 3) if self.front else None
        return {"steady_steps": len(recs), **med}


def run_split_sync(llm, prompts, kind, output_len) -> dict:
    from jaxserve.sampling_params import RequestOutputKind
    eng = llm.engine
    rec = CoreStepRecorder(eng, len(prompts))
    params = make_params(kind, output_len, RequestOutputKind.FINAL_ONLY)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    rec.restore()
    return {**rec.summary(), "output_tok_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / dt, 1)}


def run_split_async(llm, prompts, kind, output_len) -> dict:
    from jaxserve.engine.async_engine import AsyncLLMEngine
    eng = llm.engine
    front = AsyncLLMEngine(eng.config, engine=eng)
    rec = CoreStepRecorder(eng, len(prompts))
    tok_s = stream_all(front, prompts, kind, output_len)
    rec.restore()
    front._stop.set()                       # stop its reader thread; the core stays up for the next run
    front._thread.join()
    return {**rec.summary(), "output_tok_s": tok_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=120)
    ap.add_argument("--layers", type=int, default=0, help="0 = the fixture (2 layers); N = N layers, random weights")
    ap.add_argument("--vocab", type=int, default=0,
                    help="the model's vocabulary size (random weights); 0 = the fixture's, 128256 with --structured")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--mode", choices=("sync", "async", "both"), default="both")
    ap.add_argument("--sampling", choices=("greedy", "random", "both"), default="both")
    ap.add_argument("--engine", choices=("inproc", "core", "split", "both"), default="both",
                    help="the engine core in this process (inproc: with its front end; core: the core's own "
                         "step loop, no sockets), in its own (split: multiprocess=True), or both = inproc + split")
    ap.add_argument("--structured", action="store_true",
                    help="constrain every request to the serving benchmark's JSON schema")
    ap.add_argument("--stub-device", action="store_true",
                    help="run no jitted step: tokens are random (allowed by the mask), their picking counts as device")
    ap.add_argument("--profile", default=None, help="after the table, cProfile the steady-state steps of one "
                                                   "more sync run (the first in-process engine given: inproc or "
                                                   "core) into this file and print its functions' ms/step")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    global STRUCTURED, STUB_DEVICE
    STRUCTURED, STUB_DEVICE = a.structured, a.stub_device

    import jax
    from jaxserve import LLM

    max_len = a.input_len + a.output_len
    # a grammar needs the tokenizer's ids among the model's (the fixture has 256): the serving benchmark's
    # shape, Llama-3's 128,256 logits over the SmolLM2 tokenizer
    folder, fmt = model_folder(a.layers, max_len, vocab=a.vocab or (128256 if a.structured else None))
    opts = dict(load_format=fmt, tokenizer=TOKENIZER, dtype="float32", max_model_len=max(256, max_len),
                max_num_seqs=a.seqs, max_num_batched_tokens=a.max_num_batched_tokens, compilation_cache_dir="",
                kv_cache_memory_bytes=1 << 30, skip_warmup=a.stub_device)
    modes = ("sync", "async") if a.mode == "both" else (a.mode,)
    kinds = ("greedy", "random") if a.sampling == "both" else (a.sampling,)
    engines = ("inproc", "split") if a.engine == "both" else (a.engine,)
    rows = []
    llm = core = None
    for engine in engines:
        rng = np.random.default_rng(0)
        if engine == "inproc":
            llm = LLM(folder, use_tqdm_on_load=False, multiprocess=False, **opts)
            llm.engine.core.runner.wait_compiled()
            vocab = llm.engine.model_config.vocab_size
        elif engine == "core":
            from jaxserve.engine.core import EngineCore
            from jaxserve.llm import engine_config_from_kwargs
            core = EngineCore(engine_config_from_kwargs(folder, **opts), progress=False)
            core.runner.wait_compiled()         # the steady state: no background compile competes for the cores
            vocab = core.model_config.vocab_size
        else:
            split = LLM(folder, use_tqdm_on_load=False, multiprocess=True, **opts)
            vocab = split.engine.model_config.vocab_size
        for mode in (("sync",) if engine == "core" else modes):
            for kind in kinds:
                prompts = [rng.integers(3, vocab, size=a.input_len).tolist() for _ in range(a.seqs)]
                if engine == "inproc":
                    res = (run_sync if mode == "sync" else run_async)(llm, prompts, kind, a.output_len)
                elif engine == "core":
                    res = run_core(core, prompts, kind, a.output_len)
                elif mode == "sync":
                    res = run_split_sync(split, prompts, kind, a.output_len)
                else:
                    res = run_split_async(split, prompts, kind, a.output_len)
                res = {"engine": engine, "mode": mode, "sampling": kind, **res}
                rows.append(res)
                print(json.dumps(res), flush=True)
        if engine == "split":
            split.shutdown()
    commit = short_commit()
    print(f"\n{time.strftime('%Y-%m-%d')} commit {commit}, {platform.machine()} x{os.cpu_count()} CPUs, "
          f"jax {jax.__version__} ({jax.default_backend()}), {a.seqs} seqs, layers {a.layers or 2}, "
          f"vocab {vocab}"
          + (", every request JSON-schema constrained" if a.structured else "")
          + (", stub device (no jitted step)" if a.stub_device else ""))
    cols = ["host", "wall", *PHASES]
    inproc_rows = [r for r in rows if r["engine"] == "inproc"]
    if inproc_rows:
        print("| mode | sampling | " + " | ".join(cols) + " | out tok/s |")
        print("|" + "---|" * (len(cols) + 3))
        for r in inproc_rows:
            print(f"| {r['mode']} | {r['sampling']} | " + " | ".join(f"{r[c]:.2f}" for c in cols)
                  + f" | {r['output_tok_s']:.0f} |")
        print("(in-process engine; ms per steady-state step, medians; host = wall - device_wait)")
    core_rows = [r for r in rows if r["engine"] == "core"]
    if core_rows:
        cols = ["core_host_cpu", "core_host", "host", "stats_send", "wall", *PHASES]
        print("\n| sampling | " + " | ".join(cols) + " | bytes/step | out tok/s |")
        print("|" + "---|" * (len(cols) + 3))
        for r in core_rows:
            print(f"| {r['sampling']} | " + " | ".join(f"{r[c]:.2f}" for c in cols)
                  + f" | {r['bytes_per_step']} | {r['output_tok_s']:.0f} |")
        print("(the engine core's step loop in this process, no sockets; ms per steady-state step, medians; host = "
              "step() wall - device_wait; stats_send = stats + msgpack encoding; core_host = host + stats_send; "
              "core_host_cpu = the engine thread's CPU time per step (time.thread_time: the other threads, "
              "XLA's CPU device among them, and other processes left out; a wait that spins counts))")
    split_rows = [r for r in rows if r["engine"] == "split"]
    if split_rows:
        cols = ["host", "loop_host", "wall", "device_wait", "front"]
        print("\n| mode | sampling | core " + " | core ".join(cols[:-1]) + " | front | steady steps | out tok/s |")
        print("|" + "---|" * (len(cols) + 4))
        fmt = lambda v: "-" if v is None else f"{v:.2f}"      # noqa: E731
        for r in split_rows:
            print(f"| {r['mode']} | {r['sampling']} | " + " | ".join(fmt(r.get(c)) for c in cols)
                  + f" | {r['steady_steps']} | {r['output_tok_s']:.0f} |")
        print("(engine core in its own process; ms per steady-state step, medians; core host = its step() wall "
              "- device_wait; loop_host adds its messages, encoding, sending; front = the front end's output "
              "processing per step, in the other process)")
    if a.profile and (llm is not None or core is not None):
        # a separate run (cProfile slows the host down): sync, the first sampling kind
        prompts = [rng.integers(3, vocab, size=a.input_len).tolist() for _ in range(a.seqs)]
        which = "core" if llm is None else "inproc"
        res = (run_core(core, prompts, kinds[0], a.output_len, profile=a.profile) if which == "core"
               else run_sync(llm, prompts, kinds[0], a.output_len, profile=a.profile))
        steps = max(1, res["profiled_steps"])
        print(f"\ncProfile of {steps} steps ({which}, sync, {kinds[0]}), functions by own time:")
        print(function_table(a.profile, steps))
    if a.json:
        write_json(a.json, __file__, argv, commit, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
