"""Where a bracketed value ends, without parsing it: brackets counted outside string literals."""
from __future__ import annotations

_CLOSE = {"{": "}", "[": "]", "(": ")"}


def value_end(text: str, i: int, quotes: str = '"', cache: dict | None = None) -> int | None:
    """Index just after the bracketed value opening at text[i] ('{', '[' or '('), None if the text ends
    first, -1 if a closing bracket does not match. Brackets inside strings (any of `quotes`, backslash
    escapes) do not count, so a string holding an end marker such as '</tool_call>' or ']' is read as part
    of the value. With `cache` (one dict per growing text), a later call resumes where the last one
    stopped, so streaming a long value costs its length once, not once per delta."""
    state = cache.get(i) if cache is not None else None
    if isinstance(state, int):
        return state       # settled on an earlier call
    if state is None:
        stack, quote, j = [_CLOSE[text[i]]], None, i + 1
    else:
        stack, quote, j = state
    n = len(text)
    while j < n:
        ch = text[j]
        if quote:
            if ch == "\\":
                if j + 1 == n:
                    break          # the escaped character has not arrived: resume at the backslash
                j += 1
            elif ch == quote:
                quote = None
        elif ch in quotes:
            quote = ch
        elif ch in _CLOSE:
            stack.append(_CLOSE[ch])
        elif ch in "}])":
            if ch != stack[-1]:
                return _settle(cache, i, -1)   # mismatched: malformed, whatever follows
            stack.pop()
            if not stack:
                return _settle(cache, i, j + 1)
        j += 1
    if cache is not None:
        cache[i] = (stack, quote, j)
    return None


def _settle(cache: dict | None, i: int, end: int) -> int:
    if cache is not None:
        cache[i] = end
    return end
