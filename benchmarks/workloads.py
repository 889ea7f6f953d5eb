"""Workloads: prompt/output lengths (fixed or drawn), random token prompts, ShareGPT files, shared prefixes,
images. Everything is drawn from one numpy Generator seeded by the config's `seed`: a rerun sends the same.
"""
from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class RequestSpec:
    """One benchmark request: token ids (or text for ShareGPT) and how many tokens to generate."""
    prompt: list[int] | str
    prompt_len: int
    output_len: int
    extra: dict | None = None      # more request-body fields (a structured-output constraint)


# A JSON schema whose string must hold more characters than any output_len of tokens can write, so a
# constrained request runs to max_tokens like an unconstrained one (a fair throughput comparison).
DEFAULT_STRUCTURED_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "minLength": 65536}},
                             "required": ["answer"], "additionalProperties": False}


def add_structured_outputs(rng: np.random.Generator, requests: list[RequestSpec], fraction: float,
                           schema: dict | None = None) -> list[RequestSpec]:
    """Give ``fraction`` of the requests (a random subset; 0 and 1 exact) vLLM's ``structured_outputs``
    JSON-schema constraint."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"workload.structured_fraction must be in [0, 1], got {fraction}")
    chosen = rng.random(len(requests)) < fraction
    for req, on in zip(requests, chosen):
        if on:
            req.extra = {"structured_outputs": {"json": schema or DEFAULT_STRUCTURED_SCHEMA}}
    return requests


def sample_lengths(spec, n: int, rng: np.random.Generator, what: str) -> np.ndarray:
    """n lengths from an int or a distribution:
    {dist: uniform, min, max} | {dist: normal, mean, std, min?, max?} | {dist: choice, values: [...]}."""
    if isinstance(spec, (int, np.integer)) or (isinstance(spec, float) and spec.is_integer()):
        if int(spec) < 1:
            raise ValueError(f"workload.{what} must be >= 1, got {spec}")
        return np.full(n, int(spec), dtype=np.int64)
    if not isinstance(spec, dict) or "dist" not in spec:
        raise ValueError(f"workload.{what}: expected an integer or {{dist: uniform|normal|choice, ...}}, got {spec!r}")
    dist = spec["dist"]
    if dist == "uniform":
        out = rng.integers(int(spec["min"]), int(spec["max"]) + 1, size=n)
    elif dist == "normal":
        out = np.rint(rng.normal(float(spec["mean"]), float(spec["std"]), size=n))
        out = np.clip(out, int(spec.get("min", 1)), int(spec.get("max", 1 << 30)))
    elif dist == "choice":
        out = rng.choice(np.asarray(spec["values"], dtype=np.int64), size=n)
    else:
        raise ValueError(f"workload.{what}.dist is {dist!r}; expected uniform, normal or choice")
    return np.maximum(out.astype(np.int64), 1)


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """Ids for random prompts: clear of the special tokens most vocabularies keep at either end."""
    margin = 1000 if vocab_size > 8000 else vocab_size // 8
    return margin, vocab_size - margin


def random_token_prompts(rng: np.random.Generator, lengths: np.ndarray, vocab_size: int) -> list[list[int]]:
    lo, hi = token_id_range(vocab_size)
    return [rng.integers(lo, hi, size=int(n)).tolist() for n in lengths]


def random_requests(rng, num_prompts: int, input_len, output_len, vocab_size: int) -> list[RequestSpec]:
    ins = sample_lengths(input_len, num_prompts, rng, "input_len")
    outs = sample_lengths(output_len, num_prompts, rng, "output_len")
    prompts = random_token_prompts(rng, ins, vocab_size)
    return [RequestSpec(p, len(p), int(o)) for p, o in zip(prompts, outs)]


def prefix_requests(rng, num_prompts: int, num_prefixes: int, prefix_len: int, input_len, output_len,
                    vocab_size: int) -> list[RequestSpec]:
    """Requests that share one of `num_prefixes` system prompts of `prefix_len` tokens, followed by a
    random suffix of `input_len` tokens: what prefix caching is for."""
    lo, hi = token_id_range(vocab_size)
    prefixes = [rng.integers(lo, hi, size=int(prefix_len)).tolist() for _ in range(max(num_prefixes, 1))]
    suffix_lens = sample_lengths(input_len, num_prompts, rng, "input_len")
    outs = sample_lengths(output_len, num_prompts, rng, "output_len")
    which = rng.integers(0, len(prefixes), size=num_prompts)
    prompts = [prefixes[which[i]] + rng.integers(lo, hi, size=int(suffix_lens[i])).tolist() for i in range(num_prompts)]
    return [RequestSpec(p, len(p), int(o)) for p, o in zip(prompts, outs)]


def sharegpt_requests(rng, path: str, num_prompts: int, output_len=None, tokenizer=None,
                      max_len: int | None = None) -> list[RequestSpec]:
    """Conversations from a ShareGPT-format JSON ([{"conversations": [{"from": "human", "value": ...},
    {"from": "gpt", "value": ...}, ...]}]): the first human turn is the prompt, the reply's length (in
    tokens with `tokenizer`, else ~4/3 tokens per word) is the output length unless output_len is set."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"workload.dataset_path {path!r}: file not found (a ShareGPT-format JSON)")
    convs = [item.get("conversations") or item.get("conversation") or [] for item in json.loads(p.read_text())]
    pairs = [(c[0]["value"], c[1]["value"]) for c in convs
             if len(c) >= 2 and c[0].get("value") and c[1].get("value")]
    if not pairs:
        raise ValueError(f"{path}: no conversations with a prompt and a reply (ShareGPT format expected)")
    order = rng.permutation(len(pairs))
    count = lambda text: len(tokenizer.encode(text)) if tokenizer is not None else max(1, round(len(text.split()) * 4 / 3))
    reqs: list[RequestSpec] = []
    for i in order:
        prompt, reply = pairs[i]
        plen = count(prompt)
        olen = int(output_len) if isinstance(output_len, (int, float)) and output_len else max(count(reply), 4)
        if max_len and plen + olen > max_len:
            continue                       # vLLM's sampler drops requests that cannot fit too
        reqs.append(RequestSpec(prompt, plen, olen))
        if len(reqs) == num_prompts:
            break
    if not reqs:
        raise ValueError(f"{path}: no conversation fits max_model_len={max_len}")
    return [reqs[i % len(reqs)] for i in range(max(num_prompts, len(reqs)))]   # small files: cycled to the count


