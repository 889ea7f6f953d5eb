"""A vision family's tiny checkpoint (tests/make_vision_fixtures.py, make_qwen_vl_fixtures.py) as its tests use
it: the golden cases, the images by name, as data URLs and in OpenAI chat messages, and an offline LLM."""
from __future__ import annotations

import base64
import copy
import os

from PIL import Image

from support.tiny_models import fixture_path, golden

GREEDY = 20          # the golden continuations' length


class VisionFixture:
    def __init__(self, name: str, max_num_batched_tokens: int):
        self.name, self.folder = name, fixture_path(name)
        self.cases = {c["name"]: c for c in golden(name)}
        self.max_num_batched_tokens = max_num_batched_tokens

    def image(self, name: str) -> Image.Image:
        return Image.open(os.path.join(self.folder, name))

    def data_url(self, name: str) -> str:
        with open(os.path.join(self.folder, name), "rb") as f:
            return "data:image/png;base64," + base64.b64encode(f.read()).decode()

    def openai_messages(self, case: dict) -> list[dict]:
        """The case's messages with its images as OpenAI image_url parts (data URLs)."""
        msgs, names = copy.deepcopy(case["messages"]), iter(case["images"])
        for m in msgs:
            m["content"] = [{"type": "image_url", "image_url": {"url": self.data_url(next(names))}}
                            if p["type"] == "image" else p for p in m["content"]]
        return msgs

    def make_llm(self, **kw):
        from jaxserve.llm import LLM
        opts = dict(dtype="float32", max_model_len=256, max_num_seqs=8,
                    max_num_batched_tokens=self.max_num_batched_tokens, use_tqdm_on_load=False) | kw
        return LLM(self.folder, **opts)
