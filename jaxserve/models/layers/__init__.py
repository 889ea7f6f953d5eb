"""Shared decoder layers: norms, rotary embeddings, attention, gated MLPs and the decoder stack (``flax.nnx``)
that every decoder family composes; a family file only picks the features and maps checkpoint names."""
