"""Structured outputs on the real SmolLM2 (CPU): JSON schemas, regex, choice, json_object, batched with free text.

One module-scoped LLM runs one large ``generate`` call (every schema greedy and sampled, plus regex, choice,
json_object and unconstrained prompts); the tests below check its replies. The sampler's mask is checked
against a numpy reference, and the bad-input cases against their messages.
"""
from __future__ import annotations

import json
import math
import random
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams, StructuredOutputsParams
from jaxserve.runner import sampler as S

MAX_TOKENS = 96
# two token buckets (32 and the largest) instead of seven: fewer forwards to compile, nothing here is about them
ENGINE = dict(max_model_len=512, max_num_seqs=32, max_num_batched_tokens=256, token_buckets=[32])


# ---------------------------------------------------------------------------------------------------
# the sampler's mask against numpy
# ---------------------------------------------------------------------------------------------------
def numpy_apply_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    out = logits.copy()
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                out[r, t] = -np.inf
    return out


@pytest.mark.parametrize("vocab", [64, 70, 95])
def test_bitmask_application_matches_numpy(vocab):
    rng = np.random.default_rng(vocab)
    rows, width = 5, (vocab + 31) // 32 + (vocab == 95)          # 95: a mask wider than the logits
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, size=(rows, width), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1                                             # all allowed
    bitmask[1] = 0
    bitmask[1, 0] = 1 << 3                                      # only token 3
    got = np.asarray(jax.jit(S.apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(got, numpy_apply_bitmask(logits, bitmask))


def test_sampler_with_mask_samples_only_allowed_tokens_and_logprobs_are_masked():
    rng = np.random.default_rng(0)
    R, V = 8, 64
    logits = rng.normal(size=(R, V)).astype(np.float32) * 3
    allowed = [rng.choice(V, size=3, replace=False) for _ in range(R)]
    bitmask = np.zeros((R, 2), np.int32)
    for r, toks in enumerate(allowed):
        for t in toks:
            bitmask[r, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    params = [SamplingParams(temperature=0 if r % 2 else 1.0, seed=r) for r in range(R)]
    meta = S.make_sampling_metadata(params, [[]] * R, [[0]] * R, [0] * R, V, R)
    out = jax.jit(S.sample, static_argnames=("num_logprobs",))(jnp.asarray(logits), meta, num_logprobs=3,
                                                               bitmask=jnp.asarray(bitmask))
    ids, lps = np.asarray(out.token_ids), np.asarray(out.topk_logprobs)
    for r in range(R):
        assert ids[r] in allowed[r]
        if r % 2:
            assert ids[r] == allowed[r][np.argmax(logits[r, allowed[r]])]
        # the top-3 logprobs are those of the masked distribution: they sum to probability 1
        assert math.isclose(float(np.exp(lps[r]).sum()), 1.0, rel_tol=1e-4)


def test_llguidance_reads_the_embedded_tokenizer_bytes_as_hf_decodes_them():
    import llguidance

    from jaxserve.engine.structured_output import llguidance_tokenizer_json
    from jaxserve.models.tokenizers import embedded_tokenizer
    tok = embedded_tokenizer()
    ll = llguidance.LLTokenizer(llguidance_tokenizer_json(tok), n_vocab=len(tok), eos_token=tok.eos_token_id)
    text = 'The sky is "blue", {"a": 1}\n  héllo wörld 日本'
    assert ll.decode_str(tok.encode(text, add_special_tokens=False)) == text


# ---------------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    ({}, "exactly one"),
    ({"regex": "a+", "choice": ["a"]}, "exactly one"),
    ({"choice": []}, "non-empty list"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": 3}, "JSON schema"),
])
def test_structured_outputs_params_reject_bad_input(kw, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kw)


# ---------------------------------------------------------------------------------------------------
# 50+ generated JSON schemas; every reply must parse and validate
# ---------------------------------------------------------------------------------------------------
def _leaf(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["string", "pattern", "integer", "number", "boolean", "enum", "array", "object"]
                      if depth < 2 else ["string", "integer", "boolean", "enum"])
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice([r"^[A-Z][a-z]{1,8}$", r"^\d{3}-\d{4}$",
                                                         r"^[a-z]+@[a-z]+\.com$", r"^(red|green|blue)$"]),
                "maxLength": 24}
    if kind == "integer":
        lo = rng.randint(-100, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 1000)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["alpha", "beta", "gamma", "delta", "north", "south", 1, 2, True, None],
                                   rng.randint(2, 4))}
    if kind == "array":
        return {"type": "array", "items": _leaf(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["name", "age", "city", "score", "tags", "id", "kind", "owner", "valid", "size"],
                       rng.randint(1, 4))
    props = {n: _leaf(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def make_schemas(count: int) -> list[dict]:
    rng = random.Random(28)
    schemas = []
    for i in range(count):
        if i % 5 == 4:
            schemas.append({"type": "array", "items": _object(rng, 1), "minItems": 1, "maxItems": 2})
        else:
            schemas.append(_object(rng, 0))
    return schemas


SCHEMAS = make_schemas(52)
REGEXES = [r"\d{3}-\d{3}-\d{4}", r"(yes|no), because [a-z ]{5,20}\.", r"[A-Z][a-z]{2,10} [A-Z][a-z]{2,10}",
           r"0x[0-9a-f]{4,8}"]
CHOICES = [["positive", "negative", "neutral"], ["Paris", "London", "Berlin", "Madrid"]]
FREE_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def chat_prompt(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


LLM_ARGS = dict(model=None, **ENGINE)


@pytest.fixture(scope="module")
def batch(llm):
    """(kind, spec, params, output) for every request of one generate call."""
    tok = llm.get_tokenizer()
    work = []
    for i, schema in enumerate(SCHEMAS):
        prompt = chat_prompt(tok, f"Reply with JSON for this schema: {json.dumps(schema)}")
        # every schema once, greedy and sampled in turn (so arrays and objects meet both)
        sampling = dict(temperature=0.8, seed=i) if i % 2 else dict(temperature=0)
        work.append(("json", schema, prompt, SamplingParams(max_tokens=MAX_TOKENS, **sampling,
                                                            structured_outputs=StructuredOutputsParams(json=schema))))
    for rx in REGEXES:
        work.append(("regex", rx, chat_prompt(tok, "Give an example."),
                     SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=1,
                                    structured_outputs=StructuredOutputsParams(regex=rx))))
    for ch in CHOICES:
        work.append(("choice", ch, chat_prompt(tok, f"Pick one of {ch}."),
                     SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                    structured_outputs=StructuredOutputsParams(choice=ch))))
    work.append(("json_object", None, chat_prompt(tok, "Describe a cat as JSON."),
                 SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                structured_outputs=StructuredOutputsParams(json_object=True))))
    for p in FREE_PROMPTS:
        work.append(("free", None, p, SamplingParams(max_tokens=24, temperature=0)))
    outs = llm.generate([w[2] for w in work], [w[3] for w in work], use_tqdm=False)
    return [(kind, spec, params, out.outputs[0]) for (kind, spec, _, params), out in zip(work, outs)]


def test_every_json_schema_reply_parses_and_validates(batch):
    replies = [(spec, out) for kind, spec, _, out in batch if kind == "json"]
    assert len(replies) == len(SCHEMAS)
    for schema, out in replies:
        assert out.finish_reason == "stop", (schema, out.text)
        value = json.loads(out.text)
        jsonschema.validate(value, schema)
        # compact separators (disable_any_whitespace): no whitespace outside strings
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', out.text)), out.text


def test_regex_and_choice_replies_match(batch):
    for kind, spec, _, out in batch:
        if kind == "regex":
            assert re.fullmatch(spec, out.text), (spec, out.text)
            assert out.finish_reason == "stop"
        elif kind == "choice":
            assert out.text in spec and out.finish_reason == "stop"


def test_json_object_reply_is_an_object(batch):
    (out,) = [o for kind, _, _, o in batch if kind == "json_object"]
    assert isinstance(json.loads(out.text), dict) and out.finish_reason == "stop"


def test_unconstrained_requests_batched_with_constrained_ones_give_the_same_tokens(llm, batch):
    free = [o for kind, _, _, o in batch if kind == "free"]
    alone = llm.generate(FREE_PROMPTS, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [o.token_ids for o in free]


def test_mask_fill_time_is_in_the_engine_stats(llm, batch):
    stats = llm.engine.stats()
    assert stats["structured_steps"] > 0 and stats["structured_mask_ms_per_step"] > 0


def test_seeded_n_and_logprobs_of_the_masked_distribution(llm):
    tok = llm.get_tokenizer()
    prompt = chat_prompt(tok, "Is the sky blue? Answer yes or no.")
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, logprobs=20,
                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    a, b = llm.generate([prompt], sp, use_tqdm=False)[0], llm.generate([prompt], sp, use_tqdm=False)[0]
    assert [c.text for c in a.outputs] == [c.text for c in b.outputs]
    for c in a.outputs:
        assert c.text in ("yes", "no") and c.finish_reason == "stop"
        first = c.logprobs[0]
        finite = [lp.logprob for lp in first.values() if math.isfinite(lp.logprob)]
        # only prefixes of "yes" / "no" have any probability, and they hold all of it
        assert all(tok.decode([t]) in ("y", "ye", "yes", "n", "no") for t, lp in first.items()
                   if math.isfinite(lp.logprob))
        assert math.isclose(sum(math.exp(x) for x in finite), 1.0, rel_tol=1e-3)


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(llm):
    sp = SamplingParams(max_tokens=4, temperature=0, structured_outputs=StructuredOutputsParams(regex="[a-z]{40}"))
    out = llm.generate(["Write letters:"], sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4 and re.fullmatch("[a-z]*", out.text)


@pytest.mark.parametrize("kw, message", [
    ({"regex": "a(b"}, "regex does not compile"),
    ({"json": {"type": "object", "if": {"type": "object"}}}, "cannot enforce"),
    ({"json": {"type": "frobnicate"}}, "invalid JSON schema"),
    ({"grammar": "start: foo"}, "grammar does not compile"),
])
def test_constraints_that_do_not_compile_are_value_errors_before_anything_runs(llm, kw, message):
    sp = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**kw))
    with pytest.raises(ValueError, match=message):
        llm.generate(["hi"], sp, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_lark_grammar(llm):
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    sp = SamplingParams(max_tokens=16, temperature=0, structured_outputs=StructuredOutputsParams(grammar=grammar))
    out = llm.generate(["What is 6 times 7?"], sp, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", out.text) and out.finish_reason == "stop"


def test_a_constrained_request_makes_a_multi_step_decode_a_single_step():
    from jaxserve.engine.request import Request
    from support.fake_scheduler import make, params, prefill
    sched, _, dev = make(steps=4)
    a = Request("a", [1, 2, 3], params(max_tokens=50))
    b = Request("b", [4, 5, 6], params(max_tokens=50))
    b.sampling_params.structured_outputs = StructuredOutputsParams(regex="[a-z]+")
    prefill(sched, dev, a, b)
    assert sched.schedule().num_steps == 1
    sched2, _, dev2 = make(steps=4)
    prefill(sched2, dev2, Request("a", [1, 2, 3], params(max_tokens=50)))
    assert sched2.schedule().num_steps == 4


def test_preempted_constrained_requests_keep_their_grammar_state_without_async_scheduling():
    """A KV cache too small for all requests at once: constrained requests are preempted and recomputed
    (their matchers keep the tokens already generated), here with the synchronous step loop."""
    llm = LLM(None, dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              num_gpu_blocks_override=10, async_scheduling=False, token_buckets=[16])
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"enum": ["red", "green"]},
                                                         "minItems": 10, "maxItems": 12}},
              "required": ["items"], "additionalProperties": False}
    sp = SamplingParams(max_tokens=80, temperature=0.8, seed=3, structured_outputs=StructuredOutputsParams(json=schema))
    prompts = [f"Request {i}. Please list some colours, red or green, as a JSON object with an items array; "
               "use at least ten items and nothing else:" for i in range(4)]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.engine.stats()["num_preemptions"] > 0
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


