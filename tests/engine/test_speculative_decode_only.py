"""Verify steps in the decode-only forward (``JAXSERVE_SPEC_DECODE_TILE``): with the switch on, a speculative
step whose requests all have at most K + 1 tokens is marked decode-only with ``max_q_len`` K + 1 and runs the
``("forward-spec", T, K + 1, True)`` variant; with it off the keys are today's. On CPU the reference attention
ignores the mark, so greedy tokens stay the engine's without speculation either way (the kernel itself:
tests/kernels/test_spec_decode_tile.py)."""
import pytest

from jaxserve import SamplingParams
from support.tiny_models import tiny_llm

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[5, 6, 7, 8] * 5, list(range(10, 30)) * 2, [9, 4, 9, 4, 9, 4, 11]]


def _tokens(llm, prompts):
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True) for _ in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_verify_steps_take_the_decode_only_forward_with_the_switch_on(llm, monkeypatch, async_scheduling):
    """Async: steps placed as if the one in flight accepted all its drafts, moved back on the device."""
    monkeypatch.setenv("JAXSERVE_SPEC_ASYNC", "1" if async_scheduling else "0")
    spec = tiny_llm(speculative_config=NGRAM, enforce_eager=True, async_scheduling=async_scheduling)
    runner = spec.engine.core.runner
    variants, width = runner.variants, runner.variants.spec_width
    runner.shapes.uniform_decode = True       # as under a Pallas backend (the reference has no decode launch)
    marks = []

    def prepare(*a, _prepare=runner.prepare, **kw):
        out = _prepare(*a, **kw)
        if kw.get("spec_width"):
            marks.append((out.md.decode_only, out.md.max_q_len))
        return out
    runner.prepare = prepare
    want = _tokens(llm, PROMPTS)

    monkeypatch.setenv("JAXSERVE_SPEC_DECODE_TILE", "0")
    assert not variants.spec_decode
    assert _tokens(spec, PROMPTS) == want
    assert marks and not any(dec for dec, _ in marks)
    assert {len(k) for k in variants.keys() if k[0] == "forward-spec"} == {3}

    marks.clear()
    monkeypatch.setenv("JAXSERVE_SPEC_DECODE_TILE", "1")
    assert variants.spec_decode
    assert _tokens(spec, PROMPTS) == want
    assert (True, width) in marks and all(q == (width if dec else 1) for dec, q in marks)
    assert any(k[0] == "forward-spec" and k[2:] == (width, True) for k in variants.keys())
    assert spec.engine.core.stats()["spec_decode_num_accepted_tokens"] > 0
