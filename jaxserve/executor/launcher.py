"""``--distributed-executor-backend mp``: one process per device on this host, started by the engine itself.

Process 0 (the one the user started: the server, ``LLM``, the CLI) writes its engine config to a temporary
file, spawns ``tensor_parallel_size × pipeline_parallel_size - 1`` workers (``python -m jaxserve.executor.worker``), and all of them
join ``jax.distributed`` through a coordinator on a free localhost port; on a GPU process i sees only local
device i. From there it is the multi-process mode of ``distributed.py``: process 0 schedules and sends each
step, the workers build the same engine and follow. Each process dispatches only its own device's share of
a step, so the host cost of a step does not grow with the number of devices as it does when one process
drives them all.

Steps reach the workers over one local TCP connection each (``distributed.SocketFanout``), not the
coordination service's key-value store. At exit process 0 releases the workers (``LocalWorkers.shutdown``)
and reaps them; a worker whose process 0 is gone reads EOF on that connection and exits.
"""
from __future__ import annotations

import atexit
import os
import pickle
import subprocess
import sys
import tempfile

from jaxserve import envs

from . import distributed


def _on_cpu() -> bool:
    # decided before JAX starts a backend (that would be too late for jax.distributed)
    platforms = envs.JAX_PLATFORMS
    return bool(platforms) and "cpu" in platforms.split(",") and "cuda" not in platforms and "gpu" not in platforms


def local_device_ids(process_id: int) -> list[int] | None:
    return None if _on_cpu() else [process_id]


class LocalWorkers:
    """The spawned worker processes of an ``mp`` engine (process 0's handle on them)."""

    def __init__(self, config, *, timeout_s: float = 120.0):
        n = config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size
        self.coordinator = f"127.0.0.1:{distributed.free_port()}"
        fd, self.config_path = tempfile.mkstemp(prefix="jaxserve-engine-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(config, f, pickle.HIGHEST_PROTOCOL)
        # the steps travel over local sockets (distributed.SocketFanout), not the coordinator's store
        self.fanout = distributed.SocketFanout()
        self.procs = [subprocess.Popen([sys.executable, "-m", "jaxserve.executor.worker", self.config_path,
                                        self.coordinator, str(n), str(i), str(self.fanout.port)],
                                       stdout=subprocess.DEVNULL)
                      for i in range(1, n)]
        self.timeout_s = timeout_s
        self._release = None
        atexit.register(self.shutdown)
        try:
            self.fanout.accept(n - 1, timeout_s, alive=lambda: all(p.poll() is None for p in self.procs))
            distributed.initialize(self.coordinator, n, 0, local_device_ids=local_device_ids(0),
                                   initialization_timeout=int(timeout_s))
        except BaseException:
            self.kill()
            raise

    def step_channel(self):
        """Process 0's channel to these workers (the engine's ``BroadcastingRunner`` sends on it)."""
        return distributed.StepChannel(transport=self.fanout)

    def set_release(self, release) -> None:
        """``release()`` tells the workers to leave their loop (the engine's BroadcastingRunner.stop)."""
        self._release = release

    def shutdown(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            try:
                release()
            except Exception:  # a worker that already died; reaped below
                pass
        # The workers, once released, wait in jax.distributed's shutdown barrier for this process: join it
        # now (JAX's own exit hook would run only after this one) instead of waiting for them first.
        try:
            import jax
            if jax.distributed.is_initialized():
                jax.distributed.shutdown()
        except Exception:
            pass
        for p in self.procs:
            try:
                p.wait(timeout=self.timeout_s if release is not None else 5)
            except subprocess.TimeoutExpired:
                p.kill()
        self._cleanup()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        self._cleanup()

    def _cleanup(self) -> None:
        self.fanout.close()
        try:
            os.unlink(self.config_path)
        except OSError:
            pass


def maybe_start(config) -> LocalWorkers | None:
    """Start the workers when the config asks for ``mp`` with more than one device and this process has not
    joined a multi-process run yet (workers themselves arrive here already initialised)."""
    import jax
    par = config.parallel
    if par.distributed_executor_backend == "ray" and not jax.distributed.is_initialized():
        from .ray_workers import RayWorkers       # the workers on a Ray cluster instead of this host
        return RayWorkers(config)
    if par.distributed_executor_backend != "mp" or par.tensor_parallel_size * par.pipeline_parallel_size <= 1 \
            or jax.distributed.is_initialized():
        return None
    if par.distributed_coordinator or par.num_processes > 1:
        raise ValueError("--distributed-executor-backend mp starts its own processes; do not combine it with "
                         "--distributed-coordinator / --num-processes")
    return LocalWorkers(config)
