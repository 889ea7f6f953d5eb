"""Engine configuration: one source of defaults (vLLM's flag names and values).

Each option of ``EngineConfig`` and its sections is declared here once (``jaxserve.options``): its default,
choices and help text make the CLI flag, the ``--config`` YAML key and the ``LLM(...)`` keyword argument."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from jaxserve.config_decoding import SpeculativeConfig, StructuredOutputsConfig
from jaxserve.options import json_dict, option, section

# The flags not spelled --option-name: vLLM's short forms and the one name that differs from its field.
FLAG_SPELLINGS: dict[str, tuple[str, ...]] = {
    "quantization": ("-q", "--quantization"),
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp"),
    "pipeline_parallel_size": ("--pipeline-parallel-size", "-pp"),
    "data_parallel_size": ("--data-parallel-size", "-dp"),
    "kv_cache_memory_bytes": ("--kv-cache-memory",),
}

# the values the CLI accepts (LLM(...) passes any value on to the part that checks it); tests/llm/test_options.py
# checks them against the lists of the modules that act on them
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy", "orbax")
QUANTIZATIONS = ("auto", "fp8", "awq", "gptq", "compressed-tensors", "gguf", "none", "awq_marlin", "gptq_marlin")
ATTENTION_BACKENDS = ("auto", "pallas", "pallas-triton", "pallas-mgpu", "reference")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder (Llama family) or encoder model.

    Frozen and hashable: it is a static argument of the jitted step.
    """
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # rope_scaling as a tuple of (key, value) pairs so the config stays hashable
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False          # q/k/v projection bias (Qwen2)
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    model_type: str = "llama"
    extra: tuple[tuple[str, Any], ...] = ()  # family-specific values (e.g. BERT's type_vocab_size)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def extra_dict(self) -> dict[str, Any]:
        return dict(self.extra)


@dataclass
class CacheConfig:
    block_size: int = option(16, choices=(8, 16, 32, 64, 128), help="tokens per KV-cache block")
    gpu_memory_utilization: float = option(
        0.9, help="share of the device's memory the engine may use (weights, activations and the KV cache)")
    num_gpu_blocks_override: int | None = option(
        None, help="this many KV-cache blocks, whatever the memory left (default: as many as fit)")
    kv_cache_memory_bytes: int | None = option(
        None, help="bytes for the KV cache (overrides --gpu-memory-utilization; the way to size it on CPU)")
    enable_prefix_caching: bool = option(True, help="automatic prefix caching")
    kv_cache_dtype: str = option(
        "auto", choices=KV_CACHE_DTYPES,
        help="the cache's storage: auto = the model's dtype; fp8 / fp8_e4m3 = e4m3 (twice the blocks)")
    cpu_kv_cache_memory_bytes: int = option(
        1 << 30, flag=False, help="the KV cache's bytes when the device reports no memory (CPU)")


