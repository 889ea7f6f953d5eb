"""Backend dispatch for paged attention: the model calls these, never a backend directly.

``backend="reference"`` is the pure-jnp path (CPU, tests, oracle); ``backend="pallas"`` the Pallas GPU
kernels (``paged_attention_pallas``; prefill tokens of steps with >= 512 token slots go to the Mosaic GPU
kernel of ``prefill_mgpu`` where it applies). ``pallas-triton`` keeps every step on the Triton kernels,
``pallas-mgpu`` sends prefill tokens to the Mosaic GPU kernel at every step size (A/B runs, GPU checks).
``default_backend()`` says which one this process should use. A model layer calls ``write_kv_and_attend``
(the K/V write, then attention over the cache that now holds the step's tokens).
An fp8 cache (``kv_cache_dtype="fp8"``, e4m3) takes ``k_scale``/``v_scale`` (scalar or ``[kv_heads]``,
None = 1.0) in both ``write_kv`` and ``paged_attention``; pass the same scales to both. Its V pages are stored
transposed (``kv_cache_shapes``; ``init_kv_caches`` makes the caches); the reference and the Triton kernels read and write that layout (the Mosaic
GPU prefill takes no fp8 cache: such steps keep their prefill tokens on the Triton tiles).
Multi-head latent attention (DeepSeek) has its own cache, one latent row per token (``mla_ref``), and its own
calls: ``write_latent``, ``mla_attention`` and ``write_latent_and_attend``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import mla_ref, ref_attention
from .ref_attention import kv_cache_shapes  # noqa: F401  (the layout, for the kernels' callers)
from .metadata import AttentionMetadata

BACKENDS = ("reference", "pallas", "pallas-triton", "pallas-mgpu")
_PREFILL_KERNEL = {"pallas": "auto", "pallas-triton": "triton", "pallas-mgpu": "mgpu"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "bfloat16", "float16", "float32")


def default_backend() -> str:
    """'pallas' when JAX runs on an NVIDIA GPU, else 'reference'."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def init_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype,
                   *, sharding=None) -> list[tuple[jax.Array, jax.Array]]:
    """One zeroed ``(k_cache, v_cache)`` pair per layer, shaped as ``kv_cache_shapes`` says: the engine's cache
    (placed with ``sharding``, e.g. split over "tp" on kv heads) or, inside a jitted call, a scratch cache."""
    shapes = kv_cache_shapes(num_blocks, block_size, num_kv_heads, head_dim, dtype)

    def zeros(shape):
        return jnp.zeros(shape, dtype) if sharding is None else jnp.zeros(shape, dtype, device=sharding)
    return [tuple(map(zeros, shapes)) for _ in range(num_layers)]


def load_kernels(backend: str) -> None:
    """Load the kernels ``backend`` may run, before any compiled step is read back from a cache: a cached
    executable that calls a Mosaic GPU kernel needs that runtime's symbols in the process, and they are
    registered when the kernel's module is imported, which a cache hit (no trace) would otherwise never do."""
    _check_backend(backend)
    if backend != "reference" and jax.default_backend() == "gpu":
        from . import paged_attention_pallas  # noqa: F401, PLC0415


def kv_cache_dtype(kv_cache_dtype: str | None, model_dtype) -> jnp.dtype:
    """The cache's storage dtype for ``--kv-cache-dtype``: ``auto`` (or None) = the model's dtype, ``fp8`` /
    ``fp8_e4m3`` = e4m3, or a float dtype by name."""
    if kv_cache_dtype in ("auto", None):
        return jnp.dtype(model_dtype)
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return jnp.dtype(ref_attention.FP8_DTYPE)
    if kv_cache_dtype in KV_CACHE_DTYPES:
        return jnp.dtype(kv_cache_dtype)
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {KV_CACHE_DTYPES}")


def decode_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """The flash-decoding splits the Pallas decode-only launch picks (default tiles) for ``num_reqs`` request
    rows and ``num_kv_heads`` kv heads (per device) at contexts up to ``max_seq_len``: whether a step bounded by
    ``metadata.SHORT_SEQ_LEN`` runs a launch shape of its own is ``decode_splits(.., SHORT_SEQ_LEN)`` against
    ``decode_splits(.., max_model_len)``."""
    from .flash_decoding import pick_splits  # noqa: PLC0415  (keeps Pallas off the CPU import path)
    return pick_splits(num_reqs, num_kv_heads, max_seq_len, 64)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")


def write_kv(k_cache, v_cache, k, v, slot_mapping, *, backend: str = "reference", k_scale=None, v_scale=None,
             interpret: bool = False):
    """Store the step's new K/V ``[T, kv_heads, head_dim]`` at ``slot_mapping`` (quantizing for fp8).

    ``reference``: two XLA scatters (K, V). ``pallas``: one kernel for both (``kv_write_pallas``), which
    skips padding tokens. Either updates a donated cache in place.
    """
    _check_backend(backend)
    if backend == "reference":
        return ref_attention.write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    _check_gpu(interpret)
    from . import kv_write_pallas  # noqa: PLC0415
    return kv_write_pallas.write_kv(k_cache, v_cache, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale,
                                    interpret=interpret)


