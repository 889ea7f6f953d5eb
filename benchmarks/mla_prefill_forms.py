"""DeepSeek's prefill attention in its two forms, a layer at a time on one GPU (the MLA issue's "measure both").

- **absorbed** (what the engine runs): ``q_nope · W_UK`` into the latent space, the Triton MLA kernel's prefill
  tiles over the paged latent cache (``kernels/mla_decode_pallas.py``), the latent output projected back with
  ``W_UV``: ``2 H (2R + P)`` FLOPs a (query, key) pair.
- **decompressed**: the chunk's latents through ``kv_b_proj`` into per-head K (``d_nope`` + the shared rope key)
  and V (padded to the key width: jax's attention takes one head dim), then cuDNN's flash attention
  (``jax.nn.dot_product_attention``): ``2 H (d_nope + P + d_v)`` FLOPs a pair plus the decompression GEMM.
  Its best case is timed: fresh prompts, whose keys are the step's own latents (no gather of cached pages; a
  chunk after a cached prefix would also decompress the prefix).

Each form runs ``--layers`` dependent layers in one jit (a layer's output feeds the next layer's queries), at
batches of fresh prompts that fill one step's token budget:

    python -m jaxserve.benchmarks.mla_prefill_forms [--heads 16,128] [--shapes 1x2048,2x1024,8x256]
"""
from __future__ import annotations

import argparse

from .kernel_bench import chain_seconds

R, P, D_NOPE, D_V, BLOCK = 512, 64, 128, 128, 16       # DeepSeek V2 / V3's MLA shape, pages of 16


def case(B: int, T: int, H: int, dtype):
    """``(weights, q_nope, q_rope, latent, latent_cache, md)`` of B fresh prompts of T tokens at H heads: the
    absorbed form's ``uk`` / ``uv`` are the halves of the decompressed form's ``kv_b``, and the paged cache
    already holds the step's latents."""
    import jax
    import jax.numpy as jnp

    from jaxserve.kernels.metadata import AttentionMetadata
    from jaxserve.kernels.mla_ref import write_latent
    ks = jax.random.split(jax.random.key(0), 4)
    n = B * T
    kv_b = jax.random.normal(ks[0], (R, H, D_NOPE + D_V), dtype) * R ** -0.5
    w = {"kv_b": kv_b.reshape(R, -1),
         "uk": kv_b[..., :D_NOPE].transpose(1, 2, 0), "uv": kv_b[..., D_NOPE:].transpose(1, 0, 2)}
    q_nope = jax.random.normal(ks[1], (n, H, D_NOPE), dtype)
    q_rope = jax.random.normal(ks[2], (n, H, P), dtype)
    latent = jax.random.normal(ks[3], (n, R + P), dtype)
    pages = -(-T // BLOCK)
    tables = 1 + jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages)
    slots = (tables[:, :, None] * BLOCK + jnp.arange(BLOCK)).reshape(B, pages * BLOCK)[:, :T].reshape(-1)
    md = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=jnp.full((B,), T, jnp.int32),
                           query_start_loc=jnp.arange(B + 1, dtype=jnp.int32) * T, num_seqs=jnp.int32(B))
    cache = write_latent(jnp.zeros((1 + B * pages, BLOCK, R + P), dtype), latent, slots)
    return w, q_nope, q_rope, latent, cache, md


def absorbed_layer(w, q_nope, q_rope, latent_cache, md, *, scale: float, interpret: bool = False):
    """``[n, H, d_v]``: the engine's form (the cache already holds the step's latents)."""
    import jax.numpy as jnp

    from jaxserve.kernels.mla_decode_pallas import mla_paged_attention
    q_lat = jnp.einsum("thd,hdr->thr", q_nope, w["uk"])
    o_lat = mla_paged_attention(q_lat, q_rope, latent_cache, md, sm_scale=scale, interpret=interpret)
    return jnp.einsum("thr,hrv->thv", o_lat, w["uv"])


