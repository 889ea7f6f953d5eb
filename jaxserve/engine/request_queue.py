"""The scheduler's queue of waiting requests under ``--scheduling-policy`` (vLLM's): ``fcfs`` is a deque in
arrival order (a preempted request re-enters at the front); ``priority`` orders by (priority, arrival time),
lower first (a preempted request re-enters by its own key). Both answer the deque calls the scheduler makes."""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Iterable, Iterator

from jaxserve.engine.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


def priority_key(req: Request) -> tuple[int, float]:
    """A request's place under the priority policy: lower priority values first, then earlier arrivals."""
    return req.priority, req.arrival_time


class PriorityRequestQueue:
    """Waiting requests by ``priority_key`` (ties in the order they were queued): a heap."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()

    def append(self, req: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(req), next(self._order), req))

    appendleft = append         # a preempted request goes back by its key

    def extendleft(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            self.append(req)

    def popleft(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("a priority queue shows its first request only")
        return self._heap[0][-1]

    def remove(self, req: Request) -> None:
        """Take out a request wherever it is (an abort)."""
        for i, entry in enumerate(self._heap):
            if entry[-1] is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError(f"{req!r} is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))


def waiting_queue(policy: str) -> deque | PriorityRequestQueue:
    """The waiting queue of a scheduling policy."""
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
    return PriorityRequestQueue() if policy == "priority" else deque()
