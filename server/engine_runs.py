"""Submitting a response's engine requests: n choices per prompt run as one merged stream that, however it
ends (finish, error, disconnect, cancel), aborts whatever has not finished; the shutdown drain; the answer
collected whole for a non-streamed response."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio

from jaxserve.sampling_params import SamplingParams

from .args import ServerArgs
from .errors import APIError, bad_request
from .metrics import RequestTracker, ServerMetrics

log = logging.getLogger("jaxserve.server")

T = TypeVar("T")
# A drain timeout ends the running requests this much (at most a tenth of the timeout) before the HTTP
# server's graceful timeout closes their connections: time to send each its error event and [DONE].
DRAIN_GRACE_S = 2.0


class ClientDisconnected(Exception):
    """The client went away before we answered; the engine requests were aborted."""


async def wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client closes the connection. The request body has been read by now, so the
    next ASGI message is http.disconnect, which the server sends only then."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (aborting its engine requests) if the client disconnects first."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work_task.cancel()
        raise
    finally:
        watch_task.cancel()
    if work_task.done():
        return work_task.result()
    work_task.cancel()
    try:
        await work_task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()


@dataclass(slots=True)
class Choice:
    """One engine request behind one choice of a response."""
    index: int
    request_id: str
    params: SamplingParams
    tracker: RequestTracker
    finished: bool = False
    # nothing to abort: the engine raised for it (never accepted, or failed), or it is a beam search's choice
    # the search never answered (the search aborts its own step requests)
    failed: bool = False


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None = None  # the text when the user sent text (for echo / the engine's logs)
    choices: list[Choice] = field(default_factory=list)
    beam_search: Any = None  # a BeamSearchRun (server/beam_search.py): the choices are its best beams
    priority: int = 0                   # the request's (--scheduling-policy priority)
    cache_salt: str | None = None       # the request's prefix-cache namespace
    mm_features: list | None = None     # its images, processed (multimodal.ImageFeature)
    lora_request: Any = None            # the LoRA adapter its model names (jaxserve.lora.LoRARequest)

    def generate(self, engine: Any, c: Choice) -> AsyncIterator[Any]:
        """The engine's output stream of one of this prompt's choices."""
        extra = {"mm_features": self.mm_features} if self.mm_features else {}
        if self.lora_request is not None:
            extra["lora_request"] = self.lora_request
        return engine.generate(self.token_ids, c.params, c.request_id, prompt=self.text, priority=self.priority,
                               cache_salt=self.cache_salt, **extra)


class EngineRuns:
    """The engine requests of every response in flight, and the drain that ends them at shutdown."""

    def __init__(self, engine: Any, args: ServerArgs, metrics: ServerMetrics):
        self.engine = engine
        self.args = args
        self.metrics = metrics
        self.draining = False
        self.drain_expired = False
        # tasks now awaiting an engine output in ``run``: the ones a drain timeout interrupts
        self._awaiting_engine: set[asyncio.Task] = set()
        self._interrupted: set[asyncio.Task] = set()

    def add_choices(self, prompt: Prompt, params: list[SamplingParams], request_id: str,
                    first_index: int = 0) -> None:
        """One engine request per SamplingParams: choice ``first_index + i`` of the response, engine request id
        ``{request_id}-{index}``."""
        for index, p in enumerate(params, first_index):
            prompt.choices.append(Choice(index, f"{request_id}-{index}", p,
                                         self.metrics.tracker(len(prompt.token_ids), p.max_tokens)))

    # -- draining ----------------------------------------------------------------------------------

    def start_drain(self, timeout: float) -> None:
        """SIGTERM: refuse new work (/health 503) and, a little before the HTTP server's own graceful
        timeout cuts connections, end every request still running with an error (``expire_drain``).
        Call on the event loop."""
        self.draining = True
        grace = min(DRAIN_GRACE_S, timeout / 10)
        asyncio.get_running_loop().call_later(max(timeout - grace, 0.0), self.expire_drain)

    def expire_drain(self) -> None:
        """The drain timeout ran out: every request waiting for the engine ends now, a stream with an error
        event and [DONE], any other with a 503 (``run`` raises ``drain_error``)."""
        self.drain_expired = True
        for task in list(self._awaiting_engine):
            self._interrupted.add(task)
            task.cancel()

    def drain_error(self) -> APIError:
        return APIError(503, "the server is shutting down and its drain timeout (--drain-timeout) ran out before "
                             "this request finished", code="draining")

    async def _next_output(self, source: AsyncIterator[T]) -> T:
        """``source``'s next item; a drain timeout interrupts only this wait (never a write to the client)."""
        if self.drain_expired:
            raise self.drain_error()
        task = asyncio.current_task()
        self._awaiting_engine.add(task)
        try:
            return await source.__anext__()
        except asyncio.CancelledError:
            if task not in self._interrupted:
                raise
            self._interrupted.discard(task)
            task.uncancel()
            raise self.drain_error() from None
        finally:
            self._awaiting_engine.discard(task)

    # -- running -----------------------------------------------------------------------------------

    async def run(self, prompts: list[Prompt]) -> AsyncIterator[tuple[Choice, Any, Any]]:
        """Run every choice of every prompt in the engine; yield (choice, CompletionOutput, RequestOutput)
        as outputs arrive. However the consumer stops (finish, error, disconnect, cancel), every engine
        request that has not finished is aborted before this returns, so its KV blocks are freed. A choice
        that ends with finish_reason "error" (its constraint refused or its matcher failed; stop_reason says
        why) before any token raises a 400: the response's status when it has not started."""
        work = [(p, c) for p in prompts for c in p.choices]
        streams = [s for p in prompts for s in ([self._beams(p)] if p.beam_search is not None
                                                else [self._single(p, c) for c in p.choices])]
        source = streams[0] if len(streams) == 1 else self._merged(streams)
        try:
            while True:
                try:
                    c, out = await self._next_output(source)
                except StopAsyncIteration:
                    break
                comp = out.outputs[0]
                c.tracker.on_output(len(comp.token_ids), getattr(out, "metrics", None))
                if out.finished or comp.finish_reason is not None:
                    c.finished = True
                    c.tracker.on_finish(comp.finish_reason, getattr(out, "metrics", None))
                    if comp.finish_reason == "error" and not c.tracker.num_generated:
                        raise bad_request(str(comp.stop_reason or "the request's output constraint failed"))
                yield c, comp, out
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled stream must still clean up
                await source.aclose()  # closing the engine's generate() aborts there too
                for p in prompts:
                    trackers = [c.tracker for c in p.choices]
                    if all(c.finished for c in p.choices) and not any(t.aborted for t in trackers):
                        self.metrics.on_prompt_finished(trackers)
                for _, c in work:
                    if not c.finished and not c.failed:
                        c.tracker.on_finish("abort")
                        try:
                            await self.engine.abort(c.request_id)
                        except Exception as e:  # already gone is fine
                            log.debug("abort %s: %s", c.request_id, e)

    def log_request(self, p: Prompt, c: Choice) -> None:
        """--enable-log-requests (vLLM's): one line per engine request, the prompt cut to --max-log-len
        characters and token ids."""
        if not self.args.enable_log_requests:
            return
        n = self.args.max_log_len
        text = p.text if n is None or p.text is None else p.text[:n]
        ids = p.token_ids if n is None else p.token_ids[:n]
        log.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", c.request_id, text,
                 c.params, ids)

    async def _single(self, p: Prompt, c: Choice) -> AsyncIterator[tuple[Choice, Any]]:
        """One choice's engine request: the engine's stream as is (alone, the common case: no extra task or
        queue hop)."""
        self.log_request(p, c)
        gen = p.generate(self.engine, c)
        try:
            async for out in gen:
                yield c, out
        except Exception:
            self._failed(c)
            raise
        finally:
            await gen.aclose()

    async def _beams(self, p: Prompt) -> AsyncIterator[tuple[Choice, Any]]:
        """A beam search's choices, each whole once the search ends."""
        self.log_request(p, p.choices[0])
        sent: set[int] = set()
        try:
            async for c, out in p.beam_search.stream(self.engine, p):
                sent.add(c.index)
                yield c, out
        finally:
            for c in p.choices:
                if c.index not in sent:
                    self._failed(c)

    async def _merged(self, streams: list[AsyncIterator[tuple[Choice, Any]]]) -> AsyncIterator[tuple[Choice, Any]]:
        """Several streams (``_single``'s, ``_beams``') as one, in arrival order: a pump task per stream."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(stream: AsyncIterator[tuple[Choice, Any]]) -> None:
            try:
                async for item in stream:
                    await queue.put((item, None))
            except Exception as e:  # forwarded to the consumer
                await queue.put((None, e))
            else:
                await queue.put((None, StopAsyncIteration()))

        tasks = [asyncio.ensure_future(pump(s)) for s in streams]
        try:
            remaining = len(tasks)
            while remaining:
                item, exc = await queue.get()
                if isinstance(exc, StopAsyncIteration):
                    remaining -= 1
                elif exc is not None:
                    raise exc
                else:
                    yield item
        finally:
            for t in tasks:  # cancelling a pump closes its stream's generate(), which aborts in the engine
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def _failed(c: Choice) -> None:
        """This choice holds nothing to abort (``Choice.failed``)."""
        c.failed = True
        c.tracker.on_finish("abort")

    async def collect(self, prompts: list[Prompt]) -> list["Accumulated"]:
        """Run to completion (non-streaming): every choice's text, token count, logprobs, finish."""
        accs = {c.index: Accumulated() for p in prompts for c in p.choices}
        async with contextlib.aclosing(self.run(prompts)) as outputs:
            async for c, comp, _out in outputs:
                acc = accs[c.index]
                acc.text.append(comp.text)
                acc.token_ids.extend(comp.token_ids)
                if comp.logprobs:
                    acc.logprobs.extend(comp.logprobs)
                if comp.finish_reason is not None:
                    acc.finish_reason, acc.stop_reason = comp.finish_reason, comp.stop_reason
                if acc.prompt_logprobs is None and getattr(_out, "prompt_logprobs", None):
                    acc.prompt_logprobs = _out.prompt_logprobs
        return [accs[i] for i in sorted(accs)]


@dataclass(slots=True)
class Accumulated:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list | None = None      # vLLM's [None, {token: Logprob}, ...] when asked for
