"""Image loading and preprocessing in worker processes (``--mm-processor-workers N``).

Decoding, resizing, normalising and hashing one image is tens of milliseconds of CPU, and parts of it hold the
GIL, so on threads of the server's one process image requests queue behind each other however many cores the
host has. A pool of N spawned processes, each with its own copy of the model's ``ImageProcessing`` and the media
limits (sent once, at start), runs a prompt's images from URLs to ``ImageFeature``s; bad input comes back as the
same ``InvalidRequestError`` (a 400) the threads would raise.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
from typing import Any

from jaxserve.multimodal.media import MediaLimits, load_image_url
from jaxserve.multimodal.processing import ImageProcessing

_STATE: tuple[ImageProcessing, MediaLimits] | None = None


def _start(processing: ImageProcessing, limits: MediaLimits) -> None:
    global _STATE
    _STATE = (processing, limits)


def load_and_process(processing: ImageProcessing, limits: MediaLimits, prompt_token_ids: list[int],
                     urls: list[str]) -> tuple[list[int], list]:
    """A prompt's images from their URLs, its image tokens expanded: what a worker runs for one request."""
    return processing.process(prompt_token_ids, [load_image_url(u, limits) for u in urls])


def _ready() -> None:
    """A no-op: submitted once per worker at start, so the pool spawns them all then, not one per early request."""


def _run(prompt_token_ids: list[int], urls: list[str]) -> tuple[list[int], list]:
    assert _STATE is not None, "the worker's initializer did not run"
    return load_and_process(*_STATE, prompt_token_ids, urls)


class ImageWorkers:
    """A process pool that prepares prompts' images (``submit`` returns a ``concurrent.futures.Future``)."""

    def __init__(self, num_workers: int, processing: ImageProcessing, limits: MediaLimits):
        self._pool = concurrent.futures.ProcessPoolExecutor(
            num_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
            initargs=(processing, limits))
        for _ in range(num_workers):
            self._pool.submit(_ready)

    def submit(self, prompt_token_ids: list[int], urls: list[str]) -> concurrent.futures.Future[Any]:
        return self._pool.submit(_run, list(prompt_token_ids), list(urls))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
