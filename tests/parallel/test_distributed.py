"""Two CPU processes on localhost (jax.distributed + gloo collectives) decode the same greedy tokens as one.

The mesh is ``tp=2`` with one CPU device per process, so every layer's all-reduce crosses the process
boundary. Two levels, in one pair of processes (this file run as a script):
- model: process 0 owns the host state and broadcasts each step's padded inputs over ``StepChannel``;
  process 1 runs ``follow_steps``.
- engine: both build ``LLM(..., tensor_parallel_size=2)``; process 0 generates through the (async)
  scheduler, its engine having wrapped the runner in ``BroadcastingRunner``; process 1 runs
  ``follow_runner``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from support import FIXTURES, TESTS, xla_flags

MAX_NEW_TOKENS = 5
TIMEOUT_S = 300


def _process_main(process_id: int, port: int) -> None:
    from jaxserve import executor, parallel

    assert executor.initialize(f"127.0.0.1:{port}", 2, process_id) is True
    import jax

    from support.tp_greedy import GreedyDecoder, random_params, tiny_config

    assert jax.process_count() == 2 and jax.device_count() == 2 and jax.local_device_count() == 1
    cfg = tiny_config(8, 4)
    mesh = parallel.make_mesh(2)
    decoder = GreedyDecoder(cfg, random_params(cfg, seed=3), mesh, max_new_tokens=MAX_NEW_TOKENS)
    channel = executor.StepChannel()
    if executor.is_driver():
        tokens, logits = decoder.generate(channel)
        report = {"tokens": tokens, "logits": logits.tolist(), "steps_sent": channel.steps_sent}
    else:
        report = {"followed": executor.follow_steps(channel, decoder.run_step)}

    # LLMEngine wraps process 0's runner in BroadcastingRunner itself (its StepChannel is the second one
    # created on every process, after the one above)
    # process 1 has room for fewer KV blocks (12 of 4 KiB each, against the 17 process 0 could use): both
    # must size the sharded cache alike, to the smaller count
    llm = _engine_llm(tensor_parallel_size=2, kv_bytes=(1 << 20) if process_id == 0 else 12 * 4096)
    report = report | {"num_kv_blocks": llm.engine.core.runner.num_blocks}
    if executor.is_driver():
        assert isinstance(llm.engine.core.runner, executor.BroadcastingRunner)
        from jaxserve.errors import InvalidRequestError
        from jaxserve.sampling_params import SamplingParams
        try:    # an extra computation only process 0 would launch: refused, not a hang
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
            report["prompt_logprobs_error"] = None
        except InvalidRequestError as e:
            report["prompt_logprobs_error"] = str(e)
        report["engine_tokens"] = _engine_generate(llm)
        llm.engine.core.runner.stop()
        report["engine_steps_sent"] = llm.engine.core.runner.channel.steps_sent
    else:
        report["engine_followed"] = executor.follow_runner(llm.engine.core.runner)
    print(json.dumps(report), flush=True)
    jax.distributed.shutdown()


ENGINE_MODEL = os.path.join(FIXTURES, "models", "tiny-llama3")
ENGINE_PROMPTS = [[5, 17, 99, 3, 42], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200, 11, 11, 64]]


def _engine_llm(tensor_parallel_size: int, kv_bytes: int = 1 << 20):
    from jaxserve.llm import LLM
    return LLM(ENGINE_MODEL, tensor_parallel_size=tensor_parallel_size, dtype="float32", max_model_len=64,
               max_num_batched_tokens=32, max_num_seqs=4, kv_cache_memory_bytes=kv_bytes, skip_warmup=True,
               compilation_cache_dir="", use_tqdm_on_load=False)


def _engine_generate(llm) -> list[list[int]]:
    from jaxserve.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(ENGINE_PROMPTS, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    from support.server_fakes import free_port

    port, logs = free_port(), tmp_path_factory.mktemp("procs")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=TESTS)
    env["XLA_FLAGS"] = xla_flags()  # one CPU device per process
    # output to files, not pipes: a process blocked on a full pipe stops its heartbeats and the other aborts
    files = [(open(logs / f"p{i}.out", "w+"), open(logs / f"p{i}.err", "w+")) for i in range(2)]
    procs = [subprocess.Popen([sys.executable, __file__, str(i), str(port)], env=env, stdout=out, stderr=err)
             for i, (out, err) in enumerate(files)]
    deadline, outs = time.monotonic() + TIMEOUT_S, []
    try:
        for p, (out, err) in zip(procs, files):
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
            err.seek(0)
            assert p.returncode == 0, f"process exited {p.returncode}:\n{err.read()[-4000:]}"
            out.seek(0)
            outs.append(json.loads(out.read().strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for out, err in files:
            out.close()
            err.close()
    return outs


def test_two_processes_match_one(two_process_run):
    from support.tp_greedy import GreedyDecoder, random_params, tiny_config

    driver, follower = two_process_run
    cfg = tiny_config(8, 4)
    tokens, logits = GreedyDecoder(cfg, random_params(cfg, seed=3), None, max_new_tokens=MAX_NEW_TOKENS).generate()
    assert driver["tokens"] == tokens
    np.testing.assert_allclose(np.array(driver["logits"]), logits, atol=2e-5, rtol=1e-4)
    # the follower ran exactly the steps process 0 sent, then left its loop on stop()
    assert follower["followed"] == driver["steps_sent"] == MAX_NEW_TOKENS


def test_two_process_engine_matches_one(two_process_run):
    driver, follower = two_process_run
    assert driver["num_kv_blocks"] == follower["num_kv_blocks"] == 12
    assert "prompt_logprobs is not available" in (driver["prompt_logprobs_error"] or "")
    assert driver["engine_tokens"] == _engine_generate(_engine_llm(tensor_parallel_size=1))
    assert [len(t) for t in driver["engine_tokens"]] == [MAX_NEW_TOKENS] * len(ENGINE_PROMPTS)
    assert follower["engine_followed"] == driver["engine_steps_sent"] >= MAX_NEW_TOKENS


@pytest.mark.slow
def test_cli_three_processes_smollm2_tp3(tmp_path):
    """``python -m jaxserve generate`` on 3 processes (SmolLM2 split 3 ways across them) prints what one
    process prints: process 0 schedules, processes 1 and 2 follow its 8 steps."""
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams
    from support.server_fakes import free_port

    prompt, port = "The capital of France is", free_port()
    flags = ["--prompt", prompt, "--max-tokens", "8", "--max-model-len", "128", "--max-num-batched-tokens", "64",
             "--max-num-seqs", "4", "--skip-warmup", "--dtype", "float32"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = xla_flags()
    logs = [(open(tmp_path / f"{i}.out", "w+"), open(tmp_path / f"{i}.err", "w+")) for i in range(3)]
    procs = [subprocess.Popen([sys.executable, "-m", "jaxserve", "generate", "--tensor-parallel-size", "3",
                               "--distributed-coordinator", f"127.0.0.1:{port}", "--num-processes", "3",
                               "--process-id", str(i), *flags], env=env, stdout=out, stderr=err)
             for i, (out, err) in enumerate(logs)]
    try:
        for p, (_, err) in zip(procs, logs):
            p.wait(timeout=TIMEOUT_S)
            err.seek(0)
            assert p.returncode == 0, err.read()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs[0][0].seek(0)
    text = logs[0][0].read().split(f"### prompt: {prompt!r}\n", 1)[1]     # what follows the header line
    expected = LLM(None, dtype="float32", max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4,
                   skip_warmup=True, use_tqdm_on_load=False).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    assert text == expected + "\n"
    for i in (1, 2):
        logs[i][1].seek(0)
        assert f"process {i}: followed 8 steps" in logs[i][1].read()


def test_initialize_single_process_is_a_no_op(monkeypatch):
    from jaxserve.executor import distributed

    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.initialize() is False
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        distributed.initialize()


def test_step_channel_single_process():
    from jaxserve.executor import StepChannel

    channel = StepChannel()
    channel.send({"x": np.arange(3)})   # one process: nothing to broadcast to
    assert channel.steps_sent == 0
    with pytest.raises(RuntimeError, match="needs more than one process"):
        channel.receive()


def test_socket_step_transport(monkeypatch):
    """The mp executor's local transport: every worker gets every message in order; process 0 exiting is
    EOF on the workers, a worker exiting is an error on process 0's next sends, and accept gives up."""
    import threading

    from jaxserve.executor import distributed

    monkeypatch.setattr(distributed, "is_driver", lambda: True)
    fan = distributed.SocketFanout()
    receivers = {}
    threads = [threading.Thread(target=lambda i=i: receivers.__setitem__(i, distributed.SocketReceiver(fan.port, i)))
               for i in (2, 1)]
    for t in threads:
        t.start()
    fan.accept(2, timeout_s=30)
    for t in threads:
        t.join()
    out = distributed.StepChannel(transport=fan)
    out.multi_process = True
    steps = [{"step": 0}, list(range(20_000)), ("x", np.arange(5))]
    for st in steps:
        out.send(st)
    out.stop()
    assert out.steps_sent == 3
    for i in (1, 2):
        inp = distributed.StepChannel(transport=receivers[i])
        inp.multi_process = True
        got = [inp.receive() for _ in range(4)]
        assert [k for k, _ in got] == [1, 1, 1, 2]
        assert got[0][1] == steps[0] and got[1][1] == steps[1] and np.array_equal(got[2][1][1], steps[2][1])
    fan.close()
    with pytest.raises(RuntimeError, match="closed the step channel"):
        receivers[1].recv_bytes()
    # a worker that is gone
    fan2 = distributed.SocketFanout()
    rx = distributed.SocketReceiver(fan2.port, 1)
    fan2.accept(1, timeout_s=30)
    rx.close()
    with pytest.raises(RuntimeError, match="worker process is gone"):
        for _ in range(1000):
            fan2.send_bytes(b"x" * 4096)
    fan2.close()
    fan3 = distributed.SocketFanout()
    with pytest.raises(RuntimeError, match="0 of 1 worker"):
        fan3.accept(1, timeout_s=0.3)
    fan3.close()


