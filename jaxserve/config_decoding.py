"""The decoding sections of the engine configuration (``jaxserve.config`` re-exports them): the limits and
settings of structured outputs (``--structured-outputs-config``) and speculative decoding
(``--speculative-config``), both given as one JSON object."""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from jaxserve.options import json_dict

@dataclass(frozen=True)
class StructuredOutputsLimits:
    """What one request's constraint may ask of the grammar compiler (each a key of
    ``--structured-outputs-config``; ``jaxserve.engine.structured_output.limits`` checks them).

    - ``max_constraint_bytes``: the constraint's text in UTF-8 bytes (a JSON schema as compact JSON, a
      grammar, a regex, a choice list as JSON).
    - ``max_json_schema_depth``: how deep a JSON schema nests, counting every JSON object and array of the
      schema document and reading each ``$ref`` as if its definition were written in place (a definition
      that refers back to itself counts once). OpenAI's 10 levels of nested objects are about 30 here.
    - ``max_json_schema_properties``: properties declared in a JSON schema, all objects together (OpenAI's).
    - ``max_json_enum_values``: ``enum`` entries in a JSON schema, all enums together.
    - ``max_choice_options``: strings of a ``choice`` constraint.
    - ``max_grammar_rules``: rule and terminal definitions of a grammar (Lark or GBNF).
    - ``max_tools``: tools of one chat request (OpenAI's).
    - ``max_tool_parameters``: properties of one tool's ``parameters`` schema.
    - ``max_parser_row_items``: llguidance's ``max_items_in_row``, the most items one row of the Earley
      parser may hold while it generates. An object with optional properties needs about four items per
      optional property in one row, so this also bounds optional properties per object (checked before the
      compile); a grammar that reaches it anyway ends its request with an error. Raising it admits larger
      objects at the cost of slower mask steps for such requests.
    - ``compile_timeout_s``: a grammar's compile time budget in seconds; over it the request is refused.
    - ``grammar_cache_bytes``: memory kept for compiled grammars (least recently used dropped first).
    """
    max_constraint_bytes: int = 1 << 20
    max_json_schema_depth: int = 128
    max_json_schema_properties: int = 5000
    max_json_enum_values: int = 10_000
    max_choice_options: int = 10_000
    max_grammar_rules: int = 5000
    max_tools: int = 128
    max_tool_parameters: int = 500
    max_parser_row_items: int = 2000
    compile_timeout_s: float = 10.0
    grammar_cache_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        for f in dataclasses.fields(StructuredOutputsLimits):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"structured-outputs limit {f.name} must be a positive number, got {value!r}")

    @classmethod
    def from_config(cls, config: Any) -> "StructuredOutputsLimits":
        """The limits an object's same-named attributes set (a ``StructuredOutputsConfig``, a namespace);
        the defaults for those it lacks."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls) if hasattr(config, f.name)})

    @property
    def max_optional_properties(self) -> int:
        """Optional properties one object may declare: each takes about four parser items in the row that
        chooses the next key, beside a few of the object's own."""
        return max((self.max_parser_row_items - 8) // 4, 1)


@dataclass(frozen=True)
class StructuredOutputsConfig(StructuredOutputsLimits):
    """vLLM's ``--structured-outputs-config``: its keys flat in one JSON object, the limits
    (``StructuredOutputsLimits``) beside ``backend`` and ``disable_any_whitespace``.
    ``disable_any_whitespace`` (default True here; vLLM's is False): JSON is generated with compact separators
    and no free whitespace, so a model cannot loop on whitespace until max_tokens; False allows any JSON
    whitespace between tokens. ``disable_additional_properties`` (default True here; vLLM's xgrammar backend is
    strict too): a JSON schema's objects (``response_format``, ``structured_outputs.json``, named and required
    tool calls) allow no keys they do not declare unless they set ``additionalProperties``; False leaves them
    open except where the request says ``strict: true``. ``backend``: llguidance is the one backend ("auto" and
    "guidance" both name it)."""
    backend: str = "auto"
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = True

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "guidance"):
            raise ValueError(f"structured outputs backend must be 'auto' or 'guidance' (llguidance), "
                             f"got {self.backend!r}")
        super().__post_init__()

    @classmethod
    def from_json(cls, value: str) -> "StructuredOutputsConfig":
        """The flag's JSON (an argparse type: a bad value is a usage error that says why)."""
        try:
            return cls(**json.loads(value))
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(f"--structured-outputs-config: {e}") from None


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "deepseek_mtp")
# the methods whose proposer reads the target's hidden states (its steps return them)
HIDDEN_STATE_METHODS = ("eagle", "eagle3", "deepseek_mtp")
# vLLM's methods not served here, each with what it is (refused by name)
UNSUPPORTED_SPECULATIVE_METHODS = {"medusa": "Medusa heads", "mlp_speculator": "MLP speculators"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config``: ``method`` proposes ``num_speculative_tokens`` tokens per request and
    step, which the target verifies in one step (``jaxserve.engine.speculator``). ``ngram``: prompt lookup, the
    tokens after the latest earlier occurrence of the sequence's last ``prompt_lookup_min`` ..
    ``prompt_lookup_max`` tokens (the longest that occurs; both default to 5, or to each other when one is
    given, as vLLM). ``draft_model``: a smaller ``model`` sharing the target's tokenizer, run greedily.
    ``eagle``: an EAGLE-1 head's folder as ``model`` (``models.eagle``), run greedily on the target's hidden
    states; ``eagle3``: an EAGLE-3 head's folder (``models.eagle3``), likewise on the hidden states of three
    of the target's layers; ``deepseek_mtp``: a DeepSeek target's own multi-token-prediction layer, likewise
    (``model``: the target's folder, its default)."""
    method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        method = self.method or ("draft_model" if self.model else None)
        if method in UNSUPPORTED_SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {method!r} ({UNSUPPORTED_SPECULATIVE_METHODS[method]}) is not "
                             f"supported; supported: {', '.join(SPECULATIVE_METHODS)}")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got "
                             f"{self.method!r}")
        object.__setattr__(self, "method", method)
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {k!r}")
        if method == "ngram":
            if self.model is not None:
                raise ValueError("the ngram method takes no model (draft_model does)")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = 5
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(f"prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max, "
                                 f"got {lo!r} and {hi!r}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif not self.model and method != "deepseek_mtp":
            raise ValueError(f"the {method} method needs a model (" + (
                "the EAGLE head's folder)" if method == "eagle" else "the EAGLE-3 head's folder)"
                if method == "eagle3" else "a path or configs/models name)"))

    @classmethod
    def coerce(cls, value: Any) -> "SpeculativeConfig | None":
        """A config from a JSON object's text, a dict (LLM keyword arguments, YAML) or a config; None stays None."""
        if value is None or isinstance(value, cls):
            return value
        fields = json_dict(value)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**fields)

    @classmethod
    def from_json(cls, value: str) -> "SpeculativeConfig":
        """The flag's JSON (an argparse type: a bad value is a usage error that says why)."""
        try:
            return cls.coerce(value)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(f"--speculative-config: {e}") from None
