"""Shared test setup: CPU JAX, no model hub, no persistent compilation cache unless $JAXSERVE_TEST_XLA_CACHE names
one (XLA:CPU crashes now and then loading a cached executable: runner/compile_cache.py) but an in-process memo
of compiled executables (support/executable_memo.py); and the fixtures
several test folders use, each set up by a module attribute (``LLM_ARGS``, ``GOLDEN``). A folder's own fixtures
live in its conftest.py, the helpers behind them in tests/support/."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from support import XLA_CACHE_DIR, xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS"))

import jax  # noqa: E402

if XLA_CACHE_DIR:
    jax.config.update("jax_compilation_cache_dir", XLA_CACHE_DIR)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
else:
    from support.executable_memo import install as install_executable_memo  # noqa: E402

    install_executable_memo()


import pytest  # noqa: E402

from support.goldens import load_golden  # noqa: E402
from support.llms import module_llm  # noqa: E402


@pytest.fixture(scope="module")
def llm(request):
    """The module's offline ``LLM``, built from its ``LLM_ARGS`` (support/llms.py; none: the tiny Llama 3)."""
    return module_llm(getattr(request.module, "LLM_ARGS", None))


@pytest.fixture(scope="module")
def golden(request):
    """The module's golden data: the JSON file its ``GOLDEN`` names (under tests/fixtures), or what ``GOLDEN()``
    returns."""
    source = request.module.GOLDEN
    return source() if callable(source) else load_golden(source)
