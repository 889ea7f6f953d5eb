"""``python -m jaxserve serve|generate|bench|convert`` — flags named like ``vllm serve``."""
from __future__ import annotations

import argparse
import json
import os
import sys

from jaxserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, StructuredOutputsConfig


def _bool_flag(p: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    p.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=default, help=help)


def _structured_outputs_config(value: str) -> StructuredOutputsConfig:
    try:
        return StructuredOutputsConfig(**json.loads(value))
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"--structured-outputs-config: {e}") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", dest="model_flag", default=None,
                   help="HF folder, GGUF file, or a configs/models name (with --load-format dummy); "
                        "default: the embedded SmolLM2-135M-Instruct")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy", "orbax"])
    g.add_argument("-q", "--quantization", default="auto",
                   choices=["auto", "fp8", "awq", "gptq", "compressed-tensors", "none", "awq_marlin", "gptq_marlin"],
                   help="how the projections' weights are stored: auto follows config.json's quantization_config; "
                        "fp8 also quantizes a float checkpoint at load; with --load-format dummy, random weights "
                        "in that storage")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--task", default="auto", choices=["auto", "generate", "embed"])
    g.add_argument("--chat-template", default=None, help="a Jinja template string or a file holding one")
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "pallas", "pallas-triton", "pallas-mgpu", "reference"],
                   help="auto: pallas on a GPU, else reference; pallas-triton / pallas-mgpu pin the prefill kernel")
    g.add_argument("--compilation-cache-dir", default=None,
                   help="JAX persistent compilation cache (default ~/.cache/jaxserve/xla; '' = off)")
    g.add_argument("--max-logprobs", type=int, default=20)
    g.add_argument("--enforce-eager", action="store_true",
                   help="compile nothing at start-up: each step variant compiles when a step first needs it "
                        "(vLLM's flag; by default the first-needed buckets compile before serving, the rest in "
                        "the background)")
    g.add_argument("--skip-warmup", action="store_true", help="the same as --enforce-eager")
    _bool_flag(g, "async-scheduling", True, "dispatch step N+1 before reading step N's tokens (host never waits)")
    g.add_argument("--structured-outputs-config", type=_structured_outputs_config, default=None,
                   help='JSON, as vLLM\'s: {"backend": "guidance", "disable_any_whitespace": true} (the defaults; '
                        'false lets JSON outputs hold any whitespace)')
    c = p.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32, 64, 128])
    c.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    c.add_argument("--num-gpu-blocks-override", type=int, default=None)
    c.add_argument("--kv-cache-memory", type=int, default=None, dest="kv_cache_memory_bytes",
                   help="bytes for the KV cache (overrides --gpu-memory-utilization; the way to size it on CPU)")
    _bool_flag(c, "enable-prefix-caching", True, "automatic prefix caching")
    c.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    s = p.add_argument_group("scheduler")
    s.add_argument("--max-num-seqs", type=int, default=None)
    s.add_argument("--max-num-batched-tokens", type=int, default=None)
    _bool_flag(s, "enable-chunked-prefill", True, "chunked prefill")
    s.add_argument("--max-waiting-requests", type=int, default=None)
    s.add_argument("--token-buckets", default=None, nargs="+",
                   help="padded step sizes to compile, e.g. 4 8 16 64 256 2048 or 4,8,16,64,256 (default: 4, 8, 16, 32, ... up to "
                        "--max-num-batched-tokens; a batch-1 decode step pads to the smallest)")
    s.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode iterations per dispatch when every scheduled request decodes (a device-side "
                        "loop; 1 = off). Cuts the host's share of each token: worth it where the host, not "
                        "the GPU, sets the pace (small batches, tensor parallelism). A step with any request "
                        "using penalties or a pending min_tokens runs one iteration")
    d = p.add_argument_group("parallel")
    d.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    d.add_argument("--distributed-coordinator", default=None, help="HOST:PORT of process 0")
    d.add_argument("--distributed-executor-backend", default="uni", choices=["uni", "mp"],
                   help="uni: one process drives all tensor-parallel devices; mp: one process per device on this "
                        "host (workers spawned and stopped by the engine)")
    d.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="keep XLA's all-reduce for every step; by default steps of up to 1 MiB of activations "
                        "(128 tokens of a 4096-wide model) use a CUDA one-shot all-reduce when each GPU has its "
                        "own process (mp executor or --num-processes) and nvcc is there to build it")
    d.add_argument("--enable-expert-parallel", action="store_true",
                   help="mixture-of-experts models: shard the experts over the devices (whole experts per "
                        "device) instead of splitting every expert tensor-parallel like a dense MLP")
    d.add_argument("--num-processes", type=int, default=1)
    d.add_argument("--process-id", type=int, default=0)
    p.add_argument("--config", default=None, help="a YAML file of flags (flag names, - or _); flags override it")


