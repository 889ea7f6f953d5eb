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
