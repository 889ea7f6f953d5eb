"""uvicorn's httptools protocol with a read timeout: a request's head and body must arrive within
``--read-timeout`` of its first byte (and a new connection must start one within it), else 408 and the
connection closes. uvicorn alone holds a connection open forever while a client trickles a request's
headers or body (it only times out idle keep-alive connections)."""
from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger("jaxserve.server")


def timed_http_protocol(read_timeout: float) -> type[asyncio.Protocol]:
    """The protocol class to pass as ``uvicorn.Config(http=...)``."""

    class TimedHttpToolsProtocol(HttpToolsProtocol):
        _read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._read_timer = self.loop.call_later(read_timeout, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                if cycle.response_started:      # the app answered already: only the connection can go
                    self.transport.close()
                    return
                cycle.disconnected = True       # the app's next receive() says the client left
                cycle.message_event.set()
            msg = f"the request did not arrive within {read_timeout:g} s (--read-timeout)".encode()
            log.info("%s: %s", "%s:%d" % self.client if self.client else "client", msg.decode())
            self.transport.write(b"".join([
                STATUS_LINE[408], b"content-type: text/plain; charset=utf-8\r\n",
                b"content-length: " + str(len(msg)).encode() + b"\r\n", b"connection: close\r\n\r\n", msg]))
            self.transport.close()

    return TimedHttpToolsProtocol
