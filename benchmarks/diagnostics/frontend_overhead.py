"""The front end's CPU per generated token at many concurrent streams, against a fake engine core.

    .venv/bin/python benchmarks/diagnostics/frontend_overhead.py [--streams 256] [--output-len 128]
        [--step-ms 10] [--level processor|async|server|all] [--stop] [--logprobs N] [--profile FILE]

With the engine core in its own process, everything that needs text runs in the front end: decoding the
core's per-step messages, incremental detokenization, stop strings, RequestOutputs, the hand-over to the
asyncio streams, and (the server) OpenAI chunks, msgspec JSON and SSE. This measures that CPU without a
model: ``FakeCoreClient`` stands where ``core_client.MPClient`` stands (the same messages, msgpack-encoded and
decoded as the sockets would carry them) and answers one step every ``--step-ms`` (a device at that many ms
per step) with one token per running request, read from a fixed English text as the SmolLM2 tokenizer
spells it (real detokenization work: multi-token words, spaces, punctuation), finishing each request by
length at ``--output-len`` as the core would.

Levels (each includes the ones before it):
- ``processor``: ``LLMEngine.step`` in a loop (decode the message, the front end's ``OutputProcessor``,
  DELTA RequestOutputs), as the async front's reader thread runs it;
- ``async``: ``AsyncLLMEngine`` (its reader thread, the hand-over to the event loop) with one coroutine per
  stream consuming ``generate``;
- ``server``: the Litestar app (``server.app.build_app``) over ASGI, one streamed ``/v1/completions`` per
  stream as ``benchmarks/loadgen.py`` sends it (token-id prompt, ignore_eos, ``include_usage``), the SSE
  bytes taken by a minimal ASGI ``send`` (no HTTP parser or socket: uvicorn's part is not in it).

Figure: front-end CPU µs per generated token = (this process's CPU time - the fake core's own CPU) / output
tokens, over the whole run (every stream admitted at once); ``of it in gc``: the CPU time inside the garbage
collector's passes (``gc.callbacks``) per token. ``ms/step`` = µs/token x streams: the front end's
CPU per engine step; above the device's ms per step, one front end bounds the server (on this CPU).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import os
import pickle
import platform
import sys
import threading
import time
from types import SimpleNamespace

import msgspec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
TOKENIZER = os.path.join(ROOT, "configs", "tokenizers", "smollm2")

from benchmarks.diagnostics.host_overhead import (  # noqa: E402  (ROOT on sys.path)
    function_table, short_commit, write_json)

# What the fake model "writes": ordinary prose, code-ish punctuation and a few non-ASCII characters (which
# byte-level BPE splits over tokens), cycled; each stream starts at its own offset.
TEXT = (
    "The engine core runs the scheduler and the model runner in a busy loop, while the front end turns "
    "token ids into text. Each step, every running request gets one new token: \"hello\", 'world', (x + y) * 2 "
    "= 42; naïve café — déjà vu… 東京 and 🙂 take several bytes each. A stop string may span two tokens, so the "
    "detokenizer holds back the last few characters until they are settled.\n\n    def step(self):\n        "
    "return self.schedule()\n"
)
PROMPT_LEN = 512


def _fake_core_client_class():
    from jaxserve.engine.core_client import MPClient

    class FakeCoreClient(_FakeCore, MPClient):        # the fake transport under MPClient's reading
        def __init__(self, facts, tokens, step_s, logprobs=None):
            _FakeCore.__init__(self, facts, tokens, step_s, logprobs)
            self._start_reading(facts)
    return FakeCoreClient


class _FakeCore:
    """``MPClient``'s transport (send / recv / is_alive / close / dead_reason) over a core that samples from
    a script: the same messages through msgpack, no process, no model.

    ``own_cpu_s``: the CPU this object spends being the core (building and encoding its outputs), which the
    figure leaves out; decoding them is the front end's and counts."""

    def __init__(self, facts, tokens: list[int], step_s: float, logprobs: int | None = None):
        from jaxserve.engine import messages as m
        from jaxserve.engine.request import RequestStatus
        self.length_capped = int(RequestStatus.FINISHED_LENGTH_CAPPED)
        self.m = m
        self.facts = facts
        self.dead_reason = None
        self.tokens = tokens
        self.step_s = step_s
        self.logprobs = logprobs
        self.live: dict[str, list] = {}           # request id -> [max_tokens, produced, offset into tokens]
        self.lock = threading.Lock()
        self.encoder = msgspec.msgpack.Encoder()
        self.to_core = msgspec.msgpack.Decoder(m.ToCore)
        self.from_core = msgspec.msgpack.Decoder(m.FromCore)
        self.next_due = 0.0
        self.own_cpu_s = 0.0
        self.steps = 0
        self.tokens_out = 0

    def send(self, msg) -> None:
        c0 = time.thread_time()
        msg = self.to_core.decode(self.encoder.encode(msg))
        m = self.m
        with self.lock:
            if isinstance(msg, (m.EngineCoreRequest, m.AddRequests)):
                for r in (msg.requests if isinstance(msg, m.AddRequests) else [msg]):
                    params = pickle.loads(r.sampling_params)
                    self.live[r.request_id] = [params.max_tokens, 0, (len(self.live) * 7) % len(self.tokens)]
            elif isinstance(msg, m.AbortRequests):
                for rid in msg.request_ids:
                    self.live.pop(rid, None)
        self.own_cpu_s += time.thread_time() - c0

    def recv(self, timeout_s: float):
        now = time.perf_counter()
        wait = self.next_due - now
        if wait > 0:
            if wait > timeout_s:
                time.sleep(timeout_s)
                return None
            time.sleep(wait)
        c0 = time.thread_time()
        m = self.m
        outs = []
        toks, n_toks = self.tokens, len(self.tokens)
        with self.lock:
            if not self.live:
                self.own_cpu_s += time.thread_time() - c0
                time.sleep(min(timeout_s, 0.01))
                return None
            done = []
            for rid, st in self.live.items():
                tok = toks[(st[2] + st[1]) % n_toks]
                st[1] += 1
                finished = st[1] >= st[0]
                lps = None
                if self.logprobs is not None:
                    k = self.logprobs
                    lps = [(-0.5, 1, [tok] + [toks[(st[1] + i) % n_toks] for i in range(1, k)],
                            [-0.5 - 0.1 * i for i in range(k)])]
                outs.append(m.EngineCoreOutput(rid, [tok], self.length_capped if finished else 0, None, lps,
                                               **({"first_scheduled_time": time.time(), "first_token_time": time.time()}
                                                  if st[1] == 1 else {})))
                if finished:
                    done.append(rid)
            for rid in done:
                del self.live[rid]
            running = len(self.live)
        self.steps += 1
        self.tokens_out += len(outs)
        data = self.encoder.encode(m.EngineCoreOutputs(outs, {"num_running": running, "num_waiting": 0,
                                                              "kv_cache_usage": 0.5}))
        self.next_due = max(self.next_due + self.step_s, time.perf_counter())
        self.own_cpu_s += time.thread_time() - c0
        return self.from_core.decode(data)

    def is_alive(self) -> bool:
        return True

    def close(self, timeout_s: float = 0.0) -> None:
        pass


