"""The server tests' fixtures: the module's ``server`` (its ``SERVER`` spec, support/servers.py), its real SmolLM2 server
(``REAL_SERVER``) where it has one, and clients of both."""
import httpx
import pytest

from support.servers import serving


@pytest.fixture(scope="module")
def server(request):
    """The module's server: an InProcessServer over a scripted engine or a ServerProcess, as ``SERVER`` says."""
    yield from serving(request.module.SERVER)


@pytest.fixture(scope="module")
def http(server):
    """An httpx client of the module's server, with its API key when it has one."""
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    with httpx.Client(base_url=server.url, headers=headers, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    """The openai SDK on the module's server."""
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key or "none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def real(request):
    """A module's real SmolLM2 server beside its scripted one, as its ``REAL_SERVER`` spec says."""
    yield from serving(request.module.REAL_SERVER)


@pytest.fixture(scope="module")
def real_client(real):
    """The openai SDK on the module's real server."""
    import openai
    return openai.OpenAI(base_url=real.url + "/v1", api_key="x", max_retries=0, timeout=300)
