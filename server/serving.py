"""What chat and completions share: model names, prompt rendering and tokenizing, the token budget,
request -> SamplingParams, and running n engine requests as one merged stream that always cleans up.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio

from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

from .args import ServerArgs, resolve_tool_parser
from .errors import APIError, bad_request, model_not_found
from .metrics import RequestTracker, ServerMetrics
from .protocol import ChatMessage, PromptLogprob, SamplingFields, StructuredOutputs
from .tool_parsers.choice import ToolRequestError, template_messages

log = logging.getLogger("jaxserve.server")

T = TypeVar("T")
MIN_LOGPROB = -9999.0  # JSON has no -inf
THREAD_THRESHOLD_CHARS = 4096  # shorter prompts tokenize faster than a thread hop costs
# Long texts tokenize on worker threads, this many at once: a tokenizer's working memory is a multiple of
# its input, so the bound on concurrent tokenization is a bound on that memory.
TOKENIZE_THREADS = 4
# A drain timeout ends the running requests this much (at most a tenth of the timeout) before the HTTP
# server's graceful timeout closes their connections: time to send each its error event and [DONE].
DRAIN_GRACE_S = 2.0
# A request's own chat template (--trust-request-chat-template) is a program: it may run this long.
REQUEST_TEMPLATE_TIMEOUT_S = 5.0
# apply_chat_template's own arguments: chat_template_kwargs may not override them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "chat_template", "tools", "documents",
                                      "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                      "truncation", "max_length", "return_tensors", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})


def structured_outputs_from_request(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint from ``response_format``, ``structured_outputs`` or a ``guided_*`` field
    (vLLM's rules: at most one of them); None without one. Raises a 400 naming the conflicting fields."""
    found: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema (the JSON schema)",
                              "response_format")
        found.append(("response_format", {"json": rf.json_schema.schema}))
    so = req.structured_outputs
    if so is not None:
        given = {name: getattr(so, name) for name in StructuredOutputs.__struct_fields__
                 if getattr(so, name) is not None and getattr(so, name) is not False}
        if len(given) != 1:
            raise bad_request("structured_outputs must set exactly one of json, regex, choice, grammar, "
                              f"json_object; got {', '.join(given) or 'none'}", "structured_outputs")
        found.append(("structured_outputs", given))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, {key: value}))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"only one structured-output constraint per request; got {' and '.join(n for n, _ in found)}",
                          found[1][0])
    field_name, kw = found[0]
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:
        raise bad_request(str(e), field_name) from e


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


class ClientDisconnected(Exception):
    """The client went away before we answered; the engine requests were aborted."""


async def wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client closes the connection. The request body has been read by now, so the
    next ASGI message is http.disconnect, which the server sends only then."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """Await `work`, but cancel it (aborting its engine requests) if the client disconnects first."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work_task.cancel()
        raise
    finally:
        watch_task.cancel()
    if work_task.done():
        return work_task.result()
    work_task.cancel()
    try:
        await work_task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()


@dataclass(slots=True)
class Choice:
    """One engine request behind one choice of a response."""
    index: int
    request_id: str
    params: SamplingParams
    tracker: RequestTracker
    finished: bool = False
    failed: bool = False      # the engine raised for it (never accepted, or failed): nothing to abort


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None = None  # the text when the user sent text (for echo / the engine's logs)
    choices: list[Choice] = field(default_factory=list)