def make_engine(a, tokens):
    """An ``LLMEngine`` whose core (``multiprocess``) is a ``FakeCoreClient``."""
    from transformers import AutoTokenizer

    from jaxserve.engine import core_client
    from jaxserve.engine.core import EngineFacts
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.llm import engine_config_from_kwargs
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    config = engine_config_from_kwargs("fake-model", tokenizer=TOKENIZER, max_model_len=PROMPT_LEN + a.output_len + 64,
                                       max_num_seqs=a.streams)
    facts = EngineFacts(config=config, tokenizer=tok, model_config=SimpleNamespace(vocab_size=len(tok)),
                        max_model_len=config.max_model_len, eos_token_ids=(tok.eos_token_id,), chat_template=None,
                        is_embedding=False, multi_process=False, structured_unsupported_reason=None,
                        model_source="fake", load_format="fake", dtype_name="none", load_seconds=0.0,
                        warmup_seconds=0.0)
    real, fake = core_client.MPClient, _fake_core_client_class()
    core_client.MPClient = lambda *_a, **_k: fake(facts, tokens, a.step_ms / 1e3, a.logprobs)
    try:
        return LLMEngine(config, progress=False, multiprocess=True)
    finally:
        core_client.MPClient = real


def sampling_params(a):
    from jaxserve import SamplingParams
    from jaxserve.sampling_params import RequestOutputKind
    return SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True, logprobs=a.logprobs,
                          stop=["@@never@@", "\n\n\n"] if a.stop else None, output_kind=RequestOutputKind.DELTA)


