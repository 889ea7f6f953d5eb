"""The LoRA adapters the server serves by name (``--lora-modules`` at start, ``/v1/load_lora_adapter`` at run
time), each a ``LoRARequest`` a request gets by naming the adapter as its ``model``.

Unloading: an adapter unloaded while requests use it is unloaded for new requests at once (they get the
unknown-model 404); the requests already running finish with it, and its device slot is reused once they
have (finish-then-unload). Loading the same name again after an unload gives a new adapter id, so no
prefix-cache block of the old weights is ever reused for the new ones.
"""
from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

from msgspec import Struct

from jaxserve import envs
from jaxserve.lora import LoRARequest, read_adapter
from jaxserve.lora.peft import AdapterError

from .errors import APIError, bad_request


class LoadLoRAAdapterRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str | None = None
    lora_int_id: int | None = None          # vLLM's field; the name decides


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """``name=path`` or vLLM's JSON ``{"name", "path", "base_model_name"}`` → (name, path, base model name)."""
    if text.lstrip().startswith("{"):
        try:
            d = json.loads(text)
            return str(d["name"]), str(d["path"]), d.get("base_model_name")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--lora-modules {text!r}: expected JSON with name and path ({e})") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path")
    return name, path, None


class LoRAAdapters:
    def __init__(self, engine: Any, base_names: list[str], modules: list[str] | None):
        lora_config = getattr(getattr(engine, "config", None), "lora", None)
        self.enabled = bool(lora_config is not None and lora_config.enable_lora)
        self.max_lora_rank = lora_config.max_lora_rank if self.enabled else 0
        self.model_config = getattr(engine, "model_config", None)
        self.base_names = base_names
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        if modules and not self.enabled:
            raise ValueError("--lora-modules needs --enable-lora")
        for text in modules or ():
            name, path, base = parse_lora_module(text)
            self.add(name, path, base)

    @property
    def runtime_updates(self) -> bool:
        """Whether the load / unload routes are served (vLLM's rule: --enable-lora and the env switch)."""
        return self.enabled and envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING

    def resolve(self, model: str | None) -> LoRARequest | None:
        return self.by_name.get(model) if model is not None else None

    def for_request(self, req: Any) -> LoRARequest | None:
        """The adapter a generation request's ``model`` names (None: the base model)."""
        lora = self.resolve(req.model)
        if lora is not None and req.use_beam_search:
            raise bad_request("use_beam_search is not supported with a LoRA adapter", "use_beam_search")
        return lora

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the adapter (raises ``AdapterError`` / ``ValueError``) and serve it as ``name``."""
        if name in self.by_name or name in self.base_names:
            raise ValueError(f"The lora adapter '{name}' has already been loaded." if name in self.by_name else
                             f"'{name}' is the base model's name")
        read_adapter(path, self.model_config, self.max_lora_rank)
        lora = LoRARequest(name, next(self._ids), path, base_model_name or self.base_names[0])
        self.by_name[name] = lora
        return lora

    async def load(self, name: str | None, path: str | None) -> str:
        if not name or not path:
            raise bad_request("both 'lora_name' and 'lora_path' must be provided", "lora_name" if not name else
                              "lora_path")
        try:      # reading the adapter's files is blocking work: off the event loop
            await asyncio.to_thread(self.add, name, path)
        except (AdapterError, ValueError) as e:
            raise bad_request(str(e), "lora_path") from None
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str | None) -> str:
        if not name:
            raise bad_request("'lora_name' must be provided", "lora_name")
        if self.by_name.pop(name, None) is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="lora_not_found")
        return f"Success: LoRA adapter '{name}' removed successfully."
