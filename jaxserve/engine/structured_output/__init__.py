"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar) checked against limits,
compiled by llguidance once per distinct constraint on worker threads, and enforced with a token mask per
step.

- ``limits``: ``StructuredOutputsLimits`` and the cheap checks that run before any compile;
- ``grammar``: llguidance's side (tokenizer, grammar text, the compile of a template, error messages);
- ``compiler``: ``GrammarCompiler``, the worker pool, its time budget and its cache bounded in bytes;
- ``manager``: ``StructuredOutputManager``, the matchers of running requests and the step's mask.
"""
from .compiler import GrammarCompiler
from .grammar import CompiledGrammar, llguidance_tokenizer_json
from .limits import StructuredOutputsLimits, check_constraint, check_json_schema, check_tools
from .manager import PendingMask, StructuredOutputManager, bitmask_width

__all__ = ["CompiledGrammar", "GrammarCompiler", "PendingMask", "StructuredOutputManager", "StructuredOutputsLimits",
           "bitmask_width", "check_constraint", "check_json_schema", "check_tools", "llguidance_tokenizer_json"]
