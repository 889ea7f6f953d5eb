"""Golden fixtures of a tiny random Gemma 3 vision model (SigLIP + pooled projector + Gemma 3 text model with
bidirectional attention among an image's tokens) from HF transformers; run with the oracle env:
    .venv-oracle/bin/python tests/make_gemma3_vision_fixtures.py

Writes tests/fixtures/models/tiny-gemma3-vision/: config.json, model.safetensors (bfloat16, read back as
float32), the processor's configs (Gemma 3 image processing, PIL backend, 56x56 pixels, 7-pixel patches
pooled 2x2: 16 image tokens per image), a byte-level tokenizer with Gemma 3's special tokens and a shortened
Gemma 3 chat template, the test images, golden.json (per case: prompt, HF's expanded ids, HF's greedy
continuation, the smallest top-1/top-2 margin) and logits.npy (HF float32 logits of the first case's prompt).
The text model's sliding window (8) is shorter than an image (16 tokens), so its windowed layers test the
mask's AND of window and image block.
"""
from __future__ import annotations

import os

import torch
from make_model_fixtures import randomize
from make_vision_fixtures import chat_cases, greedy_without_eos, make_images, make_tokenizer, save_processor, \
    write_golden
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil, Gemma3Processor

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models", "tiny-gemma3-vision")
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_image>", "<end_of_image>", "<image_soft_token>",
            "<start_of_turn>", "<end_of_turn>")
BOI_ID, EOI_ID, IMAGE_ID = 4, 5, 6
# Gemma 3's template, shortened (no system-prompt folding): images print <start_of_image>, texts trimmed
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
IMAGES = {"wide.png": (90, 50, 7), "small.png": (30, 40, 8), "square.png": (64, 64, 9)}   # (width, height, seed)


def cases() -> list[dict]:
    chat = chat_cases("wide.png", ("small.png", "square.png"), "small.png")
    return [
        chat["one_image"], chat["two_images"],
        {"name": "text_around", "raw": "look at <start_of_image> and tell me:", "images": ["square.png"]},
        chat["two_turns"],
        {"name": "raw_placeholder", "raw": "<start_of_image>A photo of", "images": ["wide.png"]},
        chat["text_only"],
        # text_around's first 24 tokens (8-token blocks: a prefix hit that ends inside the image), then other text
        {"name": "same_start_other_end", "raw": "look at <start_of_image>so, what is it?", "images": ["square.png"]},
        # pan-and-scan: the wide image and its two crops (45x50 each), each 16 tokens
        dict(chat["one_image"], name="pan_and_scan",
             processor_kwargs={"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 20}),
    ]


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(2)
    os.makedirs(OUT, exist_ok=True)
    tokenizer = make_tokenizer(SPECIALS, bos="<bos>", eos="<eos>", unk="<unk>", pad="<pad>",
                               additional=SPECIALS[4:], chat_template=CHAT_TEMPLATE)
    tokenizer.boi_token, tokenizer.eoi_token, tokenizer.image_token = SPECIALS[4:7]
    tokenizer.boi_token_id, tokenizer.eoi_token_id, tokenizer.image_token_id = BOI_ID, EOI_ID, IMAGE_ID
    vocab = len(tokenizer)
    text = dict(vocab_size=vocab + 7, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                sliding_window=8, max_position_embeddings=512, rms_norm_eps=1e-6,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1, pad_token_id=0)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, image_size=56, patch_size=7, layer_norm_eps=1e-6,
                  hidden_act="gelu_pytorch_tanh")
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                          boi_token_index=BOI_ID, eoi_token_index=EOI_ID, image_token_index=IMAGE_ID,
                          bos_token_id=2, eos_token_id=[1, 8], pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    randomize(model, 0)
    model.to(torch.bfloat16).save_pretrained(OUT, safe_serialization=True)
    model = Gemma3ForConditionalGeneration.from_pretrained(OUT, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    image_processor = Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, resample=2,
                                              image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=16,
                                chat_template=CHAT_TEMPLATE)
    save_processor(processor, tokenizer, OUT, "Gemma3ImageProcessor")
    images = make_images(IMAGES, OUT)
    write_golden(OUT, model, processor, cases(), images, greedy_without_eos)


if __name__ == "__main__":
    main()
