"""Server-sent events: `data: {json}\\n\\n` ... `data: [DONE]\\n\\n`, with the first output awaited before
the 200 goes out, so errors found on submission (400, 429) keep their HTTP status."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator, Callable

import anyio
import msgspec
from litestar.response import Stream

from .errors import to_api_error
from .serving import Prompt, Serving, race_disconnect

log = logging.getLogger("jaxserve.server")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


Render = Callable[[AsyncIterator[tuple[Any, Any, Any]]], AsyncIterator[bytes]]


async def open_stream(serving: Serving, prompts: list[Prompt], receive, render: Render) -> Stream:
    """Submit, wait for the first output (or the client leaving), then stream `render(outputs)` as SSE.

    `render` turns (choice, CompletionOutput, RequestOutput) items into SSE frames; an exception it lets
    through becomes an error event, and [DONE] always ends the stream. A client disconnect cancels the
    body, which closes `serving.run`, which aborts the unfinished engine requests.
    """
    outputs = serving.run(prompts)
    try:
        first = await race_disconnect(receive, outputs.__anext__())
    except StopAsyncIteration:
        first = None
    except BaseException:
        with anyio.CancelScope(shield=True):
            await outputs.aclose()
        raise

    async def replay() -> AsyncIterator[tuple[Any, Any, Any]]:
        if first is not None:
            yield first
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
                await outputs.aclose()
        yield DONE

    return Stream(body(), media_type="text/event-stream", headers=SSE_HEADERS)
