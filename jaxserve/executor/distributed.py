"""Beyond one host: ``jax.distributed`` start-up and the step channel that keeps the processes in lockstep.

Multi-controller JAX: every process runs the same jitted step on its own devices and XLA's collectives
join them, so every process must launch the same steps with the same inputs, in the same order. Only
process 0 runs the scheduler (and the server); it sends each step's description to the others over a
``StepChannel`` before launching it, and every other process runs a follower loop instead of an engine
loop: receive, launch the same step, repeat, until process 0 calls ``channel.stop()`` (at shutdown).
Step outputs (sampled tokens) come out replicated, so process 0 reads its local copy and the followers
never read theirs.

With the engine, every process builds the same ``ModelExecutor`` (warm-up runs everywhere in the same
order); process 0's ``build_runner`` wraps its runner, the other processes follow it::

    if jax.process_count() > 1:
        if is_driver():
            runner = BroadcastingRunner(runner)     # process 0: the engine core's scheduler + server as usual;
            ...                                     # runner.stop() at shutdown
        else:
            follow_runner(runner)                   # the others (worker.py, the CLI): no scheduler, no server

What travels is the scheduler's decision (the ``ScheduledRequest`` list, and whether the step reads the
previous step's on-device tokens), not padded arrays: ``ModelRunner.prepare`` and the sampling metadata
are deterministic functions of it, so the runner needs no change and every process builds identical
inputs.

Transport, two kinds, both host-only:
- the ``mp`` executor's workers (one host, spawned by the engine: ``launcher.py``) read their steps from a
  local TCP connection to process 0 (``SocketFanout`` / ``SocketReceiver``): a send is a write per worker
  and a receive a blocking read; a worker learns at once (EOF) when process 0 is gone, and process 0 (a
  broken pipe) when a worker is;
- otherwise (``--num-processes``, possibly several hosts) the ``jax.distributed`` coordination service's
  key-value store (one gRPC set per step on process 0, one blocking get on each follower).
Neither is a device collective such as
``multihost_utils.broadcast_one_to_all``. A collective would be a separate device program per step that
must not interleave with the in-flight step's all-reduces: with async scheduling (step N+1 launched
before step N's tokens are read) and gloo on CPU, such programs run concurrently and the processes' gloo
calls cross ("collective mismatch"). The store touches no device, so it cannot; it also costs no device
time. It is reached through ``jax._src.distributed.global_state.client`` (JAX has no public accessor).
On one host the socket's round trip is about a tenth of the store's.
"""
from __future__ import annotations

import pickle
import socket
import struct
import time
from typing import Any, Callable

import jax

from jaxserve import envs

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
    coordinator = coordinator or envs.JAX_COORDINATOR_ADDRESS
    num_processes = num_processes if num_processes is not None else envs.JAX_NUM_PROCESSES
    process_id = process_id if process_id is not None else envs.JAX_PROCESS_ID
    if coordinator is None and (num_processes or 1) == 1:
        return False
    if jax.distributed.is_initialized():
        return True
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id {process_id} is out of range for num_processes={num_processes}")
    if "cpu" in (envs.JAX_PLATFORMS or "cpu").split(","):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator and not jax.config.values.get("jax_cross_host_transfer_socket_address"):
        # pipeline stages on other processes: ``jax.device_put`` between them is a cross-host transfer, served
        # from this address (the interface the coordinator is reached through, a free port)
        jax.config.update("jax_cross_host_transfer_socket_address", transfer_address(coordinator))
    jax.distributed.initialize(coordinator, num_processes, process_id, local_device_ids=local_device_ids,
                               initialization_timeout=initialization_timeout)
    return True


def transfer_address(coordinator: str) -> str:
    """``HOST:PORT`` for this process's cross-host transfers: the local address of the route to the
    coordinator (127.0.0.1 for a local one) and a port free now."""
    host, _, port = coordinator.rpartition(":")
    if host in ("127.0.0.1", "localhost", "::1", ""):
        local = "127.0.0.1"
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:     # no packet is sent
            probe.connect((host, int(port)))
            local = probe.getsockname()[0]
    return f"{local}:{free_port(local)}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_driver() -> bool:
    """True on the process that runs the scheduler (process 0)."""
    return jax.process_index() == 0


_HEADER = struct.Struct("<Q")


def _nodelay(conn: socket.socket) -> socket.socket:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)     # a step is one small write: send it now
    return conn


