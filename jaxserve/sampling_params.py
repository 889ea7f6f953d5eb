"""Sampling parameters for text generation: vLLM's field names, defaults and validation.

Every invalid value raises `ValueError` with one line that names the field, the allowed range and the
value given, so the server can return it to the user as an HTTP 400 unchanged.
"""
from __future__ import annotations

import enum
import math
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS); above it but under _MIN_TEMPERATURE
# it is raised to _MIN_TEMPERATURE because logits / 1e-9 overflow float32.
_SAMPLING_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2
MAX_N = 1024
MAX_LOGIT_BIAS = 100.0      # OpenAI's range for a logit_bias value: [-100, 100]


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0   # every RequestOutput carries the whole output so far
    DELTA = 1        # only what is new since the last RequestOutput
    FINAL_ONLY = 2   # one RequestOutput, when the request finishes


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value: Any, limit: int = 200) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters (a request may send a long list)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + " ..."


def _token_id(key: Any) -> int | None:
    """A logit_bias key as a token id: an int >= 0 or its decimal string ("42"); None otherwise."""
    if _is_int(key):
        return key if key >= 0 else None
    if isinstance(key, str) and key.strip().isdecimal():
        return int(key)
    return None


SEED_LIMIT = 1 << 64


def check_seed(seed: Any, n: int = 1) -> None:
    """A request's seed: an integer in [0, 2^64) (-1 or None: no seed); with n > 1 choice i samples with
    seed + i, so seed + n - 1 must stay below 2^64. Raises ValueError naming the field."""
    if seed is None or seed == -1 and _is_int(seed):
        return
    if not _is_int(seed) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an integer in [0, 2^64) (or -1 / null for none), got {seed!r}")
    if seed + n > SEED_LIMIT:
        raise ValueError(f"seed + n must be at most 2^64 (choice i samples with seed + i), got seed {seed} "
                         f"and n {n}")


