"""The engine a front end talks to: ``LLMEngine`` (the ``EngineClient``) validates and builds requests, hands
them to its engine core, in this process or in its own, and renders the core's outputs as RequestOutputs.

    step() = the core's next outputs (in this process: one ``EngineCore.step``) → the front end's
             ``OutputProcessor`` (detokenize, stop strings, logprobs) → RequestOutputs; a request a stop
             string ended is aborted in the core

The offline ``LLM`` drives it directly, the server through ``async_engine.AsyncLLMEngine`` (on a background
thread). Validation and admission limits are checked once, here, at the engine boundary (``make_request``),
which builds the request's front-end ``Request``; the core builds its own from what the front end sends.
With the core in its own process (``multiprocess``) ``add_requests`` and ``abort_request`` may be called from
any thread and ``step`` from one thread at a time; in this process, all from the one thread that steps.
"""
from __future__ import annotations

import functools
import itertools
import os
import threading
import time
import weakref
from typing import Any, Protocol, Sequence

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.core import EngineFacts
from jaxserve.engine.core_client import InprocClient, MPClient, data_parallel_size
from jaxserve.engine.dp_client import DPClient
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.request import Request
from jaxserve.errors import InvalidRequestError, ReplicaLostError
from jaxserve.multimodal.media import MediaLimits, load_image_url
from jaxserve.multimodal.processing import ImageProcessing, encode_around
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams, check_token_ids


DEFAULT_IMAGE_LIMIT = 8      # images in one prompt without --limit-mm-per-prompt


class EngineClient(Protocol):
    """What a front end (``LLM``, ``AsyncLLMEngine``, the server through it) needs of an engine."""
    multiprocess: bool          # the core runs in its own process (see the module docstring for threads)
    config: EngineConfig
    tokenizer: Any
    model_config: Any
    max_model_len: int
    chat_template: str | None
    served_model_name: str
    is_embedding: bool
    structured_output: Any      # the StructuredOutputManager the server compiles constraints with
    last_output_time: float     # when (time.monotonic) the core's outputs last arrived

    def facts(self) -> EngineFacts: ...
    def new_request_id(self) -> str: ...
    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     prompt: str | None = None, arrival_time: float | None = None, *,
                     strict_length: bool = False, priority: int = 0, cache_salt: str | None = None,
                     wait_for_grammar: bool = True, lora_request=None) -> Request: ...
    def add_requests(self, reqs: list[Request]) -> None: ...
    def abort_request(self, request_ids: str | list[str]) -> None: ...
    def step(self, timeout_s: float | None = None) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def num_unfinished_requests(self) -> int: ...
    def request_ids(self) -> list[str]: ...
    def embed(self, prompt_token_ids_list, *, truncate_prompt_tokens=None, dimensions=None): ...
    def stats(self) -> dict: ...
    def wait_compiled(self, timeout: float | None = None) -> bool: ...
    def is_core_alive(self) -> bool: ...
    def shutdown(self) -> None: ...


