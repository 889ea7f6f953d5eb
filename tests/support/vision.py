"""A vision family's tiny checkpoint (tests/make_vision_fixtures.py, make_qwen_vl_fixtures.py) as its tests use
it: the golden cases, the images by name, as data URLs and in OpenAI chat messages, and an offline LLM."""
from __future__ import annotations

import base64
import copy
import os

import numpy as np
import pytest
from PIL import Image

from support.tiny_models import PagedRunner, fixture_path, golden, hf_logits

GREEDY = 20          # the golden continuations' length


class VisionFixture:
    def __init__(self, name: str, max_num_batched_tokens: int, **llm_kwargs):
        self.name, self.folder = name, fixture_path(name)
        self.cases = {c["name"]: c for c in golden(name)}
        self.max_num_batched_tokens = max_num_batched_tokens
        self.llm_kwargs = llm_kwargs          # what every offline LLM of the fixture gets besides

    def image(self, name: str) -> Image.Image:
        return Image.open(os.path.join(self.folder, name))

    def data_url(self, name: str) -> str:
        with open(os.path.join(self.folder, name), "rb") as f:
            return "data:image/png;base64," + base64.b64encode(f.read()).decode()

    def openai_messages(self, case: dict) -> list[dict]:
        """The case's messages with its images as OpenAI image_url parts (data URLs)."""
        msgs, names = copy.deepcopy(case["messages"]), iter(case["images"])
        for m in msgs:
            m["content"] = [{"type": "image_url", "image_url": {"url": self.data_url(next(names))}}
                            if p["type"] == "image" else p for p in m["content"]]
        return msgs

    def run_case(self, llm, case: dict, image_names: list[str] | None = None):
        """A golden case through an offline LLM, greedy over ``GREEDY`` tokens: a raw prompt with its images
        (``image_names`` instead, if given), or the case's chat messages with data URLs."""
        from jaxserve.sampling_params import SamplingParams
        sp = SamplingParams(temperature=0.0, max_tokens=GREEDY, ignore_eos=True)
        if "raw" in case:
            images = [self.image(n) for n in (image_names or case["images"])]
            return llm.generate({"prompt": case["prompt"], "multi_modal_data": {"image": images}}, sp,
                                use_tqdm=False)[0]
        return llm.chat(self.openai_messages(case), sp, use_tqdm=False)[0]

    def check_greedy(self, llm, name: str) -> None:
        """The case's prompt ids and greedy continuation are HF's."""
        out = self.run_case(llm, self.cases[name])
        assert out.prompt_token_ids == self.cases[name]["prompt_ids"]
        assert list(out.outputs[0].token_ids) == self.cases[name]["greedy_ids"]

    def check_sdk_chat(self, client, model: str, name: str) -> None:
        """The case's chat through the server with the openai SDK (data URLs): HF's greedy text and prompt
        length."""
        from transformers import AutoTokenizer
        case = self.cases[name]
        r = client.chat.completions.create(model=model, messages=self.openai_messages(case), max_tokens=GREEDY,
                                           temperature=0, extra_body={"ignore_eos": True})
        want = AutoTokenizer.from_pretrained(self.folder).decode(case["greedy_ids"], skip_special_tokens=True)
        assert r.choices[0].message.content == want
        assert r.usage.prompt_tokens == len(case["prompt_ids"])

    def check_no_compiles_after_warmup(self, llm, names: tuple[str, ...] = ("one_image", "two_images")) -> None:
        """Once the background compiles are done, image requests (one image, two images) compile nothing: no
        step variant, no encoder batch."""
        runner = llm.engine.core.runner
        assert llm.wait_compiled(timeout=600)
        before = (runner.compiled_variants(), runner.encoder._step._cache_size())
        for name in names:
            self.run_case(llm, self.cases[name])
        assert (runner.compiled_variants(), runner.encoder._step._cache_size()) == before

    def check_batched_with_text_only(self, llm, raw_cases: tuple[str, ...]) -> None:
        """Raw image prompts and a text-only prompt (before and after them) in one batch: each as alone."""
        from jaxserve.sampling_params import SamplingParams
        sp = SamplingParams(temperature=0.0, max_tokens=GREEDY, ignore_eos=True)
        text_ids = self.cases["text_only"]["prompt_ids"]
        raw = [self.cases[n] for n in raw_cases]
        prompts = [{"prompt_token_ids": text_ids}] + [
            {"prompt": c["prompt"], "multi_modal_data": {"image": [self.image(n) for n in c["images"]]}}
            for c in raw] + [{"prompt_token_ids": text_ids}]
        outs = llm.generate(prompts, sp, use_tqdm=False)
        expect = [self.cases["text_only"]] + raw + [self.cases["text_only"]]
        assert [list(o.outputs[0].token_ids) for o in outs] == [c["greedy_ids"] for c in expect]

    def embedded_first_case(self):
        """(the model in float32, the first case's expanded ids, its image features, their embeddings
        ``[images * tokens, hidden]``), the ids checked against HF's processor's."""
        from jaxserve.models.loader import load_model
        from jaxserve.multimodal.processing import ImageProcessing
        model = load_model(self.folder, dtype="float32")
        case = self.cases["one_image"]
        proc = ImageProcessing.from_folder(self.folder, model.config.extra_dict, tokenizer=model.tokenizer)
        ids, feats = proc.process(model.tokenizer.encode(case["prompt"], add_special_tokens=False),
                                  [self.image(n).convert("RGB") for n in case["images"]])
        assert ids == case["prompt_ids"]
        emb = model.family.encode_images(model.params, np.stack([f.pixel_values for f in feats]), model.config)
        return model, ids, feats, np.asarray(emb).reshape(-1, model.config.hidden_size)

    def check_prefill_logits(self, model, ids: list[int], mm_inputs, index: np.ndarray, max_len: int) -> None:
        """``ids`` prefilled in one step (the runner's inputs and forward, a paged cache of ``max_len``
        tokens) with the image operands ``mm_inputs`` at ``index``: logits within 1e-4 of HF float32's."""
        import functools

        import jax

        from jaxserve.runner.step_functions import forward_fn
        runner = PagedRunner(model, max_reqs=1, max_len=max_len)
        ints, layout = runner.inputs([(0, ids, 0)], max_len, logits_rows=list(range(len(ids))))
        step = jax.jit(functools.partial(forward_fn, model.family, model.config, "reference", False),
                       static_argnames=("layout",))
        _, logits = step(model.params, runner.kv_caches, ints, runner.no_prev, mm_inputs, index.astype(np.int32),
                         layout=layout)
        err = np.abs(np.asarray(logits)[:len(ids)] - hf_logits(self.name)).max()
        assert err <= 1e-4, f"max abs logit error {err:.2e} vs HF float32"

    def tp_report(self, names: tuple[str, ...]) -> dict:
        """In a process of 2 fake devices: each case's greedy ids at tensor parallelism 2, and the sharding of
        the vision tower's first q projection."""
        import jax
        assert jax.device_count() == 2
        engine = self.make_llm(tensor_parallel_size=2, skip_warmup=True, compilation_cache_dir="")
        report = {name: list(self.run_case(engine, self.cases[name]).outputs[0].token_ids) for name in names}
        wq = engine.engine.core.model.params["vision"]["layers"][0]["wq"]
        report["wq_spec"] = str(wq.sharding.spec)
        return report

    def check_tensor_parallel(self, test_file: str, names: tuple[str, ...]) -> None:
        """``test_file --tp-worker`` (which prints ``tp_report``) on 2 fake CPU devices: HF's greedy ids, and a
        vision tower sharded like the decoder."""
        from support.fake_devices import fake_device_report
        report = fake_device_report([os.path.abspath(test_file), "--tp-worker"], 2)
        for name in names:
            assert report[name] == self.cases[name]["greedy_ids"], name
        assert "tp" in report["wq_spec"]

    def make_llm(self, **kw):
        from jaxserve.llm import LLM
        opts = dict(dtype="float32", max_model_len=256, max_num_seqs=8,
                    max_num_batched_tokens=self.max_num_batched_tokens, use_tqdm_on_load=False)
        opts |= self.llm_kwargs | kw
        return LLM(self.folder, **opts)


def llm_fixture(vision: VisionFixture):
    """A module-scoped pytest fixture: ``vision``'s offline LLM, shut down after the module."""
    @pytest.fixture(scope="module")
    def llm():
        engine = vision.make_llm()
        yield engine
        engine.shutdown()
    return llm


def looked_up(payload: np.ndarray, table: np.ndarray) -> np.ndarray:
    """A uint8 payload ``[lh, lw, merge**2 * C * p * p]`` through its ``[C, 256]`` value table, on the host."""
    lh, lw, k = payload.shape
    c = table.shape[0]
    blocks = payload.reshape(lh, lw, -1, c, k // (4 * c)).astype(np.intp)
    return table[np.arange(c)[:, None], blocks].reshape(lh, lw, k)
