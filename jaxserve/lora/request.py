"""The request for an adapter, as vLLM's ``LoRARequest``: a name, a positive integer id and a PEFT folder."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """``lora_int_id`` identifies the adapter in the engine (its slot, its prefix-cache namespace): two requests
    with the same id must mean the same weights. ``base_model_name``: the model it adapts, as /v1/models shows
    it (None: the served model)."""
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self):
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
