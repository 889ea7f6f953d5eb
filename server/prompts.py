"""The prompt a request renders to: chat templates applied, texts tokenized (long ones on worker threads, a
few at once), and the bounds a prompt must meet before it costs work (characters, token ids)."""
from __future__ import annotations

import ctypes
import threading
from functools import partial
from typing import Any, Callable, TypeVar

import anyio
import msgspec

from jaxserve import envs
from jaxserve.engine.llm_engine import truncate_prompt
from jaxserve.errors import InvalidRequestError
from jaxserve.multimodal.chat import image_conversation, template_reads_parts

from .args import ServerArgs
from .errors import APIError, bad_request
from .request_types import ChatMessage
from .tool_parsers.choice import ToolRequestError, template_messages

T = TypeVar("T")
THREAD_THRESHOLD_CHARS = 4096  # shorter prompts tokenize faster than a thread hop costs
# Long texts tokenize on worker threads, this many at once: a tokenizer's working memory is a multiple of
# its input, so the bound on concurrent tokenization is a bound on that memory.
TOKENIZE_THREADS = 4
# A request's own chat template (--trust-request-chat-template) is a program: it may run this long.
REQUEST_TEMPLATE_TIMEOUT_S = 5.0
# apply_chat_template's own arguments: chat_template_kwargs may not override them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "chat_template", "tools", "documents",
                                      "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                      "truncation", "max_length", "return_tensors", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token can stand for (its longest vocabulary entry; byte-level vocabularies
    spell each byte as one character, so this also bounds bytes), or None if the tokenizer cannot say."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:   # a tokenizer without a readable vocabulary: no character bound
        return None
    return max((len(t) for t in vocab), default=0) or None


class TemplateTimeout(Exception):
    """A chat template ran past its time bound."""


def run_with_deadline(fn: Callable[[], T], seconds: float) -> T:
    """``fn()`` in this (worker) thread, stopped with TemplateTimeout once it runs past ``seconds``: a timer
    raises it asynchronously in this thread (CPython's PyThreadState_SetAsyncExc), which pure-Python code
    such as Jinja's compiled templates sees at its next bytecode; no cost while it runs."""
    tid = threading.get_ident()
    lock = threading.Lock()
    state = {"finished": False, "fired": False}

    def interrupt() -> None:
        with lock:
            if not state["finished"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(TemplateTimeout))
    timer = threading.Timer(seconds, interrupt)
    timer.start()
    try:
        return fn()
    except TemplateTimeout:
        raise TemplateTimeout(f"the chat template ran past {seconds:g} s") from None
    finally:
        with lock:
            state["finished"] = True
            if state["fired"]:      # not raised yet (fn had just returned): never let it hit the pool's next job
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)
        timer.cancel()


