"""Pallas GPU kernels and their pure-jnp references (installed as jaxserve.kernels)."""
