"""jaxserve: an LLM inference server on JAX/XLA (vLLM's feature set, Pallas GPU kernels)."""
import os as _os

__version__ = "0.1.0"

# jaxserve's default XLA flags go into XLA_FLAGS before anything starts JAX's backends (XLA reads them once)
from jaxserve import xla_flags as _xla_flags  # noqa: E402

_xla_flags.apply()

# kernels/ and server/ are top-level folders of the source tree, installed as jaxserve.kernels and
# jaxserve.server (pyproject's package-dir). When this package is imported from a source checkout without
# that mapping (e.g. `python -m benchmarks.runner` run from a checkout's root), find them beside it.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py")) and _root not in __path__:
    __path__.append(_root)


def __getattr__(name):
    # Lazy, so `import jaxserve` stays cheap (the CLI parses flags before JAX starts).
    if name == "LLM":
        from jaxserve.llm import LLM
        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from jaxserve import sampling_params
        return getattr(sampling_params, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from jaxserve import outputs
        return getattr(outputs, name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "__version__"]
