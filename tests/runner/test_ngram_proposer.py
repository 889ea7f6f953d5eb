"""The prompt-lookup proposer (``runner.ngram_proposer``): the longest suffix match wins, then the latest."""
import numpy as np

from jaxserve.runner.ngram_proposer import propose_ngram


def test_longest_then_latest_match_proposes_what_followed():
    t = np.array([1, 2, 3, 9, 7, 2, 3, 8, 5, 1, 2, 3])
    # the 3-gram [1, 2, 3] occurs at 0 (followed by 9, 7); [2, 3] alone also at 5 (followed by 8): longest wins
    assert propose_ngram(t, 2, 3, 2) == [9, 7]
    # with n capped at 2 the latest [2, 3] wins
    assert propose_ngram(t, 1, 2, 3) == [8, 5, 1]


def test_no_match_too_short_or_near_the_end():
    assert propose_ngram(np.array([1, 2, 3, 4]), 1, 3, 3) == []
    assert propose_ngram(np.array([5, 6, 5, 6]), 3, 3, 2) == []            # only a 2-gram repeats
    assert propose_ngram(np.array([7, 7, 7]), 1, 2, 4) == [7]              # what follows the match, however little
    assert propose_ngram(np.array([1, 2, 1, 2]), 1, 2, 0) == []