WORDS = ["the", "a", "picture", "shows", "what", "is", "in", "it"]     # one token each in common vocabularies


def random_image_url(rng: np.random.Generator, size: int) -> str:
    """A JPEG data URL of ``size`` x ``size`` random pixels (every request's image its own: no encoder reuse), as
    vLLM's benchmark sends its random images (a noise PNG is ~4 MB at 1024² and ~40 ms to decode)."""
    from PIL import Image  # noqa: PLC0415
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB").save(buf, "JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def image_requests(rng, num_prompts: int, image_size: int, input_len, output_len) -> list[RequestSpec]:
    """Chat requests of one random ``image_size``² image and ~``input_len`` text tokens (``prompt_len``, a word a
    token), after a system message that keeps a stand-in tokenizer's default one (ids past the vocab) out."""
    text_lens = sample_lengths(input_len, num_prompts, rng, "input_len")
    out_lens = sample_lengths(output_len, num_prompts, rng, "output_len")
    reqs = []
    for n_text, n_out in zip(text_lens, out_lens):
        text = "".join(" " + w for w in rng.choice(WORDS, size=int(n_text)))   # every word space-led: one token
        messages = [{"role": "system", "content": "what is in the picture"}, {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": random_image_url(rng, image_size)}},
            {"type": "text", "text": text}]}]
        reqs.append(RequestSpec(text, int(n_text), int(n_out), {"messages": messages}))
    return reqs


def arrival_delays(rng, num: int, request_rate: float, burstiness: float = 1.0) -> np.ndarray:
    """Gaps between request sends: gamma(shape=burstiness, mean=1/rate) (burstiness 1 = Poisson);
    rate inf sends everything at once."""
    if request_rate == float("inf") or request_rate <= 0:
        return np.zeros(num)
    if burstiness <= 0:
        raise ValueError("workload.burstiness must be > 0 (1 = Poisson; < 1 burstier; > 1 more regular)")
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
