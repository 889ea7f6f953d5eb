"""How far from the limit: per-chip limits (configs/hardware/*.yaml) and per-model FLOP/byte counts.

Conventions:
- Two memory ceilings per chip: ``read_bandwidth`` (a read-only streaming reduction) and ``copy_bandwidth``
  (read + write bytes of a device copy), both measured by benchmarks/diagnostics/bandwidth.py. Every step here
  streams weights and KV and writes little, so its bound uses the read ceiling.
- A decode step reads every weight once (`weight_bytes` counts all parameters, embedding table included,
  although a step only gathers T rows of it: the true bound is ~7 % higher for Llama-3.1-8B) plus the
  K and V of every cached token of every sequence in the batch.
- FLOPs: 2 per multiplied weight per token (the embedding gather multiplies nothing; the LM head runs only
  for tokens that are sampled: one per prefill sequence, one per decode token) plus attention:
  QK^T and PV are 4·layers·heads·head_dim FLOPs per (query, key) pair; causal prefill of n tokens has
  n(n+1)/2 pairs.
- A step takes at least max(bytes / bandwidth, FLOPs / peak) (the roofline); a workload's bound is the
  sum of its steps' bounds. Tensor parallelism over N chips multiplies both limits by N.
- A measured figure above its limit means the limit's assumptions are wrong (bytes counted, or a ceiling too
  low): ``percent`` then warns, reports 100 and keeps the message for the report's notes.
"""
from __future__ import annotations

import functools
import os
import time
import warnings
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
HARDWARE_DIR = REPO_ROOT / "configs" / "hardware"

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "float8_e4m3fn": 1, "int8": 1}


@dataclass(frozen=True)
class Hardware:
    name: str
    read_bandwidth: float              # bytes/s of one chip, read-only streaming
    peak_flops: dict[str, float]       # dtype -> FLOP/s of one chip
    memory_bytes: float
    bandwidth_source: str = ""
    flops_source: dict[str, str] = field(default_factory=dict)
    num_devices: int = 1               # chips the model is sharded over (TP)
    source_file: str = ""
    copy_bandwidth: float = 0.0        # bytes/s of one chip, read + write bytes of a copy (0: not known)
    copy_source: str = ""

    def flops(self, dtype: str) -> float:
        per_chip = self.peak_flops.get(dtype) or self.peak_flops.get("bfloat16") or max(self.peak_flops.values())
        return per_chip * self.num_devices

    @property
    def bandwidth(self) -> float:
        """The read ceiling of all chips: what weight and KV streaming is bounded by."""
        return self.read_bandwidth * self.num_devices

    @property
    def copy(self) -> float:
        """The copy ceiling (read + write bytes) of all chips, for kernels that write as much as they read."""
        return self.copy_bandwidth * self.num_devices

    def scaled(self, num_devices: int) -> "Hardware":
        return dataclasses.replace(self, num_devices=num_devices)

    def describe(self, dtype: str) -> dict[str, Any]:
        return {"name": self.name, "num_devices": self.num_devices,
                "read_bandwidth_TBps": self.bandwidth / 1e12, "bandwidth_source": self.bandwidth_source,
                "copy_bandwidth_TBps": self.copy / 1e12, "copy_source": self.copy_source,
                "peak_TFLOPs": self.flops(dtype) / 1e12, "dtype": dtype,
                "flops_source": self.flops_source.get(dtype, ""), "file": self.source_file}


def load_hardware(name_or_path: str) -> tuple[Hardware, dict]:
    """A hardware file by name (configs/hardware/NAME.yaml) or path → (Hardware, raw dict)."""
    path = Path(name_or_path)
    if not path.suffix:
        path = HARDWARE_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml")))
        raise ValueError(f"hardware {name_or_path!r} not found (known: {known}, or a path to a YAML file)")
    raw = yaml.safe_load(path.read_text())
    for key in ("name", "read_bandwidth", "peak_flops"):
        if key not in raw:
            raise ValueError(f"hardware file {path} has no {key!r}")
    hw = Hardware(name=raw["name"], read_bandwidth=float(raw["read_bandwidth"]),
                  peak_flops={k: float(v) for k, v in raw["peak_flops"].items()},
                  memory_bytes=float(raw.get("memory_bytes", 0)),
                  bandwidth_source=raw.get("read_bandwidth_source", ""),
                  flops_source=dict(raw.get("peak_flops_source") or {}), source_file=str(path.name),
                  copy_bandwidth=float(raw.get("copy_bandwidth", 0)), copy_source=raw.get("copy_bandwidth_source", ""))
    return hw, raw


