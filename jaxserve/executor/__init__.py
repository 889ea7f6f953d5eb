"""Processes: multi-process start-up (``jax.distributed``), the step channel that keeps every process
launching the same steps, the ``mp`` executor's spawned workers and the ``ray`` executor's actors. The
tensor- and pipeline-parallel math they run is ``jaxserve.parallel``'s."""
from .distributed import BroadcastingRunner, StepChannel, follow_runner, follow_steps, initialize, is_driver

__all__ = ["BroadcastingRunner", "StepChannel", "follow_runner", "follow_steps", "initialize", "is_driver"]