_TEXT_KINDS = ("json", "regex", "choice", "grammar", "structural_tag")     # the constraints given as a value


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's ``StructuredOutputsParams``): exactly one of

    - ``json``: a JSON schema (a dict, or its JSON text): the output is one JSON value that validates;
    - ``regex``: the output matches the regular expression (Rust ``regex`` syntax, anchored at both ends);
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: a Lark grammar (llguidance's dialect) or a GBNF / EBNF grammar;
    - ``json_object``: ``True``: the output is one JSON object (any keys);
    - ``structural_tag``: free text in which segments that start with a trigger follow their JSON schemas
      (vLLM's, xgrammar's first format: ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``,
      a dict or its JSON text; ``jaxserve.engine.structured_output.structural_tag``).

    ``disable_additional_properties`` (vLLM's name): ``True`` closes the JSON schema's objects (no keys they do
    not declare, unless they set ``additionalProperties``) whatever the engine's default (its
    ``--structured-outputs-config`` key of the same name; the default here is closed).
    ``reasoning_end_token_ids``: the token ids of a thinking model's end-of-thinking marker (``</think>``):
    the constraint holds only after the output contains them (the thinking part before is free); None: from
    the first token.

    The engine enforces it with a token mask per step (``jaxserve.engine.structured_output``); the grammar
    is compiled when the request is accepted, so a bad one is a ``ValueError`` (HTTP 400) naming the problem.
    """
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_additional_properties: bool = False
    reasoning_end_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        given = [name for name in _TEXT_KINDS if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object, "
                             f"structural_tag; got {', '.join(given) if given else 'none'}")
        for name, types, what in (("json", (dict, bool), "a JSON schema (an object)"),
                                  ("structural_tag", (dict,), "an object with structures and triggers")):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.{name} is not valid JSON: {e}") from None
                setattr(self, name, value)
            if value is not None and not isinstance(value, types):
                raise ValueError(f"structured_outputs.{name} must be {what}, got {value!r:.80}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings, "
                                 f"got {self.choice!r}")
            if any(not isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must hold strings only, got {self.choice!r}")
            self.choice = list(self.choice)
        if not isinstance(self.disable_additional_properties, bool):
            raise ValueError("structured_outputs.disable_additional_properties must be a boolean, "
                             f"got {self.disable_additional_properties!r}")
        marker = self.reasoning_end_token_ids
        if marker is not None:
            if not isinstance(marker, (list, tuple)) or not marker or any(not _is_int(t) or t < 0 for t in marker):
                raise ValueError("structured_outputs.reasoning_end_token_ids must be a non-empty list of token ids, "
                                 f"got {marker!r}")
            self.reasoning_end_token_ids = list(marker)

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar", "structural_tag" or "json_object"."""
        for name in _TEXT_KINDS:
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def spec(self) -> str:
        """The constraint as one canonical string (with ``kind``: the key of the compiled-grammar cache)."""
        kind = self.kind
        if kind in ("json", "structural_tag"):
            return json.dumps(getattr(self, kind), sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return json.dumps(self.choice)
        if kind == "json_object":
            return ""
        return getattr(self, kind)


@dataclass
class SamplingParams:
    """How to sample the output of one request (vLLM's `SamplingParams`, same names and defaults).

    `top_k` 0 or -1 and `top_p` 1 and `min_p` 0 mean "off"; `temperature` 0 means greedy (then top-k/p
    and min-p are reset to off, as in vLLM). `seed` makes a request reproducible whatever batch it runs in.

    Token restrictions, applied on the device before sampling (``jaxserve.runner.sampler``): `logit_bias`
    ({token id: bias in [-100, 100]} added to the logits), `allowed_token_ids` (only these may be sampled),
    `bad_words` (words never generated: the engine tokenizes each with and without a leading space, as vLLM;
    a one-token word is always blocked, a longer one's last token when the output ends with the rest).
    """
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Set by the engine (update_from_generation_config, update_from_tokenizer), not by users.
    eos_token_id: int | None = field(default=None, init=False, repr=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.seed == -1:   # the OpenAI-style "no seed"
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))   # dedupe, keep order
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.top_k == -1:
            self.top_k = 0
        self._normalise_token_restrictions()
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters cannot change an argmax, so turn them off (keeps the sampler on its fast path).
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        elif self.temperature < _MIN_TEMPERATURE:
            self.temperature = _MIN_TEMPERATURE
        self._all_stop_token_ids.update(self.stop_token_ids)

    # ---- validation -------------------------------------------------------------------------------
    def _normalise_token_restrictions(self) -> None:
        """logit_bias keys as ints (OpenAI sends them as strings, vLLM takes both) and values as floats;
        allowed_token_ids and bad_words as lists. Raises naming the field and the offending entry."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a map of token id to bias, got {_shown(self.logit_bias)}")
            bias: dict[int, float] = {}
            for token, value in self.logit_bias.items():
                tid = _token_id(token)
                if tid is None:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {_shown(token)}")
                if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {_shown(value)} for token "
                                     f"{tid}")
                bias[tid] = float(value)
            self.logit_bias = bias
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not ids or any(not _is_int(t) or t < 0 for t in ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids (integers >= 0), "
                                 f"got {_shown(ids)}")
            self.allowed_token_ids = list(dict.fromkeys(ids))
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or any(not isinstance(w, str) or not w.lstrip() for w in words):
                raise ValueError(f"bad_words must be a list of words (non-blank strings), got {_shown(words)}")
            self.bad_words = list(words)

    def _verify(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an integer in [1, {MAX_N}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise bad(name, "a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not math.isfinite(self.repetition_penalty) \
                or self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "a finite number > 0 (1 = off)")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature):
            raise bad("temperature", "a finite number in [0, 2]")
        if self.temperature < 0.0:
            raise bad("temperature", ">= 0 (0 = greedy)")
        if self.temperature > 2.0:
            raise bad("temperature", "<= 2")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1] (1 = off)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an integer >= 1, or 0 or -1 to consider all tokens")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1] (0 = off)")
        check_seed(self.seed, self.n)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 (or None for up to max_model_len)")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise bad(name, "None, an integer >= 0, or -1 for the whole vocabulary")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        for i, s in enumerate(self.stop):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:     # a lone surrogate ("\ud800"): no text the model writes holds it
                raise ValueError(f"stop[{i}] holds a lone surrogate ({s[e.start]!r} at {e.start}): a stop string "
                                 "must be valid Unicode text") from None
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True; set detokenize=True or remove stop")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), "
                             f"got {self.stop_token_ids!r}")
        if self.truncate_prompt_tokens is not None and \
                (not _is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < -1
                 or self.truncate_prompt_tokens == 0):
            raise bad("truncate_prompt_tokens", "None, an integer >= 1, or -1 for max_model_len")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind "
                             f"({', '.join(k.name for k in RequestOutputKind)}), got {self.output_kind!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, "
                             f"got {type(self.structured_outputs).__name__}")
        if self.n > 1 and self.temperature < _SAMPLING_EPS:
            raise ValueError(f"n must be 1 when temperature is 0 (greedy sampling), got {self.n}")

    # ---- what the engine and the sampler read ------------------------------------------------------
    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def uses_penalties(self) -> bool:
        """Whether a presence/frequency/repetition penalty is on, as the sampler sees it (float32): sampling
        then needs the request's real token history on the host."""
        f32 = np.float32
        return bool(f32(self.presence_penalty) != 0 or f32(self.frequency_penalty) != 0
                    or f32(self.repetition_penalty) != 1)

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling reads the request's real output tokens on the host: a penalty, or a bad word of
        several tokens (its last token is blocked only after the others)."""
        return self.uses_penalties or any(len(w) > 1 for w in self._bad_words_token_ids or ())

    @property
    def restricts_tokens(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad_words change which tokens the sampler may draw."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words)

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """The token sequences bad_words stands for (after update_from_tokenizer; vLLM's name)."""
        return self._bad_words_token_ids

    @property
    def all_stop_token_ids(self) -> set[int]:
        """stop_token_ids plus the model's eos ids (after update_from_generation_config): the ids that
        min_tokens keeps the sampler from producing. Includes eos even with ignore_eos, as in vLLM."""
        return self._all_stop_token_ids

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a stream holds back so it never emits text that a stop string later cuts."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    def update_from_generation_config(self, generation_config: dict[str, Any] | None,
                                      eos_token_id: int | None = None) -> None:
        """Learn the model's eos ids. `eos_token_id` (the tokenizer's) stops the request unless
        ignore_eos; other eos ids from generation_config join stop_token_ids (unless ignore_eos); all of
        them join all_stop_token_ids (blocked while min_tokens is not reached)."""
        if not self.ignore_eos:
            self.eos_token_id = eos_token_id
        if eos_token_id is not None:
            self._all_stop_token_ids.add(eos_token_id)
        eos_ids = (generation_config or {}).get("eos_token_id")
        if eos_ids is None:
            return
        eos_ids = {eos_ids} if _is_int(eos_ids) else set(eos_ids)
        eos_ids.discard(eos_token_id)
        if eos_ids:
            self._all_stop_token_ids.update(eos_ids)
            if not self.ignore_eos:
                self.stop_token_ids = list(dict.fromkeys([*self.stop_token_ids, *sorted(eos_ids)]))

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize bad_words as vLLM does: each word without a leading space, and with one when that
        spells it with a different first token and as many tokens (the word inside a text)."""
        if not self.bad_words:
            return
        sequences: list[list[int]] = []
        for word in self.bad_words:
            word = word.lstrip()
            bare = list(tokenizer.encode(word, add_special_tokens=False))
            if not bare:
                from jaxserve.errors import InvalidRequestError
                raise InvalidRequestError(f"bad_words entries must spell at least one token, got {word!r}",
                                          param="bad_words")
            sequences.append(bare)
            spaced = list(tokenizer.encode(" " + word, add_special_tokens=False))
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        self._bad_words_token_ids = sequences

    def clone(self) -> "SamplingParams":
        """A copy the engine can mutate (update_from_generation_config) without touching the caller's."""
        import copy
        return copy.deepcopy(self)


def check_logprobs(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """Called by the engine before a request enters the queue (vLLM's --max-logprobs, default 20;
    -1 = no limit). Raises InvalidRequestError (a ValueError) naming the field and the limit."""
    from jaxserve.errors import InvalidRequestError

    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is None:
            continue
        wanted = vocab_size if value == -1 else value
        if max_logprobs != -1 and wanted > max_logprobs:
            raise InvalidRequestError(
                f"{name} must be <= {max_logprobs} (the server's --max-logprobs), got {value}", param=name)
        if wanted > vocab_size:
            raise InvalidRequestError(f"{name} must be <= the vocabulary size {vocab_size}, got {value}",
                                      param=name)


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Called by the engine before a request enters the queue: logit_bias and allowed_token_ids name tokens
    of the model's vocabulary. Raises InvalidRequestError naming the field and the ids outside it."""
    from jaxserve.errors import InvalidRequestError

    for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids)):
        bad = [t for t in ids or () if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"{name} has token ids outside the vocabulary (size {vocab_size}): "
                                      f"{bad[:10]}{' ...' if len(bad) > 10 else ''}", param=name)


@dataclass
class BeamSearchParams:
    """How to beam-search the output of a prompt (vLLM's ``BeamSearchParams``, same names and defaults):
    ``beam_width`` beams, at most ``max_tokens`` generated tokens each; a beam's score is its summed logprob
    over its generated length (EOS counted) to the power ``length_penalty`` (> 0 favours longer beams, < 0
    shorter ones). ``temperature`` only picks the token each one-token step samples, which beam search does
    not use; ``include_stop_str_in_output`` keeps a finished beam's EOS in the server's ``token_ids``."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be a number in [0, 2], got {self.temperature!r}")
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
