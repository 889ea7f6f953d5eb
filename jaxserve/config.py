"""Engine configuration: one source of defaults (vLLM's flag names and values)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


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
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None   # on CPU (no memory stats): bytes for the KV cache
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"               # auto | fp8 (e4m3)
    cpu_kv_cache_memory_bytes: int = 1 << 30   # default KV budget when the device reports no memory


@dataclass
class SchedulerConfig:
    # None = a platform default (resolve()): large on GPU, small on CPU where every bucket compiles slowly
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    max_waiting_requests: int | None = None
    # padded token counts a step may have (each is one compiled forward); None = 4, 8, 16, 32, ... up
    # to max_num_batched_tokens (model_runner.MIN_TOKEN_BUCKET). Fewer buckets = a shorter warm-up, more padding.
    token_buckets: tuple[int, ...] | None = None
    # vLLM's multi-step scheduling: a step whose requests all decode runs this many decode iterations in one
    # jitted call (a device-side loop: forward, sample, feed the token back), so the host dispatches once per
    # num_scheduler_steps tokens. 1 = off. Steps with penalties or a min_tokens still pending run
    # one iteration.
    num_scheduler_steps: int = 1


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    # "uni": this process drives every device of the mesh; "mp": one process per device on this host (the
    # engine spawns tensor_parallel_size - 1 workers that follow process 0's steps; jaxserve/executor/launcher.py)
    distributed_executor_backend: str = "uni"
    # the row-parallel layers' all-reduce of small steps through the CUDA one-shot kernel
    # (jaxserve/parallel/collectives.py) where it can run (GPUs, one process per GPU); True keeps XLA's
    disable_custom_all_reduce: bool = False
    # vLLM's --enable-expert-parallel: a mixture-of-experts model's experts sharded over the mesh (whole
    # experts per device) instead of tensor parallel like a dense MLP (jaxserve/models/layers/moe.py)
    enable_expert_parallel: bool = False


@dataclass
class StructuredOutputsConfig:
    """vLLM's ``--structured-outputs-config``. ``disable_any_whitespace`` (default True here; vLLM's is
    False): JSON is generated with compact separators and no free whitespace, so a model cannot loop on
    whitespace until max_tokens; False allows any JSON whitespace between tokens. ``backend``: llguidance
    is the one backend ("auto" and "guidance" both name it)."""
    backend: str = "auto"
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "guidance"):
            raise ValueError(f"structured outputs backend must be 'auto' or 'guidance' (llguidance), "
                             f"got {self.backend!r}")


@dataclass
class EngineConfig:
    model: str | None = None                   # HF folder, GGUF file or configs/models name; None = SmolLM2
    tokenizer: str | None = None
    dtype: str = "auto"                        # auto | float32 | bfloat16 | float16
    load_format: str = "auto"                  # auto | safetensors | gguf | dummy | orbax
    quantization: str = "auto"                 # auto (the checkpoint's) | fp8 | awq | gptq | compressed-tensors | none
    max_model_len: int | None = None
    seed: int = 0
    task: str = "auto"                         # auto | generate | embed
    served_model_name: str | None = None
    chat_template: str | None = None
    attention_backend: str = "auto"            # auto | pallas | reference
    compilation_cache_dir: str | None = None   # None = ~/.cache/jaxserve/xla; "" disables it
    max_logprobs: int = 20
    skip_warmup: bool = False                  # the older name of enforce_eager
    # vLLM's flag: compile nothing ahead; each step variant compiles when a step first needs it
    enforce_eager: bool = False
    async_scheduling: bool = True              # dispatch step N+1 before reading step N's tokens
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # vLLM's name; LLM(structured_outputs_config={...}) takes a dict too
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs_config, dict):
            self.structured_outputs_config = StructuredOutputsConfig(**self.structured_outputs_config)

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
