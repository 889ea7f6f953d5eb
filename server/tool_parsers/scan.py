"""Where a bracketed value ends, without parsing it: brackets counted outside string literals."""
from __future__ import annotations

_CLOSE = {"{": "}", "[": "]", "(": ")"}


def value_end(text: str, i: int, quotes: str = '"') -> int | None:
    """Index just after the bracketed value opening at text[i] ('{', '[' or '('), None if the text ends
    first, -1 if a closing bracket does not match. Brackets inside strings (any of `quotes`, backslash escapes) do not count, so a string holding
    an end marker such as '</tool_call>' or ']' is read as part of the value."""
    stack = [_CLOSE[text[i]]]
    quote = None
    j, n = i + 1, len(text)
    while j < n:
        ch = text[j]
        if quote:
            if ch == "\\":
                j += 1
            elif ch == quote:
                quote = None
        elif ch in quotes:
            quote = ch
        elif ch in _CLOSE:
            stack.append(_CLOSE[ch])
        elif ch in "}])":
            if ch != stack[-1]:
                return -1  # mismatched: malformed, whatever follows
            stack.pop()
            if not stack:
                return j + 1
        j += 1
    return None
