"""Gemma 3 as a vision model end to end against HF transformers (tests/make_gemma3_vision_fixtures.py: a tiny
random checkpoint whose sliding window is shorter than an image, its images and HF's float32 outputs): the
prompt's logits within 1e-4 (bidirectional attention among an image's tokens), HF's greedy continuation
through the engine for one image, two images, text around an image, a two-turn chat with an earlier image, a
raw prompt with the placeholder, batched with text-only requests, under the prefix cache (the same image, a
hit that ends inside an image, another image), with chunked prefill keeping each image whole, and at tensor
parallelism 2 on fake CPU devices; the processor's placeholder expansion (Gemma's own tokenizer), pan-and-scan
crops."""
from __future__ import annotations

import functools
import json
import sys

import jax
import numpy as np
import pytest

from support.tiny_models import PagedRunner, hf_logits
from support.vision import VisionFixture, llm_fixture

NAME = "tiny-gemma3-vision"
VISION = VisionFixture(NAME, max_num_batched_tokens=64)
FOLDER, CASES = VISION.folder, VISION.cases
make_llm = VISION.make_llm


run_case = VISION.run_case


llm = llm_fixture(VISION)


def test_logits_match_hf():
    """The first case's prompt prefilled in one step, its image's tokens attending to each other: logits within
    1e-4 of HF's (causal image attention is far off: the limit row is what makes them match)."""
    from jaxserve.runner.step_functions import forward_fn
    model, ids, feats, slab = VISION.embedded_first_case()
    T = 64
    index = np.full((3, T), -1, np.int32)
    index[0], index[1] = T, 0
    rows = np.concatenate([np.arange(f.offset, f.end) for f in feats])
    index[0, :len(rows)], index[1, :len(rows)] = rows, np.arange(len(slab))
    for f in feats:
        index[2, f.offset:f.end] = f.end - 1
    runner = PagedRunner(model, max_reqs=1, max_len=T)
    ints, layout = runner.inputs([(0, ids, 0)], T, logits_rows=list(range(len(ids))))
    step = jax.jit(functools.partial(forward_fn, model.family, model.config, "reference", False),
                   static_argnames=("layout",))
    errs = []
    for idx in (index, index[:2]):
        _, logits = step(model.params, runner.kv_caches, ints, runner.no_prev, slab, idx, layout=layout)
        errs.append(np.abs(np.asarray(logits) - hf_logits(NAME)).max())
    assert errs[0] <= 1e-4, f"max abs logit error {errs[0]:.2e} vs HF float32"
    assert errs[1] > 1e-2                          # causal image attention: not HF's model


@pytest.mark.parametrize("name", [n for n in CASES if n not in ("same_start_other_end", "pan_and_scan")])
def test_greedy_matches_hf(llm, name):
    out = run_case(llm, CASES[name])
    assert out.prompt_token_ids == CASES[name]["prompt_ids"]
    assert list(out.outputs[0].token_ids) == CASES[name]["greedy_ids"]


def test_image_requests_compile_nothing_after_the_warm_up(llm):
    """The image step variants (their index with the attend limit row) compile in the background, the
    encoder's batches at start-up."""
    VISION.check_no_compiles_after_warmup(llm)


def test_batched_with_text_only_requests(llm):
    """Image prompts and text prompts in one batch: each as alone."""
    VISION.check_batched_with_text_only(llm, ("text_around", "raw_placeholder"))


def test_prefix_cache_same_image_a_hit_inside_an_image_and_another_image():
    """8-token blocks; text_around's image spans [11, 27). The same prompt again reuses 40 tokens; a prompt
    that shares its first 24 tokens hits 24, ending inside the image: its remaining image tokens attend to
    the cached ones and to each other, and the cached ones were computed seeing the whole image (a step
    never ends inside an image), so the output is still HF's. Another image shares only the block before it."""
    engine = make_llm(block_size=8, enable_prefix_caching=True)
    case, other_end = CASES["text_around"], CASES["same_start_other_end"]
    first, again = run_case(engine, case), run_case(engine, case)
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == case["greedy_ids"]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 40
    mid = run_case(engine, other_end)
    assert mid.num_cached_tokens == 24 and list(mid.outputs[0].token_ids) == other_end["greedy_ids"]
    other = run_case(engine, case, ["wide.png"])
    assert other.num_cached_tokens == 8 and list(other.outputs[0].token_ids) != case["greedy_ids"]
    engine.shutdown()


def test_chunked_prefill_keeps_each_image_in_one_step():
    """A 24-token step budget: two_images' chunks stop before each image (a chunk may not end inside one;
    the runner asserts it) and the outputs stay HF's; an image larger than a step is refused up front."""
    from jaxserve.errors import InvalidRequestError
    engine = make_llm(max_num_batched_tokens=24, max_num_seqs=4)
    assert engine.engine.core.encoder_cache.whole_images      # forced on for this family
    for name in ("two_images", "one_image"):
        out = run_case(engine, CASES[name])
        assert list(out.outputs[0].token_ids) == CASES[name]["greedy_ids"], name
    engine.shutdown()
    small = make_llm(max_num_batched_tokens=8, max_num_seqs=4, max_num_encoder_input_tokens=16,
                     skip_warmup=True)
    with pytest.raises(InvalidRequestError, match="one step's budget"):
        run_case(small, CASES["one_image"])
    small.shutdown()


