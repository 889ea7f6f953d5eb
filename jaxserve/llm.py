"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, ``.chat(...)``, ``.embed(...)``.

``generate`` runs the engine to completion with FINAL_ONLY outputs. ``multiprocess=True`` (or
JAXSERVE_ENABLE_MULTIPROCESSING=1) runs the engine core in its own process; the default is one process: either
way the caller's thread steps the engine, and queues each prompt between steps, in prompt order, once its images
are preprocessed on worker threads (``Admission``). A SamplingParams with n > 1 becomes n engine requests
(``<id>_<i>``, seeds ``seed + i``), merged back into one RequestOutput by index, as the server does for its
choices.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Sequence

from jaxserve import envs
from jaxserve.beam_search import BeamSearchOutput, beam_search_offline
from jaxserve.config import EngineConfig
from jaxserve.options import from_kwargs
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

ADMIT_POLL_S = 0.01      # with the core in its own process: how long a step waits for outputs while
                         # prompts are still being preprocessed
_END = object()


def engine_config_from_kwargs(model: str | None = None, **kw) -> EngineConfig:
    """Flat keyword arguments (vLLM's names: ``block_size``, not ``cache.block_size``) → EngineConfig. Unknown
    names are an error that names them, not ignored."""
    return from_kwargs(EngineConfig, {"model": model, **kw}, "LLM")


