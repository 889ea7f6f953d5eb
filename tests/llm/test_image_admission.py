"""``LLM.generate``'s image prompts enter the engine as their own images are preprocessed (``llm.Admission``):
the engine steps while later images are still in the worker threads, outputs stay HF's greedy continuation in
the caller's order, and errors are those of preprocessing every image first, with nothing left queued. The tiny
Qwen2.5-VL checkpoint (tests/make_qwen_vl_fixtures.py); a fake slow preprocessor (the real one, held back on an
event) orders the threads, with no timing assumptions."""
from __future__ import annotations

import sys
import threading

import pytest

from support.vision import GREEDY, VisionFixture

VL = VisionFixture("tiny-qwen2.5-vl", max_num_batched_tokens=128)
CASE = VL.cases["text_around"]              # a raw prompt with one image
WAIT_S = 60                                 # only a broken admission waits this long


def sampling():
    from jaxserve.sampling_params import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=GREEDY, ignore_eos=True)


def image_prompt(images=None) -> dict:
    return {"prompt": CASE["prompt"], "multi_modal_data": {"image": images or [VL.image(n) for n in CASE["images"]]}}


@pytest.fixture(scope="module")
def llm():
    engine = VL.make_llm()
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=True)
def overlap(monkeypatch):
    """The overlap is off by default on the CPU (``llm.media_overlap``): these tests turn it on."""
    monkeypatch.setenv("JAXSERVE_OFFLINE_MEDIA_OVERLAP", "1")


class Held:
    """``engine.images.process`` patched: a prompt whose first image is in ``hold`` waits for its event before
    the real preprocessing; ``stepped`` is set once an engine step has returned; every call's thread and the
    stepping thread are recorded."""

    def __init__(self, llm, monkeypatch, hold: dict):
        self.hold, self.stepped, self.threads, self.step_threads = hold, threading.Event(), set(), set()
        self.waited: dict[int, bool] = {}
        images, eng = llm.engine.images, llm.engine
        real_process, real_step = images.process, eng.step

        def process(ids, imgs):
            self.threads.add(threading.get_ident())
            event = self.hold.get(id(imgs[0])) if imgs else None
            if event is not None:
                self.waited[id(imgs[0])] = event.wait(WAIT_S)
            return real_process(ids, imgs)

        def step(*a, **k):
            self.step_threads.add(threading.get_ident())
            out = real_step(*a, **k)
            self.stepped.set()
            return out
        monkeypatch.setattr(images, "process", process)
        monkeypatch.setattr(eng, "step", step)


def test_engine_steps_while_the_last_image_is_preprocessed(llm, monkeypatch):
    """The last prompt's image is preprocessed only after the engine has stepped (the earlier prompts are
    queued and running): it does not wait out WAIT_S, preprocessing ran off the stepping thread, and each
    output is HF's, in the caller's order."""
    last = VL.image(CASE["images"][0])
    held = Held(llm, monkeypatch, {})
    held.hold[id(last)] = held.stepped
    outs = llm.generate([image_prompt(), image_prompt(), {"prompt_token_ids": VL.cases["text_only"]["prompt_ids"]},
                         image_prompt([last])], sampling(), use_tqdm=False)
    assert held.waited == {id(last): True}
    assert not held.threads & held.step_threads
    expect = [CASE, CASE, VL.cases["text_only"], CASE]
    assert [list(o.outputs[0].token_ids) for o in outs] == [c["greedy_ids"] for c in expect]
    assert [o.prompt_token_ids for o in outs] == [c["prompt_ids"] for c in expect]
    assert not llm.engine.has_unfinished_requests()


