"""GBNF grammars converted to Lark in a child process.

llguidance reads a GBNF (llama.cpp) grammar through its converter to Lark, which is pure Python, quadratic in
the length of a chain of rules, and holds the GIL while it runs: seconds for a chain a request can easily
spell, during which every other thread of the process (the event loop, the engine's step loop) waits about
the interpreter's switch interval for each GIL hand-over. In a child process it holds nobody's GIL, and a
conversion past the compile's time budget is killed rather than left running. (Lark grammars, and every
other kind of constraint, compile in Rust without that cost: they stay in the process.)
"""
from __future__ import annotations

import subprocess
import sys

from jaxserve.errors import InvalidRequestError

_CONVERT = ("import os, sys; os.nice(10); from llguidance.gbnf_to_lark import gbnf_to_lark; "
            "sys.stdout.buffer.write(gbnf_to_lark(sys.stdin.buffer.read().decode()).encode())")


def is_gbnf(text: str) -> bool:
    """Whether a grammar needs the conversion (it is not Lark already: llguidance's own test)."""
    from llguidance.gbnf_to_lark import is_lark_syntax
    return not is_lark_syntax(text)


def gbnf_to_lark(text: str, timeout_s: float) -> str:
    """The Lark text of a GBNF grammar, converted in a child process. Raises InvalidRequestError for a
    grammar the converter refuses, TimeoutError past ``timeout_s``."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"invalid grammar: it is not valid Unicode text ({e.reason})",
                                  param="grammar") from None
    try:
        done = subprocess.run([sys.executable, "-c", _CONVERT], input=data, capture_output=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"converting the GBNF grammar took more than {timeout_s:g} s") from None
    if done.returncode != 0:
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        reason = lines[-1].split(": ", 1)[-1] if lines else f"the converter exited with {done.returncode}"
        if lines and lines[-1].startswith("RecursionError"):
            reason = "nested too deeply to convert"
        raise InvalidRequestError(f"invalid grammar: cannot convert it from GBNF to Lark: {reason[:300]}",
                                  param="grammar")
    return done.stdout.decode()
