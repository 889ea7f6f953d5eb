"""Golden fixtures of a tiny random Llama 3.2 Vision model (``MllamaForConditionalGeneration``: a tiled ViT with
a local and a gated global transformer, a projector, and a Llama text model with gated cross-attention layers)
from HF transformers; run with the oracle env:
    .venv-oracle/bin/python tests/make_vision_fixtures.py mllama

Writes tests/fixtures/models/tiny-mllama/: config.json, model.safetensors (bfloat16, read back as float32),
the processor's configs (Mllama image processing, PIL backend, 28x28 tiles, up to 2 tiles per image: a wide
image takes both, a square one one tile and a padding tile), a byte-level tokenizer with Llama 3's special
tokens and ``<|image|>`` (id = the text vocab size, as the hub's checkpoints have it), a shortened Llama 3.2
Vision chat template, the test images, golden.json (per case: prompt, HF's ids, HF's greedy continuation, the
smallest top-1/top-2 margin) and logits.npy (HF float32 logits of the first case's prompt). Raw prompts hold
``<|begin_of_text|>`` themselves (HF's processor adds it where it is missing).
"""
from __future__ import annotations

import os

import torch
from make_model_fixtures import randomize
from make_vision_fixtures import chat_cases, greedy_without_eos, make_images, make_tokenizer, save_processor, \
    write_golden
from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaImageProcessorPil, MllamaProcessor

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "models", "tiny-mllama")
SPECIALS = ("<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>")
IMAGE_TOKEN = "<|image|>"
# Llama 3.2 Vision's template, shortened (no system prompt, no tools): an image part prints <|image|>
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
IMAGES = {"wide.png": (80, 36, 11), "square.png": (40, 40, 12), "tall.png": (30, 70, 13)}   # (width, height, seed)


def cases() -> list[dict]:
    chat = chat_cases("wide.png", ("square.png", "tall.png"), "tall.png")
    return [
        chat["one_image"],
        dict(chat["one_image"], name="one_image_other", images=["square.png"]),
        {"name": "text_around", "raw": "<|begin_of_text|>look at <|image|> and tell me:", "images": ["tall.png"]},
        chat["two_turns"],
        {"name": "raw_placeholder", "raw": "<|image|><|begin_of_text|>A photo of", "images": ["square.png"]},
        chat["text_only"],
        chat["two_images"],
        # consecutive images: HF gives both the text after them
        {"name": "two_images_together", "messages": [{"role": "user", "content": [
            {"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare them."}]}],
         "images": ["wide.png", "square.png"]},
        # one image twice: one cross-attention slot, its keys counted twice where both are seen
        {"name": "same_image_twice", "messages": [{"role": "user", "content": [
            {"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same?"}]}],
         "images": ["tall.png", "tall.png"]},
    ]


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(2)
    os.makedirs(OUT, exist_ok=True)
    tokenizer = make_tokenizer(SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>", unk="<unk>",
                               pad="<|finetune_right_pad_id|>", additional=SPECIALS[4:], chat_template=CHAT_TEMPLATE)
    vocab = len(tokenizer)                 # the text vocab; <|image|> is the next id, as on the hub
    tokenizer.add_special_tokens({"additional_special_tokens": [*SPECIALS[4:], IMAGE_TOKEN]})
    assert tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == vocab
    tokenizer.image_token, tokenizer.image_token_id = IMAGE_TOKEN, vocab
    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                cross_attention_layers=[1, 3], num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                bos_token_id=1, eos_token_id=6, pad_token_id=3)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_global_layers=2,
                  attention_heads=2, image_size=28, patch_size=14, max_num_tiles=2, vision_output_dim=96,
                  intermediate_layers_indices=[0, 2], supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]],
                  norm_eps=1e-5)
    config = MllamaConfig(text_config=text, vision_config=vision, image_token_index=vocab)
    torch.manual_seed(0)
    model = MllamaForConditionalGeneration(config).eval()
    randomize(model, 0)
    model.to(torch.bfloat16).save_pretrained(OUT, safe_serialization=True)
    model = MllamaForConditionalGeneration.from_pretrained(OUT, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    image_processor = MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=2)
    processor = MllamaProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    save_processor(processor, tokenizer, OUT, "MllamaImageProcessor")
    images = make_images(IMAGES, OUT)
    write_golden(OUT, model, processor, cases(), images, greedy_without_eos)


if __name__ == "__main__":
    main()
