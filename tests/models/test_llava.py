"""LLaVA-1.5 end to end against HF transformers (tests/make_vision_fixtures.py: a tiny random checkpoint, its
images and HF's float32 outputs): the prompt's logits within 1e-4, and HF's greedy continuation through the
engine for one image, two images, text around an image, a two-turn chat with an earlier image, a raw prompt
with the placeholder, batched with text-only requests, under the prefix cache, with chunked prefill and an
encoder budget splitting the work, and at tensor parallelism 2 on fake CPU devices."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from support.vision import GREEDY, VisionFixture, llm_fixture

NAME = "tiny-llava"
VISION = VisionFixture(NAME, max_num_batched_tokens=64)
FOLDER, CASES = VISION.folder, VISION.cases
image, data_url, openai_messages, make_llm = VISION.image, VISION.data_url, VISION.openai_messages, VISION.make_llm


run_case = VISION.run_case


llm = llm_fixture(VISION)


def test_logits_match_hf():
    """The first case's prompt prefilled in one step, its image embedded by the encoder: logits within 1e-4."""
    model, ids, feats, slab = VISION.embedded_first_case()
    index = np.stack([np.concatenate([np.arange(f.offset, f.end) for f in feats]), np.arange(len(slab))])
    VISION.check_prefill_logits(model, ids, slab, index, max_len=64)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_matches_hf(llm, name):
    out = run_case(llm, CASES[name])
    assert out.prompt_token_ids == CASES[name]["prompt_ids"]
    assert list(out.outputs[0].token_ids) == CASES[name]["greedy_ids"]


def test_image_requests_compile_nothing_after_the_warm_up(llm):
    """The image step variants compile in the background and the encoder's batches at start-up: once they
    are done, image requests (one image, two images) run without compiling."""
    VISION.check_no_compiles_after_warmup(llm)


def test_tokenizing_around_the_placeholder_equals_the_tokenizer(llm):
    """What a dummy model served with another model's tokenizer does (split the text at each placeholder)
    gives the ids of a tokenizer that has the placeholder as a special token."""
    images = llm.engine.images
    assert not images.splits_placeholder
    for case in CASES.values():
        text = case["prompt"]
        assert images.encode(text, False) == llm.tokenizer.encode(text, add_special_tokens=False)


def test_batched_with_text_only_requests(llm):
    """Image prompts and text prompts in one batch: each as alone."""
    VISION.check_batched_with_text_only(llm, ("text_around", "raw_placeholder"))
    stats = llm.engine.stats()
    assert stats["request_images_total"] >= 2 and stats["requests_with_images_total"] >= 2
    assert stats["images_encoded_total"] >= 1 and stats["encoder_seconds_total"] > 0


@pytest.mark.slow    # ~10 s; the image-keyed prefix cache runs fast for Qwen-VL
def test_prefix_cache_same_image_shares_and_other_image_does_not():
    """Block hashes include the images a block overlaps: the same image reuses the prompt's blocks, another
    image with the same text shares only the blocks before it."""
    from jaxserve.sampling_params import SamplingParams
    engine = make_llm(block_size=8, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0.0, max_tokens=GREEDY, ignore_eos=True)
    case = CASES["text_around"]          # 53 tokens; the image's 16 tokens start at 15

    def run(img: str):
        return engine.generate({"prompt": case["prompt"], "multi_modal_data": {"image": [image(img)]}}, sp,
                               use_tqdm=False)[0]
    first, again, other = run("tall.png"), run("tall.png"), run("red.png")
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == case["greedy_ids"]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 48
    assert other.num_cached_tokens == 8          # the block before the image: text only
    assert list(other.outputs[0].token_ids) != case["greedy_ids"]
    engine.shutdown()


def test_chunked_prefill_and_encoder_budget_split_the_images():
    """A step budget of 8 tokens splits each image's 16 tokens over steps; an encoder budget of one image
    encodes the second image of a prompt in a later step. The outputs stay HF's."""
    engine = make_llm(max_num_batched_tokens=8, max_num_seqs=4, max_num_encoder_input_tokens=16,
                      encoder_cache_size=32)
    for name in ("two_images", "one_image"):
        out = run_case(engine, CASES[name])
        assert list(out.outputs[0].token_ids) == CASES[name]["greedy_ids"], name
    engine.shutdown()


def test_image_hashes_and_encoder_cache_accounting():
    from jaxserve.engine.encoder_cache_manager import EncoderCacheManager
    from jaxserve.engine.request import Request
    from jaxserve.multimodal.inputs import ImageFeature
    enc = EncoderCacheManager(budget=16, capacity=32)
    a, b = (ImageFeature(h, 4, 16, np.zeros(1)) for h in ("a", "b"))
    r1, r2 = Request("1", [0] * 30, None, mm_features=[a]), Request("2", [0] * 30, None, mm_features=[b])
    assert enc.schedule(r1, 0, 10, 16)[:2] == (10, [a])           # the chunk ends inside the image
    assert enc.schedule(r2, 0, 10, 0)[:2] == (4, [])              # no budget left: cut before the image
    assert enc.schedule(r2, 0, 10, 16)[:2] == (10, [b])
    r1.num_computed_tokens = 20
    enc.release_computed(r1)
    c = ImageFeature("c", 0, 16, np.zeros(1))
    r3 = Request("3", [0] * 20, None, mm_features=[c])
    assert enc.schedule(r3, 0, 20, 16)[:2] == (20, [c]) and enc.take_freed() == ["a"]   # evicts the unheld


# ------------------------------------------------------------------------------- tensor parallelism
TP_CASES = ("one_image", "two_images", "raw_placeholder")


@pytest.mark.slow     # a fake-device TP run: make test-slow
def test_tensor_parallel_2_matches_hf():
    VISION.check_tensor_parallel(__file__, TP_CASES)


if __name__ == "__main__" and sys.argv[1:] == ["--tp-worker"]:
    print(json.dumps(VISION.tp_report(TP_CASES)))
