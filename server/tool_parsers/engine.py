"""The one streaming engine every tool-call format runs on.

NOTE (the algorithm): the engine keeps the whole output text and a position `pos` before which everything
is settled (emitted as content, or read as complete calls). Each `feed` looks for a format's start marker
after `pos`; text before it is content, and a tail that could still grow into a marker is held back. From a
marker on, the format's `read_block` reads the block from the text so far and answers the calls it holds
(each with the arguments known to be final so far), where the block ends, or that it is malformed — then
the marker is content after all. The engine emits only what is new since the last feed, so any delta size
(one token, five, the whole text) gives the same calls, and the non-streaming answer is one feed of the
whole text: the concatenated argument fragments equal the non-streaming arguments by construction.
A format never reports a call that could later turn out malformed (JSON formats report a call only once
its JSON parsed), so nothing emitted is ever taken back.
"""
from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

_ALNUM = string.ascii_letters + string.digits


@dataclass(slots=True)
class PartialCall:
    """A call as far as the text read so far settles it: `arguments` only ever grows."""
    name: str
    arguments: str = ""       # JSON text (a prefix of the final text until `done`)
    done: bool = False


@dataclass(slots=True)
class Block:
    calls: list[PartialCall] = field(default_factory=list)
    end: int | None = None    # index just after the block; None: the block goes on


@dataclass(slots=True)
class FunctionCall:
    id: str
    name: str
    arguments: str            # a JSON object as text


@dataclass(slots=True)
class ToolCallDelta:
    """OpenAI's streaming shape: the first delta of a call has id and name, later ones argument text."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(slots=True)
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[FunctionCall]


def skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


def partial_marker_start(text: str, pos: int, markers: tuple[str, ...]) -> int:
    """The index from which the end of `text` could still grow into one of `markers` (len(text): none)."""
    best = len(text)
    for m in markers:
        for k in range(min(len(m) - 1, len(text) - pos), 0, -1):
            if m.startswith(text[len(text) - k:]):
                best = min(best, len(text) - k)
                break
    return best


def call_arguments(value: Any) -> str | None:
    """A model's arguments value as the JSON object text we return (None: not an object)."""
    if value is None:
        return "{}"
    if isinstance(value, str):  # some models send the arguments as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


class ToolParser:
    """Turns a model's output text into content and tool calls, streaming or at once.

    A format subclass sets `start_markers` (or overrides `find_start`) and implements `read_block`. One
    instance per generated choice: it holds that choice's stream state. `tools` is the request's tool list
    (OpenAI's dicts), for formats whose values need the parameter schemas.
    """
    name = ""
    start_markers: tuple[str, ...] = ()
    # A format whose markers are special tokens ([TOOL_CALLS], <|python_tag|>) sets this: the request then
    # runs with skip_special_tokens=False, or the markers would never reach the text.
    needs_special_tokens = False

    @classmethod
    def structural_tag(cls, tools: list[dict]) -> dict | None:
        """The format's calls as a structural tag (``jaxserve.engine.structured_output.structural_tag``): under
        ``tool_choice: "auto"`` the text stays free and each call the model starts must name a tool and give
        arguments of its schema. None (the default): the format's calls are parsed, not constrained."""
        return None

    def __init__(self, tools: list[dict] | None = None):
        self.tools = {t["function"]["name"]: t["function"] for t in (tools or [])}
        self.text = ""
        self.pos = 0
        self.block_end = 0           # where the last complete block ended (0: the start of the output)
        self._block: tuple[int, int, int] | None = None   # (marker index, body index, calls before it)
        self.calls: list[FunctionCall] = []
        self.scans: dict = {}        # value_end's resumable scans of this text, by start index

    # -- what a format provides ------------------------------------------------------------------------

    def find_start(self, text: str, pos: int) -> tuple[int, int] | int:
        """(marker index, body index) of the next block at or after `pos`; or, when there is none yet, the
        index up to which the text is surely content (a tail that may become a marker stays back)."""
        found = [(i, i + len(m)) for m in self.start_markers if (i := text.find(m, pos)) >= 0]
        if found:
            return min(found)
        return partial_marker_start(text, pos, self.start_markers)

    def read_block(self, text: str, body: int, final: bool) -> Block | None:
        """The calls of the block whose body starts at `body`; None when it is malformed. With `final`, the
        text ends here: answer a complete block or None. Every format defines it."""
        raise NotImplementedError(f"{type(self).__name__} does not define read_block (each tool-call format must)")

    def new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    # -- the engine ----------------------------------------------------------------------------------

    def feed(self, delta: str, final: bool = False) -> StreamDelta:
        """Take the next piece of output; answer the content and call deltas it settles."""
        self.text += delta
        text, out = self.text, StreamDelta()
        content: list[str] = []
        deltas: dict[int, ToolCallDelta] = {}
        while True:
            if self._block is None:
                start = self.find_start(text, self.pos)
                if isinstance(start, int):
                    safe = len(text) if final else start
                    content.append(text[self.pos:safe])
                    self.pos = max(self.pos, safe)
                    break
                content.append(text[self.pos:start[0]])
                self._block = (start[0], start[1], len(self.calls))
                self.pos = start[0]
            marker, body, base = self._block
            block = self.read_block(text, body, final)
            emitted_here = len(self.calls) > base
            if block is None or (final and block.end is None):
                assert not emitted_here, f"{self.name}: a block turned malformed after its calls were emitted"
                resume = max(body, marker + 1)     # the marker was text after all
                content.append(text[marker:resume])
                self.pos, self._block = resume, None
                continue
            for k, call in enumerate(block.calls):
                self._emit(base + k, call, deltas)
            if block.end is None:
                break
            self.pos = self.block_end = block.end
            self._block = None
        out.content = "".join(content)
        out.tool_calls = [deltas[i] for i in sorted(deltas)]
        return out

    def _emit(self, index: int, call: PartialCall, deltas: dict[int, ToolCallDelta]) -> None:
        if index == len(self.calls):
            self.calls.append(FunctionCall(self.new_id(), call.name, ""))
            deltas[index] = ToolCallDelta(index, self.calls[index].id, call.name)
        known = self.calls[index]
        assert call.arguments.startswith(known.arguments), f"{self.name}: arguments of call {index} changed"
        if len(call.arguments) > len(known.arguments):
            d = deltas.setdefault(index, ToolCallDelta(index))
            d.arguments += call.arguments[len(known.arguments):]
            known.arguments = call.arguments

    def extract(self, text: str) -> ExtractedToolCalls:
        """The whole output at once (non-streaming): content outside the calls, and the calls."""
        out = self.feed(text, final=True)
        calls = list(self.calls)
        # beside calls, the whitespace between them is no content (None when nothing else is there)
        content = (out.content.strip() or None) if calls else out.content
        return ExtractedToolCalls(content, calls)


def mistral_id() -> str:
    """Mistral's tokenizers accept only 9-character alphanumeric call ids."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))