def _normalize_prompts(prompts) -> list[tuple[str | None, list[int] | None, str | None]]:
    """str | list[str] | list[int] | list[list[int]] | dicts → [(text, token_ids, cache_salt)] (a dict's
    ``cache_salt``, vLLM's: its prefix-cache namespace)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif prompts and isinstance(prompts[0], int):
        prompts = [list(prompts)]
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append((p, None, None))
        elif isinstance(p, dict):
            out.append((p.get("prompt"), p.get("prompt_token_ids"), p.get("cache_salt")))
        else:
            out.append((None, list(p), None))
    return out


def map_media(fn, items: list) -> list:
    """``[fn(x) for x in items]`` on up to ``VLLM_MEDIA_LOADING_THREAD_COUNT`` worker threads, as the server
    loads and preprocesses images (decoding, resizing and hashing release the GIL for most of their time):
    the results in order; the first item's error in order is raised, the items not started yet dropped."""
    if len(items) < 2:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415
    pool = ThreadPoolExecutor(min(envs.VLLM_MEDIA_LOADING_THREAD_COUNT, len(items)), thread_name_prefix="media")
    try:
        return list(pool.map(fn, items))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class MediaAhead:
    """``fn`` over ``items`` on up to ``VLLM_MEDIA_LOADING_THREAD_COUNT`` worker threads, at most ``window``
    items (default: twice the threads) started and not taken yet, so that few results wait in memory: ``take()``
    is the next item's result in order (waiting for it; its error raised), ``ready()`` whether it is done.
    Closing drops the items not started and waits for those running."""

    def __init__(self, fn, items: list, window: int | None = None):
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415
        threads = max(1, min(envs.VLLM_MEDIA_LOADING_THREAD_COUNT, len(items)))
        self._fn, self._items, self._window = fn, iter(items), window or 2 * threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="media")
        self._started: collections.deque = collections.deque()
        self._fill()

    def _fill(self) -> None:
        while len(self._started) < self._window and (x := next(self._items, _END)) is not _END:
            self._started.append(self._pool.submit(self._fn, x))

    def ready(self) -> bool:
        return bool(self._started) and self._started[0].done()

    def take(self):
        fut = self._started.popleft()
        try:
            return fut.result()
        finally:
            self._fill()

    def drain(self) -> None:
        """Take every item left, raising the first one's error in order."""
        while self._started:
            self.take()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "MediaAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _images(prompts) -> list[list]:
    """Each prompt's images (``{"prompt": ..., "multi_modal_data": {"image": PIL.Image | [...]}}``, vLLM's)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif prompts and isinstance(prompts[0], int):
        return [[]]
    out = []
    for p in prompts:
        data = p.get("multi_modal_data") if isinstance(p, dict) else None
        image = (data or {}).get("image")
        out.append([] if image is None else list(image) if isinstance(image, (list, tuple)) else [image])
    return out


def media_overlap(platform: str) -> bool:
    """Whether ``generate`` queues prompts as their images are done (``Admission``): JAXSERVE_OFFLINE_MEDIA_OVERLAP,
    by default on an accelerator, not on the CPU, where the steps and the preprocessing share the cores (an
    image run measured slower overlapped there: benchmarks/results/README.md)."""
    chosen = envs.JAXSERVE_OFFLINE_MEDIA_OVERLAP
    return platform != "cpu" if chosen is None else chosen


class Admission:
    """A ``generate`` call's prompts into the engine: ``admit(wait)``, called by the thread that steps, before
    each step, queues the prompts that are ready (``wait``: one at least; the engine has nothing to run) and
    says whether all are queued. Their images are preprocessed on worker threads (``MediaAhead``), and each
    prompt is queued, in prompt order, as soon as its own images are done, so the engine steps while the rest
    are preprocessed; preprocessing never runs in the step loop's thread.

    ``requests(k, ids, features)``: prompt k's validated Requests. Errors are those of preprocessing every image
    before building any request (the first failing image in prompt order; else the first invalid prompt): a
    prompt that fails validation raises the first later image's error if one fails. The caller aborts what was
    queued before an error."""

    def __init__(self, eng, requests, all_ids: list[list[int]], all_images: list[list]):
        self.eng, self.requests, self.all_ids = eng, requests, all_ids
        facts = eng.facts()
        self.has_images = [bool(images) or bool(facts.is_multimodal and eng.images.processing.count_placeholders(ids))
                           for ids, images in zip(all_ids, all_images)]
        image_prompts = [k for k, h in enumerate(self.has_images) if h]
        self.ahead = MediaAhead(lambda k: eng.images.process(all_ids[k], all_images[k]), image_prompts) \
            if image_prompts else None
        self.next = 0               # the first prompt not queued
        self.overlap = media_overlap(facts.platform)

    def __call__(self, wait: bool) -> bool:
        batch = []
        while self.next < len(self.all_ids):
            k = self.next
            if self.has_images[k] and self.overlap and not wait and not self.ahead.ready():
                break
            ids, features = self.ahead.take() if self.has_images[k] else (self.all_ids[k], None)
            try:
                batch += self.requests(k, ids, features)
            except Exception:
                if self.ahead is not None:
                    self.ahead.drain()
                raise
            self.next, wait = k + 1, False
        if batch:
            self.eng.add_requests(batch)
        return self.next == len(self.all_ids)

    def __enter__(self) -> "Admission":
        return self

    def __exit__(self, *exc) -> None:
        if self.ahead is not None:
            self.ahead.close()


class LLM:
    def __init__(self, model: str | None = None, *, use_tqdm_on_load: bool = True,
                 engine_config: EngineConfig | None = None, multiprocess: bool | None = None, **kwargs: Any):
        from jaxserve.engine.core_client import use_multiprocess
        from jaxserve.engine.llm_engine import LLMEngine
        config = engine_config or engine_config_from_kwargs(model, **kwargs)
        self.engine = LLMEngine(config, progress=use_tqdm_on_load,
                                multiprocess=use_multiprocess(multiprocess, default=False, config=config))
        self.tokenizer = self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine core (its process, or this process's background compiles): once it is gone nothing
        holds its weights and KV cache, and the next engine can claim the memory."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the step variants compiling in the background are done (False after ``timeout``
        seconds): what a benchmark waits for before it measures the compiled steady state."""
        return self.engine.wait_compiled(timeout)

    # ---------------------------------------------------------------- generate
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """``lora_request`` (vLLM's): a ``LoRARequest`` for every prompt, or a list with one per prompt (None:
        the base model), with ``enable_lora=True``. ``priority`` (vLLM's): one per prompt, lower first, with
        ``scheduling_policy="priority"``."""
        items = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = list(sampling_params) if isinstance(sampling_params, (list, tuple)) \
            else [sampling_params] * len(items)
        if len(params_list) != len(items):
            raise ValueError(f"{len(params_list)} sampling params for {len(items)} prompts")
        priorities = [0] * len(items) if priority is None else list(priority)
        if len(priorities) != len(items):
            raise ValueError(f"{len(priorities)} priorities for {len(items)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(items)
        if len(loras) != len(items):
            raise ValueError(f"{len(loras)} LoRA requests for {len(items)} prompts")
        eng = self.engine
        all_ids, all_images = [], _images(prompts)
        for (text, ids, _), images in zip(items, all_images):
            if ids is None:
                ids = eng.images.encode(text, True) if images and eng.images.splits_placeholder else \
                    self.tokenizer.encode(text)
            all_ids.append(ids)
        order: list[tuple[str, int]] = []        # (parent id, n), in prompt order

        def requests(k: int, ids: list[int], features) -> list:
            (text, _, salt), params = items[k], params_list[k]
            parent = eng.new_request_id()
            order.append((parent, params.n))
            reqs = []
            for i in range(params.n):
                child = dataclasses.replace(params, n=1, output_kind=RequestOutputKind.FINAL_ONLY)
                if params.n > 1 and params.seed is not None:
                    child.seed = params.seed + i
                rid = f"{parent}" if params.n == 1 else f"{parent}_{i}"
                reqs.append(eng.make_request(rid, ids, child, prompt=text, priority=priorities[k], cache_salt=salt,
                                             mm_features=features, lora_request=loras[k]))
            return reqs

        with Admission(eng, requests, all_ids, all_images) as admit:
            finals = self._run(sum(p.n for p in params_list), use_tqdm, admit)
        results = []
        for parent, n in order:
            if n == 1:
                results.append(finals[parent])
                continue
            kids = [finals[f"{parent}_{i}"] for i in range(n)]
            outs = []
            for i, k in enumerate(kids):
                o = k.outputs[0]
                outs.append(dataclasses.replace(o, index=i))
            results.append(dataclasses.replace(kids[0], request_id=parent, outputs=outs))
        return results

    def _run(self, total: int, use_tqdm: bool, admit) -> dict[str, RequestOutput]:
        """Step the engine until the requests ``admit`` queues are finished: ``admit(wait)`` is called before
        each step (``wait``: the engine has nothing to run) and says whether every request is queued."""
        from tqdm.auto import tqdm
        eng = self.engine
        finals: dict[str, RequestOutput] = {}
        bar = tqdm(total=total, desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        t0 = time.perf_counter()
        n_in = n_out = 0
        all_queued = False
        try:
            while True:
                if not all_queued:
                    all_queued = admit(not eng.has_unfinished_requests())
                if not eng.has_unfinished_requests():
                    break
                # (with the core in its own process: back to admitting after a while without outputs)
                for out in eng.step(None if all_queued else ADMIT_POLL_S):
                    if out.finished:
                        finals[out.request_id] = out
                        n_in += len(out.prompt_token_ids)
                        n_out += sum(len(o.token_ids) for o in out.outputs)
                        dt = max(time.perf_counter() - t0, 1e-9)
                        bar.set_postfix_str(f"input: {n_in / dt:.1f} tok/s, output: {n_out / dt:.1f} tok/s")
                        bar.update(1)
        except BaseException:
            # Ctrl-C, or a prompt's error after others were queued: free what this call queued
            eng.abort_request(eng.request_ids())
            raise
        finally:
            bar.close()
        return finals

    # ---------------------------------------------------------------- beam search
    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: each prompt (a string, token ids, or a ``{"prompt": ...}`` /
        ``{"prompt_token_ids": ...}`` dict) beam-searched with ``params``; its best ``beam_width`` beams, best
        first, each with the prompt's and the generated tokens and their text. The steps run through
        ``generate`` (jaxserve/beam_search.py says how); ``use_tqdm`` draws no bar."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported")
        items = [i if i is not None else self.tokenizer.encode(t) for t, i, _ in _normalize_prompts(prompts)]
        return beam_search_offline(self.generate, self.tokenizer, self.engine.facts(), items, params,
                                   concurrency_limit)

    # ---------------------------------------------------------------- chat
    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Chat ``messages`` (one conversation, or a list of them); content parts of type ``image_url`` (data:,
        http(s):, file: URLs, as the server takes them) put images in the prompt."""
        from jaxserve.multimodal.chat import has_image_parts, image_conversation, template_reads_parts
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = chat_template or self.engine.chat_template
        vision = self.engine.facts().is_multimodal and template_reads_parts(template)
        imgs = self.engine.images
        parsed = [image_conversation(c, template, imgs.placeholder if vision else "", imgs.limit)
                  if vision or has_image_parts(c) else (c, []) for c in conversations]
        loaded = iter(map_media(imgs.load, [u for _, urls in parsed for u in urls]))    # worker threads
        prompts = []
        for c, urls in parsed:
            images = [next(loaded) for _ in urls]
            if images and self.engine.images.splits_placeholder:
                text = self.tokenizer.apply_chat_template(c, chat_template=template, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt,
                                                          **(chat_template_kwargs or {}))
                ids = self.engine.images.encode(text, False)
            else:
                ids = self.apply_chat_template(c, chat_template=chat_template,
                                               add_generation_prompt=add_generation_prompt,
                                               **(chat_template_kwargs or {}))
            prompts.append({"prompt": None, "prompt_token_ids": ids, "multi_modal_data": {"image": images}})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation, *, chat_template: str | None = None,
                            add_generation_prompt: bool = True, **kwargs) -> list[int]:
        template = chat_template or self.engine.chat_template
        ids = self.tokenizer.apply_chat_template(conversation, chat_template=template,
                                                 add_generation_prompt=add_generation_prompt, tokenize=True,
                                                 **kwargs)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    # ---------------------------------------------------------------- embeddings
    def embed(self, prompts, *, truncate_prompt_tokens: int | None = None, dimensions: int | None = None,
              use_tqdm: bool = False):
        from jaxserve.outputs import EmbeddingOutput, EmbeddingRequestOutput
        if not self.engine.is_embedding:
            raise ValueError("the loaded model does not support embeddings (load an embedding model, or a "
                             "decoder with task='embed')")
        items = _normalize_prompts(prompts)
        ids = [i if i is not None else self.tokenizer.encode(t) for t, i, _ in items]
        vecs = self.engine.embed(ids, truncate_prompt_tokens=truncate_prompt_tokens, dimensions=dimensions)
        return [EmbeddingRequestOutput(request_id=str(k), outputs=EmbeddingOutput(embedding=list(map(float, v))),
                                       prompt_token_ids=i, finished=True)
                for k, (i, v) in enumerate(zip(ids, vecs))]


__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "RequestOutput", "SamplingParams",
           "engine_config_from_kwargs"]