def test_manager_with_a_model_vocabulary_wider_than_the_tokenizer():
    """Dummy weights with another model's tokenizer: the config's vocab (and EOS ids) lie past the tokenizer;
    the mask still covers the model's vocabulary and never allows the ids the tokenizer lacks."""
    from types import SimpleNamespace

    from jaxserve.engine.structured_output import StructuredOutputManager
    from jaxserve.models.tokenizers import embedded_tokenizer
    tok = embedded_tokenizer()
    manager = StructuredOutputManager(tok, 128256, (128001, 128009))
    spec = StructuredOutputsParams(choice=["yes", "no"])
    manager.add_request(SimpleNamespace(request_id="a", sampling_params=SimpleNamespace(structured_outputs=spec)))
    mask = manager.fill_bitmask([(1, "a")], 3)
    assert mask.shape == (3, 128256 // 32) and (mask[0] == -1).all() and (mask[2] == -1).all()
    allowed = np.flatnonzero(np.unpackbits(mask[1].view(np.uint8), bitorder="little"))
    assert len(allowed) and allowed.max() < len(tok)
    assert {tok.decode([t]) for t in allowed} <= {"y", "ye", "yes", "n", "no"}
    assert manager.compile(spec) is manager.compile(StructuredOutputsParams(choice=["yes", "no"]))   # cached


_TP_SCRIPT = r'''
import json, os, sys
from jaxserve.llm import LLM
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
out = {}
for tp in (1, 2):
    llm = LLM(sys.argv[1], tensor_parallel_size=tp, dtype="float32", max_model_len=128, max_num_batched_tokens=64,
              max_num_seqs=4, kv_cache_memory_bytes=1 << 22, skip_warmup=True, compilation_cache_dir="",
              use_tqdm_on_load=False)
    sp = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-z]{3,8}"))
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([[5, 6, 7, 8], [9, 10, 11]], [sp, free], use_tqdm=False)
    out[tp] = [[o.outputs[0].text, o.outputs[0].token_ids] for o in outs]
    del llm
print(json.dumps(out))
'''


@pytest.mark.slow     # fake-device TP (~11 s)
def test_tensor_parallel_2_gives_the_same_constrained_tokens():
    """One process, a 2-device mesh (fake CPU devices, so a subprocess): the mask reaches the replicated
    sampler and the tokens equal TP=1's (the tiny fixture model's ids < 256 include the letters)."""
    from support.fake_devices import fake_device_report
    from support.tiny_models import fixture_path
    out = fake_device_report(["-c", _TP_SCRIPT, fixture_path("tiny-llama3")], 2, timeout=600)
    assert out["1"] == out["2"]
    assert re.fullmatch("[a-z]{3,8}", out["2"][0][0])


@pytest.mark.parametrize("disable_any_whitespace", [True, False])
def test_json_whitespace_follows_disable_any_whitespace(disable_any_whitespace):
    from jaxserve.engine.structured_output import StructuredOutputManager
    from jaxserve.models.tokenizers import embedded_tokenizer
    tok = embedded_tokenizer()
    manager = StructuredOutputManager(tok, len(tok), (tok.eos_token_id,),
                                      disable_any_whitespace=disable_any_whitespace)
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})

    def accepts(text: str) -> bool:
        m = manager.compile(spec).deep_copy()
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()
    assert accepts('{"a":1}')
    assert accepts('{ "a": 1 }') is not disable_any_whitespace


