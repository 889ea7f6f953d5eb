"""``--data-parallel-size N --distributed-executor-backend ray``: each data-parallel replica's engine core in a
Ray actor, anywhere on the running Ray cluster.

The front end (the server, ``LLM``) joins the cluster (``RAY_ADDRESS``, else the local node's cluster) and
reserves one placement group of N bundles, one per replica: ``{"CPU": 1, "GPU": T}`` (T =
``tensor_parallel_size``: Ray hands the actor those GPUs through CUDA_VISIBLE_DEVICES; the CPU is its host
loop), ``{"CPU": 1}`` on CPU. A bundle never splits across nodes, so a replica's tensor parallelism stays on
one node. The strategy is PACK: the replicas never talk to each other, so spreading them buys nothing but
isolation from a node's loss, while packing fills the nodes in turn (the front end's own first when it has
room, where its sockets need no network) and leaves whole nodes free for other work; a replica that does not
fit next to the others goes to another node.

Each actor (``CoreActor``) binds its two ZMQ sockets on its node's address (``ray.util.get_node_ip_address``,
the one the cluster's nodes reach each other on) and reports them; the front end's ``MPClient`` connects to
them and speaks the same messages as to a local engine core process. The core's body comes from the engine
(``engine.core_process.serve_engine_core``, passed as an argument, so this layer imports nothing above it).

``RayCoreProcess`` is the front end's handle on an actor, shaped like ``subprocess.Popen`` (``pid``, ``poll``,
``wait``, ``kill``): the actor's call ending (the core stopped, failed, its actor was killed, its node was
lost) reads as the process exiting, so a replica lost on the cluster is reported as a local one is.
"""
from __future__ import annotations

import logging
import os
import subprocess

from jaxserve import envs

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
KILLED = -9                 # the exit code a core reads as when its actor or node is gone


def join_cluster() -> None:
    """Join the Ray cluster (``RAY_ADDRESS``, else the one this node is part of), once per process."""
    try:
        import ray
    except ImportError:
        raise ImportError("--distributed-executor-backend ray needs Ray on every node: pip install "
                          "'jaxserve[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=envs.RAY_ADDRESS or "auto", log_to_driver=False)


def cpu_only() -> bool:
    """Whether JAX runs on CPU (the bundles then ask for no GPU)."""
    return "cpu" in envs.JAX_PLATFORMS.split(",")


def reserve(bundles: list[dict], strategy: str, timeout_s: float, what: str):
    """A ready placement group of ``bundles``; raises RuntimeError naming ``what`` did not fit."""
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group(bundles, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except Exception:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster has no room for {what} within {timeout_s:.0f} s (ray status lists "
                           "its nodes and their free resources)") from None
    return group


class CoreActor:
    """A Ray actor: one data-parallel replica's engine core, on sockets it binds on its node's address."""

    def bind(self) -> tuple[int, str, str, str]:
        """Bind the two sockets; returns (pid, node address, input address, output address)."""
        import ray
        import zmq

        host = ray.util.get_node_ip_address()
        self.ctx = zmq.Context(io_threads=1)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 2000)
        where = host
        if ":" in host:                                 # an IPv6 address
            where = f"[{host}]"
            for s in (self.inbox, self.outbox):
                s.setsockopt(zmq.IPV6, 1)
        self.inbox.bind(f"tcp://{where}:*")
        self.outbox.bind(f"tcp://{where}:*")
        return (os.getpid(), host, self.inbox.getsockopt_string(zmq.LAST_ENDPOINT),
                self.outbox.getsockopt_string(zmq.LAST_ENDPOINT))

    def run(self, body, config, progress: bool) -> int:
        """``body(config, ctx, inbox, outbox, progress)``: the engine core, until it stops (its exit code)."""
        return body(config, self.ctx, self.inbox, self.outbox, progress)


class RayCoreProcess:
    """One replica's actor as the front end's ``MPClient`` sees a core process (``subprocess.Popen``'s calls)."""

    def __init__(self, actor, pid: int, node: str, input_address: str, output_address: str):
        self.actor = actor
        self.pid = pid
        self.node = node
        self.input_address = input_address
        self.output_address = output_address
        self.call = None
        self.returncode: int | None = None

    def start(self, body, config, progress: bool) -> "RayCoreProcess":
        """Run ``body`` (the engine core) in the actor; returns self, the handle."""
        self.call = self.actor.run.remote(body, config, progress)
        return self

    def poll(self) -> int | None:
        """The core's exit code once its call has ended (``KILLED`` if the actor or its node died), else None."""
        return self.wait(0, raise_timeout=False)

    def wait(self, timeout: float | None = None, *, raise_timeout: bool = True) -> int | None:
        import ray
        if self.returncode is not None:
            return self.returncode
        if not ray.is_initialized():            # this process left the cluster (at exit): its actors went with it
            self.returncode = KILLED
            return self.returncode
        done, _ = ray.wait([self.call], num_returns=1, timeout=timeout)
        if not done:
            if raise_timeout:
                raise subprocess.TimeoutExpired(f"ray actor (pid {self.pid} on {self.node})", timeout)
            return None
        try:
            self.returncode = int(ray.get(done[0]) or 0)
        except Exception as e:  # noqa: BLE001 - RayActorError, a node lost, the actor's own error
            logger.error("data-parallel replica's actor (pid %s on %s) is gone: %s: %s", self.pid, self.node,
                         type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.returncode = KILLED
        return self.returncode

    def kill(self) -> None:
        import ray
        if ray.is_initialized():
            ray.kill(self.actor, no_restart=True)


class RayReplicas:
    """The front end's handle on the replicas' placement group and actors (``cores[i]``: replica i's)."""

    def __init__(self, num_replicas: int, tensor_parallel_size: int, *, timeout_s: float = PLACEMENT_TIMEOUT_S):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        join_cluster()
        cpu = cpu_only()
        bundle = {"CPU": 1} if cpu else {"CPU": 1, "GPU": tensor_parallel_size}
        self.group = reserve([dict(bundle) for _ in range(num_replicas)], "PACK", timeout_s,
                             f"{num_replicas} data-parallel replicas of {bundle} each")
        # the front end's engine settings (JAXSERVE_*, JAX_*, XLA_*) travel with the actors, as they do to local
        # cores; Ray sets each actor's CUDA_VISIBLE_DEVICES to its bundle's GPUs
        env = {k: v for k, v in os.environ.items() if k.startswith(("JAXSERVE_", "JAX_", "XLA_"))}
        if cpu:
            env["XLA_FLAGS"] = " ".join(filter(None, (envs.XLA_FLAGS,
                                                      f"--xla_force_host_platform_device_count={tensor_parallel_size}")))
        actor = ray.remote(CoreActor)
        self.actors = [actor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
            runtime_env={"env_vars": env}, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            max_restarts=0).remote() for i in range(num_replicas)]
        try:
            bound = ray.get([a.bind.remote() for a in self.actors], timeout=timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.cores = [RayCoreProcess(a, *b) for a, b in zip(self.actors, bound)]
        logger.info("Ray: %d data-parallel replicas placed (PACK) on %s", num_replicas,
                    ", ".join(f"{c.node} (pid {c.pid})" for c in self.cores))

    def shutdown(self) -> None:
        """Kill what is left of the actors and free the placement group (after the cores were told to stop)."""
        import ray
        actors, self.actors = self.actors, []
        if not ray.is_initialized():            # this process left the cluster (at exit): they went with it
            return
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if actors:
            ray.util.remove_placement_group(self.group)
