"""The benchmark tests' fixtures."""
import threading
import time

import pytest

from support.scripted_sse_server import ScriptedServer
from support.server_fakes import free_port


@pytest.fixture(scope="module")
def scripted_server():
    """The scripted SSE server (support/scripted_sse_server.py) on a loopback port: ``(app, base URL)``."""
    import uvicorn
    app = ScriptedServer(gap=0.02)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    yield app, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)
