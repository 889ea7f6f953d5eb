"""One source per option: the config dataclasses declare every engine and server option, and the CLI flags,
the ``--config`` YAML keys, ``LLM(**kwargs)`` and the benchmark configs' engine section all come from (or are
checked against) those declarations."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import yaml

from benchmarks import config as bcfg
from jaxserve import cli
from jaxserve.config import FLAG_SPELLINGS, EngineConfig, SpeculativeConfig
from jaxserve.llm import engine_config_from_kwargs
from jaxserve.options import flag_names, options_of
from jaxserve.server.args import ServerArgs, server_args_from_namespace

ENGINE = list(options_of(EngineConfig))
SERVER = list(options_of(ServerArgs))
# the flags of the CLI that set no config field: the command's own
CLI_ONLY = {"help", "config", "model_tag",
            "prompt", "chat", "max_tokens", "temperature", "top_p", "top_k", "n", "sampling_seed"}


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    return parser._subparsers._group_actions[0].choices[command]


def parse_with_yaml(argv: list[str]) -> argparse.Namespace:
    """What ``jaxserve.cli.main`` parses: the ``--config`` file's keys as defaults, then the flags."""
    parser = cli.build_parser()
    cli._apply_yaml_config(subparser(parser, argv[0]), argv[1:])
    return parser.parse_args(argv)


def field_value(config, name: str):
    """An option's value in a config with sections (``block_size`` is ``config.cache.block_size``)."""
    for f in dataclasses.fields(config):
        if f.name == name:
            return getattr(config, name)
        if "section" in f.metadata:
            sub = getattr(config, f.name)
            if any(g.name == name for g in dataclasses.fields(sub)):
                return getattr(sub, name)
    raise KeyError(name)


def test_every_field_is_a_declared_option_with_help():
    for o in ENGINE + SERVER:                 # options_of raises on a field that is not declared
        assert o.option.help.strip(), o.name
    names = [o.name for o in ENGINE]
    assert len(names) == len(set(names)), "an option name is set flat, so it is unique across the sections"
    shared = {o.name for o in ENGINE} & {o.name for o in SERVER}
    # the server's --served-model-name sets the engine's name too (its first); nothing else is in both
    assert shared == {"served_model_name"}
    assert not next(o for o in ENGINE if o.name == "served_model_name").option.flag
    assert set(FLAG_SPELLINGS) <= set(names), "the table of flag spellings names engine options"


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_flag_sets_a_field_and_every_field_has_a_flag(command):
    dests = {a.dest for a in subparser(cli.build_parser(), command)._actions} - CLI_ONLY
    flagged = {o.name for o in ENGINE if o.option.flag}
    if command == "serve":
        flagged |= {o.name for o in SERVER if o.option.flag}
    assert dests == flagged
    # what has no flag of its own: a keyword argument only, or set by the server's flag of the same name
    assert {o.name for o in ENGINE if not o.option.flag} == {"served_model_name", "cpu_kv_cache_memory_bytes"}


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_cli_defaults_are_the_dataclass_defaults(command, monkeypatch):
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    a = cli.build_parser().parse_args([command])
    assert cli.engine_config_from_args(a) == EngineConfig() == engine_config_from_kwargs()
    if command == "serve":
        assert server_args_from_namespace(a) == ServerArgs()


def _other_value(o):
    """A value for option ``o`` other than its default: (its command-line words, its field's value)."""
    default = o.default
    if o.option.choices:
        value = next(c for c in o.option.choices if c != default)
        return [str(value)], value
    if isinstance(default, bool):
        return [], not default
    if o.name == "token_buckets":
        return ["4,8", "32"], (4, 8, 32)
    if o.name == "structured_outputs_config":
        return ['{"disable_any_whitespace": false}'], type(default)(disable_any_whitespace=False)
    if o.name == "speculative_config":
        return ['{"method": "ngram", "num_speculative_tokens": 2}'], SpeculativeConfig("ngram", 2)
    if o.name == "distributed_coordinator":
        return ["h:1"], "h:1"
    if o.name in ("limit_mm_per_prompt", "mm_processor_kwargs"):
        return ['{"image": 2}'], {"image": 2}
    if o.name == "hf_overrides":
        return ['{"num_hidden_layers": 2}'], {"num_hidden_layers": 2}
    if o.name == "allowed_media_domains":
        return ["a.com,b.org"], ("a.com", "b.org")
    for scalar in (int, float, str):
        if o.hint in (scalar, scalar | None):
            value = scalar(3) if scalar is not str else "x"
            return [str(value)], value
    raise AssertionError(f"no test value for {o.name} ({o.hint})")


