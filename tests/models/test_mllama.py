"""Llama 3.2 Vision (Mllama) end to end against HF transformers (tests/make_mllama_fixtures.py: a tiny random
checkpoint, its images and HF's float32 outputs): the prompt's logits within 1e-4, and HF's greedy
continuation through the engine for one image (two tiles, and one tile beside a padding tile), two images
(text between them; side by side), text before and after an image, a two-turn chat with an earlier image, a
raw prompt with the placeholder, text only, batched together, under the prefix cache, with more image requests than cross-attention slots (they wait),
and at tensor parallelism 2 on fake CPU devices."""
from __future__ import annotations

import functools
import json
import sys

import jax
import numpy as np
import pytest

from support.tiny_models import PagedRunner, hf_logits
from support.vision import GREEDY, VisionFixture, llm_fixture

NAME = "tiny-mllama"
VISION = VisionFixture(NAME, max_num_batched_tokens=64)
FOLDER, CASES = VISION.folder, VISION.cases
image, run_case, make_llm = VISION.image, VISION.run_case, VISION.make_llm

llm = llm_fixture(VISION)


def test_logits_match_hf():
    """The first case's prompt (its image two tiles) prefilled in one step over the image's cross-attention
    keys: logits within 1e-4, tokens before the image included (HF's fully masked rows)."""
    from jaxserve.models.loader import load_model
    from jaxserve.multimodal.processing import ImageProcessing
    from jaxserve.runner.step_functions import forward_fn
    model = load_model(FOLDER, dtype="float32")
    case = CASES["one_image"]
    proc = ImageProcessing.from_folder(FOLDER, model.config.extra_dict, tokenizer=model.tokenizer)
    ids, (f,) = proc.process(model.tokenizer.encode(case["prompt"], add_special_tokens=False),
                             [image(n).convert("RGB") for n in case["images"]])
    assert ids == case["prompt_ids"] and f.length == 1
    kv = model.family.encode_cross_kv(model.params, f.pixel_values, f.extra["aspect_ratio_ids"].reshape(1),
                                      f.extra["aspect_ratio_mask"].reshape(1, -1), model.config)
    pool = tuple(np.concatenate([np.asarray(x), np.zeros_like(x)], axis=1) for x in kv)   # + an empty slot
    runner = PagedRunner(model, max_reqs=1, max_len=64)
    ints, layout = runner.inputs([(0, ids, 0)], 64, logits_rows=list(range(len(ids))))
    after = np.arange(len(ids)) >= f.offset
    index = np.zeros((model.family.cross_index_rows(model.config), 64), np.int32)    # image 0 in slot 0
    index[0] = -1
    index[0, :len(ids)] = after
    index[5, :len(ids)] = np.where(after, 2 * 5, pool[0].shape[2])     # two tiles of 5 keys; before: all
    step = jax.jit(functools.partial(forward_fn, model.family, model.config, "reference", False),
                   static_argnames=("layout",))
    _, logits = step(model.params, runner.kv_caches, ints, runner.no_prev, pool, index, layout=layout)
    err = np.abs(np.asarray(logits)[:len(ids)] - hf_logits(NAME)).max()
    assert err <= 1e-4, f"max abs logit error {err:.2e} vs HF float32"


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_matches_hf(llm, name):
    VISION.check_greedy(llm, name)


def test_batched_with_text_only_requests(llm):
    """Image prompts and text prompts in one batch: each as alone (text rows skip the cross layers)."""
    VISION.check_batched_with_text_only(llm, ("text_around", "raw_placeholder"))
    stats = llm.engine.stats()
    assert stats["request_images_total"] >= 2 and stats["images_encoded_total"] >= 1


def test_image_requests_compile_nothing_after_the_warm_up(llm):
    """The image step variants compile in the background and the encoder's batches at start-up: once they
    are done, image and text requests run without compiling."""
    VISION.check_no_compiles_after_warmup(llm, ("one_image", "text_around", "text_only"))


def test_more_images_than_supported_is_a_400(llm):
    from jaxserve.errors import InvalidRequestError
    from jaxserve.sampling_params import SamplingParams
    prompt = "<|begin_of_text|>" + "<|image|>" * 5 + "Five?"
    with pytest.raises(InvalidRequestError, match="takes at most 4 per prompt"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": [image("wide.png")] * 5}},
                     SamplingParams(max_tokens=2), use_tqdm=False)


