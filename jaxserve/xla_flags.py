"""The XLA flags jaxserve runs with unless XLA_FLAGS sets them (or JAXSERVE_XLA_FLAGS=0).

XLA reads XLA_FLAGS once, when its first backend starts, so ``apply`` runs when jaxserve is imported; the
processes jaxserve starts (the engine core, tensor-parallel workers) inherit the environment.
"""
from __future__ import annotations

from jaxserve import envs

DEFAULTS = {
    # A step's CUDA graph is re-recorded, command by command, whenever a buffer it uses has moved since its last
    # call. The temp buffer moves nearly every call and nearly every command uses it, so the re-record bounded
    # launch-bound steps (MoE at batch 1). SKIP_TEMP keeps the temp buffer at one virtual address (XLA maps it
    # there; this selects XLA's VMM allocator), so a call updates only the commands whose inputs moved. Measured
    # in benchmarks/results/README.md (the command-buffer update mode row).
    "xla_gpu_command_buffer_update_mode": "SKIP_TEMP",
}


def apply() -> None:
    """Add each of ``DEFAULTS`` that XLA_FLAGS does not set to XLA_FLAGS."""
    if not envs.JAXSERVE_XLA_FLAGS:
        return
    current = envs.XLA_FLAGS or ""
    added = [f"--{name}={value}" for name, value in DEFAULTS.items() if f"--{name}=" not in current]
    if added:
        envs.write("XLA_FLAGS", " ".join([current, *added]).strip())
