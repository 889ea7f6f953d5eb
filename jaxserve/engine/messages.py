"""The messages between the front end and the engine core process (msgspec Structs, msgpack on ZMQ sockets).

Front end → core: ``EngineCoreRequest`` (a validated request; ``AddRequests``: several), ``AbortRequests``, ``EmbedCall``, ``Shutdown``.
Core → front end: ``EngineCoreOutputs`` (one per step: each request's new token ids, finish status, raw
logprobs, and the core's stats), ``EmbedResult``, ``CoreReady`` (once, after load and warm-up), ``CoreFailed``.
No text crosses: the front end detokenizes, matches stop strings and builds the RequestOutputs (the
in-process engine hands the same ``EngineCoreOutput``s from its core to its front end, unencoded). Structs
are ``array_like`` (encoded as msgpack arrays, not maps) and tagged, so one decoder reads any message of a
side.

The sampling parameters travel pickled (a dataclass with derived, non-init fields; once per request, not per
step); so do the facts of ``CoreReady`` (the tokenizer, the model config: once per process).
"""
from __future__ import annotations

import io
import pickle

import msgspec
import numpy as np

# Raw logprobs of one sampled position, as the runner reads them: (logprob, rank, top ids, top logprobs).
RawLogprobs = tuple[float, int, list[int], list[float]]


class EngineCoreRequest(msgspec.Struct, array_like=True, tag=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: bytes            # pickle of the SamplingParams the front end validated
    arrival_time: float
    sampling_seed: int
    priority: int = 0
    cache_salt: str | None = None
    mm_features: bytes | None = None  # pickle of the prompt's ImageFeatures, their pixel arrays out of band:
    lora_request: tuple[str, int, str] | None = None   # its LoRA adapter: (name, id, path)
    mm_buffers: list[memoryview] | None = None        # ... the arrays' bytes (``dump_features``)


def dump_features(features: list) -> tuple[bytes, list[memoryview]]:
    """A prompt's ImageFeatures as ``EngineCoreRequest``'s ``mm_features`` and ``mm_buffers``: pickle protocol 5
    with each contiguous array's bytes out of band, so the arrays are copied once, into the message (not into
    a pickle and again into the message). numpy pickles an array of a dtype it does not define (bfloat16,
    ml_dtypes') in band: such an array goes as its bytes' unsigned view, viewed back on arrival."""
    buffers: list = []
    out = io.BytesIO()
    _OutOfBandPickler(out, protocol=5, buffer_callback=buffers.append).dump(features)
    return out.getvalue(), [b.raw() for b in buffers]


def load_features(data: bytes, buffers: list[memoryview] | None) -> list:
    """``dump_features``' features again: the arrays are read-only views of ``buffers`` (of the received
    message, which they keep alive), not copies."""
    return pickle.loads(data, buffers=buffers or ())


class _OutOfBandPickler(pickle.Pickler):
    def reducer_override(self, obj):
        if type(obj) is np.ndarray and obj.dtype.isbuiltin == 2 and obj.flags.c_contiguous:
            return _viewed_as, (obj.view(f"u{obj.dtype.itemsize}"), obj.dtype)
        return NotImplemented


def _viewed_as(raw: np.ndarray, dtype) -> np.ndarray:
    return raw.view(dtype)


class AddRequests(msgspec.Struct, array_like=True, tag=True, gc=False):
    """Several requests the core queues before its next step (LLM.generate's batch: the core schedules it
    as the in-process engine would, not split by when each message arrived)."""
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, array_like=True, tag=True, gc=False):
    request_ids: list[str]


class EmbedCall(msgspec.Struct, array_like=True, tag=True, gc=False):
    call_id: int
    prompt_token_ids: list[list[int]]
    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None


class Shutdown(msgspec.Struct, array_like=True, tag=True, gc=False):
    pass


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's news from one step. ``finish_status``: a finished RequestStatus value (0 = running);
    ``stop_reason``: the stop token id (None for EOS), or with FINISHED_ERROR the message; ``logprobs``: one RawLogprobs per new token, when the
    request asked for them; the rest are sent once, with the request's first output (which alone has a
    ``first_token_time``)."""
    request_id: str
    new_token_ids: list[int]
    finish_status: int = 0
    stop_reason: int | str | None = None
    logprobs: list[RawLogprobs] | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # the prompt's logprobs (the core's scorer decodes them): per position None or {token id: (logprob,
    # rank, text)}
    prompt_logprobs: list[dict[int, tuple[float, int | None, str | None]] | None] | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, tag=True, gc=False):
    outputs: list[EngineCoreOutput]
    stats: dict | None = None           # the core's LLMEngine.stats(), every step


class EmbedResult(msgspec.Struct, array_like=True, tag=True, gc=False):
    call_id: int
    embeddings: bytes | None = None     # pickle of the list of vectors
    error: bytes | None = None          # pickle of the exception


class CoreReady(msgspec.Struct, array_like=True, tag=True, gc=False):
    facts: bytes                        # pickle of core.EngineFacts


class CoreFailed(msgspec.Struct, array_like=True, tag=True, gc=False):
    error: str                          # what stopped the core, for the front end's error messages
    exception: bytes | None = None      # pickle of the exception, when it pickles (a load error: re-raised)


ToCore = EngineCoreRequest | AddRequests | AbortRequests | EmbedCall | Shutdown
FromCore = EngineCoreOutputs | EmbedResult | CoreReady | CoreFailed