def _token_buckets(value: Any) -> tuple[int, ...] | None:
    """``4 8 16``, ``4,8,16`` or a YAML list → (4, 8, 16)."""
    if not value:
        return None
    items = value if isinstance(value, (list, tuple)) else [value]
    try:
        return tuple(int(x) for item in items for x in str(item).strip("[]() ").split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--token-buckets takes integers (4 8 16 or 4,8,16), got {value!r}") from None


@dataclass
class SchedulerConfig:
    # None = a platform default (resolved()): large on GPU, small on CPU where every bucket compiles slowly
    max_num_seqs: int | None = option(None, help="most requests running at once (default: 256 on GPU, 32 on CPU)")
    max_num_batched_tokens: int | None = option(
        None, help="the token budget of one step (default: 8192 on GPU, 256 on CPU)")
    enable_chunked_prefill: bool = option(True, help="chunked prefill")
    long_prefill_token_threshold: int | None = option(
        None, help="with chunked prefill, a prompt with more tokens than this left to compute is a long prefill: "
                   "while decodes or shorter prompts wait, long prefills share this many tokens of a step (plus "
                   "what the others leave), so a long prompt delays nobody by more than a few steps (vLLM's "
                   "flag; default: half of --max-num-batched-tokens; 0 = off)")
    max_waiting_requests: int | None = option(
        None, help="answer 429 when this many requests are waiting (default: no limit)")
    scheduling_policy: str = option(
        "fcfs", choices=("fcfs", "priority"),
        help="fcfs: waiting requests in arrival order; priority: by each request's priority (lower first, ties "
             "by arrival), and a preemption takes the lowest-priority running request (vLLM's)")
    token_buckets: tuple[int, ...] | None = option(
        None, nargs="+", convert=_token_buckets,
        help="padded step sizes to compile (each is one compiled forward), e.g. 4 8 16 64 256 2048 or "
             "4,8,16,64,256 (default: 4, 8, 16, 32, ... up to --max-num-batched-tokens; a batch-1 decode step "
             "pads to the smallest). Fewer buckets: a shorter warm-up, more padding")
    num_scheduler_steps: int = option(
        1, help="decode iterations per dispatch when every scheduled request decodes (vLLM's multi-step "
                "scheduling: a device-side loop of forward, sample, feed the token back; 1 = off). Cuts the "
                "host's share of each token: worth it where the host, not the GPU, sets the pace (small "
                "batches, tensor parallelism). A step with any request using penalties or a pending "
                "min_tokens runs one iteration")

    max_num_encoder_input_tokens: int | None = option(
        None, help="image tokens the vision encoder may compute in one step, and the most one image may take "
                   "(vLLM's encoder budget, beside the token budget; default: twice --max-num-batched-tokens, so "
                   "images never cut a step's chunks short of the token budget)")
    disable_chunked_mm_input: bool = option(
        False, help="never split an image's tokens over two steps: a chunk stops before an image it cannot take "
                    "whole (vLLM's flag; always on for models whose image tokens attend to each other both ways, "
                    "Gemma 3)")
    encoder_cache_size: int | None = option(
        None, help="image tokens whose encoder outputs stay on the device until their prompts are prefilled "
                   "(and for later requests with the same image; default: the encoder budget)")
    cross_attention_slots: int | None = option(
        None, help="images whose cross-attention keys and values stay on the device, for models that attend to "
                   "an image through cross-attention layers (Llama 3.2 Vision): one slot per image, held until "
                   "its requests finish; a request with an image waits for a free slot (default: "
                   "--max-num-seqs, at most 8)")

    def cross_attention_slot_count(self) -> int:
        """The cross-attention cache's slots of a resolved config: ``--cross-attention-slots``, else
        ``max_num_seqs`` up to 8."""
        return self.cross_attention_slots or min(self.max_num_seqs, 8)

    def encoder_limits(self) -> tuple[int, int]:
        """(image tokens encoded per step, image tokens cached) of a resolved config. The default budget is twice
        the token budget: the images a step's chunks reach take at most the token budget plus one image cut
        at the chunk's end, so a step is never cut short at an image it cannot encode (with one token budget,
        a step that prefills one image's prompt stops at the next image and pads up to its token bucket)."""
        budget = self.max_num_encoder_input_tokens or 2 * self.max_num_batched_tokens
        return budget, max(self.encoder_cache_size or budget, budget)

    def __post_init__(self) -> None:
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0, got {self.max_waiting_requests}")
        if self.cross_attention_slots is not None and self.cross_attention_slots < 1:
            raise ValueError(f"--cross-attention-slots must be >= 1, got {self.cross_attention_slots}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError(f"--long-prefill-token-threshold must be >= 0, got {self.long_prefill_token_threshold}")


def _names(value: Any, flag: str) -> tuple[str, ...] | None:
    """``a b`` / ``a,b`` / a YAML list → ("a", "b")."""
    if not value:
        return None
    items = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(x, str) for x in items):
        raise ValueError(f"{flag} takes names, got {value!r}")
    return tuple(x.strip() for item in items for x in item.split(",") if x.strip())


@dataclass
class MultiModalConfig:
    limit_mm_per_prompt: dict = option(
        default_factory=dict, type=json_dict,
        help='most items of each modality in one prompt, as vLLM\'s JSON: \'{"image": 4}\' (default: 8 images '
             'for a vision model)')
    mm_processor_kwargs: dict = option(
        default_factory=dict, type=json_dict,
        help="JSON keyword arguments for the model's image processor (e.g. Qwen's min_pixels / max_pixels)")
    allowed_local_media_path: str | None = option(
        None, help="file:// image URLs are read only under this folder (default: refused)")
    allowed_media_domains: tuple[str, ...] | None = option(
        None, nargs="+", convert=lambda v: _names(v, "--allowed-media-domains"),
        help="http(s) image URLs only from these host names, e.g. a.com b.org or a.com,b.org (default: any)")
    media_fetch_timeout: float = option(10.0, help="seconds an http(s) image URL may take to fetch")
    max_image_pixels: int = option(64 * 1024 * 1024,
                                   help="largest image accepted, in pixels (checked before it is decoded)")


@dataclass
class LoRAConfig:
    enable_lora: bool = option(
        False, help="serve LoRA adapters over the base model (PEFT folders: --lora-modules, requests naming one, "
                    "LLM.generate(lora_request=...)); off, the compiled step has no LoRA in it")
    max_loras: int = option(1, help="adapters resident on the device at once (one batch may mix them all); a "
                                    "request whose adapter finds no free slot waits for one")
    max_lora_rank: int = option(16, help="largest adapter rank served (the device slots are this wide)")
    max_cpu_loras: int | None = option(None, help="adapters kept read in host memory (default: --max-loras)")

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"--max-loras and --max-lora-rank must be positive, got {self.max_loras} and "
                             f"{self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras {self.max_cpu_loras} is below --max-loras {self.max_loras}")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = option(1, help="devices each layer's weights are split over")
    pipeline_parallel_size: int = option(
        1, help="pipeline stages: the layers split into this many contiguous groups, each on its own "
                "tensor_parallel_size devices (JAXSERVE_PP_LAYER_PARTITION sets the split)")
    pipeline_batch_queue: bool = option(
        True, help="with pipeline stages: keep up to pipeline_parallel_size steps of disjoint requests in "
                   "flight so the stages work at once (vLLM's batch queue); off: one step at a time")
    distributed_coordinator: str | None = option(
        None, metavar="HOST:PORT", help="HOST:PORT of process 0 (several hosts: start one process each)")
    num_processes: int = option(1, help="JAX processes in all (with --distributed-coordinator)")
    process_id: int = option(0, help="this process's index among --num-processes")
    distributed_executor_backend: str = option(
        "uni", choices=("uni", "mp", "ray"),
        help="uni: one process drives all devices; mp: one process per device on this host (workers spawned "
             "and stopped by the engine; jaxserve/executor/launcher.py); ray: on the running Ray cluster "
             "(pip install 'jaxserve[ray]'; RAY_ADDRESS names it), one process per pipeline stage, each on its own "
             "node (jaxserve/executor/ray_workers.py), or with --data-parallel-size one Ray actor per replica, "
             "on whichever nodes have its devices free (jaxserve/executor/ray_replicas.py)")
    disable_custom_all_reduce: bool = option(
        False, help="keep XLA's all-reduce for every step; by default steps of up to 1 MiB of activations "
                    "(128 tokens of a 4096-wide model) use a CUDA one-shot all-reduce "
                    "(jaxserve/parallel/collectives.py) when each GPU has its own process (mp executor or "
                    "--num-processes) and nvcc is there to build it")
    enable_expert_parallel: bool = option(
        False, help="mixture-of-experts models: shard the experts over the devices (whole experts per "
                    "device) instead of splitting every expert tensor-parallel like a dense MLP")
    data_parallel_size: int = option(
        1, help="engine replicas behind one front end, each in its own process on its own "
                "tensor_parallel_size devices (data_parallel_size x tensor_parallel_size in all): on this host, "
                "or with --distributed-executor-backend ray in Ray actors on the cluster's nodes (ray start on each "
                "node, then serve on one of them with RAY_ADDRESS=HEAD_IP:6379); requests go to the least loaded "
                "replica, or the one holding their prefix (jaxserve/engine/dp_client.py)")

    def __post_init__(self) -> None:
        """Refuse, saying what to change, what data-parallel replicas cannot be combined with."""
        n = self.data_parallel_size
        if n < 1:
            raise ValueError(f"--data-parallel-size is {n}: give 1 or more replicas")
        if n == 1:
            return
        if self.pipeline_parallel_size > 1:
            raise ValueError("data-parallel replicas with pipeline stages are not supported: use "
                             "--data-parallel-size 1 or --pipeline-parallel-size 1")
        if self.distributed_executor_backend == "mp" or self.num_processes > 1 or self.distributed_coordinator:
            raise ValueError("each data-parallel replica is one JAX process, on this host or (with "
                             "--distributed-executor-backend ray) in a Ray actor on the cluster's nodes: drop "
                             "--distributed-executor-backend mp / --num-processes / --distributed-coordinator, "
                             "or use --data-parallel-size 1")
        if self.enable_expert_parallel:
            raise ValueError("expert parallelism across data-parallel replicas (vLLM's DP attention with "
                             "--enable-expert-parallel) is not supported: drop --enable-expert-parallel (each "
                             "replica then holds every expert) or use --data-parallel-size 1")


