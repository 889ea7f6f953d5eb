"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, ``.chat(...)``, ``.embed(...)``.

``generate`` runs the engine to completion with FINAL_ONLY outputs. ``multiprocess=True`` (or
JAXSERVE_ENABLE_MULTIPROCESSING=1) runs the engine core in its own process; the default is one process. A SamplingParams with n > 1 becomes n
engine requests (``<id>_<i>``, seeds ``seed + i``), merged back into one RequestOutput by index, as the
server does for its choices.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from jaxserve import envs
from jaxserve.beam_search import BeamSearchOutput, beam_search_offline
from jaxserve.config import EngineConfig
from jaxserve.options import from_kwargs
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


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
        # the images preprocessed on worker threads (the first error in prompt order raised, as one by one)
        with_images = [k for k, (ids, images) in enumerate(zip(all_ids, all_images))
                       if images or (eng.facts().is_multimodal and eng.images.processing.count_placeholders(ids))]
        processed = dict(zip(with_images, map_media(lambda k: eng.images.process(all_ids[k], all_images[k]),
                                                    with_images)))
        order: list[tuple[str, int]] = []        # (parent id, n)
        batch = []                               # every request, queued at once
        for k, ((text, _, salt), params, prio, lora) in enumerate(zip(items, params_list, priorities, loras)):
            ids, features = processed.get(k, (all_ids[k], None))
            parent = eng.new_request_id()
            order.append((parent, params.n))
            for i in range(params.n):
                child = dataclasses.replace(params, n=1, output_kind=RequestOutputKind.FINAL_ONLY)
                if params.n > 1 and params.seed is not None:
                    child.seed = params.seed + i
                rid = f"{parent}" if params.n == 1 else f"{parent}_{i}"
                batch.append(eng.make_request(rid, ids, child, prompt=text, priority=prio, cache_salt=salt,
                                              mm_features=features, lora_request=lora))
        eng.add_requests(batch)
        finals = self._run(sum(n for _, n in order), use_tqdm)
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

    def _run(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        from tqdm.auto import tqdm
        eng = self.engine
        finals: dict[str, RequestOutput] = {}
        bar = tqdm(total=total, desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        t0 = time.perf_counter()
        n_in = n_out = 0
        try:
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        finals[out.request_id] = out
                        n_in += len(out.prompt_token_ids)
                        n_out += sum(len(o.token_ids) for o in out.outputs)
                        dt = max(time.perf_counter() - t0, 1e-9)
                        bar.set_postfix_str(f"input: {n_in / dt:.1f} tok/s, output: {n_out / dt:.1f} tok/s")
                        bar.update(1)
        except BaseException:
            # Ctrl-C: free what this call queued
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