def detect_hardware_name(device_kind: str, platform: str) -> str:
    """The configs/hardware file whose device_kind_patterns match this device (cpu for the host)."""
    if platform == "cpu":
        return "cpu"
    for path in sorted(HARDWARE_DIR.glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        if any(p.lower() in device_kind.lower() for p in raw.get("device_kind_patterns", [])):
            return path.stem
    raise ValueError(f"no configs/hardware file matches device {device_kind!r}; add one or set hardware: NAME")


@functools.lru_cache(maxsize=None)
def measure_host_limits(seconds: float = 1.0) -> tuple[float, float, float]:
    """(read bandwidth, copy bandwidth bytes/s, float32 matmul FLOP/s) of this host, best of a few short runs
    (once per process). Read: a numpy sum; copy: read + write bytes of a numpy copy."""
    a = np.ones(64 * 1024 * 1024 // 8, dtype=np.float64)     # 64 MiB: well past the caches
    b = np.empty_like(a)
    best_read = best_bw = 0.0
    t_end = time.perf_counter() + seconds / 2
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        np.copyto(b, a)
        best_bw = max(best_bw, 2 * a.nbytes / (time.perf_counter() - t))   # read + write
        t = time.perf_counter()
        a.sum()
        best_read = max(best_read, a.nbytes / (time.perf_counter() - t))
    import jax
    import jax.numpy as jnp
    n = 1024
    x = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(x).block_until_ready()
    best_fl, t_end = 0.0, time.perf_counter() + seconds / 2
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        mm(x).block_until_ready()
        best_fl = max(best_fl, 2 * n ** 3 / (time.perf_counter() - t))
    return best_read, best_bw, best_fl


def hardware_mismatch(setting: str, device_kind: str, platform: str) -> str | None:
    """A warning when a config names a hardware file that does not describe the device it runs on."""
    if setting in (None, "", "auto"):
        return None
    _, raw = load_hardware(setting)
    patterns = raw.get("device_kind_patterns", [])
    if any(p.lower() in (device_kind if platform != "cpu" else "cpu").lower() for p in patterns):
        return None
    return (f"WARNING: limits are from hardware {setting!r} ({raw['name']}) but the device is {device_kind!r}: "
            f"the % of limit figures do not describe this machine (use --set hardware=auto)")


def resolve_hardware(setting: str, device_kind: str, platform: str, num_devices: int = 1) -> Hardware:
    """Hardware from a config's `hardware:` value ("auto" detects); CPU limits measured when the file asks."""
    name = detect_hardware_name(device_kind, platform) if setting in (None, "", "auto") else setting
    hw, raw = load_hardware(name)
    if raw.get("measure_at_run_time") and platform == "cpu":
        read, copy, fl = measure_host_limits()
        note = f"measured at run time ({os.cpu_count()} CPUs)"
        # a sum that the CPU computes slower than it copies is compute-bound, not the memory's read ceiling
        hw = Hardware(hw.name, max(read, copy), {"float32": fl, "bfloat16": fl, "float16": fl}, hw.memory_bytes,
                      f"{note}: numpy sum (or copy, if faster)",
                      {k: f"{note}: float32 matmul through JAX" for k in hw.peak_flops},
                      1, hw.source_file, copy, f"{note}: numpy copy")
    return hw.scaled(num_devices)


@dataclass(frozen=True)
class ModelCost:
    """FLOP and byte counts of one decoder model at one weight / KV dtype."""
    params: int                        # all parameters
    body_matmul_params: int            # weights every token multiplies (not the embedding gather, not the head)
    lm_head_params: int                # the output projection (tied or not), multiplied for sampled tokens
    weight_bytes: int                  # all parameters in the weight dtype
    kv_bytes_per_token: int            # K + V of one token over all layers
    attn_flops_per_pair: int           # QK^T + PV FLOPs for one (query, key) pair over all layers
    dtype: str

    def decode_flops(self, context_lens: np.ndarray | float, batch: int = 1) -> float:
        """FLOPs of one decode step for `batch` sequences whose contexts sum to sum(context_lens)."""
        ctx_total = float(np.sum(context_lens)) if np.ndim(context_lens) else float(context_lens) * batch
        return batch * 2.0 * (self.body_matmul_params + self.lm_head_params) + self.attn_flops_per_pair * ctx_total

    def decode_bytes(self, context_lens: np.ndarray | float, batch: int = 1) -> float:
        ctx_total = float(np.sum(context_lens)) if np.ndim(context_lens) else float(context_lens) * batch
        return float(self.weight_bytes) + self.kv_bytes_per_token * ctx_total

    def prefill_flops(self, input_len: int, batch: int = 1) -> float:
        """FLOPs to prefill `batch` prompts of `input_len` tokens (causal, logits for the last token only)."""
        n = float(input_len)
        per_seq = 2.0 * self.body_matmul_params * n + 2.0 * self.lm_head_params \
            + self.attn_flops_per_pair * n * (n + 1) / 2
        return batch * per_seq

    def prefill_bytes(self, input_len: int, batch: int = 1) -> float:
        return float(self.weight_bytes) + self.kv_bytes_per_token * float(input_len) * batch


# bytes per weight of a quantized projection: int4 + a 2-byte scale and a 1-byte zero per group of 128; fp8
# + a float32 scale per output channel (negligible)
QUANTIZED_WEIGHT_BYTES = {"awq": 0.5 + 3 / 128, "gptq": 0.5 + 3 / 128, "compressed-tensors": 0.5 + 3 / 128,
                          "fp8": 1.0}


def model_cost(cfg, dtype: str = "bfloat16", kv_dtype: str | None = None,
               quantization: str | None = None) -> ModelCost:
    """Counts for a Llama-family `jaxserve.config.ModelConfig` (GQA, SwiGLU MLP, RMSNorm); ``quantization``
    (``--quantization``): the projections' storage, the rest stays ``dtype``."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} for the roofline (known: {', '.join(DTYPE_BYTES)})")
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if cfg.attention_bias else 0)
    mlp = 3 * h * cfg.intermediate_size + ((2 * cfg.intermediate_size + h) if cfg.mlp_bias else 0)
    per_layer = attn + mlp + 2 * h                           # + two RMSNorm weights
    embedding = cfg.vocab_size * h
    lm_head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    body = cfg.num_layers * per_layer + h                   # + the final norm
    params = embedding + lm_head + body
    kv_bytes = DTYPE_BYTES[kv_dtype or dtype]
    weight_bytes = params * DTYPE_BYTES[dtype]
    if quantization in QUANTIZED_WEIGHT_BYTES:
        projections = cfg.num_layers * (h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size)
        weight_bytes -= int(projections * (DTYPE_BYTES[dtype] - QUANTIZED_WEIGHT_BYTES[quantization]))
    return ModelCost(params=params, body_matmul_params=body,
                     lm_head_params=cfg.vocab_size * h, weight_bytes=weight_bytes,
                     kv_bytes_per_token=2 * cfg.num_layers * kv * kv_bytes,
                     attn_flops_per_pair=4 * cfg.num_layers * cfg.num_heads * d, dtype=dtype)


def step_time(flops: float, nbytes: float, hw: Hardware, dtype: str) -> float:
    """The roofline time of one step: whichever of compute and memory traffic takes longer."""
    return max(flops / hw.flops(dtype), nbytes / hw.bandwidth)


def decode_steps_bound(cost: ModelCost, hw: Hardware, batch: int, input_len: float, num_steps: int) -> float:
    """Seconds for `num_steps` decode steps of `batch` sequences starting at context `input_len`."""
    if num_steps <= 0 or batch <= 0:
        return 0.0
    ctx = input_len + 1 + np.arange(num_steps, dtype=np.float64)       # context each step attends over
    flops = batch * 2.0 * (cost.body_matmul_params + cost.lm_head_params) + cost.attn_flops_per_pair * batch * ctx
    nbytes = cost.weight_bytes + cost.kv_bytes_per_token * batch * ctx
    return float(np.sum(np.maximum(flops / hw.flops(cost.dtype), nbytes / hw.bandwidth)))


def prefill_bound(cost: ModelCost, hw: Hardware, batch: int, input_len: float) -> float:
    return step_time(cost.prefill_flops(input_len, batch), cost.prefill_bytes(input_len, batch), hw, cost.dtype)


def generation_bound(cost: ModelCost, hw: Hardware, num_prompts: int, input_len: float, output_len: float,
                     max_batch: int) -> dict[str, float]:
    """Ideal time for N requests (mean lengths) run in waves of `max_batch`: prefill each wave (its first
    token comes from the prefill), then output_len - 1 decode steps. Returns seconds and tok/s limits."""
    waves, left, prefill_s, decode_s = [], num_prompts, 0.0, 0.0
    while left > 0:
        waves.append(min(max_batch, left))
        left -= waves[-1]
    out_steps = max(int(round(output_len)) - 1, 0)
    for b in waves:
        prefill_s += prefill_bound(cost, hw, b, input_len)
        decode_s += decode_steps_bound(cost, hw, b, input_len, out_steps)
    total = prefill_s + decode_s
    return {"seconds": total, "prefill_seconds": prefill_s, "decode_seconds": decode_s,
            "output_tok_s": num_prompts * output_len / total if total else float("inf"),
            "total_tok_s": num_prompts * (input_len + output_len) / total if total else float("inf"),
            "requests_s": num_prompts / total if total else float("inf"), "batch": float(max(waves or [0]))}


class RooflineExceeded(UserWarning):
    """A measured figure beat its limit: the limit's assumptions (bytes counted, ceilings) are wrong."""


_exceeded: list[str] = []


def percent(measured: float, limit: float, what: str = "") -> float:
    """measured / limit in percent (for times pass limit_time / measured_time), at most 100: a figure above its
    limit is an error in the limit, so it warns and is kept for ``take_exceeded`` (the report's notes)."""
    if not limit:
        return float("nan")
    pct = 100.0 * measured / limit
    if pct > 100.0:
        msg = (f"{what or 'a figure'} is {pct:.1f} % of its roofline limit ({measured:.4g} against {limit:.4g}): "
               f"the limit undercounts (bytes or FLOPs counted, or the ceiling in configs/hardware); shown as 100 %")
        warnings.warn(msg, RooflineExceeded, stacklevel=2)
        _exceeded.append(msg)
        return 100.0
    return pct


def take_exceeded() -> list[str]:
    """The over-the-limit messages since the last call (and forget them)."""
    out = list(_exceeded)
    _exceeded.clear()
    return out