if __name__ == "__main__":
    _process_main(int(sys.argv[1]), int(sys.argv[2]))


def _mp_generate(max_tokens: int, *flags: str):
    """``python -m jaxserve generate`` of SmolLM2 at TP=3 with the mp executor: (its stderr, the text it
    printed, one process's text for the same request)."""
    from jaxserve.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    prompt = "The capital of France is"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = xla_flags()
    proc = subprocess.run([sys.executable, "-m", "jaxserve", "generate", "--tensor-parallel-size", "3",
                           "--distributed-executor-backend", "mp", *flags, "--prompt", prompt,
                           "--max-tokens", str(max_tokens), "--max-model-len", "128", "--max-num-batched-tokens", "64",
                           "--max-num-seqs", "4", "--skip-warmup", "--dtype", "float32"], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout.split(f"### prompt: {prompt!r}\n", 1)[1]
    expected = LLM(None, dtype="float32", max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4,
                   skip_warmup=True, use_tqdm_on_load=False).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)[0].outputs[0].text
    return proc.stderr, text, expected + "\n"


@pytest.mark.slow
def test_mp_executor_spawns_its_workers_and_matches_one_process():
    """``--distributed-executor-backend mp``: the user starts one command; the engine spawns a worker per
    extra device, the text equals one process's, and every process exits cleanly (rc 0, workers reaped)."""
    stderr, text, expected = _mp_generate(8)
    assert "worker 1: followed 8 steps" in stderr and "worker 2: followed 8 steps" in stderr
    assert text == expected


@pytest.mark.slow
def test_mp_executor_follows_multi_step_decoding():
    """The workers replay process 0's multi-step decodes (the scheduled entries carry num_steps): a 9-token
    answer is a prefill plus two 4-step loops, 3 steps followed, and the text is one process's."""
    stderr, text, expected = _mp_generate(9, "--num-scheduler-steps", "4")
    assert "worker 1: followed 3 steps" in stderr and "worker 2: followed 3 steps" in stderr
    assert text == expected


def test_mp_executor_is_only_started_when_asked():
    from jaxserve.config import EngineConfig, ParallelConfig
    from jaxserve.executor import launcher

    assert launcher.maybe_start(EngineConfig()) is None                                   # uni, tp 1
    assert launcher.maybe_start(EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2))) is None
    assert launcher.maybe_start(EngineConfig(parallel=ParallelConfig(distributed_executor_backend="mp"))) is None
    with pytest.raises(ValueError, match="starts its own processes"):
        launcher.maybe_start(EngineConfig(parallel=ParallelConfig(
            tensor_parallel_size=2, distributed_executor_backend="mp", num_processes=2)))
