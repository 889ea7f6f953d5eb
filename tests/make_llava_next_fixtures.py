"""Golden fixtures of a tiny random LLaVA-NeXT (CLIP ViT + MLP projector + Llama, anyres tiles and
``image_newline``) from HF transformers.

Run with the oracle env (torch + transformers):
    python tests/make_llava_next_fixtures.py      # the oracle env's python

Writes tests/fixtures/models/tiny-llava-next/: config.json (28-pixel tiles of 7-pixel patches: 16 patches a
tile; ``image_grid_pinpoints`` of 1x2, 2x1, 2x2, 3x1 and 1x3 tiles, LLaVA-NeXT's own scaled down),
model.safetensors (bfloat16, read back as float32 by the oracle), the processor's files (the PIL
``LlavaNextImageProcessor``), the byte-level tokenizer with ``<image>`` and the LLaVA chat template, the test
images (PNG, fixed seeds, of different aspect ratios) and golden.json / logits.npy as ``write_golden`` makes
them (HF's expanded ids, greedy continuation, smallest margin; the first case's float32 logits).
"""
from __future__ import annotations

import os

import torch
from make_vision_fixtures import (CHAT_TEMPLATE, greedy, make_images, make_tokenizer, save_processor,
                                  tiny_llava_configs, write_golden)
from transformers import (LlavaNextConfig, LlavaNextForConditionalGeneration,
                          LlavaNextImageProcessorPil, LlavaNextProcessor)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models", "tiny-llava-next")
TILE, PATCH = 28, 7
PINPOINTS = [[28, 56], [56, 28], [56, 56], [84, 28], [28, 84]]
IMAGES = {"wide.png": (64, 48, 1), "tall.png": (40, 80, 2), "thin.png": (30, 90, 3), "square.png": (50, 50, 4)}


def cases() -> list[dict]:
    img = {"type": "image"}
    return [
        {"name": "one_image", "messages": [{"role": "user", "content": [img, {"type": "text", "text": "What?"}]}],
         "images": ["wide.png"]},
        {"name": "two_images", "messages": [{"role": "user", "content": [
            img, {"type": "text", "text": "and"}, img, {"type": "text", "text": "Compare."}]}],
         "images": ["tall.png", "square.png"]},
        {"name": "text_around", "raw": "USER: look at <image> and tell me ASSISTANT:", "images": ["thin.png"]},
        {"name": "raw_placeholder", "raw": "<image>\nA photo of", "images": ["wide.png"]},
        {"name": "text_only", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
         "images": []},
    ]


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(2)
    os.makedirs(OUT, exist_ok=True)
    tokenizer = make_tokenizer()
    text, vision = tiny_llava_configs(len(tokenizer), TILE, PATCH, 1024)
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_token_id=4, projector_hidden_act="gelu",
                             vision_feature_layer=-2, vision_feature_select_strategy="default",
                             image_grid_pinpoints=PINPOINTS, image_seq_length=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlavaNextForConditionalGeneration(config).eval()
    for p in model.parameters():          # stored as bfloat16: the float32 model holds exactly those values
        p.copy_(p.to(torch.bfloat16).to(torch.float32))
    model.to(torch.bfloat16).save_pretrained(OUT, safe_serialization=True)
    model = LlavaNextForConditionalGeneration.from_pretrained(OUT, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    # the PIL backend, which jaxserve runs (no torch in the server)
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": TILE},
                                                 crop_size={"height": TILE, "width": TILE},
                                                 image_grid_pinpoints=PINPOINTS)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
                                   vision_feature_select_strategy="default", chat_template=CHAT_TEMPLATE,
                                   num_additional_image_tokens=1)
    save_processor(processor, tokenizer, OUT, "LlavaNextImageProcessor")
    images = make_images(IMAGES, OUT)
    write_golden(OUT, model, processor, cases(), images, greedy)


if __name__ == "__main__":
    main()
