"""``python -m jaxserve serve|generate|bench|convert`` — flags named like ``vllm serve``."""
from __future__ import annotations

import argparse
import os
import sys

from jaxserve.config import FLAG_SPELLINGS, EngineConfig
from jaxserve.options import add_options, from_namespace, options_of, unknown_option


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags (declared by EngineConfig and its sections) and ``--config``."""
    add_options(p, EngineConfig, "engine", FLAG_SPELLINGS)
    p.add_argument("--config", default=None, help="a YAML file of flags (flag names, - or _); flags override it")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed flags; ``serve MODEL`` (the positional) wins over ``--model``."""
    try:
        config = from_namespace(EngineConfig, a)
    except ValueError as e:
        raise SystemExit(f"jaxserve: {e}") from None          # a value the flags' types let through
    model_tag = getattr(a, "model_tag", None)
    return config.replace(model=model_tag) if model_tag else config


def _yaml_keys(parser: argparse.ArgumentParser) -> dict[str, str]:
    """A ``--config`` file's key (a flag's name, - or _, or an option's name) → the argparse dest it sets."""
    keys = {o.name: o.name for o in options_of(EngineConfig)}     # flagless options too (ns → EngineConfig)
    for action in parser._actions:
        if action.dest == argparse.SUPPRESS or not action.option_strings:
            continue
        keys[action.dest] = action.dest
        for flag in action.option_strings:
            if flag.startswith("--") and not (isinstance(action, argparse.BooleanOptionalAction)
                                              and flag.startswith("--no-")):
                keys[flag[2:].replace("-", "_")] = action.dest
    return keys


def _apply_yaml_config(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """``--config FILE.yaml``: its keys become parser defaults, so flags on the command line override them."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return
    import yaml
    with open(known.config) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"{known.config}: expected a mapping of flag names to values")
    keys = _yaml_keys(parser)
    defaults = {}
    for k, v in data.items():
        dest = keys.get(str(k).replace("-", "_"))
        if dest is None:
            raise SystemExit(f"{known.config}: {unknown_option(str(k), keys)}")
        defaults[dest] = v
    parser.set_defaults(**defaults)


def _setup_distributed(a) -> None:
    if a.distributed_coordinator or a.num_processes > 1:
        from jaxserve.executor import distributed
        distributed.initialize(a.distributed_coordinator, a.num_processes, a.process_id)


def _is_follower() -> bool:
    import jax
    # asks nothing of JAX's backends unless jax.distributed already started them (the mp launcher must be
    # able to start jax.distributed later, inside the engine)
    return jax.distributed.is_initialized() and jax.process_count() > 1 and jax.process_index() != 0


def cmd_follow(a) -> int:
    """A process other than 0 under jax.distributed: build the same model and runner (same weights, same
    warm-up), then launch every step process 0 sends until it stops (jaxserve.executor.distributed)."""
    from jaxserve.executor import follow_runner
    from jaxserve.executor.model_executor import ModelExecutor
    executor = ModelExecutor(engine_config_from_args(a))
    executor.build_runner()
    executor.warm_up(progress=False)
    steps = follow_runner(executor.runner)
    print(f"process {a.process_id}: followed {steps} steps", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- subcommands
def cmd_generate(a) -> int:
    from jaxserve.errors import ModelLoadError
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams
    cfg = engine_config_from_args(a)
    # one batch, then exit: instead of the serving warm-up (the smallest and largest buckets, the rest in the
    # background, which would outlive the run), compile exactly the buckets these prompts' steps need
    one_shot = not (cfg.enforce_eager or cfg.skip_warmup) and _engine_in_this_process(cfg)
    try:
        llm = LLM(engine_config=cfg.replace(skip_warmup=True) if one_shot else cfg)
    except ModelLoadError as e:
        print(f"jaxserve generate: {e}", file=sys.stderr)
        return 1
    prompts = a.prompt or ["What is the capital of France?"]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.sampling_seed, n=a.n)
    if a.chat:
        inputs = [{"prompt": None, "prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": p}])}
                  for p in prompts]
    else:
        inputs = [{"prompt": p, "prompt_token_ids": llm.tokenizer.encode(p)} for p in prompts]
    runner = getattr(llm.engine.core, "runner", None)        # (None: the core runs in its own process)
    if one_shot and hasattr(runner, "warmup_for"):
        runner.warmup_for([len(x["prompt_token_ids"]) for x in inputs for _ in range(params.n)])
    elif hasattr(runner, "stop_background_compiles"):
        runner.stop_background_compiles()       # they would finish after the run (and the exit would wait)
    outs = llm.generate(inputs, params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        for o in out.outputs:
            print(f"### prompt: {p!r}" + (f" (completion {o.index})" if len(out.outputs) > 1 else ""))
            print(o.text.strip() if a.chat else o.text)
            print(f"### finish_reason={o.finish_reason} tokens={len(o.token_ids)}", file=sys.stderr)
    release_followers = getattr(getattr(llm.engine.core, "runner", None), "stop", None)    # BroadcastingRunner
    if release_followers is not None:
        release_followers()
    return 0


def _engine_in_this_process(cfg: EngineConfig) -> bool:
    """Whether the engine (its runner) lives in this one process: no engine-core process, no JAX processes
    following this one (they must compile the same variants the serving warm-up plans)."""
    from jaxserve.engine.core_client import use_multiprocess
    par = cfg.parallel
    return not use_multiprocess(None, default=False, config=cfg) and par.num_processes <= 1 \
        and not par.distributed_coordinator and par.distributed_executor_backend == "uni"


def cmd_serve(a) -> int:
    from jaxserve.server.app import run_server
    from jaxserve.server.args import server_args_from_namespace
    cfg = engine_config_from_args(a)
    return run_server(cfg, server_args_from_namespace(a)) or 0


def cmd_bench(rest: list[str]) -> int:
    """The config-driven benchmarks (``jaxserve.benchmarks``, the source tree's benchmarks/); they read the
    configs/ folder of a source checkout, or ``$JAXSERVE_CONFIGS``."""
    from jaxserve.benchmarks.runner import main as bench_main
    return bench_main(rest)


def build_parser() -> argparse.ArgumentParser:
    from jaxserve.models.orbax_io import add_convert_args
    from jaxserve.server.args import add_server_args
    p = argparse.ArgumentParser(prog="python -m jaxserve", description="jaxserve: LLM inference on JAX/XLA")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("model_tag", nargs="?", default=None, metavar="model",
                   help="model to serve (the same as --model; default: embedded SmolLM2)")
    add_engine_args(s)
    add_server_args(s)

    g = sub.add_parser("generate", help="generate completions offline and print them")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--sampling-seed", type=int, default=None)

    sub.add_parser("bench", help="config-driven benchmarks (see benchmarks/README.md)", add_help=False)

    add_convert_args(sub.add_parser("convert", help="write an orbax checkpoint of a model"))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    parser = build_parser()
    if argv and argv[0] in parser._subparsers._group_actions[0].choices:
        _apply_yaml_config(parser._subparsers._group_actions[0].choices[argv[0]], argv[1:])
    a = parser.parse_args(argv)
    if a.command == "convert":
        from jaxserve.models.orbax_io import run_convert
        return run_convert(a) or 0
    _setup_distributed(a)
    if _is_follower():
        return cmd_follow(a)
    if a.command == "generate":
        return cmd_generate(a)
    return cmd_serve(a)
