"""Model families, the architecture registry and the weight loaders.

``load_model`` / ``LoadedModel`` are imported lazily so ``import jaxserve.models.<family>`` stays light.
"""
from __future__ import annotations

__all__ = ["LoadedModel", "load_model"]


def __getattr__(name: str):
    if name in __all__:
        from jaxserve.models import loader
        return getattr(loader, name)
    raise AttributeError(f"module 'jaxserve.models' has no attribute {name!r}")
