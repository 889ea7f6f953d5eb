"""Row gathers and stores the Pallas Triton kernels share."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def rows_of(ref, rows):
    """View of whole rows ``rows [N]`` of a 2-D ref: ``[N, ref.shape[1]]`` (a gather of contiguous rows).

    Spelled as two broadcast index arrays (not rows + slice) so interpret mode can discharge it too.
    """
    cols = lax.iota(jnp.int32, ref.shape[1])
    return ref.at[rows[:, None], cols[None, :]]


def store_rows(out_ref, rows, val, valid):
    """Store ``val [N, D]`` into rows ``rows [N]`` of ``out_ref`` where ``valid [N]``."""
    plgpu.store(rows_of(out_ref, rows), val.astype(out_ref.dtype), mask=jnp.broadcast_to(valid[:, None], val.shape))
