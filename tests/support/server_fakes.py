"""A scripted stand-in for AsyncLLMEngine (same interface, docs/design.md "Async front") and an
in-process uvicorn fixture, so the server's protocol, error and cancellation paths are tested in
milliseconds and deterministically. The real engine is driven by tests/server/test_server_e2e.py.

No tests here: the server tests import this module (and support/servers.py builds their ``server`` on it).
"""
from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from jaxserve.errors import InvalidRequestError, QueueFullError
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


EOS_ID = 256         # the byte tokenizer's <|endoftext|>


def byte_tokenizer():
    """A real HF fast tokenizer: one token per byte (ids 0..255) plus ChatML specials (256..258)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in _bytes_to_unicode().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", chat_template=CHATML)
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def next_token(prev: int, step: int, seed: int | None) -> int:
    """Lower-case letters and spaces, a pure function of (prev, step, seed): greedy is reproducible."""
    x = (prev * 31 + step * 7 + (seed or 0) * 13) % 27
    return 32 if x == 26 else 97 + x


@dataclass
class FakeEngine:
    """AsyncLLMEngine's interface. Prompts steer it: 'FAIL_AT_START' raises before any output,
    'FAIL_MIDSTREAM' raises after two tokens, 'SLOW' waits `slow_delay` per token, 'LATE' waits
    `late_first_token` before its first token, 'GRAMMAR_FAILS_AT_<k>' ends with finish_reason "error" (a
    failed grammar matcher) after k tokens."""
    max_model_len: int = 256
    served_model_name: str = "fake-model"
    token_delay: float = 0.0
    slow_delay: float = 0.05
    late_first_token: float = 3.0
    max_waiting: int | None = None
    healthy: bool = True
    dead: bool = False          # AsyncLLMEngine.dead: the loop died (the tests set it)
    tokenizer: object = field(default_factory=byte_tokenizer)
    chat_template: str | None = CHATML
    max_logprobs: int = 20
    running: dict = field(default_factory=dict)        # request id -> blocks held
    params_seen: dict = field(default_factory=dict)    # request id -> SamplingParams
    prompts_seen: dict = field(default_factory=dict)   # request id -> prompt token ids
    aborted: list = field(default_factory=list)
    finished: list = field(default_factory=list)
    num_kv_blocks: int = 64

    def facts(self):
        """The EngineFacts the front end reads of a scripted engine: a beam search's EOS ids (the byte tokenizer's
        <|endoftext|>), no images."""
        return SimpleNamespace(eos_token_ids=(EOS_ID,), is_multimodal=False)

    def stats(self) -> dict:
        from jaxserve.runner.stats import RunnerStats
        used = sum(self.running.values())
        steps = RunnerStats(steps=3, tokens=1 + 8 + 100, token_buckets=[1, 1, 0, 0, 0, 1] + [0] * 8)
        return {"num_running": len(self.running), "num_waiting": 0, "kv_cache_usage": used / self.num_kv_blocks,
                "prefix_cache_queries": 10, "prefix_cache_hits": 4, "prefix_cache_hit_rate": 0.4,
                "num_preemptions": 0, "num_kv_blocks": self.num_kv_blocks, **steps.snapshot(),
                "spec_decode_num_drafts": 5, "spec_decode_num_draft_tokens": 15, "spec_decode_num_accepted_tokens": 9,
                "spec_decode_num_accepted_tokens_per_pos": [5, 3, 1]}

    def num_waiting(self) -> int:
        return 0

    def is_healthy(self) -> bool:
        return self.healthy

    def check_admission(self, num_requests: int = 1) -> None:
        if self.max_waiting is not None and len(self.running) + num_requests > self.max_waiting:
            raise QueueFullError(f"{len(self.running)} requests are running (fake limit {self.max_waiting})")

    async def abort(self, request_id: str) -> None:
        if self.running.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    async def embed(self, token_lists, **kw):
        raise InvalidRequestError("the loaded model does not support embeddings", param="model")

    async def generate(self, prompt_token_ids, sampling_params: SamplingParams, request_id: str, prompt=None, *,
                       priority: int = 0, cache_salt: str | None = None):
        assert sampling_params.output_kind is RequestOutputKind.DELTA
        if self.max_waiting is not None and len(self.running) >= self.max_waiting:
            raise QueueFullError(f"{len(self.running)} requests are running (fake limit {self.max_waiting})")
        if len(prompt_token_ids) + (sampling_params.max_tokens or 0) > self.max_model_len:
            raise InvalidRequestError("engine-side length check", param="prompt")
        text = prompt or self.tokenizer.decode(prompt_token_ids)
        if "FAIL_AT_START" in text:
            raise RuntimeError("scripted engine failure")
        self.params_seen[request_id] = sampling_params
        self.prompts_seen[request_id] = list(prompt_token_ids)
        self.running[request_id] = 1 + len(prompt_token_ids) // 16
        metrics = RequestMetrics(arrival_time=time.time())
        delay = self.slow_delay if "SLOW" in text else self.token_delay
        prev, step, done = prompt_token_ids[-1], 0, False
        try:
            while not done:
                await asyncio.sleep(self.late_first_token if step == 0 and "LATE" in text else delay)
                if request_id not in self.running:  # aborted
                    return
                if "FAIL_MIDSTREAM" in text and step == 2:
                    raise RuntimeError("scripted failure mid-stream")
                fails_at = re.search(r"GRAMMAR_FAILS_AT_(\d+)", text)
                if fails_at is not None and step == int(fails_at.group(1)):
                    self.running.pop(request_id, None)
                    yield RequestOutput(request_id, prompt, list(prompt_token_ids), None, [CompletionOutput(
                        0, "", [], None, None, "error", "the constraint is too complex for the grammar parser")],
                        True, metrics)
                    return
                tok = next_token(prev, step, sampling_params.seed)
                prev, step = tok, step + 1
                finish = "length" if step >= sampling_params.max_tokens else None
                lp = None
                if sampling_params.logprobs is not None:
                    k = max(sampling_params.logprobs, 1)
                    lp = [{tok: Logprob(-0.5, 1, chr(tok)), **{97 + j: Logprob(-1.0 - j, 2 + j, chr(97 + j))
                                                             for j in range(k) if 97 + j != tok}}]
                now = time.time()
                metrics.first_scheduled_time = metrics.first_scheduled_time or now
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
                if finish:
                    metrics.finished_time = now
                    done = True
                    self.running.pop(request_id, None)
                    self.finished.append(request_id)
                comp = CompletionOutput(0, chr(tok), [tok], None, lp, finish, None)
                plp = fake_prompt_logprobs(prompt_token_ids) if step == 1 and \
                    sampling_params.prompt_logprobs is not None else None
                yield RequestOutput(request_id, prompt, list(prompt_token_ids), plp, [comp], done, metrics)
        finally:
            if self.running.pop(request_id, None) is not None:  # consumer left early: the async front aborts
                self.aborted.append(request_id)


def fake_prompt_logprobs(prompt_token_ids) -> list:
    """vLLM's prompt_logprobs shape, a pure function of the prompt: None, then {token: Logprob} per token."""
    return [None] + [{t: Logprob(-1.0 - (t % 7) / 10, 1 + t % 3, chr(t) if t < 256 else SPECIALS[t - 256])}
                     for t in prompt_token_ids[1:]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessServer:
    """uvicorn serving build_app(engine) on a loopback port, in a thread of this process."""

    def __init__(self, engine, **server_args):
        import uvicorn

        from jaxserve.server.app import build_app
        from jaxserve.server.args import ServerArgs

        self.port = free_port()
        self.engine = engine
        self.api_key = server_args.get("api_key")
        self.app = build_app(engine, ServerArgs(port=self.port, **server_args))
        from jaxserve.server.http_protocol import timed_http_protocol
        args = self.app.state.serving.args
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, loop="asyncio",
                                http=timed_http_protocol(args.read_timeout),
                                log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("in-process server did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
