"""Reasoning parsers (vLLM's ``--reasoning-parser`` names): a thinking model's output split into its thinking
part (``reasoning_content``) and its answer (``content``), streaming or at once.

NOTE (the rule, vLLM's): the output is thinking up to the end marker ``</think>`` and answer after it; a
``<think>`` that opens the output is dropped (templates such as DeepSeek-R1's and Qwen3.5's put it in the
prompt, older ones let the model write it); an output with no end marker is all thinking (max_tokens cut
it). There is no thinking part when the prompt already closed it (its last think marker is ``</think>``:
Qwen3's template with ``enable_thinking: false`` writes an empty ``<think></think>``) or when the request
turns thinking off (``chat_template_kwargs`` ``enable_thinking`` or ``thinking`` false, ``reasoning_effort``
"none"). A constrained output (a named or required tool choice, a response format) holds after the thinking
part, as vLLM's does: the request's constraint carries the end marker's token ids and the engine starts its
grammar once the output holds them (``StructuredOutputsParams.reasoning_end_token_ids``). A streamed delta
that ends in what may become the end marker holds that tail back, so any delta size gives the same split as
the whole text.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .tool_parsers.engine import partial_marker_start


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ThinkingParser:
    """deepseek_r1: ``<think>`` ... ``</think>`` (DeepSeek-R1 and its distills, QwQ). One instance per choice."""
    start = "<think>"
    end = "</think>"

    def __init__(self) -> None:
        self.thinking = True        # False once the end marker passed: the rest is content
        self.at_start = True        # a leading start marker may still come
        self.held = ""              # a tail that may grow into a marker

    @classmethod
    def prompt_closes_thinking(cls, prompt: str) -> bool:
        """The prompt's last think marker is the end one: the model answers without thinking."""
        return prompt.rfind(cls.end) > prompt.rfind(cls.start)

    def find_end(self, text: str) -> tuple[int, int] | None:
        """(where the thinking ends, where the content starts) in ``text``, or None."""
        i = text.find(self.end)
        return None if i < 0 else (i, i + len(self.end))

    def undecided_from(self, text: str) -> int:
        """The index from which the end of ``text`` may still grow into an end of the thinking part."""
        return partial_marker_start(text, 0, (self.end,))

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        """The next piece of output as its thinking and content parts (``final``: the output ends here)."""
        if not self.thinking:
            return ReasoningDelta(content=delta)
        text, self.held = self.held + delta, ""
        if self.at_start:
            opening = text.lstrip()
            if opening.startswith(self.start):
                text, self.at_start = opening[len(self.start):], False
            elif not final and self.start.startswith(opening):
                self.held = text                # blank so far, or a start marker's first characters
                return ReasoningDelta()
            else:
                self.at_start = False
        found = self.find_end(text)
        if found is not None:
            self.thinking = False
            return ReasoningDelta(reasoning=text[:found[0]], content=text[found[1]:])
        keep = len(text) if final else self.undecided_from(text)
        self.held = text[keep:]
        return ReasoningDelta(reasoning=text[:keep])


class Qwen3ThinkingParser(ThinkingParser):
    """qwen3: deepseek_r1's rule, and a tool call written inside the thinking part (``<tool_call>`` then
    ``<function=``, as Qwen3.5 and Qwen3-Coder do without closing it) ends the thinking part; the call is
    content, for the tool-call parser."""
    tool_call = "<tool_call>"
    _TOOL_CALL = re.compile(r"<tool_call>\s*<function[\s=]")

    def find_end(self, text: str) -> tuple[int, int] | None:
        found = super().find_end(text)
        call = self._TOOL_CALL.search(text)
        if call is not None and (found is None or call.start() < found[0]):
            return call.start(), call.start()
        return found

    def undecided_from(self, text: str) -> int:
        undecided = min(super().undecided_from(text), partial_marker_start(text, 0, (self.tool_call,)))
        call = text.rfind(self.tool_call)
        if call >= 0:       # "<tool_call>" then blanks and what may become "<function=": not decided yet
            after = text[call + len(self.tool_call):].lstrip()
            if "<function=".startswith(after) or "<function ".startswith(after):
                undecided = min(undecided, call)
        return undecided


REASONING_PARSERS: dict[str, type[ThinkingParser]] = {"deepseek_r1": ThinkingParser, "qwen3": Qwen3ThinkingParser}


def answer_thinking(parser_cls: type[ThinkingParser] | None, chat_template_kwargs: dict[str, Any] | None,
                    reasoning_effort: str | None, prompt: str | None) -> type[ThinkingParser] | None:
    """The reasoning parser of an answer to this chat prompt, None when it has no thinking part (the server
    has no parser, the request turned thinking off, or the prompt closed it)."""
    if parser_cls is None or thinking_off(chat_template_kwargs, reasoning_effort) \
            or parser_cls.prompt_closes_thinking(prompt or ""):
        return None
    return parser_cls


def thinking_off(chat_template_kwargs: dict[str, Any] | None, reasoning_effort: str | None) -> bool:
    """The request turned thinking off (the template variables Qwen3's and DeepSeek-V3.1's templates read)."""
    kwargs = chat_template_kwargs or {}
    return kwargs.get("enable_thinking") is False or kwargs.get("thinking") is False or reasoning_effort == "none"
