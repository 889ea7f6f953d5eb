"""SamplingParams: vLLM's defaults, normalisation, every validation error, eos handling, logprob limits."""
import pytest

from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import RequestOutputKind, SamplingParams, SamplingType, check_logprobs, check_token_ids


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, 0.0, 0.0, 1.0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, 0, 0.0, None)
    assert (p.stop, p.stop_token_ids, p.ignore_eos, p.max_tokens, p.min_tokens) == ([], [], False, 16, 0)
    assert (p.logprobs, p.prompt_logprobs, p.truncate_prompt_tokens) == (None, None, None)
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.include_stop_str_in_output
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.sampling_type is SamplingType.RANDOM
    assert p.output_text_buffer_length == 0


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[5, 3, 5], top_k=-1, seed=-1, logprobs=True)
    assert p.stop == ["###"] and p.stop_token_ids == [5, 3] and p.top_k == 0 and p.seed is None
    assert p.logprobs == 1
    assert p.all_stop_token_ids == {3, 5}
    assert p.output_text_buffer_length == 2
    assert SamplingParams(stop=["ab", "wxyz"], include_stop_str_in_output=True).output_text_buffer_length == 0
    assert SamplingParams(stop=("ab", "wxyz")).output_text_buffer_length == 3


def test_greedy_turns_filters_off_and_tiny_temperature_is_clamped():
    g = SamplingParams(temperature=0, top_p=0.5, top_k=7, min_p=0.3)
    assert g.sampling_type is SamplingType.GREEDY
    assert (g.temperature, g.top_p, g.top_k, g.min_p) == (0.0, 1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-7).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=1e-3).temperature == pytest.approx(1e-2)
    assert SamplingParams(seed=0).sampling_type is SamplingType.RANDOM_SEED


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n must be an integer in [1, 1024], got 0"),
    (dict(n=2.5), "n must be"),
    (dict(presence_penalty=2.5), "presence_penalty must be a number in [-2, 2], got 2.5"),
    (dict(frequency_penalty=-3), "frequency_penalty must be a number in [-2, 2], got -3"),
    (dict(repetition_penalty=0), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number > 0"),
    (dict(temperature=-1), "temperature must be >= 0 (0 = greedy), got -1"),
    (dict(temperature=2.5), "temperature must be <= 2, got 2.5"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=0), "top_p must be in (0, 1] (1 = off), got 0"),
    (dict(top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_k=-2), "top_k must be an integer >= 1, or 0 or -1 to consider all tokens, got -2"),
    (dict(top_k=2.0), "top_k must be an integer"),
    (dict(min_p=1.5), "min_p must be in [0, 1] (0 = off), got 1.5"),
    (dict(min_p=-0.1), "min_p must be in [0, 1]"),
    (dict(seed="7"), "seed must be an integer in [0, 2^64)"),
    (dict(seed=2**64), "seed must be an integer in [0, 2^64) (or -1 / null for none), got 18446744073709551616"),
    (dict(seed=-2), "seed must be an integer in [0, 2^64)"),
    (dict(seed=2**64 - 2, n=3), "seed + n must be at most 2^64 (choice i samples with seed + i)"),
    (dict(stop=["ok", "a\ud800b"]), "stop[1] holds a lone surrogate ('\\ud800' at 1)"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0, got -1"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens must be <= max_tokens (10), got 20"),
    (dict(logprobs=-2), "logprobs must be None, an integer >= 0, or -1"),
    (dict(prompt_logprobs=-5), "prompt_logprobs must be None, an integer >= 0, or -1"),
    (dict(stop=["ok", ""]), "stop must be a string or a list of non-empty strings"),
    (dict(stop="x", detokenize=False), "stop strings need detokenize=True"),
    (dict(stop_token_ids=[1, -4]), "stop_token_ids must be a list of token ids"),
    (dict(stop_token_ids=["a"]), "stop_token_ids must be a list of token ids"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be None, an integer >= 1, or -1"),
    (dict(output_kind="delta"), "output_kind must be a RequestOutputKind"),
    (dict(n=3, temperature=0), "n must be 1 when temperature is 0 (greedy sampling), got 3"),
    (dict(logit_bias=[(1, 2.0)]), "logit_bias must be a map of token id to bias"),
    (dict(logit_bias={"a": 1}), "logit_bias keys must be token ids (integers >= 0), got 'a'"),
    (dict(logit_bias={-3: 1}), "logit_bias keys must be token ids (integers >= 0), got -3"),
    (dict(logit_bias={"1.5": 1}), "logit_bias keys must be token ids"),
    (dict(logit_bias={5: 101}), "logit_bias values must be numbers in [-100, 100], got 101 for token 5"),
    (dict(logit_bias={"5": float("nan")}), "logit_bias values must be numbers in [-100, 100], got nan for token 5"),
    (dict(logit_bias={5: "1"}), "logit_bias values must be numbers in [-100, 100]"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list of token ids (integers >= 0), got []"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids must be a non-empty list of token ids"),
    (dict(allowed_token_ids="12"), "allowed_token_ids must be a non-empty list of token ids"),
    (dict(bad_words="word"), "bad_words must be a list of words (non-blank strings), got 'word'"),
    (dict(bad_words=["ok", " "]), "bad_words must be a list of words (non-blank strings)"),
    (dict(bad_words=[3]), "bad_words must be a list of words"),
])
def test_validation_errors_name_the_field_and_range(kwargs, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_valid_edges_are_accepted():
    SamplingParams(presence_penalty=-2, frequency_penalty=2, temperature=2, top_p=1e-9, min_p=1, top_k=1,
                   max_tokens=None, logprobs=-1, prompt_logprobs=0, truncate_prompt_tokens=-1, n=4)


def test_update_from_generation_config():
    p = SamplingParams(stop_token_ids=[7])
    p.update_from_generation_config({"eos_token_id": [2, 9]}, eos_token_id=2)
    assert p.eos_token_id == 2
    assert p.stop_token_ids == [7, 9]            # the extra eos id stops too; the primary one is eos_token_id
    assert p.all_stop_token_ids == {2, 7, 9}
    q = SamplingParams(ignore_eos=True)
    q.update_from_generation_config({"eos_token_id": 9}, eos_token_id=2)
    assert q.eos_token_id is None and q.stop_token_ids == []
    assert q.all_stop_token_ids == {2, 9}        # min_tokens still blocks eos, as in vLLM
    r = SamplingParams()
    r.update_from_generation_config(None, eos_token_id=None)
    assert r.all_stop_token_ids == set()


def test_clone_is_independent():
    p = SamplingParams(stop_token_ids=[1])
    c = p.clone()
    c.update_from_generation_config({}, eos_token_id=5)
    assert p.all_stop_token_ids == {1} and c.all_stop_token_ids == {1, 5}


def test_check_logprobs():
    check_logprobs(SamplingParams(logprobs=20, prompt_logprobs=0), max_logprobs=20, vocab_size=100)
    with pytest.raises(InvalidRequestError, match=r"logprobs must be <= 20 \(the server's --max-logprobs\), got 21"):
        check_logprobs(SamplingParams(logprobs=21), max_logprobs=20, vocab_size=100)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be <= 20") as info:
        check_logprobs(SamplingParams(prompt_logprobs=-1), max_logprobs=20, vocab_size=100)
    assert info.value.param == "prompt_logprobs"
    check_logprobs(SamplingParams(logprobs=-1), max_logprobs=-1, vocab_size=100)
    with pytest.raises(InvalidRequestError, match="vocabulary size 100"):
        check_logprobs(SamplingParams(logprobs=101), max_logprobs=-1, vocab_size=100)


def test_token_restrictions_normalise_as_vllm():
    p = SamplingParams(logit_bias={"12": 5, 7: -100, "0": 100.0}, allowed_token_ids=(4, 2, 4), bad_words=("x",))
    assert p.logit_bias == {12: 5.0, 7: -100.0, 0: 100.0} and all(type(v) is float for v in p.logit_bias.values())
    assert p.allowed_token_ids == [4, 2] and p.bad_words == ["x"] and p.restricts_tokens
    assert not SamplingParams(logit_bias={}, bad_words=[]).restricts_tokens
    assert SamplingParams().bad_words_token_ids is None


def test_bad_words_tokenize_with_and_without_a_leading_space_as_vllm():
    from jaxserve.models.tokenizers import embedded_tokenizer
    tok = embedded_tokenizer()

    def enc(text):
        return tok.encode(text, add_special_tokens=False)
    p = SamplingParams(bad_words=["hello world", "  hello", "12"])
    p.update_from_tokenizer(tok)
    # "hello world" and " hello world" differ in their first token: both; "12" and " 12" differ in length
    expected = [enc("hello world"), enc(" hello world"), enc("hello"), enc(" hello"), enc("12")]
    assert len(enc(" 12")) != len(enc("12")) and p.bad_words_token_ids == expected
    assert p.needs_token_history                              # multi-token words read the output so far
    one = SamplingParams(bad_words=["hello"])
    one.update_from_tokenizer(tok)
    assert one.bad_words_token_ids == [enc("hello"), enc(" hello")] and not one.needs_token_history
    assert SamplingParams(repetition_penalty=1.1).needs_token_history
    assert p.clone().bad_words_token_ids == expected          # the engine's copy (pickled to the core) keeps them


def test_check_token_ids_against_the_vocabulary():
    check_token_ids(SamplingParams(logit_bias={99: 1}, allowed_token_ids=[0, 99]), vocab_size=100)
    with pytest.raises(InvalidRequestError, match=r"logit_bias has token ids outside the vocabulary \(size 100\): "
                                                  r"\[100, 500\]") as info:
        check_token_ids(SamplingParams(logit_bias={100: 1, 3: 1, 500: 2}), vocab_size=100)
    assert info.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError, match="allowed_token_ids has token ids outside") as info:
        check_token_ids(SamplingParams(allowed_token_ids=[1, 100]), vocab_size=100)
    assert info.value.param == "allowed_token_ids"