def _int_list(v):
    if not v:
        return None
    items = v if isinstance(v, (list, tuple)) else [v]
    return tuple(int(x) for item in items for x in str(item).strip("[]() ").split(",") if x.strip())


def _first(v):
    return v[0] if isinstance(v, (list, tuple)) else v


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    model = getattr(a, "model", None) or getattr(a, "model_flag", None)
    template = a.chat_template
    if template and os.path.isfile(template):
        with open(template) as f:
            template = f.read()
    return EngineConfig(
        model=model, tokenizer=a.tokenizer, dtype=a.dtype, load_format=a.load_format,
        quantization=a.quantization,
        max_model_len=a.max_model_len, seed=a.seed, task=a.task,
        served_model_name=_first(getattr(a, "served_model_name", None)),
        chat_template=template, attention_backend=a.attention_backend,
        compilation_cache_dir=a.compilation_cache_dir, max_logprobs=a.max_logprobs, skip_warmup=a.skip_warmup,
        enforce_eager=a.enforce_eager,
        async_scheduling=a.async_scheduling,
        structured_outputs_config=a.structured_outputs_config or StructuredOutputsConfig(),
        cache=CacheConfig(block_size=a.block_size, gpu_memory_utilization=a.gpu_memory_utilization,
                          num_gpu_blocks_override=a.num_gpu_blocks_override,
                          kv_cache_memory_bytes=a.kv_cache_memory_bytes,
                          enable_prefix_caching=a.enable_prefix_caching, kv_cache_dtype=a.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                                  enable_chunked_prefill=a.enable_chunked_prefill,
                                  max_waiting_requests=a.max_waiting_requests,
                                  token_buckets=_int_list(a.token_buckets),
                                  num_scheduler_steps=a.num_scheduler_steps),
        parallel=ParallelConfig(tensor_parallel_size=a.tensor_parallel_size,
                                distributed_coordinator=a.distributed_coordinator,
                                num_processes=a.num_processes, process_id=a.process_id,
                                distributed_executor_backend=a.distributed_executor_backend,
                                disable_custom_all_reduce=a.disable_custom_all_reduce,
                                enable_expert_parallel=a.enable_expert_parallel))


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
    dests = {a.dest: a for a in parser._actions}
    defaults = {}
    for k, v in data.items():
        key = k.replace("-", "_")
        if key == "model":
            key = "model_flag" if "model_flag" in dests else key
        if key == "kv_cache_memory":
            key = "kv_cache_memory_bytes"
        if key not in dests:
            raise SystemExit(f"{known.config}: unknown option {k!r}")
        defaults[key] = v
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
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams
    cfg = engine_config_from_args(a)
    # one batch, then exit: instead of the serving warm-up (the smallest and largest buckets, the rest in the
    # background, which would outlive the run), compile exactly the buckets these prompts' steps need
    one_shot = not (cfg.enforce_eager or cfg.skip_warmup) and _engine_in_this_process(cfg)
    llm = LLM(engine_config=cfg.replace(skip_warmup=True) if one_shot else cfg)
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
    """The config-driven benchmark of a source checkout (benchmarks/runner.py). Its workloads, model shapes and
    hardware limits live in the checkout's benchmarks/ and configs/, which a package install does not carry,
    so an installed jaxserve says where to run it instead of importing half of it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not all(os.path.isdir(os.path.join(root, d)) for d in ("benchmarks", "configs")):
        print("jaxserve bench runs the benchmarks of a source checkout (benchmarks/ and configs/ are not "
              "installed with the package): clone the repository, pip install -e it, and run "
              "jaxserve bench from there", file=sys.stderr)
        return 2
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.runner import main as bench_main
    return bench_main(rest)


def build_parser() -> argparse.ArgumentParser:
    from jaxserve.models.orbax_io import add_convert_args
    from jaxserve.server.args import add_server_args
    p = argparse.ArgumentParser(prog="python -m jaxserve", description="jaxserve: LLM inference on JAX/XLA")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("model", nargs="?", default=None, help="model to serve (default: embedded SmolLM2)")
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
