"""How far from the limit: per-chip limits (configs/hardware/*.yaml) and per-model FLOP/byte counts, from the
family's own parameter shapes; the conventions are benchmarks/README.md's "How far from the limit"."""
from __future__ import annotations

import functools
import os
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from .config import CONFIGS_DIR

HARDWARE_DIR = CONFIGS_DIR / "hardware"

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
        return replace(self, num_devices=num_devices)

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
    if missing := [key for key in ("name", "read_bandwidth", "peak_flops") if key not in raw]:
        raise ValueError(f"hardware file {path} has no {missing[0]!r}")
    hw = Hardware(name=raw["name"], read_bandwidth=float(raw["read_bandwidth"]),
                  peak_flops={k: float(v) for k, v in raw["peak_flops"].items()},
                  memory_bytes=float(raw.get("memory_bytes", 0)),
                  bandwidth_source=raw.get("read_bandwidth_source", ""),
                  flops_source=dict(raw.get("peak_flops_source") or {}), source_file=str(path.name),
                  copy_bandwidth=float(raw.get("copy_bandwidth", 0)), copy_source=raw.get("copy_bandwidth_source", ""))
    return hw, raw


def _describes(raw: dict, device_kind: str, platform: str) -> bool:
    kind = (device_kind if platform != "cpu" else "cpu").lower()
    return any(p.lower() in kind for p in raw.get("device_kind_patterns", []))


def detect_hardware_name(device_kind: str, platform: str) -> str:
    """The configs/hardware file whose device_kind_patterns match this device (cpu for the host)."""
    if platform == "cpu":
        return "cpu"
    for path in sorted(HARDWARE_DIR.glob("*.yaml")):
        if _describes(yaml.safe_load(path.read_text()), device_kind, platform):
            return path.stem
    raise ValueError(f"no configs/hardware file matches device {device_kind!r}; add one or set hardware: NAME")