@pytest.mark.slow    # ~25 s; the image-keyed prefix cache runs fast for Qwen-VL
def test_prefix_cache_same_image_shares_and_other_image_does_not():
    """Every token of an image prompt depends on the image (the cross layers; tokens before it too, as HF's
    masked rows): the same image reuses the prompt's blocks, another image with the same text none."""
    from jaxserve.sampling_params import SamplingParams
    engine = make_llm(block_size=8, enable_prefix_caching=True)
    sp = SamplingParams(temperature=0.0, max_tokens=GREEDY, ignore_eos=True)
    case = CASES["one_image"]                  # 29 tokens, the image token at 9
    first, again = run_case(engine, case), run_case(engine, case)
    other = run_case(engine, CASES["one_image_other"])
    text = engine.generate({"prompt_token_ids": case["prompt_ids"][:9] + [40] * 20}, sp, use_tqdm=False)[0]
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == case["greedy_ids"]
    assert list(other.outputs[0].token_ids) == CASES["one_image_other"]["greedy_ids"]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 24
    assert other.num_cached_tokens == 0 and text.num_cached_tokens == 0
    engine.shutdown()


def test_requests_wait_for_a_cross_attention_slot():
    """Two slots, image requests with four different images (one of them holding two) and a text one: each
    image request waits for its slots (none fails), and every output is HF's."""
    engine = make_llm(cross_attention_slots=2, max_num_batched_tokens=16)
    names = ("one_image", "two_images", "one_image_other", "raw_placeholder", "text_only")
    from jaxserve.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=GREEDY, ignore_eos=True)
    prompts = []
    for n in names:
        c = CASES[n]
        prompts.append({"prompt_token_ids": c["prompt_ids"]} if not c["images"] else
                       {"prompt_token_ids": c["prompt_ids"], "multi_modal_data": {"image": list(map(image, c["images"]))}})
    outs = engine.generate(prompts, sp, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [CASES[n]["greedy_ids"] for n in names]
    engine.shutdown()


def test_text_only_steps_run_the_text_program(llm, monkeypatch):
    """A text request to the model costs what it costs a text model: its steps never take the image variant
    (its cross layers are skipped); an image request's steps, decodes included, all do."""
    runner = llm.engine.core.runner
    calls = []
    real = runner.variants.forward_mm_for
    monkeypatch.setattr(runner.variants, "forward_mm_for", lambda T: calls.append(T) or real(T))
    VISION.check_greedy(llm, "text_only")
    assert calls == []
    VISION.check_greedy(llm, "raw_placeholder")
    assert len(calls) >= GREEDY


def test_encoder_cache_manager_holds_an_image_for_the_whole_request():
    from jaxserve.engine.encoder_cache_manager import EncoderCacheManager
    from jaxserve.engine.request import Request
    from jaxserve.multimodal.inputs import ImageFeature
    enc = EncoderCacheManager(budget=1, capacity=1, whole_request=True)
    a, b = ImageFeature("a", 9, 1, np.zeros(1)), ImageFeature("b", 9, 1, np.zeros(1))
    r1, r2 = Request("1", [0] * 30, None, mm_features=[a]), Request("2", [0] * 30, None, mm_features=[b])
    assert enc.schedule(r1, 0, 4, 1)[:2] == (4, [a])        # encoded before the chunk that ends before it
    r1.num_computed_tokens = 30
    enc.release_computed(r1)                                  # still held: decodes read it
    assert enc.schedule(r2, 0, 16, 1)[:2] == (0, [])          # no free slot: the request waits
    enc.release_all(r1)                                       # finished
    assert enc.schedule(r2, 20, 8, 1)[:2] == (8, [b]) and enc.take_freed() == ["a"]   # a prefix hit past it
    # two slots, one held: a request with two images takes neither until both fit
    enc = EncoderCacheManager(budget=2, capacity=2, whole_request=True)
    c, d = ImageFeature("c", 3, 1, np.zeros(1)), ImageFeature("d", 5, 1, np.zeros(1))
    r3 = Request("3", [0] * 30, None, mm_features=[c, d])
    assert enc.schedule(r1, 0, 30, 2)[:2] == (30, [a])
    assert enc.schedule(r3, 0, 30, 1) == (0, [], 1) and "c" not in enc.cached
    enc.release_all(r3)
    enc.release_all(r1)
    assert enc.schedule(r3, 0, 30, 2)[:2] == (30, [c, d]) and enc.take_freed() == ["a"]


# ------------------------------------------------------------------------------- tensor parallelism
TP_CASES = ("one_image", "text_around", "raw_placeholder")


@pytest.mark.slow     # a fake-device TP run: make test-slow
def test_tensor_parallel_2_matches_hf():
    from support.fake_devices import fake_device_report
    report = fake_device_report([__file__, "--tp-worker"], 2)
    for name in TP_CASES:
        assert report[name] == CASES[name]["greedy_ids"], name


if __name__ == "__main__" and sys.argv[1:] == ["--tp-worker"]:
    engine = make_llm(tensor_parallel_size=2, skip_warmup=True, compilation_cache_dir="")
    print(json.dumps({n: list(run_case(engine, CASES[n]).outputs[0].token_ids) for n in TP_CASES}))