def _text_or_file(value: str) -> str:
    """A file's text where ``value`` names a file (``--chat-template FILE``), else ``value``."""
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    return value


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) else value


@dataclass
class EngineConfig:
    model: str | None = option(
        None, help="HF folder, GGUF file, or a configs/models name (with --load-format dummy); default: the "
                   "embedded SmolLM2-135M-Instruct")
    tokenizer: str | None = option(None, help="HF folder of the tokenizer (default: the model's)")
    dtype: str = option("auto", choices=DTYPES, help="the weights' and activations' dtype (auto: the checkpoint's)")
    load_format: str = option("auto", choices=LOAD_FORMATS,
                              help="how to read the model (auto: from the path; dummy: random weights)")
    quantization: str = option(
        "auto", choices=QUANTIZATIONS,
        help="how the projections' weights are stored: auto follows config.json's quantization_config (a GGUF "
             "file's 4-bit weights stay int4; none dequantizes them); fp8 also quantizes a float checkpoint at "
             "load; with --load-format dummy, random weights in that storage")
    max_model_len: int | None = option(None, help="longest prompt + output in tokens (default: the model's)")
    hf_overrides: dict = option(
        default_factory=dict, type=json_dict,
        help='JSON keys that replace the model\'s HF config values before it is read, as vLLM\'s: e.g. '
             '\'{"num_hidden_layers": 24}\' or \'{"rope_scaling": {...}}\'; a nested config (text_config, ...) '
             'takes its keys in turn (HF folders, GGUF files, configs/models names; a GGUF file read from its metadata '
             'alone takes num_hidden_layers, max_position_embeddings, rope_theta, rms_norm_eps, sliding_window)')
    seed: int = option(0, help="seeds the sampling of requests that give no seed of their own")
    task: str = option("auto", choices=("auto", "generate", "embed"),
                       help="what the model serves (auto: embed for an embedding model, else generate)")
    served_model_name: str | None = option(
        None, flag=False, convert=_first, help="the model's name in the API (the first of --served-model-name)")
    chat_template: str | None = option(None, convert=_text_or_file,
                                       help="a Jinja template string or a file holding one")
    attention_backend: str = option(
        "auto", choices=ATTENTION_BACKENDS,
        help="auto: pallas on a GPU, else reference; pallas-triton / pallas-mgpu pin the prefill kernel")
    compilation_cache_dir: str | None = option(
        None, help="JAX persistent compilation cache (default ~/.cache/jaxserve/xla; '' = off)")
    max_logprobs: int = option(20, help="most logprobs a request may ask for")
    enforce_eager: bool = option(
        False, help="compile nothing at start-up: each step variant compiles when a step first needs it (vLLM's "
                    "flag; by default the first-needed buckets compile before serving, the rest in the background)")
    skip_warmup: bool = option(False, help="the same as --enforce-eager, and no warm-up of an embedding model")
    async_scheduling: bool = option(
        True, help="dispatch step N+1 before reading step N's tokens (host never waits)")
    cache: CacheConfig = section(CacheConfig, "KV cache")
    scheduler: SchedulerConfig = section(SchedulerConfig, "scheduler")
    parallel: ParallelConfig = section(ParallelConfig, "parallel")
    multimodal: MultiModalConfig = section(MultiModalConfig, "images")
    lora: LoRAConfig = section(LoRAConfig, "LoRA adapters")
    # LLM(structured_outputs_config={...}) takes a dict too
    structured_outputs_config: StructuredOutputsConfig = option(
        default_factory=StructuredOutputsConfig, type=StructuredOutputsConfig.from_json,
        help='JSON, as vLLM\'s: {"backend": "guidance", "disable_any_whitespace": true, '
             '"disable_additional_properties": true} (the defaults; disable_any_whitespace false lets JSON outputs '
             'hold any whitespace; disable_additional_properties false lets a JSON schema\'s objects hold keys '
             'they do not declare unless the request says strict), and the limits on a request\'s constraint, '
             'e.g. {"max_choice_options": 20000, "compile_timeout_s": 30} (server/README.md lists them)')

    speculative_config: SpeculativeConfig | None = option(
        None, type=SpeculativeConfig.from_json, convert=SpeculativeConfig.coerce,
        help='speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_max": 4, "prompt_lookup_min": 2} (prompt lookup) or {"method": "draft_model", '
             '"model": PATH, "num_speculative_tokens": 4} (a smaller model with the same tokenizer); each step '
             'verifies the proposed tokens in one forward. Steps then run synchronously (no async scheduling)')

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs_config, dict):
            self.structured_outputs_config = StructuredOutputsConfig(**self.structured_outputs_config)
        self.speculative_config = SpeculativeConfig.coerce(self.speculative_config)

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)

    def resolved(self, platform: str) -> "EngineConfig":
        """A copy with the platform defaults filled in (``platform``: jax.default_backend())."""
        gpu = platform in ("gpu", "cuda", "rocm", "tpu")
        sched = dataclasses.replace(
            self.scheduler,
            max_num_seqs=self.scheduler.max_num_seqs or (256 if gpu else 32),
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens or (8192 if gpu else 256))
        if sched.max_num_batched_tokens < sched.max_num_seqs:
            sched.max_num_seqs = sched.max_num_batched_tokens
        return dataclasses.replace(self, scheduler=sched)