def _check_gpu(interpret: bool) -> None:
    if not interpret and jax.default_backend() != "gpu":
        raise ValueError(f"attention backend 'pallas' needs an NVIDIA GPU (JAX runs on "
                         f"{jax.default_backend()!r}); use backend 'reference' (or 'auto')")


def paged_attention(q, k_cache, v_cache, md: AttentionMetadata, *, sm_scale: float,
                    soft_cap: float | None = None, sliding_window: int | None = None,
                    backend: str = "reference", k_scale=None, v_scale=None, interpret: bool = False,
                    **pallas_options):
    """Ragged paged attention ``q [T, Hq, D]`` -> ``[T, Hq, D]`` (semantics in ``kernels/metadata.py``).

    ``pallas_options``: tile sizes / launch parameters / ``dot_dtype`` of the Pallas kernel (ignored by the
    reference, which computes in f32)."""
    _check_backend(backend)
    if backend == "reference":
        return ref_attention.ragged_paged_attention(q, k_cache, v_cache, md, sm_scale=sm_scale,
                                                    soft_cap=soft_cap, sliding_window=sliding_window,
                                                    k_scale=k_scale, v_scale=v_scale)
    _check_gpu(interpret)
    from . import paged_attention_pallas  # noqa: PLC0415  (keeps Pallas off the CPU import path)
    pallas_options.setdefault("prefill_kernel", _PREFILL_KERNEL[backend])
    return paged_attention_pallas.ragged_paged_attention(
        q, k_cache, v_cache, md, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        k_scale=k_scale, v_scale=v_scale, interpret=interpret, **pallas_options)


def write_kv_and_attend(q, k, v, k_cache, v_cache, md: AttentionMetadata, *, sm_scale: float,
                        soft_cap: float | None = None, sliding_window: int | None = None,
                        backend: str = "reference", k_scale=None, v_scale=None, interpret: bool = False,
                        **pallas_options):
    """``write_kv`` of the step's new ``k``/``v`` then ``paged_attention`` of ``q`` (which sees them): what a
    layer does. Returns ``(out [T, Hq, D], k_cache, v_cache)``.

    The Pallas backends pack q, k and v into one ``[T, Hq + 2 * kv_heads, D]`` array that both kernels read
    (``kv_write_pallas.write_kv_packed``, ``num_q_heads`` of the attention kernel), so the QKV projection's
    epilogue (RoPE on q and k) is one XLA fusion instead of three (rope q, rope k, a copy of v). A decode-only
    step (``md.decode_only``) writes in its attention launch (``write_kv`` of the Pallas kernel): one launch
    per layer fewer, and no program reads a slot it writes. Other steps that may take the Mosaic GPU prefill
    (``pallas-mgpu``, or ``pallas`` at ``MGPU_MIN_TOKENS`` token slots and more) write and attend unpacked.
    """
    _check_backend(backend)
    packed = False
    if backend != "reference":
        _check_gpu(interpret)
        from . import kv_write_pallas, paged_attention_pallas  # noqa: PLC0415
        pallas_options.setdefault("prefill_kernel", _PREFILL_KERNEL[backend])
        kernel = pallas_options["prefill_kernel"]
        # a step that may go to the Mosaic GPU prefill, which TMA-loads the queries alone, stays unpacked:
        # packing would cost a copy of them, and the small fusions it saves are nothing next to such a step
        packed = md.decode_only or not (
            kernel == "mgpu" or (kernel == "auto" and q.shape[0] >= paged_attention_pallas.MGPU_MIN_TOKENS))
    if not packed:
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, md.slot_mapping, backend=backend, k_scale=k_scale,
                                    v_scale=v_scale, interpret=interpret)
        out = paged_attention(q, k_cache, v_cache, md, sm_scale=sm_scale, soft_cap=soft_cap,
                              sliding_window=sliding_window, backend=backend, k_scale=k_scale, v_scale=v_scale,
                              interpret=interpret, **pallas_options)
        return out, k_cache, v_cache
    hq = q.shape[1]
    qkv = jnp.concatenate([q, k.astype(q.dtype), v.astype(q.dtype)], axis=1)
    if md.decode_only:
        return paged_attention_pallas.ragged_paged_attention(
            qkv, k_cache, v_cache, md, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
            k_scale=k_scale, v_scale=v_scale, interpret=interpret, num_q_heads=hq, write_kv=True, **pallas_options)
    k_cache, v_cache = kv_write_pallas.write_kv_packed(k_cache, v_cache, qkv, md.slot_mapping, num_q_heads=hq,
                                                       k_scale=k_scale, v_scale=v_scale, interpret=interpret)
    out = paged_attention_pallas.ragged_paged_attention(
        qkv, k_cache, v_cache, md, sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window,
        k_scale=k_scale, v_scale=v_scale, interpret=interpret, num_q_heads=hq, **pallas_options)
    return out, k_cache, v_cache