@pytest.mark.parametrize("o", [o for o in ENGINE if o.option.flag], ids=lambda o: o.name)
def test_each_flag_yaml_key_and_keyword_reach_the_field(o, tmp_path):
    words, value = _other_value(o)
    flag = next(f for f in flag_names(o.name, FLAG_SPELLINGS) if f.startswith("--"))
    if isinstance(value, bool):
        flag = flag if value else "--no-" + flag[2:]
    from_flag = cli.engine_config_from_args(cli.build_parser().parse_args(["generate", flag, *words]))
    assert field_value(from_flag, o.name) == value
    assert field_value(engine_config_from_kwargs(**{o.name: value}), o.name) == value
    path = tmp_path / "c.yaml"
    yaml_value = words[0] if o.name in ("structured_outputs_config", "allowed_media_domains") else \
        json.loads(words[0]) if o.name == "speculative_config" else value     # (a YAML mapping)
    for key in {o.name, o.name.replace("_", "-"), flag.removeprefix("--no-").removeprefix("--")}:
        path.write_text(yaml.safe_dump({key: list(yaml_value) if isinstance(yaml_value, tuple) else yaml_value}))
        a = parse_with_yaml(["generate", "--config", str(path)])
        assert field_value(cli.engine_config_from_args(a), o.name) == value, key


def test_vllm_short_flags():
    a = cli.build_parser().parse_args(["serve", "-q", "fp8", "-tp", "2"])
    cfg = cli.engine_config_from_args(a)
    assert (cfg.quantization, cfg.parallel.tensor_parallel_size) == ("fp8", 2)


def test_yaml_config_flags_override_it_and_unknown_keys_are_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max-num-seqs: 3\nkv_cache_memory: 1000\nport: 9000\nmodel: m\n")
    a = parse_with_yaml(["serve", "--config", str(path), "--max-num-seqs", "5"])
    cfg = cli.engine_config_from_args(a)
    assert (cfg.scheduler.max_num_seqs, cfg.cache.kv_cache_memory_bytes, cfg.model) == (5, 1000, "m")
    assert server_args_from_namespace(a).port == 9000
    path.write_text("max_num_seq: 3\n")
    with pytest.raises(SystemExit, match="unknown option 'max_num_seq' .*did you mean 'max_num_seqs'"):
        parse_with_yaml(["serve", "--config", str(path)])


def test_the_positional_model_wins_over_model_flag():
    a = cli.build_parser().parse_args(["serve", "pos", "--model", "flag"])
    assert cli.engine_config_from_args(a).model == "pos"
    assert cli.engine_config_from_args(cli.build_parser().parse_args(["serve", "--model", "flag"])).model == "flag"


def test_an_unknown_llm_keyword_is_an_error_naming_it():
    with pytest.raises(TypeError, match="LLM got an unknown option 'blok_size' .*did you mean 'block_size'"):
        engine_config_from_kwargs(blok_size=4)
    cfg = engine_config_from_kwargs("m", block_size=4, max_num_seqs=2, tensor_parallel_size=2)
    assert (cfg.model, cfg.cache.block_size, cfg.scheduler.max_num_seqs, cfg.parallel.tensor_parallel_size) \
        == ("m", 4, 2, 2)


def test_a_negative_queue_limit_is_refused():
    with pytest.raises(SystemExit, match="max-waiting-requests must be >= 0"):
        cli.engine_config_from_args(cli.build_parser().parse_args(["serve", "--max-waiting-requests", "-1"]))


def test_bench_engine_section_is_checked_and_its_serve_flags_parse_to_the_same_config():
    with pytest.raises(bcfg.ConfigError, match="engine: unknown option 'max_num_seq'"):
        bcfg.engine_kwargs(bcfg.load_config("cpu-smoke", ["engine.max_num_seq=2"]))
    cfg = bcfg.load_config("cpu-smoke", ["engine.kv_cache_memory_bytes=1000", "engine.enforce_eager=false",
                                         "engine.enable_prefix_caching=false", "engine.token_buckets=[4, 16]"])
    kw = bcfg.engine_kwargs(cfg)
    from_flags = cli.engine_config_from_args(cli.build_parser().parse_args(["serve", *bcfg.server_flags(cfg)]))
    assert from_flags == engine_config_from_kwargs(**{**kw, "token_buckets": (4, 16)})


def test_choice_lists_match_the_code_that_acts_on_them():
    from jaxserve import config
    from jaxserve.kernels import ops
    from jaxserve.models import loaded_model
    from jaxserve.quantization import config as quant
    assert set(config.ATTENTION_BACKENDS) == {"auto", *ops.BACKENDS}
    assert set(config.DTYPES) - {"auto"} <= set(loaded_model.DTYPES)
    assert {quant.canonical_method(q) for q in config.QUANTIZATIONS} == set(quant.QUANTIZATION_METHODS)
    for kv in config.KV_CACHE_DTYPES:
        ops.kv_cache_dtype(kv, "bfloat16")                  # each one is understood


def test_speculative_config_flag_errors_say_why():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "--speculative-config", '{"method": "medusa"}'])
    spec = engine_config_from_kwargs(speculative_config={"model": "tiny", "num_speculative_tokens": 3})
    assert spec.speculative_config.method == "draft_model"
    lookup = SpeculativeConfig("ngram", 4, prompt_lookup_max=3)
    assert (lookup.prompt_lookup_min, lookup.prompt_lookup_max) == (3, 3)