def decompressed_layer(w, q_nope, q_rope, latent, B: int, T: int, *, scale: float, implementation=None):
    """``[n, H, d_v]``: K/V decompressed from the step's latents, then one causal attention per prompt."""
    import jax
    import jax.numpy as jnp
    n, H, _ = q_nope.shape
    kv = (latent[:, :R] @ w["kv_b"]).reshape(n, H, D_NOPE + D_V)
    k_rope = jnp.broadcast_to(latent[:, None, R:], (n, H, P))
    k = jnp.concatenate([kv[..., :D_NOPE], k_rope], axis=-1)
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    v = jnp.pad(kv[..., D_NOPE:], ((0, 0), (0, 0), (0, D_NOPE + P - D_V)))    # jax's attention: one head dim
    out = jax.nn.dot_product_attention(q.reshape(B, T, H, -1), k.reshape(B, T, H, -1), v.reshape(B, T, H, -1),
                                       scale=scale, is_causal=True, implementation=implementation)
    return out.reshape(n, H, -1)[..., :D_V]


def time_forms(B: int, T: int, H: int, layers: int, reps: int, interpret: bool = False) -> dict[str, float]:
    """Seconds a layer of each form (``inf`` where a form does not compile here)."""
    import jax
    import jax.numpy as jnp

    w, q_nope, q_rope, latent, cache, md = case(B, T, H, jnp.float32 if interpret else jnp.bfloat16)
    scale = (D_NOPE + P) ** -0.5

    def absorbed(q, qr, cache, md):
        for _ in range(layers):
            q = absorbed_layer(w, q, qr, cache, md, scale=scale, interpret=interpret)
        return q

    def decompressed(q, qr, latent, impl):
        for _ in range(layers):
            q = decompressed_layer(w, q, qr, latent, B, T, scale=scale, implementation=impl)
        return q

    forms = {"absorbed": (jax.jit(absorbed), (q_nope, q_rope, cache, md)),
             "decompressed (cuDNN)": (jax.jit(decompressed, static_argnums=3),
                                      (q_nope, q_rope, latent, None if interpret else "cudnn")),
             "decompressed (XLA)": (jax.jit(decompressed, static_argnums=3), (q_nope, q_rope, latent, "xla"))}
    one = [absorbed_layer(w, q_nope, q_rope, cache, md, scale=scale, interpret=interpret),
           decompressed_layer(w, q_nope, q_rope, latent, B, T, scale=scale, implementation="xla")]
    err = float(jnp.max(jnp.abs(one[0].astype(jnp.float32) - one[1].astype(jnp.float32))))
    print(f"  B={B} T={T} H={H}: one layer, max |absorbed - decompressed| = {err:.3g}", flush=True)
    out = {}
    for name, (fn, args) in forms.items():
        try:
            out[name] = chain_seconds(fn, *args, n_iter=layers, reps=reps)
        except Exception as e:  # noqa: BLE001  (a form that does not compile here is said, not fatal)
            print(f"  {name} at B={B} T={T} H={H}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            out[name] = float("inf")
    return out


def flops(B: int, T: int, H: int) -> dict[str, float]:
    """Causal FLOPs a layer of each form (half the (query, key) pairs), absorption / decompression GEMMs in."""
    pairs = B * T * (T + 1) / 2
    n = B * T
    return {"absorbed": 2 * H * (2 * R + P) * pairs + 2 * n * H * (D_NOPE * R + R * D_V),
            "decompressed": 2 * H * (D_NOPE + P + D_V) * pairs + 2 * n * R * H * (D_NOPE + D_V)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", default="16,128", help="heads a device, comma-separated")
    ap.add_argument("--shapes", default="1x2048,2x1024,8x256", help="prompts x tokens, comma-separated")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--interpret", action="store_true", help="CPU: Pallas interpret mode, float32, tiny sizes")
    a = ap.parse_args(argv)
    print("| heads | prompts × tokens | form | µs a layer | TFLOP/s | decompressed / absorbed time |\n"
          "|---|---|---|---|---|---|")
    for H in map(int, a.heads.split(",")):
        for shape in a.shapes.split(","):
            B, T = map(int, shape.split("x"))
            t = time_forms(B, T, H, a.layers, a.reps, a.interpret)
            f = flops(B, T, H)
            for name, s in t.items():
                tf = f[name.split(" ")[0]] / s / 1e12 if s != float("inf") else 0.0
                ratio = "" if name == "absorbed" else f"{s / t['absorbed']:.2f}"
                print(f"| {H} | {B} × {T} | {name} | {s * 1e6:.1f} | {tf:.0f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
