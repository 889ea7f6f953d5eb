"""The server a test module's ``server`` fixture (tests/server/conftest.py) starts: the module sets ``SERVER`` to
one of these specs, and a fixture that needs a second server runs ``serving`` on its own spec."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from support.server_fakes import FakeEngine, InProcessServer
from support.server_process import smol_server


@dataclass(frozen=True)
class ServerSpec:
    start: Callable[[], Any]       # an InProcessServer or a ServerProcess: url, api_key, stop()
    must_survive: bool = False     # the module fails when the server process died under its tests


def scripted(engine: Callable[[], FakeEngine] = FakeEngine, **server_args) -> ServerSpec:
    """uvicorn in this process over a scripted engine (``engine()`` is built when the fixture starts)."""
    return ServerSpec(lambda: InProcessServer(engine(), **server_args))


def smol(*flags: str, must_survive: bool = False) -> ServerSpec:
    """The embedded-SmolLM2 server process (``server_process.smol_server``) with these extra flags."""
    return ServerSpec(lambda: smol_server(*flags), must_survive)


def serving(spec: ServerSpec):
    """A module fixture's body: starts the server, yields it, stops it."""
    srv = spec.start()
    yield srv
    alive = not spec.must_survive or srv.proc.poll() is None
    srv.stop()
    assert alive, "the server died during the suite:\n" + srv.tail()