# ------------------------------------------------------------------ multi-head latent attention (DeepSeek)
def write_latent(latent_cache, latent, slot_mapping, *, backend: str = "reference", scale=None):
    """Store the step's latent rows ``[T, kv_lora_rank + rope_dim]`` at ``slot_mapping`` (``mla_ref``'s
    layout; fp8 divides by the per-tensor ``scale``). One XLA scatter on every backend: a row is one
    contiguous run of the page, which the scatter writes at copy speed."""
    _check_backend(backend)
    return mla_ref.write_latent(latent_cache, latent, slot_mapping, scale=scale)


MGPU_MIN_HEADS = 64     # mla_attention's decode="auto": the Mosaic GPU kernel from this many heads (DeepSeek-V3)


def mla_attention(q_nope_latent, q_rope, latent_cache, md: AttentionMetadata, *, sm_scale: float,
                  kv_lora_rank: int, backend: str = "reference", scale=None, interpret: bool = False,
                  prefill: str = "kernel", decode: str = "auto", **pallas_options):
    """Absorbed MLA over the paged latent cache: ``[T, H, R]`` latent outputs (``mla_ref`` has the semantics).

    ``reference``: ``mla_ref``. The Pallas backends run ``mla_decode_pallas.mla_paged_attention``: a
    decode-only step one token a program (one page load serves a group of heads), a step with prefill chunks
    in tiles of a few tokens of one request (one page load serves the tile's tokens and heads).
    ``prefill="reference"`` runs the latter steps through ``mla_ref`` under XLA instead (a token's context
    gathered for each token). ``decode``: the decode-only steps' kernel, ``triton`` (``mla_decode_pallas``),
    ``mgpu`` (``mla_decode_mgpu`` where it ``supported`` the call, else Triton) or ``auto`` (``mgpu`` at
    ``MGPU_MIN_HEADS`` heads or more, where its TMA pages and wgmma beat the Triton gathers: kernels/README.md).
    A latent rank or rope dim the kernels do not tile (not a power of two of at least 16) runs the reference."""
    _check_backend(backend)
    if prefill not in ("kernel", "reference"):
        raise ValueError(f"prefill must be 'kernel' or 'reference', got {prefill!r}")
    if decode not in ("auto", "triton", "mgpu"):
        raise ValueError(f"decode must be 'auto', 'triton' or 'mgpu', got {decode!r}")
    if backend != "reference":
        _check_gpu(interpret)
        from . import mla_decode_pallas  # noqa: PLC0415  (keeps Pallas off the CPU import path)
    if backend == "reference" or (not md.decode_only and prefill == "reference") \
            or not mla_decode_pallas.tileable(q_nope_latent.shape[-1], q_rope.shape[-1]):
        return mla_ref.mla_paged_attention(q_nope_latent, q_rope, latent_cache, md, sm_scale=sm_scale,
                                           kv_lora_rank=kv_lora_rank, scale=scale)
    if md.decode_only and (decode == "mgpu" or (decode == "auto" and q_nope_latent.shape[1] >= MGPU_MIN_HEADS)):
        from . import mla_decode_mgpu  # noqa: PLC0415
        if mla_decode_mgpu.supported(q_nope_latent, q_rope, latent_cache, kv_scale=scale):
            return mla_decode_mgpu.mla_paged_attention(q_nope_latent, q_rope, latent_cache, md, sm_scale=sm_scale,
                                                       kv_lora_rank=kv_lora_rank, interpret=interpret)
    return mla_decode_pallas.mla_paged_attention(q_nope_latent, q_rope, latent_cache, md, sm_scale=sm_scale,
                                                 kv_lora_rank=kv_lora_rank, kv_scale=scale, interpret=interpret,
                                                 **pallas_options)


def write_latent_and_attend(q_nope_latent, q_rope, latent, latent_cache, md: AttentionMetadata, *,
                            sm_scale: float, kv_lora_rank: int, backend: str = "reference", scale=None,
                            **kernel_kwargs):
    """``write_latent`` of the step's rows, then ``mla_attention`` (which sees them): what an MLA layer does.
    Returns ``(latent out [T, H, R], latent_cache)``."""
    latent_cache = write_latent(latent_cache, latent, md.slot_mapping, backend=backend, scale=scale)
    out = mla_attention(q_nope_latent, q_rope, latent_cache, md, sm_scale=sm_scale, kv_lora_rank=kv_lora_rank,
                        backend=backend, scale=scale, **kernel_kwargs)
    return out, latent_cache
