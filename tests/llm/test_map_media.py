"""``llm.map_media`` and ``llm.MediaAhead``: the offline API's image work on worker threads, results in the
items' order and the first failing item's error (in order) raised, as a loop over the items would;
``MediaAhead`` starts at most its window of items beyond those taken."""
from __future__ import annotations

import threading
import time

import pytest

from jaxserve.llm import MediaAhead, map_media


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


def test_ahead_takes_in_order_and_starts_at_most_its_window_beyond_those_taken():
    started, lock = [], threading.Lock()

    def record(x):
        with lock:
            started.append(x)
        time.sleep(0.01 if x % 3 == 0 else 0.0)
        return x * x

    with MediaAhead(record, list(range(10)), window=3) as ahead:
        out = []
        for taken in range(10):
            with lock:
                assert len(started) <= taken + 3
            out.append(ahead.take())
        assert not ahead.ready()
    assert out == [x * x for x in range(10)] and sorted(started) == list(range(10))


def test_ahead_raises_the_first_error_in_order_and_drops_the_rest():
    started = []

    def fail(x):
        started.append(x)
        if x == 1:
            time.sleep(0.05)            # fails after item 2 has
            raise ValueError("one")
        if x == 2:
            raise KeyError("two")
        return x

    with MediaAhead(fail, list(range(50)), window=4) as ahead:
        assert ahead.take() == 0
        with pytest.raises(ValueError, match="one"):
            ahead.drain()
    assert len(started) <= 6


def test_ahead_ready_once_the_next_item_is_done():
    gate = threading.Event()
    with MediaAhead(lambda x: gate.wait(5) and x, [7, 8]) as ahead:
        assert not ahead.ready()
        gate.set()
        assert ahead.take() == 7
        assert ahead.take() == 8