class SocketFanout:
    """Process 0's end of the local step transport: a listening socket on 127.0.0.1 and, after ``accept``,
    one connection per worker. ``send_bytes`` writes a length-prefixed message to every worker."""

    def __init__(self):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []

    def accept(self, n: int, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
        """Wait for ``n`` workers to connect (each says its process id first). ``alive()`` false = give up."""
        deadline = time.monotonic() + timeout_s
        self._listener.settimeout(0.5)
        conns = {}
        while len(conns) < n:
            if time.monotonic() > deadline or not alive():
                raise RuntimeError(f"{len(conns)} of {n} worker processes connected to the step channel")
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            conns[_HEADER.unpack(_recv_exact(conn, _HEADER.size))[0]] = _nodelay(conn)
        self._conns = [conns[k] for k in sorted(conns)]

    def send_bytes(self, data: bytes) -> None:
        msg = _HEADER.pack(len(data)) + data
        for conn in self._conns:
            try:
                conn.sendall(msg)
            except OSError as e:
                raise RuntimeError(f"a worker process is gone (step channel: {e})") from None

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        self._listener.close()


class SocketReceiver:
    """A worker's end of the local step transport (see ``SocketFanout``)."""

    def __init__(self, port: int, process_id: int, timeout_s: float = 60.0):
        self._conn = _nodelay(socket.create_connection(("127.0.0.1", port), timeout=timeout_s))
        self._conn.settimeout(None)
        self._conn.sendall(_HEADER.pack(process_id))

    def recv_bytes(self) -> bytes:
        (n,) = _HEADER.unpack(_recv_exact(self._conn, _HEADER.size))
        return _recv_exact(self._conn, n)

    def close(self) -> None:
        self._conn.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise RuntimeError("process 0 closed the step channel (it exited)")
        buf += chunk
    return bytes(buf)


class StepChannel:
    """Process 0 → all: a sequence of picklable step descriptions.

    ``transport``: a ``SocketFanout`` (on process 0) or ``SocketReceiver`` (on a worker) of the ``mp``
    executor; by default the coordination service's store, where message ``n`` is key
    ``jaxserve/steps/<channel>/<n>`` and process 0 deletes keys ``KEEP`` steps old (a follower cannot lag
    that far: every step's collectives need all processes). Channels are numbered in creation order, which
    is the same on every process. With one process ``send``/``stop`` do nothing and ``receive`` is an error.
    """
    KEEP = 64
    _created = 0

    def __init__(self, poll_timeout_s: float = 60.0, transport=None):
        self.transport = transport
        self.multi_process = jax.process_count() > 1
        self.prefix = f"jaxserve/steps/{StepChannel._created}"
        StepChannel._created += 1
        self.steps_sent = 0
        self._next = 0
        self.poll_timeout_ms = int(poll_timeout_s * 1000)

    def send(self, step: Any) -> None:
        if self.multi_process:
            self._put(_STEP, step)
            self.steps_sent += 1

    def stop(self) -> None:
        """Release the followers from their loop (call once, at shutdown, on process 0)."""
        if self.multi_process:
            self._put(_STOP, None)

    def receive(self) -> tuple[int, Any]:
        """The next message (blocks; an idle server just keeps a follower waiting here)."""
        if not self.multi_process:
            raise RuntimeError("StepChannel.receive needs more than one process")
        if self.transport is not None:
            self._next += 1
            return pickle.loads(self.transport.recv_bytes())
        key = f"{self.prefix}/{self._next}"
        while True:
            try:
                data = _client().blocking_key_value_get_bytes(key, self.poll_timeout_ms)
                break
            except Exception as e:  # the client raises XlaRuntimeError; only a timeout means "keep waiting"
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise
        self._next += 1
        return pickle.loads(data)

    def _put(self, kind: int, step: Any) -> None:
        if not is_driver():
            raise RuntimeError("only process 0 sends steps; the others follow them")
        if self.transport is not None:
            self.transport.send_bytes(pickle.dumps((kind, step), pickle.HIGHEST_PROTOCOL))
            self._next += 1
            return
        client = _client()
        n = self._next
        client.key_value_set_bytes(f"{self.prefix}/{n}", pickle.dumps((kind, step), pickle.HIGHEST_PROTOCOL))
        if n >= self.KEEP:
            client.key_value_delete(f"{self.prefix}/{n - self.KEEP}")
        self._next += 1


def _client():
    from jax._src import distributed as jax_distributed
    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized (call jaxserve.parallel.initialize first)")
    return client


def follow_steps(channel: StepChannel, run_step: Callable[[Any], Any]) -> int:
    """A follower's loop: run every step process 0 sends, until it stops. Returns the number of steps."""
    steps = 0
    while True:
        kind, step = channel.receive()
        if kind == _STOP:
            return steps
        run_step(step)
        steps += 1


class BroadcastingRunner:
    """Process 0's ``ModelRunner``: ``dispatch`` first sends the step to the followers.

    Each message is ``(scheduled, reads_prev)``: the follower passes its own previous step as ``prev``
    exactly when process 0 passed one, so placeholder tokens resolve to the same rows everywhere.
    ``collect`` and everything else are the wrapped runner's.
    """

    def __init__(self, runner, channel: StepChannel | None = None):
        self._runner = runner
        self.channel = channel or StepChannel()
        self._stopped = False

    def dispatch(self, scheduled, prev=None):
        self.channel.send((list(scheduled), prev is not None))
        return self._runner.dispatch(scheduled, prev)

    def stop(self) -> None:
        """Release the followers (idempotent: the CLI, the server's shutdown and the mp launcher's exit hook
        may each call it)."""
        if not self._stopped:
            self._stopped = True
            self.channel.stop()

    def __getattr__(self, name):
        return getattr(self._runner, name)


def follow_runner(runner, channel: StepChannel | None = None) -> int:
    """A follower process's main loop with the engine's ``ModelRunner``: launch each step process 0
    dispatches (never reading its tokens) until process 0 stops. Returns the number of steps."""
    last = None

    def run(message):
        nonlocal last
        scheduled, reads_prev = message
        last = runner.dispatch(scheduled, last if reads_prev else None)

    steps = follow_steps(channel or StepChannel(), run)
    if last is not None:
        jax.block_until_ready(last.tokens)
    return steps