def prompts(a, vocab: int) -> list[list[int]]:
    return [[(i * 131 + j * 17) % (vocab - 10) + 5 for j in range(PROMPT_LEN)] for i in range(a.streams)]


def run_processor(a, eng, start) -> dict:
    start()
    params = sampling_params(a)
    for i, p in enumerate(prompts(a, eng.model_config.vocab_size)):
        eng.add_request(f"p{i}", p, params)
    n = chunks = 0
    while eng.has_unfinished_requests():
        for out in eng.step(timeout_s=1.0):
            n += len(out.outputs[0].token_ids)
            chunks += 1
    return {"tokens": n, "outputs": chunks}


def run_async(a, eng, start) -> dict:
    from jaxserve.engine.async_engine import AsyncLLMEngine
    front = AsyncLLMEngine(eng.config, engine=eng)
    params = sampling_params(a)
    start()

    async def one(i, p):
        n = 0
        async for out in front.generate(p, params, f"a{i}"):
            n += len(out.outputs[0].token_ids)
        return n

    async def main():
        return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(a, eng.model_config.vocab_size)))))
    n = asyncio.run(main())
    front._stop.set()
    front._thread.join()
    return {"tokens": n}


def run_server(a, eng, start) -> dict:
    """``--streams`` streamed /v1/completions through the app's ASGI callable."""
    from jaxserve.engine.async_engine import AsyncLLMEngine
    from server.app import build_app
    from server.args import ServerArgs
    front = AsyncLLMEngine(eng.config, engine=eng)
    app = build_app(front, ServerArgs(disable_uvicorn_access_log=True))
    vocab = eng.model_config.vocab_size
    stats = {"chunks": 0, "bytes": 0, "tokens": 0, "errors": 0}

    async def one(i, p):
        body = {"model": "fake-model", "prompt": p, "max_tokens": a.output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if a.stop:
            body["stop"] = ["@@never@@", "\n\n\n"]
        if a.logprobs is not None:
            body["logprobs"] = a.logprobs
        raw = msgspec.json.encode(body)
        done = asyncio.Event()
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        last = b""

        async def send(message):
            nonlocal last
            if message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if chunk:
                    stats["chunks"] += 1
                    stats["bytes"] += len(chunk)
                    last = chunk if b"usage" in chunk else last
                if not message.get("more_body", False):
                    done.set()
            elif message["type"] == "http.response.start" and message["status"] != 200:
                stats["errors"] += 1

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"),
                                              (b"content-length", str(len(raw)).encode())],
                 "client": ("127.0.0.1", 1000 + i), "server": ("127.0.0.1", 8000), "state": {}}
        await app(scope, receive, send)
        done.set()
        for line in last.split(b"\n\n"):
            if line.startswith(b"data: {") and b'"usage"' in line:
                usage = msgspec.json.decode(line[6:]).get("usage")
                if usage:
                    stats["tokens"] += usage["completion_tokens"]

    async def main():
        start()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(a, vocab))))
    asyncio.run(main())
    front._stop.set()
    front._thread.join()
    return stats


