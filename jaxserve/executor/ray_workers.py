"""``--distributed-executor-backend ray``: the engine's JAX processes placed on a running Ray cluster.

One JAX process per pipeline stage (each drives its stage's ``tensor_parallel_size`` devices): tensor
parallelism stays inside a node, where its all-reduces are cheap, and only the stages' hidden states cross
nodes. The process the user starts (the server, ``LLM``, the CLI) joins the cluster (``ray.init`` with
``RAY_ADDRESS``, else the local node's cluster) and is process 0, stage 0, the scheduler; it reserves a
placement group of one bundle per stage, one per node (``STRICT_SPREAD``), one of them on its own node, and
starts a ``StageWorker`` actor in each other bundle. The coordinator address (this node's address, a free
port) reaches the workers as an argument of their Ray call; they join ``jax.distributed`` with it, build the
same ``ModelExecutor`` and follow process 0's steps (``distributed.follow_runner`` over the coordination
service's store, as ``--num-processes`` does). Ray only places and starts the processes; steps, weights and
activations never go through it.

A worker that dies (its actor, its node) ends its Ray call with an error; a watcher thread here sees it within
``WATCH_S`` and calls ``on_worker_lost`` (the server's engine fails its in-flight requests and /health answers
503), or without one ends this process, which could otherwise wait for the lost stage forever.
"""
from __future__ import annotations

import atexit
import importlib
import logging
import os
import threading

from jaxserve import envs

from . import distributed
from .ray_replicas import cpu_only, join_cluster, reserve

logger = logging.getLogger(__name__)

WATCH_S = 0.5
PLACEMENT_TIMEOUT_S = 120.0


class StageWorker:
    """A Ray actor: one JAX process of the engine (stage ``process_id``)."""

    def run(self, config, coordinator: str, num_processes: int, process_id: int) -> int:
        # the worker module by name, as the mp executor starts it (it builds the executor that starts us)
        steps = importlib.import_module("jaxserve.executor.worker").follow(config, coordinator, num_processes,
                                                                            process_id)
        # every process leaves jax.distributed together (process 0 at its exit); this actor then ends
        import jax
        jax.distributed.shutdown()
        return steps


class RayWorkers:
    """Process 0's handle on the workers: the placement group, the actors, their calls and the watcher."""

    def __init__(self, config, *, timeout_s: float = PLACEMENT_TIMEOUT_S):
        import ray
        from ray.util.placement_group import placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        par = config.parallel
        n, tp = par.pipeline_parallel_size, par.tensor_parallel_size
        if n < 2:
            raise ValueError("--distributed-executor-backend ray places one process per pipeline stage: give "
                             "--pipeline-parallel-size 2 or more (tensor parallelism alone runs in one process)")
        join_cluster()
        on_cpu = cpu_only()
        bundle = {"CPU": 1} if on_cpu else {"CPU": 1, "GPU": tp}
        self.group = reserve([dict(bundle) for _ in range(n)], "STRICT_SPREAD", timeout_s,
                             f"{n} pipeline stages of {bundle} each, one per node")
        here = ray.get_runtime_context().get_node_id()
        nodes = placement_group_table(self.group)["bundles_to_node_id"]
        mine = [b for b, node in nodes.items() if node == here]
        if not mine:
            ray.util.remove_placement_group(self.group)
            raise RuntimeError("no bundle of the placement group is on this node: start jaxserve on a node of the "
                               "Ray cluster that has one stage's devices free")
        others = [b for b in sorted(nodes) if b != mine[0]]
        host = ray.util.get_node_ip_address()
        self.coordinator = f"{host}:{distributed.free_port(host)}"
        env = {k: v for k in ("JAX_PLATFORMS", "JAXSERVE_PP_LAYER_PARTITION") if (v := getattr(envs, k))}
        if on_cpu:
            env["XLA_FLAGS"] = " ".join(filter(None, (envs.XLA_FLAGS, f"--xla_force_host_platform_device_count={tp}")))
        actor = ray.remote(StageWorker)
        self.actors = [actor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=b),
            runtime_env={"env_vars": env}, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            max_restarts=0).remote() for b in others]
        self.calls = [a.run.remote(config, self.coordinator, n, i + 1) for i, a in enumerate(self.actors)]
        self.on_worker_lost = None          # set by whoever can fail the requests (the server's engine)
        self.lost: str | None = None
        self._release = None
        self._stopping = threading.Event()
        try:
            distributed.initialize(self.coordinator, n, 0, local_device_ids=None if on_cpu else list(range(tp)),
                                   initialization_timeout=int(timeout_s))
        except BaseException:
            self.kill()
            raise
        atexit.register(self.shutdown)
        self._watcher = threading.Thread(target=self._watch, name="jaxserve-ray-watch", daemon=True)
        self._watcher.start()
        logger.info("Ray: %d stages, one process each on its own node; coordinator %s", n, self.coordinator)

    def step_channel(self):
        """None: the coordination service's store carries the steps (the workers may be on other hosts)."""
        return None

    def set_release(self, release) -> None:
        self._release = release

    def _watch(self) -> None:
        import ray
        while not self._stopping.is_set():
            done, _ = ray.wait(self.calls, num_returns=1, timeout=WATCH_S)
            if not done or self._stopping.is_set():
                continue
            try:
                ray.get(done[0])
                why = "a pipeline stage's worker process left before the engine stopped"
            except Exception as e:  # noqa: BLE001 - RayActorError, a node lost, the worker's own error
                why = f"a pipeline stage's worker process died: {type(e).__name__}: {str(e).splitlines()[0]}"
            self.lost = why
            logger.error("%s", why)
            if self.on_worker_lost is not None:
                self.on_worker_lost(why)
            else:       # the driver would wait for the lost stage forever
                logger.error("no engine to fail its requests: exiting")
                os._exit(1)
            return

    def shutdown(self) -> None:
        import ray
        self._stopping.set()
        release, self._release = self._release, None
        if self.lost is None and ray.wait(self.calls, num_returns=len(self.calls), timeout=0)[0]:
            self.lost = "a pipeline stage's worker process is gone"
        if self.lost is not None:
            # jax.distributed's shutdown (this hook's or JAX's own at exit) would wait for the lost process
            logger.error("%s: exiting without jax.distributed's shutdown", self.lost)
            self.kill()
            logging.shutdown()
            os._exit(1)
        if release is not None:
            try:
                release()
                # the released workers wait in jax.distributed's shutdown barrier for this process: join it
                import jax
                jax.distributed.shutdown()
                ray.get(self.calls, timeout=60)
            except Exception:  # noqa: BLE001 - a worker already gone; killed below
                pass
        self.kill()

    def kill(self) -> None:
        import ray
        if self._stopping.is_set() and not getattr(self, "actors", None):
            return
        self._stopping.set()
        actors, self.actors = getattr(self, "actors", []), []
        for a in actors:
            ray.kill(a, no_restart=True)
        if actors:
            ray.util.remove_placement_group(self.group)