def test_without_the_overlap_every_image_is_preprocessed_before_the_first_step(llm, monkeypatch):
    """JAXSERVE_OFFLINE_MEDIA_OVERLAP=0 (the CPU's default): the engine steps only once every image is done, so
    the held last image never sees a step and waits out its (short) hold; the outputs stay HF's."""
    monkeypatch.setenv("JAXSERVE_OFFLINE_MEDIA_OVERLAP", "0")
    last = VL.image(CASE["images"][0])
    held = Held(llm, monkeypatch, {})
    held.hold[id(last)] = held.stepped
    monkeypatch.setattr(sys.modules[__name__], "WAIT_S", 2)
    outs = llm.generate([image_prompt(), image_prompt([last])], sampling(), use_tqdm=False)
    assert held.waited == {id(last): False}
    assert [list(o.outputs[0].token_ids) for o in outs] == [CASE["greedy_ids"]] * 2


def test_the_overlap_defaults_to_accelerators_only(monkeypatch):
    from jaxserve.llm import media_overlap
    monkeypatch.delenv("JAXSERVE_OFFLINE_MEDIA_OVERLAP")
    assert media_overlap("gpu") and not media_overlap("cpu")
    monkeypatch.setenv("JAXSERVE_OFFLINE_MEDIA_OVERLAP", "1")
    assert media_overlap("cpu")


def test_images_done_out_of_order_keep_the_callers_order(llm, monkeypatch):
    """The first prompt's image is held until the second's is done (the second is ready first): the outputs,
    their request ids and prompts are in the caller's order, each as alone."""
    first, second = VL.image(CASE["images"][0]), VL.image(CASE["images"][0])
    second_done = threading.Event()
    held = Held(llm, monkeypatch, {id(first): second_done})
    real = llm.engine.images.process

    def process(ids, imgs):
        out = real(ids, imgs)
        if imgs[0] is second:
            second_done.set()
        return out
    monkeypatch.setattr(llm.engine.images, "process", process)
    two = VL.cases["two_turns"]
    outs = llm.generate([image_prompt([first]), image_prompt([second])], sampling(), use_tqdm=False)
    assert held.waited == {id(first): True}
    assert [list(o.outputs[0].token_ids) for o in outs] == [CASE["greedy_ids"]] * 2
    assert int(outs[0].request_id) + 1 == int(outs[1].request_id)
    chats = llm.chat([VL.openai_messages(two), VL.openai_messages(VL.cases["two_images"])], sampling(),
                     use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in chats] == [two["greedy_ids"], VL.cases["two_images"]["greedy_ids"]]


def test_a_bad_image_after_queued_prompts_raises_and_leaves_nothing_queued(llm, monkeypatch):
    """A prompt whose placeholders do not match its images, preprocessed after the engine has stepped the good
    prompts before it: the error it raises alone, nothing of the call left in the engine, and the engine
    answers the next call."""
    from jaxserve.errors import InvalidRequestError
    bad_images = [VL.image(CASE["images"][0])] * 2
    held = Held(llm, monkeypatch, {})
    held.hold[id(bad_images[0])] = held.stepped
    with pytest.raises(InvalidRequestError, match="placeholder"):
        llm.generate([image_prompt(), image_prompt(), image_prompt(bad_images), image_prompt()], sampling(),
                     use_tqdm=False)
    assert held.waited == {id(bad_images[0]): True}
    assert not llm.engine.has_unfinished_requests() and not llm.engine.core.scheduler.has_unfinished_requests()
    monkeypatch.undo()
    assert list(llm.generate(image_prompt(), sampling(), use_tqdm=False)[0].outputs[0].token_ids) == \
        CASE["greedy_ids"]


def test_an_invalid_prompt_before_a_bad_image_raises_the_image_error(llm):
    """As when every image was preprocessed before any request was built: an image's error wins over an
    earlier prompt's invalid token; that prompt alone among good images raises its own error. Nothing is
    left queued either way."""
    from jaxserve.errors import InvalidRequestError
    invalid = {"prompt_token_ids": [1, 10_000, 2]}
    bad = image_prompt([VL.image(CASE["images"][0])] * 2)
    with pytest.raises(InvalidRequestError, match="placeholder"):
        llm.generate([image_prompt(), invalid, image_prompt(), bad], sampling(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([image_prompt(), invalid, image_prompt()], sampling(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
