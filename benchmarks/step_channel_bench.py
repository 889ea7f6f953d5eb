"""Step channel latency between two processes on this host: the coordination service's key-value store
(``--num-processes``, any number of hosts) against the ``mp`` executor's local socket.

    python benchmarks/step_channel_bench.py [--messages 500] [--bytes 2000]

Process 0 sends a ``--bytes`` message through each transport, the other process receives it and answers
with a one-byte acknowledgement by the same route (a key for the store, the same connection for the
socket); the table gives the median and p90 round trip. A follower receives one message per engine step
before it can launch that step, so half a round trip is the transport's share of its lag. CPU only (the
two processes join ``jax.distributed`` on CPU); no accelerator is touched.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def run(pid: int, coordinator: str, step_port: int, n: int, nbytes: int) -> dict | None:
    os.environ["JAX_PLATFORMS"] = "cpu"
    from jaxserve.parallel import distributed

    fan = rx = None
    if pid == 0:
        fan = _BENCH_FANOUT                # bound by main() before it spawned the other process
        fan.accept(1, timeout_s=60)
    else:
        rx = distributed.SocketReceiver(step_port, 1)
    distributed.initialize(coordinator, 2, pid)
    client = distributed._client()
    payload = os.urandom(nbytes)
    res = {}
    # key-value store
    times = []
    for i in range(n):
        if pid == 0:
            t = time.perf_counter()
            client.key_value_set_bytes(f"bench/msg/{i}", payload)
            client.blocking_key_value_get_bytes(f"bench/ack/{i}", 60_000)
            times.append(time.perf_counter() - t)
        else:
            client.blocking_key_value_get_bytes(f"bench/msg/{i}", 60_000)
            client.key_value_set_bytes(f"bench/ack/{i}", b"k")
    res["kv"] = times
    # local socket
    times = []
    for _ in range(n):
        if pid == 0:
            t = time.perf_counter()
            fan.send_bytes(payload)
            fan._conns[0].recv(1)
            times.append(time.perf_counter() - t)
        else:
            rx.recv_bytes()
            rx._conn.sendall(b"k")
    res["socket"] = times
    return res if pid == 0 else None


_BENCH_FANOUT = None


def main(argv=None) -> int:
    global _BENCH_FANOUT
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=500)
    p.add_argument("--bytes", type=int, default=2000, help="message size (a pickled decode step is ~1-2 KB)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        coordinator, port = a.child.split(",")
        run(1, coordinator, int(port), a.messages, a.bytes)
        return 0
    os.environ["JAX_PLATFORMS"] = "cpu"
    from jaxserve.parallel import distributed
    from jaxserve.parallel.launcher import _free_port
    _BENCH_FANOUT = distributed.SocketFanout()
    coordinator = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--messages", str(a.messages),
                              "--bytes", str(a.bytes), "--child", f"{coordinator},{_BENCH_FANOUT.port}"], env=env)
    res = run(0, coordinator, _BENCH_FANOUT.port, a.messages, a.bytes)
    import jax
    jax.distributed.shutdown()             # the other process waits for this one in the shutdown barrier
    child.wait(timeout=120)
    print(f"| transport ({a.bytes}-byte message, {a.messages} round trips) | median round trip | p90 |")
    print("|---|---|---|")
    for name, label in (("kv", "coordination service key-value store"), ("socket", "local socket (mp executor)")):
        ts = sorted(res[name][10:])        # the first round trips warm up connections
        print(f"| {label} | {1e6 * statistics.median(ts):.0f} us | {1e6 * ts[int(0.9 * (len(ts) - 1))]:.0f} us |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