@functools.lru_cache(maxsize=None)
def measure_host_limits(seconds: float = 1.0) -> tuple[float, float, float]:
    """(read bandwidth, copy bandwidth bytes/s, float32 matmul FLOP/s) of this host, best of a few short runs
    (once per process). Read: a numpy sum; copy: read + write bytes of a numpy copy."""
    import jax
    import jax.numpy as jnp

    def best_rates(seconds: float, *runs) -> list[float]:
        """Each of ``runs`` ((call, work) pairs, called in turn) at its best work a second over ``seconds``."""
        best, t_end = [0.0] * len(runs), time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            for i, (call, work) in enumerate(runs):
                t = time.perf_counter()
                call()
                best[i] = max(best[i], work / (time.perf_counter() - t))
        return best
    a = np.ones(64 * 1024 * 1024 // 8, dtype=np.float64)     # 64 MiB: well past the caches
    b = np.empty_like(a)
    copy, read = best_rates(seconds / 2, (lambda: np.copyto(b, a), 2 * a.nbytes), (a.sum, a.nbytes))  # copy: r + w
    x = jnp.ones((1024, 1024), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(x).block_until_ready()
    return read, copy, best_rates(seconds / 2, (lambda: mm(x).block_until_ready(), 2 * 1024 ** 3))[0]


def hardware_mismatch(setting: str, device_kind: str, platform: str) -> str | None:
    """A warning when a config names a hardware file that does not describe the device it runs on."""
    if setting in (None, "", "auto"):
        return None
    _, raw = load_hardware(setting)
    if _describes(raw, device_kind, platform):
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
    body_matmul_params: int            # weights one token multiplies (not the embedding gather, not the head;
                                       # of an MoE layer's routed experts its top_k)
    lm_head_params: int                # the output projection (tied or not), multiplied for sampled tokens
    weight_bytes: int                  # the weights a one-token step reads, in the weight dtype (no untied
                                       # embedding; of an MoE layer's routed experts top_k): step_weight_bytes
    kv_bytes_per_token: int            # K + V (MLA: the latent row) of one token over all layers, as cached
    attn_flops_per_pair: int           # QK^T + PV FLOPs for one (query, key) pair over all layers
    dtype: str
    layer_windows: tuple[int | None, ...] = ()   # per layer: its sliding window, None = global (all layers if empty)
    expert_params: int = 0             # every routed expert of every MoE layer (shared experts are dense)
    num_experts: int = 0               # routed experts per MoE layer (0: a dense model)
    experts_per_token: int = 0         # top_k

    @property
    def active_params(self) -> int:
        """Parameters one token uses: every weight but the routed experts it is not sent to (the figure MoE
        model cards quote as "activated", e.g. Qwen3-30B-A3B's 3.3 B)."""
        routed = self.expert_params // self.num_experts * self.experts_per_token if self.num_experts else 0
        return self.params - self.expert_params + routed

    def experts_touched(self, tokens: float) -> float:
        """Expected share of an MoE layer's routed experts that ``tokens`` tokens send rows to (uniform,
        independent routing): 1 − (1 − k/E)^tokens; exactly k/E for one token."""
        if not self.num_experts:
            return 0.0
        return 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** max(float(tokens), 1.0)

    def step_weight_bytes(self, tokens: float) -> float:
        """Weight bytes one step of ``tokens`` tokens reads: the dense weights whole, the routed experts its
        tokens touch (``experts_touched``). A dense model's is ``weight_bytes`` at every size."""
        if not self.num_experts:
            return float(self.weight_bytes)
        extra = self.experts_touched(tokens) - self.experts_per_token / self.num_experts
        return float(self.weight_bytes) + self.expert_params * DTYPE_BYTES[self.dtype] * extra

    def keys(self, context_lens) -> np.ndarray:
        """Keys one new token attends over at each context length (any shape), averaged over the layers (so
        ``* kv_bytes_per_token`` is its K/V read and ``* attn_flops_per_pair`` its attention FLOPs): a windowed
        layer sees at most its window."""
        ctx = np.asarray(context_lens, dtype=np.float64)
        per_layer = [ctx if w is None else np.minimum(ctx, float(w)) for w in self.layer_windows or (None,)]
        return np.sum(per_layer, axis=0) / len(per_layer)

    def _total_keys(self, context_lens, batch: int) -> float:
        """Keys read by one decode step, summed over the sequences (in units of one all-layer token)."""
        return float(np.sum(self.keys(context_lens))) * (1 if np.ndim(context_lens) else batch)

    def kv_read_bytes(self, context_lens, batch: int = 1) -> float:
        """K/V bytes one decode step reads for sequences at ``context_lens`` (an array, or one length for
        ``batch`` sequences)."""
        return self.kv_bytes_per_token * self._total_keys(context_lens, batch)

    def decode_flops(self, context_lens: np.ndarray | float, batch: int = 1) -> float:
        """FLOPs of one decode step for `batch` sequences at `context_lens` (an array: one per sequence)."""
        return batch * 2.0 * (self.body_matmul_params + self.lm_head_params) \
            + self.attn_flops_per_pair * self._total_keys(context_lens, batch)

    def decode_bytes(self, context_lens: np.ndarray | float, batch: int = 1) -> float:
        tokens = np.size(context_lens) if np.ndim(context_lens) else batch
        return self.step_weight_bytes(tokens) + self.kv_read_bytes(context_lens, batch)

    def tokens_held(self, cache_bytes: float, block_size: int = 16) -> int:
        """Tokens a KV cache of ``cache_bytes`` holds, in whole blocks of ``block_size`` (as the engine sizes it)."""
        return int(cache_bytes // (self.kv_bytes_per_token * block_size)) * block_size

    def prefill_pairs(self, input_len: float) -> float:
        """Causal (query, key) pairs of one prompt over all layers, in units of one layer: n(n+1)/2 in a global
        layer; w(w+1)/2 + (n - w)·w in one with window w < n."""
        n = float(input_len)
        pairs = [n * (n + 1) / 2 if w is None or n <= w else w * (w + 1) / 2 + (n - w) * w
                 for w in self.layer_windows or (None,)]
        return sum(pairs) / len(pairs)

    def prefill_flops(self, input_len: int, batch: int = 1) -> float:
        """FLOPs to prefill `batch` prompts of `input_len` tokens (causal, logits for the last token only)."""
        n = float(input_len)
        return batch * (2.0 * self.body_matmul_params * n + 2.0 * self.lm_head_params
                        + self.attn_flops_per_pair * self.prefill_pairs(n))

    def prefill_bytes(self, input_len: int, batch: int = 1) -> float:
        tokens = float(input_len) * batch
        return self.step_weight_bytes(tokens) + self.kv_bytes_per_token * tokens


# bytes per weight of a quantized projection: int4 + a 2-byte scale and a 1-byte zero per group of 128; fp8
# + a float32 scale per output channel (negligible)
QUANTIZED_WEIGHT_BYTES = {"awq": 0.5 + 3 / 128, "gptq": 0.5 + 3 / 128, "compressed-tensors": 0.5 + 3 / 128,
                          "fp8": 1.0}
# quantization.loading.LINEAR_WEIGHTS
PROJECTIONS = ("q", "k", "v", "o", "gate_up", "down", "q_a", "q_b", "kv_a", "fused_qkv_a")
EXPERTS = ("experts_gate_up", "experts_down")           # an MoE layer's routed experts (models/layers/moe.py)


def model_cost(cfg, dtype: str = "bfloat16", kv_dtype: str | None = None,
               quantization: str | None = None) -> ModelCost:
    """Counts for a decoder ``jaxserve.config.ModelConfig`` of any registered family; ``quantization``
    (``--quantization``): the projections' storage, the rest stays ``dtype``."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} for the roofline (known: {', '.join(DTYPE_BYTES)})")
    from jaxserve.errors import ModelLoadError
    from jaxserve.models import registry
    try:
        _, family = registry.resolve_architecture(cfg.architecture)
    except ModelLoadError as e:
        raise ValueError(f"no roofline for {cfg.architecture}: {e}") from None
    if not hasattr(family, "decoder_spec"):
        raise ValueError(f"no roofline for {cfg.architecture}: not a decoder family")
    shapes, spec = family.param_shapes(cfg), family.decoder_spec(cfg)
    sizes = {path: int(np.prod(shape)) for path, shape in _leaves(shapes)}
    params = sum(sizes.values())
    embedding, lm_head = sizes[("embed",)], sizes.get(("lm_head",), 0)
    body = params - embedding - lm_head                     # every layer weight (norms, biases too) + final norm
    head = lm_head or embedding                             # tied: the embedding table is the head
    if spec.mla:                                            # one latent row per token and layer, absorbed
        kv_values, pair_flops = spec.mla.latent_width, 2 * cfg.num_heads * (2 * spec.mla.kv_lora_rank
                                                                            + spec.mla.qk_rope_head_dim)
    else:
        kv_values, pair_flops = 2 * cfg.num_kv_heads * cfg.head_dim, 4 * cfg.num_heads * cfg.head_dim
    experts = sum(n for path, n in sizes.items() if len(path) == 3 and path[0] == "layers" and path[2] in EXPERTS)
    extra = cfg.extra_dict                                  # the MoE fields under HF's names
    num_experts, top_k = (int(extra["num_experts"]), int(extra["num_experts_per_tok"])) if experts else (0, 0)
    inactive = experts - (experts // num_experts * top_k if experts else 0)   # routed experts a token skips
    body -= inactive
    weight_bytes = (body + head) * DTYPE_BYTES[dtype]
    if quantization in QUANTIZED_WEIGHT_BYTES:
        projections = sum(n for path, n in sizes.items()
                          if len(path) == 3 and path[0] == "layers" and path[2] in PROJECTIONS)
        weight_bytes -= int(projections * (DTYPE_BYTES[dtype] - QUANTIZED_WEIGHT_BYTES[quantization]))
    return ModelCost(params=params, body_matmul_params=body, lm_head_params=head, weight_bytes=weight_bytes,
                     kv_bytes_per_token=cfg.num_layers * kv_values * DTYPE_BYTES[kv_dtype or dtype],
                     attn_flops_per_pair=cfg.num_layers * pair_flops, dtype=dtype,
                     layer_windows=tuple(spec.windows), expert_params=experts, num_experts=num_experts,
                     experts_per_token=top_k)


def _leaves(shapes: dict, prefix: tuple = ()):
    """(path, shape) of every leaf of a ``param_shapes`` pytree (dicts and lists of dicts)."""
    items = shapes.items() if isinstance(shapes, dict) else enumerate(shapes)
    for key, value in items:
        if isinstance(value, tuple):
            yield prefix + (key,), value
        else:
            yield from _leaves(value, prefix + (key,))


def decode_steps_bound(cost: ModelCost, hw: Hardware, batch: int, input_len: float, num_steps: int) -> float:
    """Seconds for `num_steps` decode steps of `batch` sequences starting at context `input_len`."""
    if num_steps <= 0 or batch <= 0:
        return 0.0
    ctx = input_len + 1 + np.arange(num_steps, dtype=np.float64)       # context each step attends over
    keys = batch * cost.keys(ctx)                                      # per step, all layers, all sequences
    flops = batch * 2.0 * (cost.body_matmul_params + cost.lm_head_params) + cost.attn_flops_per_pair * keys
    nbytes = cost.step_weight_bytes(batch) + cost.kv_bytes_per_token * keys
    return float(np.sum(np.maximum(flops / hw.flops(cost.dtype), nbytes / hw.bandwidth)))


def prefill_bound(cost: ModelCost, hw: Hardware, batch: int, input_len: float) -> float:
    """The roofline time of one prefill step: whichever of compute and memory traffic takes longer."""
    return max(cost.prefill_flops(input_len, batch) / hw.flops(cost.dtype),
               cost.prefill_bytes(input_len, batch) / hw.bandwidth)


def generation_bound(cost: ModelCost, hw: Hardware, num_prompts: int, input_len: float, output_len: float,
                     max_batch: int) -> dict[str, float]:
    """Ideal time for N requests (mean lengths) run in waves of `max_batch`: prefill each wave (its first
    token comes from the prefill), then output_len - 1 decode steps. Returns seconds and tok/s limits."""
    waves = [min(max_batch, num_prompts - i) for i in range(0, num_prompts, max_batch)]
    prefill_s = decode_s = 0.0
    out_steps = max(int(round(output_len)) - 1, 0)
    for b in waves:
        prefill_s += prefill_bound(cost, hw, b, input_len)
        decode_s += decode_steps_bound(cost, hw, b, input_len, out_steps)
    total = prefill_s + decode_s
    rate = num_prompts / total if total else float("inf")            # requests a second
    return {"seconds": total, "prefill_seconds": prefill_s, "decode_seconds": decode_s,
            "output_tok_s": rate * output_len, "total_tok_s": rate * (input_len + output_len),
            "requests_s": rate, "batch": float(max(waves or [0]))}


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


def cache_capacity(models: list[str], cache_gib: float):
    """A ``report.Table`` (``python -m jaxserve.benchmarks.roofline GIB NAME ...`` prints it): per configs/models
    name its params / active, layers, and with a bf16 then an fp8 cache its bytes a token, the tokens GIB hold."""
    from jaxserve.models.configs import model_config_from_hf

    from .models import named_model_hf_config
    from .report import Table
    t = Table(f"KV cache per token and tokens held in {cache_gib:g} GiB (computed)", ["model", "params / active B",
              "layers", "bytes / token (bf16)", "tokens (bf16)", "bytes / token (fp8)", "tokens (fp8)"])
    for name in models:
        cfg = model_config_from_hf(named_model_hf_config(name))
        costs = [model_cost(cfg, kv_dtype=kv) for kv in ("bfloat16", "fp8")]
        t.rows.append([name, f"{costs[0].params / 1e9:.1f} / {costs[0].active_params / 1e9:.1f}", cfg.num_layers]
                      + [x for c in costs for x in (c.kv_bytes_per_token, c.tokens_held(cache_gib * 2 ** 30))])
    return t


if __name__ == "__main__":
    import sys
    print(cache_capacity(sys.argv[2:], float(sys.argv[1])).markdown())
