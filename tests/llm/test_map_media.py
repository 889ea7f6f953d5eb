"""``llm.map_media``: the offline API's image work on worker threads, results in the items' order and the
first failing item's error (in order) raised, as a loop over the items would."""
from __future__ import annotations

import threading
import time

import pytest

from jaxserve.llm import map_media


def test_results_in_order_from_several_threads():
    seen = set()

    def slow_first(x):
        seen.add(threading.get_ident())
        time.sleep(0.05 if x == 0 else 0.0)
        return x * x

    assert map_media(slow_first, list(range(6))) == [0, 1, 4, 9, 16, 25]
    assert len(seen) > 1


def test_first_error_in_order_wins():
    def fail(x):
        if x == 1:
            time.sleep(0.05)            # fails after item 3 has
            raise ValueError("one")
        if x == 3:
            raise KeyError("three")
        return x

    with pytest.raises(ValueError, match="one"):
        map_media(fail, [0, 1, 2, 3])


def test_one_item_runs_inline():
    assert map_media(lambda x: threading.get_ident(), [0]) == [threading.get_ident()]
    assert map_media(lambda x: x, []) == []
