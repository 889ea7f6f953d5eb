"""The engine core process: an ``EngineCore`` in a busy loop.

    messages in (add / abort / embed / shutdown) → step() → EngineCoreOutputs out → repeat

The loop reads every message waiting before each step, so an abort reaches the scheduler within one step;
with nothing to run it blocks on the input socket. Its sockets: PULL for what the front end sends, PUSH for
what it answers (``jaxserve.engine.core_client.MPClient`` holds the other ends). It answers ``CoreReady`` (the
``EngineFacts``) once the model is loaded and warm, ``CoreFailed`` if loading or a step raises (then it
exits 1), and exits when its front end goes away (its parent process ends) or sends ``Shutdown``.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import time

import msgspec

from jaxserve.engine import messages as m
from jaxserve.engine.gc_heap import prepare_gc_for_serving
from jaxserve.engine.request import RequestStatus
from jaxserve.errors import ModelLoadError
from jaxserve.lora import LoRARequest

logger = logging.getLogger(__name__)

# With requests unfinished the loop only polls its input; idle, it waits this long between checks of its
# parent (a front end that died without a Shutdown).
IDLE_POLL_MS = 500


def run_engine_core(config, input_address: str, output_address: str, progress: bool) -> None:
    """The process's body: connect to the front end's sockets, serve until Shutdown (exit 1 if the core failed)."""
    import zmq

    # SIGTERM / Ctrl-C go to the front end, which drains and then sends Shutdown; the core keeps stepping
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context(io_threads=1)
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(output_address)
    if serve_engine_core(config, ctx, inbox, outbox, progress):
        sys.exit(1)


def serve_engine_core(config, ctx, inbox, outbox, progress: bool) -> int:
    """Load the engine, say so on ``outbox``, serve what ``inbox`` brings until Shutdown; then close the
    sockets and ``ctx``. Returns 0, or 1 after reporting ``CoreFailed``. (Its own process runs it through
    ``run_engine_core``; a data-parallel replica's Ray actor on sockets it bound itself.)"""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    encoder = msgspec.msgpack.Encoder()
    try:
        from jaxserve.engine.core import EngineCore
        from jaxserve.utils import startup_timeline
        startup_timeline.record_imports()
        engine = EngineCore(config, progress=progress)
        outbox.send(encoder.encode(m.CoreReady(pickle.dumps(engine.facts()))))
        # the model's and runner's objects out of the collector's passes, while the front end reads the facts
        prepare_gc_for_serving()
        EngineCoreLoop(engine, inbox, outbox, encoder).run()
    except BaseException as e:  # noqa: BLE001 - reported to the front end, then the process ends
        if isinstance(e, ModelLoadError):       # the user's to act on: the front end prints it, in one line
            logger.debug("engine core failed: %s", e)
        else:
            logger.exception("engine core failed")
        try:
            try:
                exc = pickle.dumps(e)
            except Exception:  # noqa: BLE001 - not picklable: the text is enough
                exc = None
            outbox.send(encoder.encode(m.CoreFailed(f"{type(e).__name__}: {e}", exc)))
        finally:
            outbox.close(linger=2000)
            inbox.close(linger=0)
            ctx.term()
        return 1
    outbox.close(linger=2000)
    inbox.close(linger=0)
    ctx.term()
    return 0


class EngineCoreLoop:
    def __init__(self, engine, inbox, outbox, encoder):
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.encoder = encoder
        self.decoder = msgspec.msgpack.Decoder(m.ToCore)
        self.parent = os.getppid()
        self.running = True
        self.loop_ms = 0.0                  # wall time of the iterations that stepped, summed

    def run(self) -> None:
        import zmq
        eng, inbox = self.engine, self.inbox
        t0 = time.perf_counter()
        while self.running:
            if not eng.has_unfinished_requests():
                # idle: block for the next message (waking now and then to notice a parent that died)
                if not inbox.poll(IDLE_POLL_MS):
                    if os.getppid() != self.parent:
                        logger.info("the front end is gone; the engine core exits")
                        return
                    continue
                t0 = time.perf_counter()
            handled = 0
            while True:                         # everything waiting, before the step
                try:
                    raw = inbox.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self.handle(self.decoder.decode(raw.buffer))
                handled += 1
            if not self.running:
                return
            if not eng.has_unfinished_requests():
                if handled:                     # e.g. the last aborts: the front end's stats show them
                    self.outbox.send(self.encoder.encode(m.EngineCoreOutputs([], eng.stats())))
                continue
            self.step_and_send()
            t1 = time.perf_counter()
            # the loop's whole cost of a step: its messages, the step, encoding and sending its outputs
            self.loop_ms += (t1 - t0) * 1e3
            t0 = t1

    def step_and_send(self) -> None:
        """One engine step and its EngineCoreOutputs (with the core's stats) to the front end: the loop's
        per-step work, apart from reading the inbox."""
        eng = self.engine
        outputs = eng.step()
        stats = eng.stats()
        stats["core_loop_ms_total"] = self.loop_ms          # up to the previous step
        self.outbox.send(self.encoder.encode(m.EngineCoreOutputs(outputs, stats)), copy=False)

    def add(self, msg: m.EngineCoreRequest) -> None:
        try:
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, pickle.loads(msg.sampling_params),
                                    msg.arrival_time, msg.sampling_seed, priority=msg.priority,
                                    cache_salt=msg.cache_salt,
                                    mm_features=m.load_features(msg.mm_features, msg.mm_buffers)
                                    if msg.mm_features else None,
                                    lora_request=LoRARequest(*msg.lora_request) if msg.lora_request else None)
        except Exception:  # noqa: BLE001 - the front end validated it; end that request, keep serving
            logger.exception("request %s could not be queued; it ends as aborted", msg.request_id)
            self.outbox.send(self.encoder.encode(m.EngineCoreOutputs(
                [m.EngineCoreOutput(msg.request_id, [], int(RequestStatus.FINISHED_ABORTED))])))

    def handle(self, msg) -> None:
        eng = self.engine
        if isinstance(msg, m.EngineCoreRequest):
            self.add(msg)
        elif isinstance(msg, m.AddRequests):
            for r in msg.requests:
                self.add(r)
        elif isinstance(msg, m.AbortRequests):
            eng.abort_requests(msg.request_ids)
        elif isinstance(msg, m.EmbedCall):
            t0 = time.perf_counter()
            try:
                vecs = eng.embedder.embed(msg.prompt_token_ids, truncate_prompt_tokens=msg.truncate_prompt_tokens,
                                          dimensions=msg.dimensions)
                reply = m.EmbedResult(msg.call_id, embeddings=pickle.dumps(vecs))
            except Exception as e:  # noqa: BLE001 - the caller's error
                reply = m.EmbedResult(msg.call_id, error=pickle.dumps(e))
            logger.debug("embedded %d inputs in %.1f ms", len(msg.prompt_token_ids), 1e3 * (time.perf_counter() - t0))
            self.outbox.send(self.encoder.encode(reply))
        elif isinstance(msg, m.Shutdown):
            self.running = False



def main(argv: list[str]) -> None:
    """``python -m jaxserve.engine.core_process CONFIG_PICKLE INPUT_ADDRESS OUTPUT_ADDRESS`` (MPClient runs it)."""
    config_path, input_address, output_address = argv
    with open(config_path, "rb") as f:
        config, progress = pickle.load(f)
    run_engine_core(config, input_address, output_address, progress)


if __name__ == "__main__":
    from jaxserve.utils.startup_imports import hide_torch
    hide_torch()            # this process runs JAX only: its tokenizer need not import torch
    main(sys.argv[1:])
