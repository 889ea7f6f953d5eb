"""A worker process of ``--distributed-executor-backend mp`` (started by ``launcher.LocalWorkers``; a Ray
worker runs ``follow`` in its actor):

    python -m jaxserve.executor.worker CONFIG.pkl COORDINATOR NUM_PROCESSES PROCESS_ID STEP_PORT

Joins ``jax.distributed``, builds the same model and runner as process 0 (``ModelExecutor``: same weights, same
warm-up) and launches every step process 0 sends until it says stop.
"""
from __future__ import annotations

import pickle
import sys


def follow(config, coordinator: str, num_processes: int, process_id: int, *, local_device_ids=None,
           receiver=None) -> int:
    """Join ``jax.distributed``, build process 0's model and runner, and launch every step it sends until it
    says stop (``receiver``: the mp executor's socket; None: the coordination service's store, as the Ray
    workers use). Returns the number of steps."""
    from jaxserve.executor import distributed
    distributed.initialize(coordinator, num_processes, process_id, local_device_ids=local_device_ids)
    from jaxserve.executor.model_executor import ModelExecutor
    executor = ModelExecutor(config)
    executor.build_runner()
    executor.warm_up(progress=False)
    return distributed.follow_runner(executor.runner, distributed.StepChannel(transport=receiver))


def main(argv=None) -> int:
    config_path, coordinator, n, i, port = (argv if argv is not None else sys.argv[1:])
    n, i = int(n), int(i)
    with open(config_path, "rb") as f:
        config = pickle.load(f)
    from jaxserve.executor import distributed, launcher
    receiver = distributed.SocketReceiver(int(port), i)       # process 0 accepts before jax.distributed
    steps = follow(config, coordinator, n, i, local_device_ids=launcher.local_device_ids(i), receiver=receiver)
    print(f"worker {i}: followed {steps} steps", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from jaxserve.utils.startup_imports import hide_torch
    hide_torch()            # this process runs JAX only: its tokenizer need not import torch
    sys.exit(main())
