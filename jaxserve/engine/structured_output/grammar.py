"""llguidance's side of structured outputs: its tokenizer, the grammar text of a constraint, the compile of
a template matcher (with its memory measured), and its error texts turned into messages a user can act on."""
from __future__ import annotations

import ctypes
import dataclasses
import json
import threading

from jaxserve.errors import InvalidRequestError

from .gbnf import gbnf_to_lark, is_gbnf
from .json_schema import close_objects
from .structural_tag import parse_structural_tag, structural_tag_lark
from .limits import NOUN_OF_KIND, PARAM_OF_KIND, StructuredOutputsLimits, over_limit

EXCERPT_CHARS = 300      # how much of a grammar a log line or an error message quotes


@dataclasses.dataclass(slots=True)
class CompiledGrammar:
    """A compiled constraint: the template matcher each request copies, a bound of the heap it holds (the
    grammar cache's measure of it) and the start of its text for log lines."""
    matcher: object
    nbytes: int
    kind: str
    excerpt: str


class GrammarBuilder:
    """The llguidance tokenizer (built on first use, once: it takes about a second) and the compile of one
    constraint to a template matcher. Thread-safe; ``compile`` is what the grammar compiler's workers run.

    ``vocab_size``: max(the model's vocab_size, len(tokenizer)) (some tokenizers are one longer than the
    config; llguidance needs every id the model can emit). ``disable_any_whitespace`` (vLLM's name): JSON
    uses compact separators and no free whitespace, so a model cannot loop on whitespace until max_tokens.
    ``disable_additional_properties`` (vLLM's name): a JSON schema's objects allow no undeclared keys unless
    they say so (``json_schema.close_objects``); off, only a constraint that asks for it is closed."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, *, disable_any_whitespace: bool = True,
                 disable_additional_properties: bool = True, limits: StructuredOutputsLimits | None = None):
        self.hf_tokenizer = tokenizer
        self.vocab_size = max(int(vocab_size), len(tokenizer))
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.disable_any_whitespace = disable_any_whitespace
        self.disable_additional_properties = disable_additional_properties
        self.limits = limits or StructuredOutputsLimits()
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._parser_limits = None

    def tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance
                # llguidance takes EOS ids from the tokenizer's own range only (dummy weights served with
                # another model's tokenizer have the config's EOS past it: the tokenizer's EOS stands in)
                eos = [t for t in self.eos_token_ids if t < len(self.hf_tokenizer)] \
                    or self.hf_tokenizer.eos_token_id
                self._ll_tokenizer = llguidance.LLTokenizer(
                    llguidance_tokenizer_json(self.hf_tokenizer), n_vocab=self.vocab_size, eos_token=eos)
                # verbose errors quote the parser state and the grammar: a runtime error could run to megabytes
                self._parser_limits = llguidance.LLParserLimits(
                    max_items_in_row=self.limits.max_parser_row_items, verbose_errors=False)
            return self._ll_tokenizer

    def grammar_text(self, params) -> str:
        """llguidance's grammar text for a StructuredOutputsParams."""
        import llguidance
        kind = params.kind
        if kind in ("json", "json_object"):
            # as JSON text (not the dict): llguidance's parser refuses a document nested past its recursion
            # limit, where converting the dict would recurse on the thread's stack; key order is kept
            schema = params.json
            if kind == "json" and (self.disable_additional_properties or params.disable_additional_properties):
                schema = close_objects(schema)
            schema = json.dumps(schema) if kind == "json" else '{"type": "object"}'
            options = {"whitespace_flexible": not self.disable_any_whitespace}
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            except ValueError as e:
                raise InvalidRequestError(f"invalid JSON schema: {e}", param="json_schema") from None
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            # one terminal whose alternatives are the options: the lexer matches them as one token class, where
            # a rule of alternatives puts every option in one parser row (slow to compile, and past the row
            # limit for large lists)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in params.choice))
        if kind == "structural_tag":
            close = self.disable_additional_properties or params.disable_additional_properties
            try:
                tag = parse_structural_tag(params.structural_tag)
            except ValueError as e:
                raise InvalidRequestError(str(e), param="structural_tag") from None
            if close:
                tag["structures"] = [{**s, "schema": close_objects(s["schema"])} for s in tag["structures"]]
            return llguidance.LLMatcher.grammar_from_lark(structural_tag_lark(
                tag, whitespace_flexible=not self.disable_any_whitespace))
        text = params.grammar
        if is_gbnf(text):           # converted in a child process (gbnf.py says why)
            try:
                text = gbnf_to_lark(text, self.limits.compile_timeout_s)
            except TimeoutError:
                budget = self.limits.compile_timeout_s
                raise over_limit("the grammar's compile time in seconds", f"more than {budget:g}",
                                 "compile_timeout_s", self.limits, "grammar") from None
        try:
            return llguidance.LLMatcher.grammar_from_lark(text)
        except ValueError as e:
            raise InvalidRequestError(f"invalid grammar: {e}", param="grammar") from None
        except RecursionError:
            raise InvalidRequestError("invalid grammar: nested too deeply to convert", param="grammar") from None

    def compile(self, params) -> CompiledGrammar:
        """The template matcher of a constraint. Raises InvalidRequestError naming the problem: an invalid
        schema, a schema keyword llguidance cannot enforce, a regex or grammar that does not compile, a
        grammar too large for llguidance."""
        import llguidance
        tokenizer = self.tokenizer()
        text = self.grammar_text(params)
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=self._parser_limits)
        if matcher.is_error():
            raise InvalidRequestError(describe_compile_error(params.kind, matcher.get_error()),
                                      param=PARAM_OF_KIND[params.kind])
        return CompiledGrammar(matcher, grammar_bytes(params.kind, len(text)), params.kind, excerpt(params.spec))