def truncate_prompt(prompt_token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: up to max_model_len; None:
    the whole prompt)."""
    if keep == -1:
        keep = max_model_len
    return prompt_token_ids[-keep:] if keep is not None and len(prompt_token_ids) > keep else prompt_token_ids


def validate_prompt_length(prompt_token_ids: Sequence[int] | int, max_tokens: int | None,
                           max_model_len: int) -> None:
    """Reject a prompt that is empty or longer than max_model_len, or (when max_tokens is given) one that
    leaves no room for max_tokens new tokens, as vLLM's OpenAI server does. Pass max_tokens=None to only
    check the prompt (generation then stops at max_model_len, "length")."""
    n = prompt_token_ids if isinstance(prompt_token_ids, int) else len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt is empty: send at least one token", param="prompt")
    if n > max_model_len:
        raise InvalidRequestError(f"prompt has {n} tokens, max_model_len is {max_model_len}", param="prompt")
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} tokens exceed "
            f"max_model_len {max_model_len}; lower max_tokens or shorten the prompt", param="max_tokens")


class RequestBuilder:
    """The engine boundary: validate a request once and build its front-end ``Request``, from the loaded
    engine's facts and the structured-output manager that compiles its constraint."""

    def __init__(self, facts: EngineFacts, structured_output):
        self.facts = facts
        self.structured_output = structured_output
        self._seed_rng = np.random.default_rng(facts.config.seed)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, *, strict_length: bool = True,
                 priority: int = 0, cache_salt: str | None = None, wait_for_grammar: bool = True) -> None:
        """Reject what can never run, with a message a user can act on. ``strict_length``: prompt + max_tokens
        must fit max_model_len (the server's rule); off, generation just stops at max_model_len (offline).
        ``priority`` needs ``--scheduling-policy priority``; ``cache_salt`` is a non-empty string (vLLM's).
        ``wait_for_grammar``: a constraint is compiled (on the grammar workers) and this thread waits for its
        verdict; off, only its cheap checks run here (the server awaited the verdict already; otherwise the
        engine core refuses the request with an error output)."""
        facts = self.facts
        if facts.is_embedding:
            raise InvalidRequestError(
                f"the loaded model ({facts.served_model_name}) serves embeddings (/v1/embeddings, LLM.embed), "
                "not text generation", param="model")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token", param="prompt")
        # (Mllama's <|image|> is an input embedding past the output vocabulary)
        vocab = facts.model_config.extra_dict.get("input_vocab_size") or facts.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (size {vocab})", param="prompt")
        validate_prompt_length(len(prompt_token_ids), params.max_tokens if strict_length else None,
                               facts.max_model_len)
        sched = facts.config.scheduler
        if not sched.enable_chunked_prefill and len(prompt_token_ids) > sched.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt has {len(prompt_token_ids)} tokens, more than max_num_batched_tokens "
                f"{sched.max_num_batched_tokens} with chunked prefill off", param="prompt")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > facts.config.max_logprobs:
                raise InvalidRequestError(
                    f"{name}={k} is above the server's max_logprobs={facts.config.max_logprobs}", param=name)
        if params.prompt_logprobs is not None and facts.multi_process:
            # the prompt scorer is an extra computation process 0 alone would launch (the others only follow
            # steps), and the mesh's collectives would wait for them forever
            raise InvalidRequestError("prompt_logprobs is not available when the model is spread over several "
                                      "processes (--num-processes / --distributed-executor-backend mp)",
                                      param="prompt_logprobs")
        if params.prompt_logprobs is not None and facts.config.parallel.pipeline_parallel_size > 1:
            raise InvalidRequestError("prompt_logprobs is not available with pipeline stages "
                                      "(--pipeline-parallel-size)", param="prompt_logprobs")
        check_token_ids(params, facts.model_config.vocab_size)             # logit_bias, allowed_token_ids
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", param="priority")
        if priority != 0 and facts.config.scheduler.scheduling_policy != "priority":
            raise InvalidRequestError(f"priority is {priority}, but priority scheduling is not enabled: start the "
                                      "server with --scheduling-policy priority", param="priority")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError(f"cache_salt must be a non-empty string, got {cache_salt!r}", param="cache_salt")
        if params.structured_outputs is not None:     # cached; raises naming the problem
            self.structured_output.validate(params.structured_outputs, wait=wait_for_grammar)

    def validate_images(self, features: list, params: SamplingParams) -> None:
        """An image needs a vision model, and tokens that fit one step's encoder budget; its prompt is not
        scored (the scoring forward has no image embeddings: it would score other inputs than the model's)."""
        facts = self.facts
        if params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs is not supported for prompts with images",
                                      param="prompt_logprobs")
        if not facts.is_multimodal:
            raise InvalidRequestError(f"the model {facts.served_model_name} does not take images (a text-only "
                                      "model): send text content only", param="messages")
        if facts.multi_process:
            raise InvalidRequestError("images are not supported when the model is spread over several processes "
                                      "(--num-processes / --distributed-executor-backend mp)", param="messages")
        budget, _ = facts.config.scheduler.encoder_limits()
        step_budget = facts.config.scheduler.max_num_batched_tokens
        for f in features:
            if f.length > budget:
                raise InvalidRequestError(f"an image takes {f.length} tokens, more than the encoder budget of "
                                          f"{budget} (--max-num-encoder-input-tokens)", param="messages")
            if facts.whole_images and step_budget is not None and f.length > step_budget:
                raise InvalidRequestError(f"an image takes {f.length} tokens, more than one step's budget of "
                                          f"{step_budget} (--max-num-batched-tokens); this model computes an "
                                          "image's tokens in one step", param="messages")

    def validate_lora(self, lora_request, params: SamplingParams) -> None:
        """A request may name an adapter only with LoRA on, and is then not scored (the prompt scorer runs the
        base model). Its folder is checked where it is read (the engine core; the server when it registers)."""
        if not self.facts.config.lora.enable_lora:
            raise InvalidRequestError(f"the request names LoRA adapter {lora_request.lora_name!r}, but LoRA is not "
                                      "enabled: start the engine with --enable-lora", param="model")
        if params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs is not supported with a LoRA adapter", param="prompt_logprobs")

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     prompt: str | None = None, arrival_time: float | None = None, *,
                     strict_length: bool = False, priority: int = 0, cache_salt: str | None = None,
                     wait_for_grammar: bool = True, mm_features: list | None = None,
                     lora_request=None) -> Request:
        """Truncate the prompt as asked, validate (``validate``), and build the Request with its own copy of
        the parameters (which knows the model's eos ids: the sampler blocks them below min_tokens) and its
        sampling seed. ``priority``: its place under ``--scheduling-policy priority`` (lower first);
        ``cache_salt``: its prefix-cache namespace (two salts never share blocks). Raises InvalidRequestError;
        queues nothing (``LLMEngine.add_requests`` does)."""
        prompt_token_ids = list(prompt_token_ids)
        eos_token_ids = self.facts.eos_token_ids
        kept = truncate_prompt(prompt_token_ids, params.truncate_prompt_tokens, self.facts.max_model_len)
        if mm_features and len(kept) < len(prompt_token_ids):
            raise InvalidRequestError("truncate_prompt_tokens cannot cut a prompt with images",
                                      param="truncate_prompt_tokens")
        prompt_token_ids = kept
        self.validate(prompt_token_ids, params, strict_length=strict_length, priority=priority,
                      cache_salt=cache_salt, wait_for_grammar=wait_for_grammar)
        if mm_features:
            self.validate_images(mm_features, params)
        if lora_request is not None:
            self.validate_lora(lora_request, params)
        params = params.clone()
        params.update_from_generation_config({"eos_token_id": list(eos_token_ids)},
                                             eos_token_ids[0] if eos_token_ids else None)
        params.update_from_tokenizer(self.facts.tokenizer)              # bad_words as token sequences
        req = Request(request_id, prompt_token_ids, params, eos_token_ids=eos_token_ids,
                      arrival_time=arrival_time or time.time(), prompt=prompt, priority=priority,
                      cache_salt=cache_salt, mm_features=mm_features, lora_request=lora_request)
        req.sampling_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**31 - 1))
        return req


