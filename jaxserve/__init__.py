"""jaxserve: an LLM inference server on JAX/XLA."""
__version__ = "0.1.0"
