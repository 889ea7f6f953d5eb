"""Two CPU processes on localhost (jax.distributed + gloo collectives) decode the same greedy tokens as one.

Process 0 owns the host state (the stand-in for the scheduler) and broadcasts each step's padded inputs over
``StepChannel``; process 1 runs ``follow_steps``. The mesh is ``tp=2`` with one CPU device per process, so
every layer's all-reduce crosses the process boundary. Each process is this file run as a script.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

MAX_NEW_TOKENS = 5
TIMEOUT_S = 300


def _process_main(process_id: int, port: int) -> None:
    from jaxserve import parallel

    assert parallel.initialize(f"127.0.0.1:{port}", 2, process_id) is True
    import jax

    from tp_greedy import GreedyDecoder, random_params, tiny_config

    assert jax.process_count() == 2 and jax.device_count() == 2 and jax.local_device_count() == 1
    cfg = tiny_config(8, 4)
    mesh = parallel.make_mesh(2)
    decoder = GreedyDecoder(cfg, random_params(cfg, seed=3), mesh, max_new_tokens=MAX_NEW_TOKENS)
    channel = parallel.StepChannel()
    if parallel.is_driver():
        tokens, logits = decoder.generate(channel)
        print(json.dumps({"tokens": tokens, "logits": logits.tolist(), "steps_sent": channel.steps_sent}),
              flush=True)
    else:
        steps = parallel.follow_steps(channel, decoder.run_step)
        print(json.dumps({"followed": steps}), flush=True)
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_run():
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.path.dirname(__file__))
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    procs = [subprocess.Popen([sys.executable, __file__, str(i), str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline, outs = time.monotonic() + TIMEOUT_S, []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, f"process exited {p.returncode}:\n{err[-4000:]}"
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def test_two_processes_match_one(two_process_run):
    from tp_greedy import GreedyDecoder, random_params, tiny_config

    driver, follower = two_process_run
    cfg = tiny_config(8, 4)
    tokens, logits = GreedyDecoder(cfg, random_params(cfg, seed=3), None, max_new_tokens=MAX_NEW_TOKENS).generate()
    assert driver["tokens"] == tokens
    np.testing.assert_allclose(np.array(driver["logits"]), logits, atol=2e-5, rtol=1e-4)
    # the follower ran exactly the steps process 0 sent, then left its loop on stop()
    assert follower["followed"] == driver["steps_sent"] == MAX_NEW_TOKENS


def test_initialize_single_process_is_a_no_op(monkeypatch):
    from jaxserve.parallel import distributed

    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize() is False
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        distributed.initialize()


def test_step_channel_single_process():
    from jaxserve.parallel import StepChannel

    channel = StepChannel()
    channel.send({"x": np.arange(3)})   # one process: nothing to broadcast to
    assert channel.steps_sent == 0
    with pytest.raises(RuntimeError, match="needs more than one process"):
        channel.receive()


if __name__ == "__main__":
    _process_main(int(sys.argv[1]), int(sys.argv[2]))
