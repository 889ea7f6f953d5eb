"""The LoRA fixtures (tests/make_lora_fixtures.py): three PEFT adapters over tiny-llama3 and their HF + peft
float32 greedy continuations."""
from __future__ import annotations

import functools
import json
import os

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "lora")


@functools.cache
def lora_golden() -> dict:
    with open(os.path.join(FIXTURES, "golden.json")) as f:
        return json.load(f)


def adapter_path(name: str) -> str:
    return os.path.join(FIXTURES, name)


def adapter_names() -> list[str]:
    return list(lora_golden()["adapters"])
