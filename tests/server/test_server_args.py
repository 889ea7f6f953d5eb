"""Server flags through the real CLI parser, and the request models' own checks (no server needed)."""
from __future__ import annotations

import argparse

import msgspec
import pytest

from jaxserve.cli import build_parser, engine_config_from_args
from jaxserve.server.args import ServerArgs, add_server_args, server_args_from_namespace
from jaxserve.server.request_types import ChatCompletionRequest, CompletionRequest


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_defaults_match_server_args(monkeypatch):
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert server_args_from_namespace(parse()) == ServerArgs()


def test_vllm_flag_names(monkeypatch):
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    a = parse("--host", "0.0.0.0", "--port", "9001", "--api-key", "k", "--served-model-name", "a", "b",
              "--max-waiting-requests", "7", "--metrics-prefix", "vllm", "--max-body-bytes", "1000",
              "--drain-timeout", "3", "--allowed-origins", '["http://x"]', "--response-role", "bot")
    s = server_args_from_namespace(a)
    assert (s.host, s.port, s.api_key, s.served_model_name) == ("0.0.0.0", 9001, "k", ["a", "b"])
    assert (s.metrics_prefix, s.max_body_bytes, s.drain_timeout) == ("vllm", 1000, 3.0)
    assert s.allowed_origins == ["http://x"] and s.response_role == "bot"
    cfg = engine_config_from_args(a)  # the shared flag reaches the engine too; the queue limit is the engine's
    assert cfg.served_model_name == "a" and cfg.scheduler.max_waiting_requests == 7


def test_num_scheduler_steps_flag():
    assert engine_config_from_args(parse()).scheduler.num_scheduler_steps == 1      # off by default
    for cmd in ("serve", "generate"):
        a = build_parser().parse_args([cmd, "--num-scheduler-steps", "8"])
        assert engine_config_from_args(a).scheduler.num_scheduler_steps == 8
    with pytest.raises(SystemExit):                                                  # an int, not any string
        parse("--num-scheduler-steps", "many")


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("JAXSERVE_API_KEY", "from-env")
    assert server_args_from_namespace(parse()).api_key == "from-env"
    assert server_args_from_namespace(parse("--api-key", "flag")).api_key == "flag"


def test_add_server_args_leaves_the_engine_flags_to_the_engine():
    p = argparse.ArgumentParser()
    p.add_argument("--max-waiting-requests", type=int, default=3)
    add_server_args(p)  # no argparse conflict
    assert p.parse_args([]).max_waiting_requests == 3


def test_request_models():
    req = msgspec.json.decode(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],'
                              b' "max_tokens": 5, "max_completion_tokens": 9}', type=ChatCompletionRequest)
    assert req.messages[0].text() == "a" and req.requested_max_tokens() == 9
    for prompt, want in (('"x"', ["x"]), ('["x", "y"]', ["x", "y"]), ("[1, 2]", [[1, 2]]),
                         ("[[1], [2, 3]]", [[1], [2, 3]])):
        assert msgspec.json.decode(b'{"prompt": %s}' % prompt.encode(), type=CompletionRequest).prompt_batch() == want
    for bad in ('["x", 1]', "[[1], 2]", "[[]]"):
        with pytest.raises(ValueError):
            msgspec.json.decode(b'{"prompt": %s}' % bad.encode(), type=CompletionRequest).prompt_batch()
    for bad in (b'{"prompt": []}', b'{"prompt": "x", "n": 0}', b'{"prompt": "x", "temperature": 3}',
                b'{"prompt": "x", "top_p": 0}', b'{"prompt": "x", "logprobs": -1}'):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(bad, type=CompletionRequest)


def test_wildcard_origin_with_credentials_is_refused_at_start_up():
    with pytest.raises(SystemExit, match="browsers refuse"):
        server_args_from_namespace(parse("--allowed-origins", "*", "--allow-credentials"))
    ok = server_args_from_namespace(parse("--allowed-origins", "http://a.example", "--allow-credentials"))
    assert ok.allowed_origins == ["http://a.example"] and ok.allow_credentials
    assert server_args_from_namespace(parse("--allowed-origins", "*")).allowed_origins == ["*"]


def test_enable_log_requests_logs_each_request_cut_to_max_log_len(caplog):
    """--enable-log-requests logs a request's prompt and ids cut to --max-log-len; off, nothing is logged."""
    import argparse
    import logging
    from types import SimpleNamespace

    from jaxserve.sampling_params import SamplingParams
    from server.args import add_server_args, server_args_from_namespace
    from server.engine_runs import Choice, EngineRuns, Prompt

    ns = add_server_args(argparse.ArgumentParser()).parse_args(["--enable-log-requests", "--max-log-len", "5"])
    args = server_args_from_namespace(ns)
    assert args.enable_log_requests and args.max_log_len == 5
    prompt = Prompt(token_ids=list(range(10)), text="The capital of France")
    choice = Choice(index=0, request_id="cmpl-1-0", params=SamplingParams(max_tokens=3), tracker=None)
    with caplog.at_level(logging.INFO, logger="jaxserve.server"):
        EngineRuns.log_request(SimpleNamespace(args=args), prompt, choice)
        EngineRuns.log_request(SimpleNamespace(args=server_args_from_namespace(
            add_server_args(argparse.ArgumentParser()).parse_args([]))), prompt, choice)
    lines = [r.getMessage() for r in caplog.records if "Received request" in r.getMessage()]
    assert len(lines) == 1
    assert "cmpl-1-0" in lines[0] and "'The c'" in lines[0] and "[0, 1, 2, 3, 4]" in lines[0]
    assert "France" not in lines[0]
