"""Prompt-lookup (n-gram) proposals on the host: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, for the longest n in [min_n, max_n] that occurs (vLLM's ``ngram`` method).

Numpy over the request's prompt + outputs: the positions whose token equals the last one are the candidate
match ends; each candidate's match length is extended backwards up to ``max_n`` on the candidates alone,
so a step costs one pass over the sequence plus ``max_n`` passes over the (few) candidates.
"""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens following the latest occurrence (before the end) of the longest suffix of ``tokens``
    of ``min_n`` .. ``max_n`` tokens; [] when none occurs."""
    n = tokens.shape[0]
    if k <= 0 or n < min_n + 1:
        return []
    ends = np.flatnonzero(tokens[:n - 1] == tokens[n - 1])        # candidate match ends, before the suffix's
    if ends.size == 0:
        return []
    length = np.ones(ends.size, np.int64)
    alive = np.ones(ends.size, bool)
    for j in range(1, max_n):
        back = ends - j
        ok = alive & (back >= 0)
        ok[ok] = tokens[back[ok]] == tokens[n - 1 - j]
        alive = ok
        if not alive.any():
            break
        length += alive
    best = length.max()
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(length == best)[-1]])           # the latest of the longest matches
    return tokens[end + 1:end + 1 + k].tolist()