# ---------------------------------------------------------------------------------------------- memory
# A compiled grammar's heap, bounded from above by its llguidance grammar text: a constant (the tokenizer-
# sized tables every matcher holds) plus bytes per text byte, for the most compact kind (a choice list: one
# terminal) and for any other (JSON schemas with many optional properties are the least compact measured).
# tests/engine/test_grammar_compiler.py measures the allocator's in-use bytes against it.
GRAMMAR_BASE_BYTES = 192 << 10
BYTES_PER_TEXT_BYTE = {"choice": 16}
BYTES_PER_TEXT_BYTE_OTHER = 192


def grammar_bytes(kind: str, text_len: int) -> int:
    """The grammar cache's measure of a compiled grammar (an upper bound of the heap it holds). Computed,
    not measured: the allocator's statistics walk every free chunk under the arenas' locks."""
    return GRAMMAR_BASE_BYTES + BYTES_PER_TEXT_BYTE.get(kind, BYTES_PER_TEXT_BYTE_OTHER) * text_len


def _malloc_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim
        trim.argtypes = [ctypes.c_size_t]
        return trim
    except (OSError, AttributeError):      # not glibc
        return None


_MALLOC_TRIM = _malloc_trim()


def release_free_heap() -> None:
    """Give the allocator's free pages back to the system (after the cache dropped large grammars, whose
    freed chunks would otherwise stay resident in the arenas)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


# ---------------------------------------------------------------------------------------------- messages
def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """The start of a (possibly huge) text, for a log line or a message."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _first_line(error: str) -> str:
    """An llguidance error without the state dump or backtrace that may follow it."""
    error = error.strip()
    for cut in ("\n<", "\n"):
        error = error.split(cut, 1)[0]
    return excerpt(error)


def describe_compile_error(kind: str, error: str) -> str:
    """llguidance's compile error as a message that says which constraint it is about."""
    error = error.strip()
    if error.startswith("panic:"):          # an assertion inside llguidance, e.g. more symbols than it indexes
        return f"the {NOUN_OF_KIND[kind]} is too large for the grammar compiler ({_first_line(error)[7:]})"
    error = excerpt(error, 2000)
    if kind in ("json", "json_object"):
        if "Unimplemented" in error or "unsupported" in error.lower():
            return f"the JSON schema uses a feature structured outputs cannot enforce: {error}"
        return f"invalid JSON schema: {error}"
    if kind == "regex":
        return f"the regex does not compile: {error}"
    if kind == "choice":
        return f"invalid choice list: {error}"
    if kind == "structural_tag":
        return f"the structural tag does not compile: {error}"
    return f"the grammar does not compile: {error}"


# llguidance's runtime error texts -> the limit each one means
_RUNTIME_LIMITS = (
    ("items; max is", "max_parser_row_items (llguidance's max_items_in_row)"),
    ("Too many items", "llguidance's step_max_items"),
    ("fuel", "llguidance's lexer fuel"),
    ("too many expressions", "llguidance's max_lexer_states"),
    ("panic:", "an llguidance internal limit"),
)


def describe_runtime_error(error: str) -> tuple[str, str]:
    """(the limit, a one-line message) for a matcher that failed while generating: a grammar too complex
    for the parser's per-step limits, or a token outside the grammar (which the mask prevents)."""
    for needle, limit in _RUNTIME_LIMITS:
        if needle in error:
            return limit, f"the constraint is too complex for the grammar parser ({limit}): {_first_line(error)}"
    return "grammar", f"the constraint's matcher failed: {_first_line(error) or 'unknown error'}"


# ---------------------------------------------------------------------------------------------- tokenizer
def llguidance_tokenizer_json(tokenizer) -> str:
    """The HF fast tokenizer's ``tokenizer.json`` as llguidance reads it (what ``llguidance.hf.from_tokenizer``
    passes, without padding or truncation), with one repair: a byte-level BPE (ByteLevel pre-tokenizer) whose
    decoder is a Sequence that also holds sentencepiece steps (ByteFallback, Replace "▁": what GGUF
    conversions write) gets the plain ByteLevel decoder. llguidance reads the token bytes from the decoder's
    shape, and took such a vocabulary's "Ġ" as a literal character instead of a space."""
    import copy

    backend = copy.copy(getattr(tokenizer, "backend_tokenizer", None))
    if backend is None:
        raise InvalidRequestError("structured outputs need a fast (Rust) Hugging Face tokenizer",
                                  param="structured_outputs")
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())

    def byte_level(node) -> dict | None:
        if not isinstance(node, dict):
            return None
        if node.get("type") == "ByteLevel":
            return node
        for child in node.get("pretokenizers", node.get("decoders", [])) or []:
            found = byte_level(child)
            if found is not None:
                return found
        return None

    decoder = spec.get("decoder")
    if byte_level(spec.get("pre_tokenizer")) is not None and isinstance(decoder, dict) \
            and decoder.get("type") == "Sequence":
        level = byte_level(decoder)
        if level is not None:
            spec["decoder"] = level
    return json.dumps(spec)
