"""Answering a generation request: the whole answer once its engine requests finish, or server-sent events as
outputs arrive (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

import anyio
import msgspec
from litestar.response import Stream

from .errors import to_api_error
from .engine_runs import Accumulated, ClientDisconnected, EngineRuns, Prompt, race_disconnect, wait_disconnect

log = logging.getLogger("jaxserve.server")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class TextFrame:
    """``sse(make(text))`` for a chunk whose one varying field is a string (a stream's common chunk: new
    text, nothing else): the bytes around the text are encoded once, each chunk only encodes its text
    (msgspec writes a string field the same wherever it sits, so the frames are byte-for-byte the same)."""
    __slots__ = ("head", "tail")
    _MARK = "\x00text\x00"

    def __init__(self, make: Callable[[str], Any]):
        data, mark = sse(make(self._MARK)), msgspec.json.encode(self._MARK)
        head, found, tail = data.partition(mark)
        assert found and mark not in tail, "the template's text field must appear once"
        self.head, self.tail = head, tail

    def __call__(self, text: str) -> bytes:
        return b"".join((self.head, msgspec.json.encode(text), self.tail))


Render = Callable[[AsyncIterator[tuple[Any, Any, Any]]], AsyncIterator[bytes]]


# How long a stream waits for its first output before sending the 200: errors found on submission (bad
# input, queue full) come within milliseconds and keep their HTTP status; a slow first token (a long
# queue) does not hold the headers back, so proxies with header timeouts do not cut the request.
HEADER_WAIT_S = 0.5
# A constrained request waits longer: its grammar's matcher can fail at its first token (a parser limit met
# only while generating), which is a 400 only while no header has gone; a first token comes within a step or
# two unless the queue is long, and a proxy's header timeout is far longer than this.
CONSTRAINED_HEADER_WAIT_S = 5.0


class Renderer(Protocol):
    """A request's outputs as its answer: SSE frames as they arrive, or the whole response."""

    def stream(self, outputs: AsyncIterator[tuple[Any, Any, Any]]) -> AsyncIterator[bytes]: ...

    def response(self, accs: list[Accumulated]) -> Any: ...


async def submit(runs: EngineRuns, prompts: list[Prompt], receive: Callable[[], Awaitable[dict]],
                 renderer: Renderer, stream: bool) -> Any:
    """Run the prompts' engine requests and answer: a stream of ``renderer.stream``'s frames, or
    ``renderer.response`` once every choice has finished. A client that leaves aborts them."""
    if stream:
        return await open_stream(runs, prompts, receive, renderer.stream)
    return renderer.response(await race_disconnect(receive, runs.collect(prompts)))


async def open_stream(runs: EngineRuns, prompts: list[Prompt], receive, render: Render) -> Stream:
    """Submit, wait briefly for the first output (or the client leaving), then stream `render(outputs)`.

    `render` turns (choice, CompletionOutput, RequestOutput) items into SSE frames; an exception it lets
    through becomes an error event, and [DONE] always ends the stream. A client disconnect cancels the
    body, which closes `runs.run`, which aborts the unfinished engine requests.
    """
    constrained = any(c.params.structured_outputs is not None for p in prompts for c in p.choices)
    outputs = runs.run(prompts)
    first = asyncio.ensure_future(outputs.__anext__())
    watch = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({first, watch}, timeout=CONSTRAINED_HEADER_WAIT_S if constrained else HEADER_WAIT_S,
                           return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        first.cancel()
        raise
    finally:
        watch.cancel()
    failed = first.done() and not first.cancelled() and first.exception() is not None \
        and not isinstance(first.exception(), StopAsyncIteration)
    if failed or not first.done() and watch.done():
        first.cancel()  # cancelling the pending __anext__ closes runs.run, which aborts
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(BaseException):
                await first
            await outputs.aclose()
        if failed:
            raise first.exception()
        raise ClientDisconnected()

    async def replay() -> AsyncIterator[tuple[Any, Any, Any]]:
        try:
            item = await first
        except StopAsyncIteration:
            return
        yield item
        async for item in outputs:
            yield item

    async def body() -> AsyncIterator[bytes]:
        try:
            async with contextlib.aclosing(render(replay())) as frames:
                async for frame in frames:
                    yield frame
        except Exception as e:  # engine failure mid-stream: tell the client, then end the stream cleanly
            err = to_api_error(e)
            if err.status >= 500:
                log.error("stream failed: %s", err.message, exc_info=e)
            yield sse(err.body())
        finally:
            with anyio.CancelScope(shield=True):
                if not first.done():
                    first.cancel()
                    with contextlib.suppress(BaseException):
                        await first
                await outputs.aclose()
        yield DONE

    return Stream(body(), media_type="text/event-stream", headers=SSE_HEADERS)