class Serving:
    def __init__(self, engine: Any, args: ServerArgs):
        self.engine = engine
        self.args = args
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = int(engine.max_model_len)
        self.model_names: list[str] = list(args.served_model_name or [engine.served_model_name])
        self.model_name = self.model_names[0]
        self.max_logprobs = int(getattr(engine, "max_logprobs", None) or 20)
        self.metrics = ServerMetrics(engine, self.model_name, args.metrics_prefix)
        self.draining = False
        self.drain_expired = False
        # tasks now awaiting an engine output in ``run``: the ones a drain timeout interrupts
        self._awaiting_engine: set[asyncio.Task] = set()
        self._interrupted: set[asyncio.Task] = set()
        self.tool_parser_cls = resolve_tool_parser(args)   # --tool-call-parser (None: no auto tool choice)
        self._token_strs: dict[int, str] = {}
        # Token ids are checked against the model's embedding rows (the tokenizer may have fewer ids, e.g.
        # padded vocabularies, or dummy weights served with another model's tokenizer).
        model_vocab = getattr(getattr(engine, "model_config", None), "vocab_size", None)
        self.vocab_size = int(model_vocab or len(self.tokenizer))
        # A text of more characters than max_model_len tokens can spell is refused before it is tokenized
        # (tokenizing a multi-megabyte prompt costs gigabytes of memory only to answer "too long").
        per_token = longest_token_chars(self.tokenizer)
        self.max_prompt_chars: int | None = per_token * self.max_model_len if per_token else None
        self._tokenize_limiter: anyio.CapacityLimiter | None = None

    # -- checks ------------------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise model_not_found(name)

    def check_capacity(self, num_requests: int, param: str = "n") -> None:
        """Admission for the whole request (prompts x n) before any work: 400 above --max-request-choices
        or if it can never fit the engine, 429 if not now."""
        limit = self.args.max_request_choices
        if num_requests > limit:
            raise bad_request(f"this request asks for {num_requests} choices (prompts x n), more than the "
                              f"server's --max-request-choices {limit}; split it", param)
        self.engine.check_admission(num_requests)

    def resolve_max_tokens(self, num_prompt_tokens: int, requested: int | None, what: str) -> int:
        """OpenAI's context-length check, naming both numbers; default = what is left of max_model_len."""
        room = self.max_model_len - num_prompt_tokens
        if requested is None:
            if room <= 0:
                raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens; your "
                                    f"{what} has {num_prompt_tokens} tokens, which leaves no room for a completion.",
                               param=what, code="context_length_exceeded")
            return room
        if num_prompt_tokens + requested > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {what}, "
                                f"{requested} in the completion). Please reduce the length of the {what} or "
                                f"max_tokens.", param=what, code="context_length_exceeded")
        return requested

    # -- prompts -----------------------------------------------------------------------------------

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
                          chat_template_kwargs: dict[str, Any] | None, tools: list[dict] | None = None) -> str:
        kwargs = dict(chat_template_kwargs or {})
        if not self.args.trust_request_chat_template and (chat_template is not None or "chat_template" in kwargs):
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
        if tools is not None:
            kwargs["tools"] = tools
        size = sum(len(c["content"]) for c in conversation)
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

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.vocab_size
        bad = [t for t in ids if t < 0 or t >= vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of range: the vocabulary has {vocab} tokens", param)

    def token_namer(self, req: SamplingFields) -> Callable[[int, str | None], str]:
        """How logprobs name a token: its text, or "token_id:{id}" with return_tokens_as_token_ids (vLLM's
        extra, for tokens whose text is not valid UTF-8 on its own)."""
        if req.return_tokens_as_token_ids:
            return lambda token_id, decoded=None: f"token_id:{token_id}"
        return self.token_str

    def prompt_logprobs_out(self, positions: list | None) -> list | None:
        """The engine's prompt logprobs ([None, {id: Logprob}, ...]) as vLLM's server writes them."""
        if positions is None:
            return None
        return [None if pos is None else
                {tid: PromptLogprob(max(lp.logprob, MIN_LOGPROB), lp.rank, self.token_str(tid, lp.decoded_token))
                 for tid, lp in pos.items()} for pos in positions]

    @staticmethod
    def check_unstreamed(req: SamplingFields) -> None:
        if req.prompt_logprobs is not None and req.stream:
            raise bad_request("prompt_logprobs is supported without stream only", "prompt_logprobs")

    def token_str(self, token_id: int, decoded: str | None = None) -> str:
        if decoded is not None:
            return decoded
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id])
            self._token_strs[token_id] = s
        return s

    # -- sampling ----------------------------------------------------------------------------------

    def sampling_params(self, req: SamplingFields, *, max_tokens: int, choice_index: int,
                        logprobs: int | None) -> SamplingParams:
        if logprobs is not None and logprobs > self.max_logprobs:
            raise bad_request(f"at most {self.max_logprobs} logprobs per token are supported, got {logprobs}",
                              "top_logprobs" if hasattr(req, "top_logprobs") else "logprobs")
        if req.prompt_logprobs is not None and req.prompt_logprobs > self.max_logprobs:
            raise bad_request(f"at most {self.max_logprobs} prompt logprobs per token are supported, got "
                              f"{req.prompt_logprobs}", "prompt_logprobs")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        kw: dict[str, Any] = dict(
            n=1,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,  # -1 ("off", vLLM's) and < -1 (a 400) are SamplingParams' call
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=None if req.seed is None else req.seed + choice_index,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=structured_outputs_from_request(req),
        )
        if req.min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})",
                              "min_tokens")
        try:
            return SamplingParams(**kw)
        except ValueError as e:  # SamplingParams' messages start with the field they are about
            param = getattr(e, "param", None) or str(e).split(" ", 1)[0]
            raise bad_request(str(e), param if param.isidentifier() else None) from e

    async def compile_structured_outputs(self, prompts: list[Prompt]) -> None:
        """Compile each choice's constraint on a worker thread (the engine caches it), so a schema, regex or
        grammar that does not compile is a 400 before any response header, and the engine thread never
        compiles."""
        manager = getattr(self.engine, "structured_output", None)
        specs = {id(c.params.structured_outputs): c.params.structured_outputs
                 for p in prompts for c in p.choices if c.params.structured_outputs is not None}
        if manager is None or not specs:
            return
        for spec in specs.values():
            try:
                await anyio.to_thread.run_sync(manager.compile, spec)
            except InvalidRequestError as e:
                raise bad_request(e.message, e.param) from None

    # -- draining ----------------------------------------------------------------------------------

    def start_drain(self, timeout: float) -> None:
        """SIGTERM: refuse new work (/health 503) and, a little before the HTTP server's own graceful
        timeout cuts connections, end every request still running with an error (``expire_drain``).
        Call on the event loop."""
        self.draining = True
        grace = min(DRAIN_GRACE_S, timeout / 10)
        asyncio.get_running_loop().call_later(max(timeout - grace, 0.0), self.expire_drain)

    def expire_drain(self) -> None:
        """The drain timeout ran out: every request waiting for the engine ends now, a stream with an error
        event and [DONE], any other with a 503 (``run`` raises ``drain_error``)."""
        self.drain_expired = True
        for task in list(self._awaiting_engine):
            self._interrupted.add(task)
            task.cancel()

    def drain_error(self) -> APIError:
        return APIError(503, "the server is shutting down and its drain timeout (--drain-timeout) ran out before "
                             "this request finished", code="draining")

    async def _next_output(self, source: AsyncIterator[T]) -> T:
        """``source``'s next item; a drain timeout interrupts only this wait (never a write to the client)."""
        if self.drain_expired:
            raise self.drain_error()
        task = asyncio.current_task()
        self._awaiting_engine.add(task)
        try:
            return await source.__anext__()
        except asyncio.CancelledError:
            if task not in self._interrupted:
                raise
            self._interrupted.discard(task)
            task.uncancel()
            raise self.drain_error() from None
        finally:
            self._awaiting_engine.discard(task)

    # -- running -----------------------------------------------------------------------------------

    async def run(self, prompts: list[Prompt]) -> AsyncIterator[tuple[Choice, Any, Any]]:
        """Run every choice of every prompt in the engine; yield (choice, CompletionOutput, RequestOutput)
        as outputs arrive. However the consumer stops (finish, error, disconnect, cancel), every engine
        request that has not finished is aborted before this returns, so its KV blocks are freed."""
        work = [(p, c) for p in prompts for c in p.choices]
        source = self._single(*work[0]) if len(work) == 1 else self._merged(work)
        try:
            while True:
                try:
                    c, out = await self._next_output(source)
                except StopAsyncIteration:
                    break
                comp = out.outputs[0]
                c.tracker.on_output(len(comp.token_ids), getattr(out, "metrics", None))
                if out.finished or comp.finish_reason is not None:
                    c.finished = True
                    c.tracker.on_finish(comp.finish_reason, getattr(out, "metrics", None))
                yield c, comp, out
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled stream must still clean up
                await source.aclose()  # closing the engine's generate() aborts there too
                for p in prompts:
                    trackers = [c.tracker for c in p.choices]
                    if all(c.finished for c in p.choices) and not any(t.aborted for t in trackers):
                        self.metrics.on_prompt_finished(trackers)
                for _, c in work:
                    if not c.finished and not c.failed:
                        c.tracker.on_finish("abort")
                        try:
                            await self.engine.abort(c.request_id)
                        except Exception as e:  # already gone is fine
                            log.debug("abort %s: %s", c.request_id, e)

    def log_request(self, p: Prompt, c: Choice) -> None:
        """--enable-log-requests (vLLM's): one line per engine request, the prompt cut to --max-log-len
        characters and token ids."""
        if not self.args.enable_log_requests:
            return
        n = self.args.max_log_len
        text = p.text if n is None or p.text is None else p.text[:n]
        ids = p.token_ids if n is None else p.token_ids[:n]
        log.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", c.request_id, text,
                 c.params, ids)

    async def _single(self, p: Prompt, c: Choice) -> AsyncIterator[tuple[Choice, Any]]:
        """n = 1, one prompt (the common case): the engine's stream as is, no extra task or queue hop."""
        self.log_request(p, c)
        gen = self.engine.generate(p.token_ids, c.params, c.request_id, prompt=p.text)
        try:
            async for out in gen:
                yield c, out
        except Exception:
            self._failed(c)
            raise
        finally:
            await gen.aclose()

    async def _merged(self, work: list[tuple[Prompt, Choice]]) -> AsyncIterator[tuple[Choice, Any]]:
        """Several engine requests as one stream, in arrival order: a pump task per request."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(p: Prompt, c: Choice) -> None:
            self.log_request(p, c)
            try:
                async for out in self.engine.generate(p.token_ids, c.params, c.request_id, prompt=p.text):
                    await queue.put((c, out, None))
            except Exception as e:  # forwarded to the consumer
                self._failed(c)
                await queue.put((c, None, e))
            else:
                await queue.put((c, None, StopAsyncIteration()))

        tasks = [asyncio.ensure_future(pump(p, c)) for p, c in work]
        try:
            remaining = len(tasks)
            while remaining:
                c, out, exc = await queue.get()
                if isinstance(exc, StopAsyncIteration):
                    remaining -= 1
                elif exc is not None:
                    raise exc
                else:
                    yield c, out
        finally:
            for t in tasks:  # cancelling a pump closes its generate(), which aborts in the engine
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def _failed(c: Choice) -> None:
        """The engine raised for this request (never accepted, or failed): it holds nothing to abort."""
        c.failed = True
        c.tracker.on_finish("abort")

    async def collect(self, prompts: list[Prompt]) -> list["Accumulated"]:
        """Run to completion (non-streaming): every choice's text, token count, logprobs, finish."""
        accs = {c.index: Accumulated() for p in prompts for c in p.choices}
        async with contextlib.aclosing(self.run(prompts)) as outputs:
            async for c, comp, _out in outputs:
                acc = accs[c.index]
                acc.text.append(comp.text)
                acc.token_ids.extend(comp.token_ids)
                if comp.logprobs:
                    acc.logprobs.extend(comp.logprobs)
                if comp.finish_reason is not None:
                    acc.finish_reason, acc.stop_reason = comp.finish_reason, comp.stop_reason
                if acc.prompt_logprobs is None and getattr(_out, "prompt_logprobs", None):
                    acc.prompt_logprobs = _out.prompt_logprobs
        return [accs[i] for i in sorted(accs)]


@dataclass(slots=True)
class Accumulated:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list | None = None      # vLLM's [None, {token: Logprob}, ...] when asked for