def test_whole_image_scheduling():
    from jaxserve.engine.encoder_cache_manager import EncoderCacheManager
    from jaxserve.engine.request import Request
    from jaxserve.multimodal.inputs import ImageFeature
    enc = EncoderCacheManager(budget=32, capacity=64, whole_images=True)
    a, b = ImageFeature("a", 4, 16, np.zeros(1)), ImageFeature("b", 24, 4, np.zeros(1))
    r = Request("1", [0] * 40, None, mm_features=[a, b])
    assert enc.schedule(r, 0, 10, 32)[:2] == (4, [])          # would end inside a: stops before it
    assert enc.schedule(r, 0, 26, 32)[:2] == (24, [a])        # a whole, b not: stops before b
    assert enc.schedule(r, 8, 10, 32)[:2] == (0, [])          # starts inside a (a prefix hit), cannot finish it
    assert enc.schedule(r, 8, 20, 32)[:2] == (20, [b])        # a's rest and b whole
    assert EncoderCacheManager(32, 64).schedule(Request("2", [0] * 40, None, mm_features=[a]), 0, 10, 32)[0] == 10


CHAT_PROMPT = "<start_of_turn>user\n<start_of_image>Describe this.<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.parametrize("prompt,crops", [(p, 0) for p in (
    CHAT_PROMPT, "look at <start_of_image> and tell me", "<start_of_image>\n\nHi", "a\n\n<start_of_image>\nb",
    "x <start_of_image><start_of_image> y", "a\n\n\n<start_of_image>\n\n\nb", "text.<start_of_image>Next")] + [
    (p, 2) for p in (CHAT_PROMPT, "a\n\n\n<start_of_image>\n\n\nb", "text.<start_of_image>Next")])
def test_expansion_tokenizes_as_gemma_tokenizes_hfs_expanded_text(prompt, crops):
    """Gemma's own tokenizer (the packaged Gemma 3 270M's): expanding the ids of ``prompt`` gives the ids of
    the text HF's processor expands (newline runs next to the wrap merged as the tokenizer merges them; with
    pan-and-scan crops, the text around them). The image's soft tokens stand in as another special token
    (this vocabulary stops before them). Not covered: a crop text after a space (" " + "Here" tokenize
    apart here, together in HF's text; the chat template puts an image after a newline)."""
    from jaxserve.models.gguf_file import GGUFFile
    from jaxserve.models.gemma3_vision import CROPS_TEXT
    from jaxserve.models.gguf_tokenizer import tokenizer_from_gguf
    from jaxserve.multimodal.processing import ImageProcessing, encode_around, newline_merges
    from support.llms import packaged_model_or_skip
    tok = _gemma_tokenizer(packaged_model_or_skip("gemma3-270m"), GGUFFile, tokenizer_from_gguf)
    boi, eoi, stand_in, stand_in_id = "<start_of_image>", "<end_of_image>", "<start_of_turn>", 105
    wrap = tuple(encode_around(tok, t, boi, 255999) for t in ("\n\n" + boi, eoi + "\n\n"))
    intro, middle, sep = CROPS_TEXT
    full = "\n\n" + boi + eoi + "\n\n"
    proc = ImageProcessing(None, boi, 255999, 14, wrap=wrap, fill_token_id=stand_in_id, merges=newline_merges(tok),
                           crops=lambda k: encode_around(tok, intro + full + middle + sep.join([full] * k), boi,
                                                         255999))
    proc.process_image = lambda img: [(np.zeros((3, 56, 56), np.float32), {}, "h")] * (1 + crops)   # 16 tokens
    ids, feats = proc.process(tok.encode(prompt, add_special_tokens=False), [None] * prompt.count(boi))
    image = "\n\n" + boi + stand_in * 16 + eoi + "\n\n"
    hf_text = prompt.replace(boi, intro + image + middle + sep.join([image] * crops) if crops else image)
    assert ids == tok.encode(hf_text, add_special_tokens=False)
    assert all(ids[f.offset:f.end] == [stand_in_id] * 16 and ids[f.offset - 1] == 255999 for f in feats)


@functools.lru_cache(maxsize=1)
def _gemma_tokenizer(path, gguf_file, tokenizer_from_gguf):
    return tokenizer_from_gguf(gguf_file(path).fields)


def test_pan_and_scan_matches_hf():
    """``--mm-processor-kwargs`` with pan-and-scan: the wide image and its two crops (each its own 16 tokens,
    its own bidirectional block), the processor's text around them; HF's ids and greedy continuation."""
    case = CASES["pan_and_scan"]
    engine = make_llm(mm_processor_kwargs=case["processor_kwargs"], max_num_seqs=2)
    out = VISION.run_case(engine, case)
    assert out.prompt_token_ids == case["prompt_ids"]
    assert list(out.outputs[0].token_ids) == case["greedy_ids"]
    engine.shutdown()


# ------------------------------------------------------------------------------- tensor parallelism
TP_CASES = ("one_image", "two_images", "raw_placeholder")


@pytest.mark.slow
def test_tensor_parallel_2_matches_hf():
    VISION.check_tensor_parallel(__file__, TP_CASES)


if __name__ == "__main__" and sys.argv[1:] == ["--tp-worker"]:
    print(json.dumps(VISION.tp_report(TP_CASES)))
