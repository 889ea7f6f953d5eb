"""Chat messages with image parts, for the chat template: OpenAI's ``{"type": "image_url", "image_url": {"url":
...}}`` content parts become the template's ``{"type": "image"}`` parts (templates of vision models, e.g.
LLaVA's, loop over a message's parts and print the model's placeholder for each image), or, for a template
that reads ``content`` as a string, the placeholder text before the message's text (vLLM's fallback).
The images' URLs come back in prompt order, for ``media.load_image_url``.
"""
from __future__ import annotations

import re
from typing import Any

from jaxserve.errors import InvalidRequestError

# a template that reads content parts' "type" renders parts itself (vLLM's "openai" content format)
_READS_PARTS = re.compile(r"""\[\s*['"]type['"]\s*\]|\.type\b|selectattr\(\s*['"]type['"]""")


def template_reads_parts(template: str | None) -> bool:
    return bool(template) and bool(_READS_PARTS.search(template))


def has_image_parts(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(_part_type(p) == "image_url" for p in m["content"])
               for m in messages)


def _part_type(part: Any) -> str | None:
    return part.get("type") if isinstance(part, dict) else getattr(part, "type", None)


def image_conversation(messages: list[dict], template: str | None, placeholder: str,
                       limit: int | None = None) -> tuple[list[dict], list[str]]:
    """``(messages for the template, image URLs in order)``; ``limit``: the most images a prompt may have."""
    parts_form = template_reads_parts(template)
    urls: list[str] = []
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(dict(m, content=[{"type": "text", "text": content or ""}]) if parts_form else m)
            continue
        parts, text, n_images = [], [], 0
        for j, p in enumerate(content):
            kind = _part_type(p)
            if kind == "text":
                t = p["text"] if isinstance(p, dict) else p.text
                parts.append({"type": "text", "text": t})
                text.append(t)
            elif kind == "image_url":
                image_url = p.get("image_url") if isinstance(p, dict) else p.image_url
                url = image_url.get("url") if isinstance(image_url, dict) else getattr(image_url, "url", image_url)
                if not isinstance(url, str):
                    raise InvalidRequestError(f"messages[{i}].content[{j}].image_url needs a url string",
                                              param=f"messages[{i}].content[{j}].image_url")
                urls.append(url)
                parts.append({"type": "image"})
                n_images += 1
            else:
                raise InvalidRequestError(f"messages[{i}].content[{j}]: content part type {kind!r} is not "
                                          "supported (text, image_url)", param=f"messages[{i}].content[{j}]")
        out.append(dict(m, content=parts if parts_form else (placeholder + "\n") * n_images + "".join(text)))
    if limit is not None and len(urls) > limit:
        raise InvalidRequestError(f"the prompt has {len(urls)} images, more than the limit of {limit} "
                                  "(--limit-mm-per-prompt)", param="messages")
    return out, urls
