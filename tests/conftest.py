"""Shared test setup: CPU JAX, no model hub, a persistent compilation cache so reruns are fast."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir",
                  os.environ.get("JAXSERVE_TEST_XLA_CACHE", os.path.join(os.path.dirname(__file__), "..", ".jax_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# -- fixtures over a test module's `server` (an InProcessServer or a ServerProcess) -----------------------------
import httpx  # noqa: E402
import pytest  # noqa: E402


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
def gemma3_path():
    """The packaged Gemma 3 270M GGUF (skips where its packages are not installed)."""
    from jaxserve.errors import ModelLoadError
    from jaxserve.models import packaged
    try:
        return packaged.packaged_gguf_path("gemma3-270m")
    except ModelLoadError as e:
        pytest.skip(str(e))
