"""Beyond one host: ``jax.distributed`` start-up and the step channel that keeps the processes in lockstep.

Multi-controller JAX: every process runs the same jitted step on its own devices and XLA's collectives
join them, so every process must call the step with the same inputs, in the same order. Only process 0
runs the scheduler (and the server). The runner therefore does, per step::

    inputs = build_padded_step_inputs(scheduler_output)     # numpy dict, process 0 only
    channel.send(inputs)                                    # process 0: one broadcast to the others
    tokens = run_step(inputs)                               # every process

and every other process runs ``follow_steps(channel, run_step)`` instead of an engine loop: it receives
each step's inputs and runs the same ``run_step`` until process 0 calls ``channel.stop()`` (at shutdown).
Step outputs (sampled tokens) come out replicated, so process 0 reads its local copy
(``fetch_replicated``) and the followers discard theirs.
"""
from __future__ import annotations

import os
import pickle
from typing import Any, Callable

import jax
import numpy as np

_MIN_PAYLOAD = 4096           # payload sizes are padded to powers of two ≥ this: few broadcast shapes
_STEP, _STOP = 1, 2


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None,
               initialization_timeout: int = 120) -> bool:
    """Start ``jax.distributed`` so ``jax.devices()`` (and so the mesh) spans every process.

    Unset arguments come from ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
    (JAX itself reads the first, and auto-detects SLURM/MPI/Kubernetes for the rest). Returns False and
    does nothing for a single process with no coordinator. Must run before anything touches a device.
    On CPU it selects gloo collectives (XLA's CPU backend has no cross-process collectives otherwise).
    """
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    if coordinator is None and (num_processes or 1) == 1:
        return False
    if jax.distributed.is_initialized():
        return True
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} is out of range for num_processes={num_processes}")
    if "cpu" in os.environ.get("JAX_PLATFORMS", "cpu").split(","):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id, local_device_ids=local_device_ids,
                               initialization_timeout=initialization_timeout)
    return True


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def is_driver() -> bool:
    """True on the process that runs the scheduler (process 0)."""
    return jax.process_index() == 0


def fetch_replicated(x: jax.Array) -> np.ndarray:
    """Host copy of a replicated array, also when the mesh spans processes (where ``np.asarray`` of a
    not-fully-addressable array is refused)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if not x.is_fully_replicated:
        raise ValueError(f"array of shape {x.shape} is sharded over processes ({x.sharding}); "
                         "replicate it in the step (jaxserve.parallel.gather_logits) before fetching it")
    return np.asarray(x.addressable_data(0))


class StepChannel:
    """Process 0 → all: each step's host inputs (any picklable pytree, e.g. a dict of padded numpy arrays).

    Two collectives per step through ``multihost_utils.broadcast_one_to_all`` (a fixed-shape header, then
    the pickled payload padded to a power of two so the broadcast compiles for a handful of sizes only).
    With one process ``send`` is a no-op and ``receive`` is an error.
    """

    def __init__(self):
        self.multi_process = jax.process_count() > 1
        self.steps_sent = 0

    def send(self, step_inputs: Any) -> None:
        if self.multi_process:
            self._broadcast(_STEP, pickle.dumps(step_inputs, protocol=pickle.HIGHEST_PROTOCOL))
            self.steps_sent += 1

    def stop(self) -> None:
        """Release the followers from ``follow_steps`` (call once, at shutdown, on process 0)."""
        if self.multi_process:
            self._broadcast(_STOP, b"")

    def receive(self) -> tuple[int, Any]:
        if not self.multi_process:
            raise RuntimeError("StepChannel.receive needs more than one process")
        from jax.experimental import multihost_utils
        header = multihost_utils.broadcast_one_to_all(np.zeros(2, np.int64))
        kind, size = int(header[0]), int(header[1])
        if kind == _STOP:
            return _STOP, None
        payload = multihost_utils.broadcast_one_to_all(np.zeros(_padded(size), np.uint8))
        return _STEP, pickle.loads(payload[:size].tobytes())

    def _broadcast(self, kind: int, data: bytes) -> None:
        from jax.experimental import multihost_utils
        if not is_driver():
            raise RuntimeError("only process 0 sends steps; the others call follow_steps()")
        multihost_utils.broadcast_one_to_all(np.array([kind, len(data)], np.int64))
        if kind == _STEP:
            buf = np.zeros(_padded(len(data)), np.uint8)
            buf[:len(data)] = np.frombuffer(data, np.uint8)
            multihost_utils.broadcast_one_to_all(buf)


def _padded(size: int) -> int:
    return max(_MIN_PAYLOAD, 1 << (max(size, 1) - 1).bit_length())


def follow_steps(channel: StepChannel, run_step: Callable[[Any], Any]) -> int:
    """A follower process's main loop: run every step process 0 sends, until it stops. Returns the count."""
    steps = 0
    while True:
        kind, step_inputs = channel.receive()
        if kind == _STOP:
            return steps
        run_step(step_inputs)
        steps += 1
