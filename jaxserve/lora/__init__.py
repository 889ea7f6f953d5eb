"""LoRA adapters: the request that names one, PEFT adapter folders read into per-layer matrices, and the
stacked device slots the step multiplies through (``layers``). The adapter manager (which adapter holds which
slot) is the engine's: ``jaxserve.engine.lora_manager``."""
from .peft import LoRAAdapter, read_adapter
from .request import LoRARequest

__all__ = ["LoRAAdapter", "LoRARequest", "read_adapter"]