class PromptRenderer:
    """The engine's tokenizer and chat template, as the routes use them."""

    def __init__(self, engine: Any, args: ServerArgs):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = int(engine.max_model_len)
        self.trust_request_chat_template = args.trust_request_chat_template
        # Token ids are checked against the model's embedding rows (the tokenizer may have fewer ids, e.g.
        # padded vocabularies, or dummy weights served with another model's tokenizer).
        model_vocab = getattr(getattr(engine, "model_config", None), "vocab_size", None)
        self.vocab_size = int(model_vocab or len(self.tokenizer))
        # A text of more characters than max_model_len tokens can spell is refused before it is tokenized
        # (tokenizing a multi-megabyte prompt costs gigabytes of memory only to answer "too long").
        per_token = longest_token_chars(self.tokenizer)
        self.max_prompt_chars: int | None = per_token * self.max_model_len if per_token else None
        self._tokenize_limiter: anyio.CapacityLimiter | None = None
        self._media_limiter: anyio.CapacityLimiter | None = None
        # a vision model's image handling (the engine front end's), None for a text model: its chat requests
        # render as today
        facts = getattr(engine, "facts", None)
        self.images = engine.images if facts is not None and facts().is_multimodal else None
        self.reads_parts = self.images is not None and template_reads_parts(self.chat_template)
        if self.images is not None:
            self.images.processing      # made now, at start-up, not by the first request on the event loop

    async def prepare_images(self, ids: list[int], urls: list[str]) -> tuple[list[int], list]:
        """Fetch and decode the images (worker threads, ``VLLM_MEDIA_LOADING_THREAD_COUNT`` at once), then
        preprocess them and expand the prompt's placeholders (a worker thread): never on the event loop."""
        if self._media_limiter is None:
            self._media_limiter = anyio.CapacityLimiter(envs.VLLM_MEDIA_LOADING_THREAD_COUNT)
        try:
            images = []
            for url in urls:
                images.append(await anyio.to_thread.run_sync(self.images.load, url, limiter=self._media_limiter))
            return await anyio.to_thread.run_sync(self.images.process, ids, images, limiter=self._media_limiter)
        except InvalidRequestError as e:
            raise bad_request(str(e), "messages") from None

    def _with_images(self, conversation: list[dict], messages: list[ChatMessage], template: str,
                     image_urls: list[str] | None) -> list[dict]:
        """The conversation with its image parts (``multimodal.chat``): what a vision model's template reads."""
        if not (self.reads_parts or any(m.num_images() for m in messages)):
            return conversation
        raw = [dict(c, content=msgspec.to_builtins(m.content)) if isinstance(m.content, list) else c
               for c, m in zip(conversation, messages)]
        try:
            out, urls = image_conversation(raw, template, self.images.placeholder, self.images.limit)
        except InvalidRequestError as e:
            raise bad_request(str(e), e.param or "messages") from None
        if image_urls is not None:
            image_urls.extend(urls)
        return out

    async def _maybe_thread(self, size: int, fn: Callable[..., T], *args: Any,
                            limiter: anyio.CapacityLimiter | None = None) -> T:
        if size < THREAD_THRESHOLD_CHARS:
            return fn(*args)
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)

    def check_prompt_chars(self, num_chars: int, what: str) -> None:
        """400 context_length_exceeded for a text that cannot fit max_model_len whatever its tokens."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; your {what} "
                                f"has {num_chars} characters, more than {self.max_model_len} tokens of at most "
                                f"{self.max_prompt_chars // self.max_model_len} characters each can hold. "
                                f"Please reduce the length of the {what}.", param=what,
                           code="context_length_exceeded")

    async def encode(self, text: str, add_special_tokens: bool = True, what: str | None = "prompt") -> list[int]:
        """Token ids of ``text``, tokenized on a worker thread when long (``TOKENIZE_THREADS`` at once).
        ``what`` names the field for the character bound (``check_prompt_chars``); None skips it (a caller
        that truncates the tokens after)."""
        if what is not None:
            self.check_prompt_chars(len(text), what)
        if self._tokenize_limiter is None:      # made on the event loop that uses it
            self._tokenize_limiter = anyio.CapacityLimiter(TOKENIZE_THREADS)
        return await self._maybe_thread(len(text), self._encode, text, add_special_tokens,
                                        limiter=self._tokenize_limiter)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    @property
    def chat_template(self) -> str | None:
        """The server's template: --chat-template, else the tokenizer's."""
        return getattr(self.engine, "chat_template", None) or getattr(self.tokenizer, "chat_template", None)

    async def render_chat(self, messages: list[ChatMessage], *, add_generation_prompt: bool,
                          continue_final_message: bool, chat_template: str | None,
                          chat_template_kwargs: dict[str, Any] | None, tools: list[dict] | None = None,
                          documents: list[dict[str, str]] | None = None, image_urls: list[str] | None = None) -> str:
        """The rendered prompt. Image parts (a vision model) render as the model's placeholders; their URLs
        are appended to ``image_urls`` in prompt order when it is given."""
        kwargs = dict(chat_template_kwargs or {})
        if not self.trust_request_chat_template and (chat_template is not None or "chat_template" in kwargs):
            raise bad_request("a request's chat_template is refused: it is a program run on the server; the "
                              "operator may allow it with --trust-request-chat-template", "chat_template")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)} (the request's own fields "
                              "say those)", "chat_template_kwargs")
        template = chat_template or self.chat_template
        if not template:
            raise bad_request("the model has no chat template; start the server with --chat-template FILE or "
                              "use /v1/completions", "messages")
        if add_generation_prompt and continue_final_message:
            raise bad_request("add_generation_prompt and continue_final_message cannot both be true",
                              "continue_final_message")
        try:
            conversation = template_messages(messages)
        except ToolRequestError as e:
            raise bad_request(str(e), e.param) from None
        if self.images is not None:
            conversation = self._with_images(conversation, messages, template, image_urls)
        elif any(m.num_images() for m in messages):
            raise bad_request("the model does not take images (a text-only model): send text content only",
                              "messages")
        if tools is not None:
            kwargs["tools"] = tools
        if documents is not None:
            kwargs["documents"] = documents
        size = sum(len(c["content"]) if isinstance(c["content"], str) else
                   sum(len(p.get("text", "")) for p in c["content"]) for c in conversation)
        self.check_prompt_chars(size, "messages")      # the rendered prompt holds every message

        def render() -> str:
            return self.tokenizer.apply_chat_template(
                conversation, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs)
        if chat_template is not None:
            # a request's (trusted) template may loop: never on the event loop, and bounded in time
            size = THREAD_THRESHOLD_CHARS
            render_fn = partial(run_with_deadline, render, REQUEST_TEMPLATE_TIMEOUT_S)
        else:
            render_fn = render
        try:
            text = await self._maybe_thread(size, render_fn)
        except APIError:
            raise
        except TemplateTimeout as e:
            raise bad_request(f"{e}: simplify the chat template", "chat_template") from None
        except Exception as e:  # a template error is the caller's input (kwargs, roles), not a crash
            raise bad_request(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                              "messages") from e
        self.check_prompt_chars(len(text), "messages")     # a template can make a prompt of any size
        return text

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: up to max_model_len)."""
        if keep is None:
            return ids
        if isinstance(keep, bool) or keep == 0 or keep < -1:
            raise bad_request("truncate_prompt_tokens must be an integer >= 1, or -1 for max_model_len",
                              "truncate_prompt_tokens")
        if keep > self.max_model_len:
            raise bad_request(f"truncate_prompt_tokens {keep} is over max_model_len {self.max_model_len}",
                              "truncate_prompt_tokens")
        return truncate_prompt(ids, keep, self.max_model_len)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.vocab_size
        bad = [t for t in ids if t < 0 or t >= vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of range: the vocabulary has {vocab} tokens", param)

