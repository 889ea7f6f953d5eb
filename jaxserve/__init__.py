"""jaxserve: an LLM inference server on JAX/XLA (vLLM's feature set, Pallas GPU kernels)."""
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so `import jaxserve` stays cheap (the CLI parses flags before JAX starts).
    if name == "LLM":
        from jaxserve.llm import LLM
        return LLM
    if name == "SamplingParams":
        from jaxserve.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from jaxserve import outputs
        return getattr(outputs, name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
