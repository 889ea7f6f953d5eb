"""Rotary position embeddings: the inverse frequencies of every RoPE variant the families use, computed as HF
transformers does (float32, once at trace time), and their application to q/k.

Variants (``rope_scaling["rope_type"]``): default, ``linear``, ``llama3``, ``longrope`` (Phi-3's, also
spelled ``su``), ``yarn``, and GGUF's ``freq_factors`` (llama.cpp's per-frequency divisors). Styles: HF's
rotate-half (most families) and the interleaved pairs of Command-R; ``rotary_dim < head_dim`` rotates only the
leading features (Phi's ``partial_rotary_factor``).

LongRoPE switches from its short to its long factors past ``original_max_position_embeddings``. HF decides
once per forward from the longest sequence; a ragged step has many, so here each token uses the long factors
when its own position is past it. Positions within the original context (every request of a model served at
``max_model_len <= original_max_position_embeddings``) are exact.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.errors import ModelLoadError

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


@dataclasses.dataclass(frozen=True)
class Rotary:
    """One RoPE table's static description (hashable: it is part of the jitted step's static config)."""
    inv_freq: tuple[float, ...]                # [rotary_dim // 2]
    rotary_dim: int
    attention_factor: float = 1.0              # cos/sin multiplier (LongRoPE, YaRN)
    interleaved: bool = False                  # Command-R pairs (2i, 2i+1) instead of (i, i + d/2)
    long_inv_freq: tuple[float, ...] | None = None   # LongRoPE: used by tokens at or past ``switch_position``
    switch_position: int | None = None
    # M-RoPE (Qwen2-VL): frequencies split in sections that rotate by the (temporal, height, width) rows of
    # positions ``[3, T]``; three equal rows (or 1-D positions) are plain RoPE
    mrope_section: tuple[int, ...] | None = None

    def cos_sin(self, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
        """cos/sin ``[T, 1, rotary_dim]``: angles in float32, cast to the compute dtype."""
        inv = jnp.asarray(np.asarray(self.inv_freq, np.float32))
        if positions.ndim == 2:         # M-RoPE: frequency j turns with row section(j) of the positions
            row = np.repeat(np.arange(len(self.mrope_section)), self.mrope_section)
            freqs = positions.astype(jnp.float32)[row].T * inv[None, :]
        elif self.long_inv_freq is not None:
            long_inv = jnp.asarray(np.asarray(self.long_inv_freq, np.float32))
            inv = jnp.where((positions >= self.switch_position)[:, None], long_inv[None, :], inv[None, :])
            freqs = positions.astype(jnp.float32)[:, None] * inv
        else:
            freqs = positions.astype(jnp.float32)[:, None] * inv[None, :]
        if self.interleaved:
            emb = jnp.repeat(freqs, 2, axis=-1)[:, None, :]
        else:
            emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]
        cos, sin = jnp.cos(emb), jnp.sin(emb)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.astype(dtype), sin.astype(dtype)

    def apply(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """RoPE on ``x [T, heads, head_dim]`` (only its first ``rotary_dim`` features when that is smaller)."""
        if self.rotary_dim < x.shape[-1]:
            rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
            return jnp.concatenate([self.apply(rot, cos, sin), rest], axis=-1)
        if self.interleaved:
            pairs = x.reshape(*x.shape[:-1], -1, 2)
            rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
        else:
            half = x.shape[-1] // 2
            rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin


def base_inv_freq(theta: float, dim: int) -> np.ndarray:
    return (1.0 / (np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)))).astype(np.float32)


def make_rotary(theta: float, rotary_dim: int, scaling: dict | None, max_position_embeddings: int, *,
                interleaved: bool = False) -> Rotary:
    """The ``Rotary`` of ``rope_theta`` / ``rope_scaling`` (a plain dict, or None for default RoPE)."""
    inv = base_inv_freq(theta, rotary_dim)
    kind = (scaling or {}).get("rope_type", "default")
    extra: dict = {}
    if kind == "default":
        pass
    elif kind == "freq_factors":
        inv = inv / np.asarray(scaling["factors"], np.float32)
    elif kind == "linear":
        inv = inv / np.float32(scaling["factor"])
    elif kind == "llama3":
        inv = _llama3(inv, scaling, max_position_embeddings)
    elif kind == "longrope":
        inv, extra = _longrope(theta, rotary_dim, scaling, max_position_embeddings)
    elif kind == "yarn":
        inv, extra = _yarn(theta, rotary_dim, scaling, max_position_embeddings)
    else:
        raise ModelLoadError(f"rope_scaling type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    return Rotary(inv_freq=tuple(float(f) for f in np.asarray(inv, np.float32)), rotary_dim=rotary_dim,
                  interleaved=interleaved, **extra)


def _llama3(inv: np.ndarray, scaling: dict, max_pos: int) -> np.ndarray:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling.get("original_max_position_embeddings") or max_pos)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _original_len(scaling: dict, field: str = "original_max_position_embeddings") -> int:
    if not scaling.get(field):
        raise ModelLoadError(f"rope_scaling type {scaling['rope_type']!r} needs {field}")
    return int(scaling[field])


def _longrope(theta: float, dim: int, scaling: dict, max_pos: int) -> tuple[np.ndarray, dict]:
    old_len = _original_len(scaling)
    factor = scaling.get("factor") or max_pos / old_len
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    shape = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    powers = (np.float32(theta) ** shape).astype(np.float32)

    def inv(factors) -> np.ndarray:
        ext = np.asarray(factors, np.float32)
        if ext.shape != (dim // 2,):
            raise ModelLoadError(f"rope_scaling long_factor/short_factor need {dim // 2} values, got {ext.shape}")
        return (1.0 / (ext * powers)).astype(np.float32)

    long_inv = inv(scaling["long_factor"])
    return inv(scaling["short_factor"]), {"attention_factor": float(attention_factor), "switch_position": old_len,
                                          "long_inv_freq": tuple(float(f) for f in long_inv)}


def _yarn(theta: float, dim: int, scaling: dict, max_pos: int) -> tuple[np.ndarray, dict]:
    old_len = int(scaling.get("original_max_position_embeddings") or max_pos)
    factor = float(scaling.get("factor") or max_pos / old_len)

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    pos_freqs = (np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))).astype(np.float32)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (np.float32(factor) * pos_freqs)
    keep = 1 - ramp
    inv = interpolation * (1 - keep) + extrapolation * keep
    return inv.astype(np.float32), {"attention_factor": float(attention_factor)}