# ---------------------------------------------------------------------------------------------------
# a thinking model's constraint holds after its end-of-thinking marker
# ---------------------------------------------------------------------------------------------------
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}


def test_the_manager_starts_a_matcher_after_the_marker_unmasked_and_unconsumed_before():
    from types import SimpleNamespace

    from jaxserve.engine.structured_output import StructuredOutputManager
    from jaxserve.models.tokenizers import embedded_tokenizer
    tok = embedded_tokenizer()
    manager = StructuredOutputManager(tok, len(tok), (tok.eos_token_id,))
    marker = tok.encode("</think>", add_special_tokens=False)
    assert len(marker) == 3                         # several tokens in this vocabulary
    spec = StructuredOutputsParams(json=CITY, reasoning_end_token_ids=marker)
    req = SimpleNamespace(request_id="r", sampling_params=SamplingParams(structured_outputs=spec))
    manager.add_request(req)
    rows = [(0, "r")]
    thought = tok.encode("Not JSON at all </ think> </", add_special_tokens=False)    # marker parts, not the marker
    for t in thought + marker:
        assert (manager.fill_bitmask(rows, 1) == -1).all()          # thinking: every token allowed
        assert manager.accept("r", t) is False
    mask = manager.fill_bitmask(rows, 1)
    answer = tok.encode('{"city":"Paris"}', add_special_tokens=False)
    first = answer[0]
    assert (mask[0, first // 32] >> (first % 32)) & 1 and not (mask == -1).all()      # the grammar from here
    assert [manager.accept("r", t) for t in answer] == [False] * (len(answer) - 1) + [True]   # the grammar ends
    assert manager.take_failure("r") is None


def test_the_grammar_starts_after_the_marker_in_the_engine(llm):
    """The real model's greedy output up to a marker taken from it is the same with the constraint (unmasked
    before); after it the reply follows the grammar. A marker the output never holds leaves it unconstrained."""
    prompt = chat_prompt(llm.get_tokenizer(), "Tell me about Paris.")
    free = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0].outputs[0]
    ids = free.token_ids
    for k in (1, 2):
        end = next(i for i in range(3, len(ids)) if ids[i + 1 - k:i + 1] not in
                   [ids[j + 1 - k:j + 1] for j in range(k - 1, i)]) + 1     # the marker's first occurrence ends here
        marker = ids[end - k:end]
        spec = StructuredOutputsParams(json=CITY, reasoning_end_token_ids=marker)
        out = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0, structured_outputs=spec),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids[:end] == ids[:end] and out.finish_reason == "stop"
        answer = json.loads(llm.get_tokenizer().decode(out.token_ids[end:]))
        jsonschema.validate(answer, CITY)
    never = StructuredOutputsParams(json=CITY, reasoning_end_token_ids=[ids[0], ids[0], ids[0], ids[0]])
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, structured_outputs=never),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids
