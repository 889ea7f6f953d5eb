"""Every environment variable jaxserve reads, in one registry: name, default, and what it switches.

Read a variable as an attribute, ``envs.JAXSERVE_NVCC``, at the point of use: each access reads the
environment again, so a variable set after import (a test, the launcher starting its workers) still counts.
Nothing else in jaxserve/, kernels/ or server/ reads ``os.environ``; a new switch gets a line here. ``write``
sets one (jaxserve's default XLA flags go into XLA_FLAGS that way, ``jaxserve/xla_flags.py``).
``environment_variables()`` lists them (name, default, meaning) for the docs.
This module imports nothing but the standard library, so the kernels and the CLI can use it before JAX starts.
"""
from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple


class EnvVar(NamedTuple):
    read: Callable[[str], Any]     # raw string (or None) -> value
    default: str | None            # as written in the environment; None = unset
    meaning: str


def _text(raw: str | None) -> str | None:
    return raw or None


def _flag(raw: str | None) -> bool:
    return raw not in ("0", "false", "False", "no", "off")


def _optional_flag(raw: str | None) -> bool | None:
    """None when unset (the caller's default applies), else as ``_flag``."""
    return None if raw in (None, "") else _flag(raw)


def _int(name: str) -> Callable[[str | None], int | None]:
    def read(raw: str | None) -> int | None:
        if raw in (None, ""):
            return None
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer") from None
    return read


_REGISTRY: dict[str, EnvVar] = {
    # server
    "JAXSERVE_API_KEY": EnvVar(_text, None, "API key the server requires ('Authorization: Bearer KEY') when "
                                            "--api-key is not given"),
    "VLLM_API_KEY": EnvVar(_text, None, "read as JAXSERVE_API_KEY when that is unset (vLLM's name)"),
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": EnvVar(lambda raw: (raw or "").lower() in ("1", "true"), None,
                                               "1 or true = with --enable-lora the server serves POST "
                                               "/v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's)"),
    "VLLM_MEDIA_LOADING_THREAD_COUNT": EnvVar(lambda raw: max(1, int(raw)) if raw else 8, "8",
                                              "images fetched, decoded and preprocessed at once, each on a "
                                              "worker thread (vLLM's; bounds their memory)"),
    # engine
    "JAXSERVE_ENABLE_MULTIPROCESSING": EnvVar(_optional_flag, None,
                                              "1 = the engine core runs in its own process, 0 = in the front "
                                              "end's (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING); unset: its own "
                                              "process for `serve`, the caller's for the offline LLM"),
    # models
    "JAXSERVE_CONFIGS": EnvVar(_text, None, "folder holding models/, bench/ and hardware/ (the model, benchmark "
                                            "and hardware configs) when jaxserve is installed outside its source "
                                            "checkout"),
    "JAXSERVE_MLA_DECODE": EnvVar(lambda raw: raw or "auto", "auto",
                                  "MLA decode-only steps' kernel: auto (default: Mosaic GPU at 64 heads or more a "
                                  "device, else Triton), triton, mgpu (where it takes the call, else Triton)"),
    "JAXSERVE_MLA_PREFILL": EnvVar(lambda raw: raw or "kernel", "kernel",
                                   "kernel (default): MLA steps with prefill chunks run the Pallas kernel in tiles of "
                                   "a request's tokens; reference: XLA's jnp reference (a context gathered a token)"),
    # CUDA kernels (the custom all-reduce)
    "JAXSERVE_NVCC": EnvVar(_text, None, "nvcc that builds the CUDA kernels (else $CUDA_HOME/bin, PATH, "
                                         "/usr/local/cuda/bin)"),
    "CUDA_HOME": EnvVar(_text, None, "CUDA toolkit folder searched for nvcc"),
    "JAXSERVE_CUDA_ARCH": EnvVar(lambda raw: raw or "native", "native", "GPU architecture the CUDA kernels "
                                                                        "are built for (nvcc -arch)"),
    "JAXSERVE_KERNEL_CACHE": EnvVar(_text, None, "folder of built CUDA kernels (default: "
                                                 "$XDG_CACHE_HOME/jaxserve/kernels)"),
    "XDG_CACHE_HOME": EnvVar(lambda raw: raw or os.path.join(os.path.expanduser("~"), ".cache"), "~/.cache",
                             "base of the default cache folders (XLA compilation cache, built kernels)"),
    "JAXSERVE_CACHE_DIR": EnvVar(_text, None, "folder of files built from packaged models and GGUF "
                                              "tokenizers, and of converted GGUF weights when no compile "
                                              "cache is on (default: $XDG_CACHE_HOME/jaxserve)"),
    # tensor parallelism
    "JAXSERVE_CUSTOM_ALL_REDUCE_FUSE_NORM": EnvVar(_flag, "1", "0 = the custom all-reduce does not fuse the "
                                                               "residual add + RMSNorm (A/B runs)"),
    "JAXSERVE_PP_LAYER_PARTITION": EnvVar(_text, None, "layers per pipeline stage, comma-separated (e.g. "
                                                       "\"5,4,4,3\"; vLLM's VLLM_PP_LAYER_PARTITION); unset: "
                                                       "as even as they divide, the layers left over on the "
                                                       "stages just before the last"),
    # quantized weights
    "JAXSERVE_INT4_FFI_GEMV": EnvVar(lambda raw: raw is None or (bool(raw) and _flag(raw)), "1",
                                     "int4 steps of <= 16 tokens run the CUDA FFI GEMV (kernels/quant_gemv.cu) on "
                                     "a GPU with nvcc; 0 = the Pallas kernel (kernels/int4_matmul_pallas.py)"),
    "JAXSERVE_INT4_GEMV_MAX_TOKENS": EnvVar(lambda raw: _int("JAXSERVE_INT4_GEMV_MAX_TOKENS")(raw or "16"), "16",
                                            "int4 steps of up to this many tokens run the CUDA FFI GEMV, in calls "
                                            "of at most 16 rows (each reads the weights once); larger steps "
                                            "dequantize and run XLA's GEMM (A/B runs of 32 / 64)"),
    "JAXSERVE_INT4_GEMV_VARIANT": EnvVar(lambda raw: raw or "v1", "v1",
                                         "which int4 CUDA GEMV kernel runs (kernels/quant_gemv.py VARIANTS): v1 "
                                         "the register-pipelined one; occ3 / occ4 its registers capped for 3 / 4 "
                                         "blocks an SM"),
    "JAXSERVE_FP8_FFI_GEMV": EnvVar(lambda raw: raw is None or (bool(raw) and _flag(raw)), "1",
                                    "fp8 weights of steps of <= 16 bf16 tokens run weight-only (W8A16) through "
                                    "the CUDA FFI GEMV (kernels/fp8_gemv.cuh) on a GPU with nvcc, per-channel and "
                                    "128x128-block scales alike; 0 = W8A8 through XLA's fp8 dot"),
    "JAXSERVE_FUSED_QKV": EnvVar(_flag, "1", "0 = a quantized model keeps q, k and v as three weights (three "
                                 "GEMMs a layer) instead of one fused qkv weight (A/B runs; models.loaded_model."
                                 "with_fused_qkv)"),
    "JAXSERVE_STEP_BUFFERS_APART": EnvVar(_flag, "1",
                                          "1 = the step keeps its per-call buffers (packed inputs, outputs) out of "
                                          "the layers' commands, so XLA updates a few commands of the step's CUDA "
                                          "graph a call (runner.step_functions); 0 = XLA's own placement (an A/B "
                                          "switch for the GPU host time)"),
    "JAXSERVE_VISION_SEQ_LENGTHS": EnvVar(lambda raw: _flag(raw or "1"), "1",
                                          "1 (default): a vision tower's full-attention blocks over rows of one "
                                          "image (Qwen-VL) attend through the fused call by sequence length, the "
                                          "image's patches gathered in front; 0: masked to the image (an N x N "
                                          "mask the kernel reads)"),
    "JAXSERVE_VISION_ATTENTION": EnvVar(lambda raw: raw or "auto", "auto",
                                        "the vision towers' attention: auto (cudnn on a GPU, dense elsewhere), "
                                        "cudnn (cuDNN's fused attention through jax.nn.dot_product_attention, GPU "
                                        "only), dense (float32 scores per block of queries, as HF's eager path) or "
                                        "xla (the fused call's XLA path, any backend)"),
    "JAXSERVE_OFFLINE_MEDIA_OVERLAP": EnvVar(_optional_flag, None,
                                             "1 = the offline API queues each prompt as soon as its images are "
                                             "preprocessed, so engine steps overlap the preprocessing of the rest; "
                                             "0 = every image first, then the prompts; unset: 1 on a GPU, 0 on the "
                                             "CPU (where steps and preprocessing share the cores: measured slower)"),
    "JAXSERVE_SPEC_ASYNC": EnvVar(_optional_flag, None,
                                  "1 = n-gram speculation under async scheduling (each step placed as if the one "
                                  "in flight accepted all its drafts; drafts proposed on the device after every "
                                  "step), 0 = speculative steps run synchronously; unset: 1 on a GPU, 0 on the "
                                  "CPU (where host and device share the cores, synchronous steps measured faster)"),
    "JAXSERVE_SPEC_FORCE_DRAFTS": EnvVar(lambda raw: bool(raw) and _flag(raw), "0",
                                         "1 = device n-gram drafts (JAXSERVE_SPEC_ASYNC=1) are proposed for every "
                                         "row, K of them, whatever the lookup finds (the row's last token "
                                         "repeated): the benchmarks' verify-step cost on random weights, whose "
                                         "text offers no matches. Output stays exact (drafts are verified)"),
    "JAXSERVE_FP8_NORM_QUANT": EnvVar(_flag, "1", "0 = each fp8 W8A8 projection quantizes its own input (an amax "
                                                  "and a cast before its GEMM) instead of the RMSNorm before it "
                                                  "quantizing it once (quantization.rms_norm_fp8; A/B runs)"),
    "JAXSERVE_FP8_WEIGHT_ONLY_MAX_TOKENS": EnvVar(_int("JAXSERVE_FP8_WEIGHT_ONLY_MAX_TOKENS"), "0",
                                                  "steps of up to this many tokens run fp8 weights as W8A16 (the "
                                                  "weight converted in the dot, activations stay bf16) instead "
                                                  "of W8A8 (A/B runs of the decode path)"),
    # mixture of experts
    "JAXSERVE_MOE_GROUPED_GEMM": EnvVar(lambda raw: raw or "auto", "auto",
                                        "the MoE layers' grouped GEMM: auto (rows_fused on a GPU, "
                                        "ragged_dot elsewhere), rows (pallas, and steps of <= 16 tokens "
                                        "through the sort-free rows kernel), rows_fused (the same, each rows "
                                        "product one launch: its plan made in the kernel), "
                                        "ragged_dot, gather or pallas (kernels/ragged_dot.py)"),
    "JAXSERVE_MOE_ROWS_LAUNCH": EnvVar(lambda raw: raw or "", "",
                                       "the fused rows kernel's launch bounds, GATE_UP[,DOWN], each "
                                       "BLOCK_N/BLOCK_K/WARPS/STAGES (A/B runs; benchmarks/moe_rows_launch.py "
                                       "times them); empty: kernels/ragged_dot.py ROWS_LAUNCH_GATED, "
                                       "ROWS_LAUNCH"),
    "JAXSERVE_MOE_SHARED_IN_ROWS": EnvVar(lambda raw: _flag(raw or "1"), "1",
                                          "1 (default): rows_fused steps compute a shared expert in the routed "
                                          "experts' two launches (3 fewer kernels a MoE layer); 0: its own "
                                          "products"),
    # XLA
    "JAXSERVE_LOAD_THREADS": EnvVar(lambda raw: _int("JAXSERVE_LOAD_THREADS")(raw or "8"), "8",
                                    "threads that read a safetensors checkpoint's tensors and copy them to the "
                                    "devices ahead of the weights being built (0: one tensor at a time); an "
                                    "orbax restore keeps as many weights' bytes in flight"),
    "JAXSERVE_XLA_FLAGS": EnvVar(_flag, "1", "0 = jaxserve adds none of its default XLA flags (jaxserve/xla_flags.py) "
                                             "to XLA_FLAGS (A/B runs)"),
    "XLA_FLAGS": EnvVar(_text, None, "XLA's own flags; jaxserve adds each of its defaults (jaxserve/xla_flags.py) "
                                     "that this does not set, when jaxserve is imported"),
    # multi-process (read by JAX too)
    "JAX_COORDINATOR_ADDRESS": EnvVar(_text, None, "host:port of process 0 for a multi-process engine"),
    "JAX_NUM_PROCESSES": EnvVar(_int("JAX_NUM_PROCESSES"), None, "processes of a multi-process engine"),
    "JAX_PROCESS_ID": EnvVar(_int("JAX_PROCESS_ID"), None, "this process's index in a multi-process engine"),
    "RAY_ADDRESS": EnvVar(_text, None, "the Ray cluster --distributed-executor-backend ray joins (Ray's variable; "
                                       "unset: the cluster this node is part of)"),
    "XLA_PYTHON_CLIENT_MEM_FRACTION": EnvVar(lambda raw: float(raw) if raw else 0.75, "0.75",
                                             "the share of a GPU's memory JAX's allocator may take (JAX's "
                                             "variable; the KV cache is sized within it)"),
    "JAX_PLATFORMS": EnvVar(lambda raw: raw or "", "", "JAX's backends; containing cpu, the multi-process "
                                                       "engine uses gloo collectives and no GPU ids"),
    "CUDA_VISIBLE_DEVICES": EnvVar(_text, None, "the GPUs this process may use (CUDA's); data-parallel replicas "
                                                "split them between their processes"),
}


def write(name: str, value: str) -> None:
    """Set a registered variable for this process and the processes it starts (jaxserve.xla_flags's defaults)."""
    if name not in _REGISTRY:
        raise KeyError(f"{name} is not a registered environment variable")
    os.environ[name] = value


def environment_variables() -> list[tuple[str, str | None, str]]:
    """(name, default, meaning) of every variable jaxserve reads, in registry order."""
    return [(name, var.default, var.meaning) for name, var in _REGISTRY.items()]


def non_secret_names() -> list[str]:
    """The registered variables whose values may be written down (a result file, a cache key): all but the
    API keys."""
    return [name for name in _REGISTRY if "API_KEY" not in name]


def __getattr__(name: str):
    var = _REGISTRY.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read(os.environ.get(name))


def __dir__():
    return sorted(list(globals()) + list(_REGISTRY))