class MultiModalInputs:
    """Images as a request brings them, through to ``ImageFeature``s: the model's image processing (made on
    first use), the limits of ``--limit-mm-per-prompt`` and the media flags. Blocking: the server calls
    ``load`` and ``process`` on worker threads."""

    def __init__(self, facts: EngineFacts):
        mm = facts.config.multimodal
        self.facts = facts
        self.limit = int(mm.limit_mm_per_prompt.get("image", DEFAULT_IMAGE_LIMIT)) if facts.is_multimodal else 0
        # what the model itself takes (Mllama: its index's images, each a cross-attention slot), whatever the flag
        self.model_limit = facts.model_config.extra_dict.get("max_images_per_prompt") if facts.is_multimodal else None
        if self.model_limit is not None:
            self.model_limit = min(self.model_limit, facts.config.scheduler.cross_attention_slot_count())
        self.media = MediaLimits(max_pixels=mm.max_image_pixels, fetch_timeout_s=mm.media_fetch_timeout,
                                 allowed_domains=tuple(d.lower() for d in mm.allowed_media_domains)
                                 if mm.allowed_media_domains else None,
                                 allowed_local_path=mm.allowed_local_media_path)
        self._processing = None
        self._lock = threading.Lock()

    @property
    def processing(self) -> ImageProcessing:
        with self._lock:
            if self._processing is None:
                facts = self.facts
                folder = facts.model_source if os.path.isdir(facts.model_source) else None
                self._processing = ImageProcessing.from_folder(folder, facts.model_config.extra_dict,
                                                               facts.config.multimodal.mm_processor_kwargs,
                                                               facts.tokenizer, dtype=facts.dtype_name)
            return self._processing

    @property
    def placeholder(self) -> str:
        return self.processing.image_token

    def check_count(self, n: int) -> None:
        if n and not self.facts.is_multimodal:
            raise InvalidRequestError(f"the model {self.facts.served_model_name} does not take images (a text-only "
                                      "model): send text content only", param="messages")
        if n > self.limit:
            raise InvalidRequestError(f"the prompt has {n} images, more than the limit of {self.limit} "
                                      "(--limit-mm-per-prompt)", param="messages")
        if self.model_limit is not None and n > self.model_limit:
            raise InvalidRequestError(f"the prompt has {n} images, but {self.facts.model_config.architecture} "
                                      f"takes at most {self.model_limit} per prompt (its images' cross-attention "
                                      "keys; --cross-attention-slots)", param="messages")

    def load(self, url: str) -> Any:
        return load_image_url(url, self.media)

    @functools.cached_property
    def splits_placeholder(self) -> bool:
        """The tokenizer does not spell the placeholder as the image token (random weights served with another
        model's tokenizer): prompts with images are tokenized around the placeholder (``encode``)."""
        p = self.processing
        return self.facts.tokenizer.encode(p.image_token, add_special_tokens=False) != [p.image_token_id]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text`` tokenized with each placeholder as the image token, as a tokenizer that has it as a special
        token does (it splits the text there)."""
        p = self.processing
        return encode_around(self.facts.tokenizer, text, p.image_token, p.image_token_id, add_special_tokens)

    def process(self, prompt_token_ids: list[int], images: list) -> tuple[list[int], list]:
        """(the prompt with its image tokens expanded, the images' features)."""
        self.check_count(len(images))
        return self.processing.process(prompt_token_ids, images)


class LLMEngine:
    """The ``EngineClient``: a front end over an engine core in this process (``multiprocess=False``; ``core``
    is that ``EngineCore``, with its scheduler and runner), in its own (``core`` is None), or in one process per
    data-parallel replica (``config.parallel.data_parallel_size`` > 1: ``dp_client.DPClient``)."""

    def __init__(self, config: EngineConfig, *, progress: bool = True, multiprocess: bool = False):
        self.client = (DPClient(config, progress=progress) if data_parallel_size(config) > 1
                       else MPClient(config, progress=progress) if multiprocess
                       else InprocClient(config, progress=progress))
        self.multiprocess = multiprocess
        self.core = self.client.core
        if multiprocess:                # an LLM dropped without shutdown() stops its core process
            weakref.finalize(self, self.client.close)
        facts = self._facts = self.client.facts
        self.config = facts.config
        self.tokenizer = facts.tokenizer
        self.model_config = facts.model_config
        self.max_model_len = facts.max_model_len
        self.eos_token_ids = facts.eos_token_ids
        self.chat_template = facts.chat_template
        self.is_embedding = facts.is_embedding
        self.served_model_name = facts.served_model_name
        self.structured_output = self.client.structured_output
        self.builder = RequestBuilder(facts, self.structured_output)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def facts(self) -> EngineFacts:
        return self._facts

    # ---------------------------------------------------------------- requests
    def new_request_id(self) -> str:
        return str(next(self._ids))

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     prompt: str | None = None, arrival_time: float | None = None, *,
                     strict_length: bool = False, priority: int = 0, cache_salt: str | None = None,
                     wait_for_grammar: bool = True, mm_features: list | None = None,
                     lora_request=None) -> Request:
        """Validate a request and build its Request (``RequestBuilder.make_request``); queues nothing.
        ``mm_features``: the prompt's images, processed (``multimodal.ImageProcessing.process``);
        ``lora_request``: its adapter (``jaxserve.lora.LoRARequest``)."""
        return self.builder.make_request(request_id, prompt_token_ids, params, prompt, arrival_time,
                                         strict_length=strict_length, priority=priority, cache_salt=cache_salt,
                                         wait_for_grammar=wait_for_grammar, mm_features=mm_features,
                                         lora_request=lora_request)

    # ---------------------------------------------------------------- images
    @functools.cached_property
    def images(self) -> MultiModalInputs:
        """The front end's image handling (loading within limits, preprocessing, placeholder expansion)."""
        return MultiModalInputs(self._facts)

    def add_requests(self, reqs: list[Request]) -> None:
        """Queue Requests from ``make_request``: the front end keeps their output state, the core gets them
        together (it queues them all before its next step). Raises InvalidRequestError if an id is in use."""
        procs = self.output_processor
        for i, req in enumerate(reqs):
            if req.request_id in procs.requests or any(r.request_id == req.request_id for r in reqs[:i]):
                raise InvalidRequestError(f"request id {req.request_id!r} is already in use", param="request_id")
        for req in reqs:
            procs.add_request(req)
        try:
            self.client.add_requests(reqs)
        except BaseException:
            for req in reqs:
                procs.remove(req.request_id)
            raise

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None, *, priority: int = 0,
                    cache_salt: str | None = None) -> None:
        """Validate and queue one request (offline rules: generation stops at max_model_len)."""
        self.add_requests([self.make_request(request_id, prompt_token_ids, params, prompt, arrival_time,
                                             priority=priority, cache_salt=cache_salt)])

    def abort_request(self, request_ids: str | list[str]) -> None:
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in request_ids:
            self.output_processor.remove(rid)
        self.client.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def num_unfinished_requests(self) -> int:
        return len(self.output_processor.requests)

    def request_ids(self) -> list[str]:
        return list(self.output_processor.requests)

    # ---------------------------------------------------------------- outputs
    def step(self, timeout_s: float | None = None) -> list[RequestOutput]:
        """The RequestOutputs of the core's next step: in this process the core runs it now; in its own this
        waits for it ([] after ``timeout_s``). Raises ReplicaLostError (the requests of a data-parallel replica
        that died, forgotten here) and EngineDeadError."""
        try:
            core_outputs = self.client.get_outputs(timeout_s)
        except ReplicaLostError as e:   # a data-parallel replica died: its requests end here, with the error
            for rid in e.request_ids:
                self.output_processor.remove(rid)
            raise
        outputs, stopped_here = self.output_processor.process_outputs(core_outputs)
        if stopped_here:                # stop strings the core cannot see: it still runs those requests
            self.client.abort_requests(stopped_here)
        return outputs

    def embed(self, prompt_token_ids_list, *, truncate_prompt_tokens=None, dimensions=None):
        """Embeddings of an embedding model (blocking; from any thread)."""
        return self.client.embed(prompt_token_ids_list, truncate_prompt_tokens=truncate_prompt_tokens,
                                 dimensions=dimensions)

    # ---------------------------------------------------------------- state and lifecycle
    def stats(self) -> dict:
        s = self.client.stats()
        if self.multiprocess:       # the verdicts this front end compiled (the core reports its own compiles)
            s["structured_verdict_compilations"] = self.structured_output.compiler.compilations
        return s

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the step variants compiling in the background are done (False after ``timeout``
        seconds): what a benchmark waits for before it measures the compiled steady state."""
        return self.client.wait_compiled(timeout)

    def is_core_alive(self) -> bool:
        return self.client.is_alive()

    @property
    def last_output_time(self) -> float:
        """When (time.monotonic) the core's outputs last arrived."""
        return self.client.last_output_time

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core: its process, or in this process its background compiles and the processes that
        follow its steps (nothing then holds the weights and KV cache: the next engine can claim them)."""
        self.client.shutdown(timeout_s)
