"""Data-parallel replicas behind one front end (``--data-parallel-size N``): ``DPClient`` makes the calls of
``core_client.MPClient`` over N engine core processes, each an ``MPClient`` on its own devices.

    add_requests   → ``ReplicaRouter`` picks each request's replica (least load, prefix affinity) → its core
    abort_requests → the replicas that hold those requests
    get_outputs    ← one zmq poll over every live replica's output socket; their steps' outputs merged

Devices: replica i sees the CUDA devices [i*k, (i+1)*k) of those visible (k = tensor_parallel_size), through
CUDA_VISIBLE_DEVICES; on CPU every replica runs on the host. With ``--distributed-executor-backend ray`` each
replica's core runs instead in a Ray actor on whichever node of the cluster has its k devices free
(``executor.ray_replicas``); its ``MPClient`` connects to the sockets the actor bound, the same messages either
way. Each replica is the ordinary engine core with its own KV cache and prefix cache; requests never move
between replicas.

A replica that dies is reported, not restarted: ``get_outputs`` raises ``ReplicaLostError`` naming the
requests it held (the front end fails those at once), ``is_alive`` turns False (the server's /health answers
503 so a supervisor can restart the server), and new requests go to the replicas left. With none left it
raises ``EngineDeadError``, as a single core's death does.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque

from jaxserve import envs
from jaxserve.engine.core_client import DEATH_CHECK_S, MPClient
from jaxserve.engine.dp_router import ReplicaRouter
from jaxserve.errors import EngineDeadError, ReplicaLostError

logger = logging.getLogger(__name__)

# per-replica stats averaged (not summed) across replicas; the rest of the numbers add up
_MEAN_STATS = frozenset({"kv_cache_usage", "host_ms_per_step", "device_ms_per_step", "tokens_per_step",
                         "moe_expert_balancedness"})
# what a dead replica no longer holds (its counters keep their totals)
_GAUGES = ("num_running", "num_waiting", "kv_cache_usage", "step_variants_pending")


def replica_devices(config, visible: str | None) -> list[str | None]:
    """Each replica's CUDA_VISIBLE_DEVICES (None: leave it as it is, on CPU). ``visible``: this process's."""
    par = config.parallel
    n, k = par.data_parallel_size, par.tensor_parallel_size
    if {p.strip() for p in envs.JAX_PLATFORMS.lower().split(",") if p.strip()} == {"cpu"}:
        return [None] * n
    ids = [d for d in visible.split(",") if d.strip()] if visible is not None else [str(i) for i in range(n * k)]
    if len(ids) < n * k:
        raise ValueError(f"{n} data-parallel replicas of {k} devices each need {n * k} GPUs, but "
                         f"CUDA_VISIBLE_DEVICES={visible} names {len(ids)}")
    return [",".join(ids[i * k:(i + 1) * k]) for i in range(n)]


def aggregate_stats(per_replica: list[dict]) -> dict:
    """The replicas' stats as one engine's: counts and totals summed, ratios averaged (the prefix-cache hit
    rate recomputed from the sums), histograms and per-expert counts added bucket by bucket."""
    out: dict = {}
    for key in dict.fromkeys(k for s in per_replica for k in s):
        values = [s[key] for s in per_replica if key in s]
        first = values[0]
        if isinstance(first, bool) or not all(type(v) is type(first) for v in values):
            out[key] = first
        elif isinstance(first, (int, float)):
            out[key] = sum(values) / len(values) if key in _MEAN_STATS else sum(values)
        elif isinstance(first, list) and all(isinstance(x, (int, float)) for v in values for x in v):
            out[key] = [sum(xs) for xs in zip(*values)]
        elif key == "iteration_tokens":        # (bounds, per-bucket counts, tokens)
            out[key] = (first[0], tuple(sum(c) for c in zip(*(v[1] for v in values))), sum(v[2] for v in values))
        elif isinstance(first, str):            # names (the LoRA adapters running): their union
            out[key] = ",".join(sorted({n for v in values for n in v.split(",") if n}))
        else:
            out[key] = first
    if out.get("prefix_cache_queries"):
        out["prefix_cache_hit_rate"] = out["prefix_cache_hits"] / out["prefix_cache_queries"]
    return out


class DPClient:
    """N engine core processes (``MPClient``s) behind the one front end."""

    multiprocess = True
    core = None                     # (they live in other processes)

    def __init__(self, config, *, progress: bool = True):
        import zmq

        self.placement = None            # with --distributed-executor-backend ray: the replicas' actors
        self.replicas: list[MPClient] = self._start(config, progress)
        first = self.replicas[0]
        self.facts = first.facts
        self.structured_output = first.structured_output
        sched = config.scheduler
        self.router = ReplicaRouter(len(self.replicas), config.cache.block_size,
                                    slack=max(2, (sched.max_num_seqs or 32) // 4))
        self._lock = threading.Lock()           # the router: requests and aborts come from any thread
        self._lost: deque[ReplicaLostError] = deque()
        self._poller = zmq.Poller()
        for rep in self.replicas:
            self._poller.register(rep.output_socket, zmq.POLLIN)
        self._next_death_check = 0.0

    def _start(self, config, progress: bool) -> list[MPClient]:
        """Start every replica at once (they load and compile side by side); if one fails, stop the others.
        On this host: a core process each on its devices; with Ray: a core in each replica's actor."""
        par = config.parallel
        n = par.data_parallel_size
        if par.distributed_executor_backend == "ray":
            from jaxserve.executor.ray_replicas import RayReplicas
            self.placement = RayReplicas(n, par.tensor_parallel_size)
            # each replica is the ordinary one-process engine (its backend is the placement, not its executor)
            config = config.replace(parallel=dataclasses.replace(par, distributed_executor_backend="uni"))
            kwargs = [{"remote": core} for core in self.placement.cores]
        else:
            kwargs = [{"env": None if d is None else {"CUDA_VISIBLE_DEVICES": d}}
                      for d in replica_devices(config, envs.CUDA_VISIBLE_DEVICES)]
        started: list = [None] * n

        def start(i: int) -> None:
            try:
                started[i] = MPClient(config, progress=progress and i == 0, **kwargs[i])
            except BaseException as e:  # noqa: BLE001 - raised below, on the caller's thread
                started[i] = e

        threads = [threading.Thread(target=start, args=(i,), name=f"jaxserve-dp-start-{i}") for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            for r in started:
                if isinstance(r, MPClient):
                    r.close()
            if self.placement is not None:
                self.placement.shutdown()
            raise failed[0]
        logger.info("%d data-parallel replicas started (pids %s)", n, ", ".join(str(r.process.pid) for r in started))
        return started

    # ---------------------------------------------------------------- requests
    def add_requests(self, reqs) -> None:
        """Route each request to its replica and send each replica its share in one message. A replica found
        dead while sending is reported (``get_outputs``) and its share goes to the others."""
        pending = list(reqs)
        while pending:
            groups: dict[int, list] = {}
            with self._lock:
                for req in pending:
                    namespace = (req.cache_salt, req.lora_request.lora_name if req.lora_request else None)
                    try:
                        replica = self.router.route(req.request_id, req.prompt_token_ids, namespace)
                    except LookupError:
                        raise EngineDeadError("every data-parallel replica died") from None
                    groups.setdefault(replica, []).append(req)
            pending = []
            for replica, group in groups.items():
                try:
                    self.replicas[replica].add_requests(group)
                except EngineDeadError as e:
                    with self._lock:
                        for req in group:
                            self.router.release(req.request_id)
                    self._replica_died(replica, str(e))
                    pending += group

    def abort_requests(self, request_ids: list[str]) -> None:
        groups: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                replica = self.router.release(rid)
                if replica is not None:
                    groups.setdefault(replica, []).append(rid)
        for replica, ids in groups.items():
            try:
                self.replicas[replica].abort_requests(ids)
            except EngineDeadError:
                pass                    # it died: nothing of it is left to free

    # ---------------------------------------------------------------- outputs
    def get_outputs(self, timeout_s: float | None = None) -> list:
        """The outputs every replica has sent (waits for some; [] after ``timeout_s``). Raises
        ReplicaLostError once for each replica that died holding requests."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self._lost:
                raise self._lost.popleft()
            outputs = self._take_ready()
            if outputs:
                return outputs
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return []
            wait = DEATH_CHECK_S if deadline is None else min(DEATH_CHECK_S, deadline - now)
            readable = dict(self._poller.poll(int(wait * 1000)))
            check_all = time.monotonic() >= self._next_death_check
            if check_all:
                self._next_death_check = time.monotonic() + DEATH_CHECK_S
            for i, rep in enumerate(self.replicas):
                if self.router.alive[i] and (rep.output_socket in readable or check_all):
                    self._read_all(i)

    def _read_all(self, replica: int) -> None:
        """Read what the replica has sent (into its MPClient's queue; nothing while an embed call reads it);
        note its death."""
        rep = self.replicas[replica]
        try:
            rep.read_available()
        except Exception as e:  # noqa: BLE001 - EngineDeadError, or the error it failed with
            self._replica_died(replica, str(e))
        self.router.kv_usage[replica] = rep.stats().get("kv_cache_usage", 0.0)

    def _take_ready(self) -> list:
        outputs = []
        for rep in self.replicas:
            outputs += rep.take_outputs()
        if outputs:
            finished = [o.request_id for o in outputs if o.finish_status]
            if finished:
                with self._lock:
                    for rid in finished:
                        self.router.release(rid)
        return outputs

    def _replica_died(self, replica: int, reason: str) -> None:
        with self._lock:
            if not self.router.alive[replica]:
                return
            lost = self.router.lose(replica)
            left = sum(self.router.alive)
        logger.error("data-parallel replica %d died (%s): %d requests failed; %d replicas serve on (not restarted: "
                     "/health answers 503)", replica, reason, len(lost), left)
        if not left:
            raise EngineDeadError(f"every data-parallel replica died; the last: {reason}")
        if lost:
            self._lost.append(ReplicaLostError(f"data-parallel replica {replica} died ({reason}); the request "
                                               "failed with it", lost))

    # ---------------------------------------------------------------- the rest of the client's calls
    def embed(self, prompt_token_ids_list, *, truncate_prompt_tokens=None, dimensions=None):
        with self._lock:
            live = [i for i, ok in enumerate(self.router.alive) if ok]
            replica = min(live, key=lambda i: self.router.load[i]) if live else None
        if replica is None:
            raise EngineDeadError("every data-parallel replica died")
        return self.replicas[replica].embed(prompt_token_ids_list, truncate_prompt_tokens=truncate_prompt_tokens,
                                            dimensions=dimensions)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(rep.wait_compiled(None if deadline is None else max(0.0, deadline - time.monotonic()))
                   for i, rep in enumerate(self.replicas) if self.router.alive[i])

    def stats(self) -> dict:
        """The replicas' stats aggregated, and each replica's under ``replicas`` (a dead one: ``dead``, its
        gauges 0)."""
        per = []
        for i, rep in enumerate(self.replicas):
            s = rep.stats()
            if not self.router.alive[i]:
                s.update(dict.fromkeys(_GAUGES, 0), dead=True)
            per.append(s)
        out = aggregate_stats(per)
        out.pop("dead", None)
        out["replicas"] = per
        return out

    @property
    def last_output_time(self) -> float:
        return max(rep.last_output_time for rep in self.replicas)

    def is_alive(self) -> bool:
        """Every replica is (one dead: the server is unhealthy, though the others serve on)."""
        return all(self.router.alive) and all(rep.is_alive() for rep in self.replicas)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.close(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every replica: all are told first, so their drains overlap; then each is waited for (up to
        ``timeout_s``) and killed if it has not stopped."""
        for rep in self.replicas:
            if rep.is_alive():
                rep.request_shutdown()
        for rep in self.replicas:
            rep.close(timeout_s)
        if self.placement is not None:
            self.placement.shutdown()
