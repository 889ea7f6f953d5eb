"""``--mm-processor-workers``: a prompt's images loaded and preprocessed in worker processes give the features
the server's threads give (LLaVA's and Qwen2-VL's processors, pickled to the workers), bad input comes back as the
same 400 with its param, and a pool whose process died is replaced."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from jaxserve.errors import InvalidRequestError
from jaxserve.models.configs import model_config_from_folder
from jaxserve.multimodal.media import MediaLimits
from jaxserve.multimodal.processing import ImageProcessing
from jaxserve.multimodal.workers import ImageWorkers, load_and_process
from support.vision import VisionFixture

LIMITS = MediaLimits(max_pixels=1 << 22)


def _text(proc: ImageProcessing) -> list[int]:
    return [t for t in (1, 2, 3, 4) if t != proc.image_token_id][:3]


def _prompt(proc: ImageProcessing, images: int) -> list[int]:
    a, b, c = _text(proc)
    return [a, b] + [t for _ in range(images) for t in (proc.image_token_id, c)]


@pytest.fixture(scope="module", params=["tiny-llava", "tiny-qwen2-vl"])
def family(request):
    fx = VisionFixture(request.param, max_num_batched_tokens=64)
    cfg = model_config_from_folder(fx.folder)[0]
    proc = ImageProcessing.from_folder(fx.folder, cfg.extra_dict)
    names = sorted(set(_images(fx)))[:2]
    workers = ImageWorkers(2, proc, LIMITS)
    yield fx, proc, names, workers
    workers.shutdown()


def test_workers_match_the_threads(family):
    fx, proc, names, workers = family
    ids, urls = _prompt(proc, len(names)), [fx.data_url(n) for n in names]
    want_ids, want = load_and_process(proc, LIMITS, ids, urls)
    got_ids, got = workers.submit(ids, urls).result(timeout=120)
    assert got_ids == want_ids and len(got) == len(want) == len(names)
    for g, w in zip(got, want):
        assert (g.hash, g.offset, g.length) == (w.hash, w.offset, w.length)
        np.testing.assert_array_equal(g.pixel_values, w.pixel_values)


def test_bad_input_comes_back_as_the_same_400(family):
    fx, proc, _, workers = family
    with pytest.raises(InvalidRequestError, match="base64") as e:
        workers.submit(_prompt(proc, 1), ["data:image/png;base64,@@@"]).result(timeout=120)
    assert e.value.param == "image_url"
    with pytest.raises(InvalidRequestError, match="placeholder"):          # an image but no placeholder
        workers.submit(_text(proc), [fx.data_url(next(_images(fx)))]).result(timeout=120)


def _images(fx):
    return (n for c in fx.cases.values() for n in c["images"])


def test_a_dead_worker_is_replaced():
    """What the server does on ``BrokenProcessPool`` (``MultiModalInputs.restart_workers``): a new pool serves."""
    fx = VisionFixture("tiny-llava", max_num_batched_tokens=64)
    proc = ImageProcessing.from_folder(fx.folder, model_config_from_folder(fx.folder)[0].extra_dict)
    url = fx.data_url(next(_images(fx)))
    pool = ImageWorkers(1, proc, LIMITS)
    try:
        pool.submit(_prompt(proc, 1), [url]).result(timeout=120)
        for pid in list(pool._pool._processes):
            os.kill(pid, signal.SIGKILL)
        from concurrent.futures.process import BrokenProcessPool
        with pytest.raises(BrokenProcessPool):
            pool.submit(_prompt(proc, 1), [url]).result(timeout=120)
    finally:
        pool.shutdown()
    pool = ImageWorkers(1, proc, LIMITS)
    try:
        assert len(pool.submit(_prompt(proc, 1), [url]).result(timeout=120)[1]) == 1
    finally:
        pool.shutdown()