LEVELS = {"processor": run_processor, "async": run_async, "server": run_server}


def measure(a, level: str, tokens: list[int], profile: str | None = None) -> dict:
    from jaxserve.engine.gc_heap import prepare_gc_for_serving
    eng = make_engine(a, tokens)
    core = eng.client
    prof = cProfile.Profile() if profile else None
    clock = {}
    thresholds = gc.get_threshold()
    collector = {"s": 0.0, "full": 0, "t0": 0.0}      # the garbage collector's share: time in collections

    def on_gc(phase, info):
        if phase == "start":
            collector["t0"] = time.thread_time()
        else:
            collector["s"] += time.thread_time() - collector["t0"]
            collector["full"] += info["generation"] == 2

    def start():
        prepare_gc_for_serving()           # as the server does once loaded
        clock["cpu"], clock["wall"], clock["core"] = time.process_time(), time.perf_counter(), core.own_cpu_s
        gc.callbacks.append(on_gc)
        if prof is not None:
            prof.enable()
    res = LEVELS[level](a, eng, start)
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    cpu, wall = time.process_time() - clock["cpu"], time.perf_counter() - clock["wall"]
    gc.callbacks.remove(on_gc)
    gc.unfreeze()                       # the next run starts as this one did
    gc.set_threshold(*thresholds)
    front_cpu = cpu - (core.own_cpu_s - clock["core"])
    n = res["tokens"]
    want = a.streams * a.output_len
    return {"level": level, "tokens": n, "complete": n == want, "steps": core.steps,
            "us_per_token": round(front_cpu / max(1, n) * 1e6, 2),
            "ms_per_step": round(front_cpu / max(1, n) * 1e3 * a.streams, 2),
            "wall_ms_per_step": round(wall / max(1, core.steps) * 1e3, 2),
            "gc_us_per_token": round(collector["s"] / max(1, n) * 1e6, 2), "full_collections": collector["full"],
            "core_cpu_s": round(core.own_cpu_s, 3), **{k: v for k, v in res.items() if k != "tokens"}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=10.0, help="the fake device's ms per step (the pace)")
    ap.add_argument("--level", choices=(*LEVELS, "all"), default="all")
    ap.add_argument("--stop", action="store_true", help="every request has two stop strings (never matched)")
    ap.add_argument("--logprobs", type=int, default=None, help="every request asks for N logprobs")
    ap.add_argument("--repeat", type=int, default=2, help="runs per level; the lowest figure is kept")
    ap.add_argument("--profile", default=None, help="cProfile one more run of the last level into this file")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer
    tokens = AutoTokenizer.from_pretrained(TOKENIZER).encode(TEXT, add_special_tokens=False)
    levels = list(LEVELS) if a.level == "all" else [a.level]
    rows = []
    for level in levels:
        runs = [measure(a, level, tokens) for _ in range(a.repeat)]
        best = min(runs, key=lambda r: r["us_per_token"])
        rows.append(best)
        print(json.dumps(best), flush=True)
    commit = short_commit()
    print(f"\n{time.strftime('%Y-%m-%d')} commit {commit}, {platform.machine()} x{os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, {a.streams} streams x {a.output_len} tokens, step {a.step_ms} ms"
          + (", 2 stop strings" if a.stop else "") + (f", logprobs {a.logprobs}" if a.logprobs is not None else ""))
    print("| level | µs/token | of it in gc | front ms/step | wall ms/step | steps |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['level']} | {r['us_per_token']:.2f} | {r['gc_us_per_token']:.2f} | {r['ms_per_step']:.2f} "
              f"| {r['wall_ms_per_step']:.2f} | {r['steps']} |")
    if a.profile:
        res = measure(a, levels[-1], tokens, profile=a.profile)
        print(f"\ncProfile of one {levels[-1]} run ({res['tokens']} tokens), functions by own time:")
        print(function_table(a.profile, max(1, res["tokens"]), unit="token", time_unit="µs"))
    if a.json:
        write_json(a.json, __file__, argv, commit, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
