"""`jaxserve bench --suite`: the shipped suites name every config and load, a suite runs each of its runs as one
bench process (its --set words, environment, GPU count and time limit), --ab runs two trees interleaved and
compares them, and the startup mode times a server's cold and warm start (also from a checkpoint it writes)."""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest

from jaxserve.benchmarks import runner, suites
from jaxserve.benchmarks.config import BENCH_CONFIG_DIR, engine_kwargs, load_config, load_configs
from jaxserve.llm import engine_config_from_kwargs


def test_every_shipped_config_is_in_a_suite_and_every_suite_loads(capsys):
    """Each run's configs load with its --set words (the engine options included), and the listing names the
    suites the device runs need."""
    runs = [r for n in suites.suite_names() for r in suites.load_suite(n)["runs"]]
    assert {c for r in runs for c in r["configs"]} == {p.stem for p in BENCH_CONFIG_DIR.glob("*.yaml")}
    for r in runs:
        for cfg in load_configs(r["configs"], r["set"]):
            engine_kwargs(cfg)
    assert runner.main(["--suite"]) == 0
    listing = capsys.readouterr().out
    for name in ("h200-llama8b", "h200-llama8b-ab", "h200-llama8b-throughput", "h200-llama8b-structured",
                 "h200-quantized", "h200-moe", "h200-startup", "h200-kernels"):
        assert f"\n{name} " in "\n" + listing


def test_a_suite_with_a_bad_name_or_config_says_so(tmp_path, monkeypatch, capsys):
    assert runner.main(["--suite", "no-such-suite"]) == 2
    assert "h200-llama8b" in capsys.readouterr().err             # the known suites
    (tmp_path / "bad.yaml").write_text("runs:\n  - [no-such-config]\n")
    monkeypatch.setattr(suites, "SUITE_DIR", tmp_path)
    assert runner.main(["--suite", "bad"]) == 2
    assert "no-such-config" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        runner.main(["--ab", str(tmp_path), "--config", "cpu-smoke"])     # --ab compares a suite


@pytest.fixture
def fake_runs(tmp_path, monkeypatch):
    """A suite ``s`` of three runs, and run_once recorded instead of run (each writes a result per config)."""
    (tmp_path / "s.yaml").write_text(
        "description: d\nruns:\n  - [cpu-smoke, cpu-smoke-latency]\n"
        "  - {configs: [cpu-smoke-serve], set: [workload.num_prompts=2], env: {X: 1}, timeout_s: 5}\n"
        "  - {configs: [cpu-smoke], gpus: 2}\n")
    monkeypatch.setattr(suites, "SUITE_DIR", tmp_path)
    monkeypatch.setattr(suites, "visible_gpus", lambda: 1)
    calls = []

    def run_once(cmd, env, cwd, timeout_s):
        calls.append((cmd, env, cwd, timeout_s))
        out = Path(cmd[cmd.index("--out") + 1])
        configs = [cmd[i + 1] for i, word in enumerate(cmd) if word == "--config"]
        for name in configs:
            (out / f"2026-01-01-{name}").mkdir(parents=True, exist_ok=True)
            (out / f"2026-01-01-{name}" / "result.json").write_text(
                json.dumps({"jaxserve": {"output_tok_per_s": 100.0 if out.name.startswith("old-") else 101.0}}))
        return 0, [f"{name}: done" for name in configs]
    monkeypatch.setattr(suites, "run_once", run_once)
    return calls


def test_a_suite_runs_each_run_as_one_bench_process(tmp_path, fake_runs, capsys):
    out = tmp_path / "out"
    assert runner.main(["--suite", "s", "--set", "seed=3", "--no-plots", "--out", str(out)]) == 0
    (cmd1, env1, _, limit1), (cmd2, env2, _, limit2) = fake_runs          # the 2-GPU run is skipped
    assert cmd1[:4] == [sys.executable, "-m", "jaxserve", "bench"]
    assert cmd1[4:] == ["--config", "cpu-smoke", "--config", "cpu-smoke-latency", "--set", "seed=3",
                        "--set", "report.plots=false", "--out", str(out)]
    assert cmd2[4:8] == ["--config", "cpu-smoke-serve", "--set", "workload.num_prompts=2"]   # its own first
    assert (env1, limit1, env2, limit2) == ({}, None, {"X": 1}, 5)
    summary = capsys.readouterr().out.split("== suite s summary ==")[1]
    assert "cpu-smoke-latency: done" in summary and "run 3/3: skipped, needs 2 GPUs (1 visible)" in summary


def test_ab_runs_the_old_and_the_new_tree_interleaved(tmp_path, fake_runs, capsys):
    old = tmp_path / "old"
    (old / "benchmarks").mkdir(parents=True)
    (old / "benchmarks" / "runner.py").write_text("")
    out = tmp_path / "out"
    assert runner.main(["--suite", "s", "--ab", str(old), "--rounds", "2", "--out", str(out)]) == 0
    sides = [(Path(cmd[cmd.index("--out") + 1]).name, cwd) for cmd, _, cwd, _ in fake_runs]
    assert sides == [("old-1", old), ("old-1", old), ("new-1", suites.REPO_ROOT), ("new-1", suites.REPO_ROOT),
                     ("old-2", old), ("old-2", old), ("new-2", suites.REPO_ROOT), ("new-2", suites.REPO_ROOT)]
    assert all(cmd[1:3] == ["-m", "benchmarks.runner"] for cmd, *_ in fake_runs)   # each tree's own runner
    table = capsys.readouterr().out.split("== suite s summary ==")[1]
    assert "| cpu-smoke | 100.0 | 101.0 | 1.010 | old: 100.0, 100.0; new: 101.0, 101.0 |" in table
    assert runner.main(["--suite", "s", "--ab", str(tmp_path / "nowhere")]) == 2


def test_run_once_passes_output_through_and_stops_at_its_limit(capsys):
    rc, summary = suites.run_once([sys.executable, "-c", "print('work'); print('== summary =='); print('x: 1 tok/s')"],
                                  {"X": "1"}, Path.cwd(), None)
    assert (rc, summary) == (0, ["x: 1 tok/s"]) and "work" in capsys.readouterr().out
    rc, summary = suites.run_once([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                                  {}, Path.cwd(), 1)
    assert rc != 0 and summary == ["TIMED OUT after 1 s"]


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_moe_batch_suite_runs_batch_1_4_16_on_one_engine(model):
    """h200-moe-batch's --set words make h200-MODEL-latency-bs1's engine the one bs4 and bs16 have, so one
    process loads and compiles once for the three; the engine decodes every batch within the sort-free MoE
    kernels' 16 tokens, at one step or several (engine.num_scheduler_steps)."""
    (run,) = [r for r in suites.load_suite("h200-moe-batch")["runs"] if r["configs"][0].startswith(f"h200-{model}")]
    names = [f"h200-{model}-latency-bs{b}" for b in (1, 4, 16)]
    assert run["configs"] == names
    assert (run["env"].get("XLA_PYTHON_CLIENT_MEM_FRACTION") == "0.95") == (model == "mixtral-8x7b")
    for nss in (1, 4):
        cfgs = load_configs(names, run["set"] + [f"engine.num_scheduler_steps={nss}"])
        engines = [engine_kwargs(c) for c in cfgs]
        assert engines[0] == engines[1] == engines[2]
        assert [c["workload"]["batch_size"] for c in cfgs] == [1, 4, 16]
        config = engine_config_from_kwargs(**engines[0])
        assert config.scheduler.num_scheduler_steps == nss
        buckets = config.scheduler.token_buckets
        assert all(min(b for b in buckets if b >= batch) <= 16 for batch in (1, 4, 16))
    engine_sets = [s for s in run["set"] if s.startswith("engine.")]
    for name in names[1:]:           # no-ops there: the bs4 / bs16 files alone run what the suite runs
        assert load_config(name, engine_sets)["engine"] == load_config(name)["engine"]


def test_moe_suite_gives_mixtral_more_memory_and_runs_the_serve_sweep():
    runs = suites.load_suite("h200-moe")["runs"]
    mixtral = [r for r in runs if any("mixtral" in c for c in r["configs"])]
    assert mixtral and all(r["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95" for r in mixtral)
    assert any(r["configs"] == ["h200-qwen3-30b-a3b-serve-sweep"] for r in runs)
    serve = load_config("h200-qwen3-30b-a3b-serve-sweep")
    assert serve["mode"] == "serve" and serve["workload"]["sweep"] == {"max_concurrency": [1, 16, 64, 256]}


@pytest.fixture
def fake_server(monkeypatch):
    """The startup mode's server and its completion faked: each start calls ``starts[0](flags, log_path)``
    (the test's stand-in, which writes the server's log), then answers " Paris"."""
    from jaxserve.benchmarks import startup
    starts = []

    @contextlib.contextmanager
    def server(flags, log_path, timeout_s):
        starts[0](flags, log_path)
        yield "http://127.0.0.1:1"

    class Answer:
        def raise_for_status(self):
            pass

        def json(self):
            return {"choices": [{"text": " Paris"}]}

    monkeypatch.setattr(startup, "running_server", server)
    monkeypatch.setattr(startup.httpx, "post", lambda *a, **k: Answer())
    return starts


def test_startup_mode_times_a_cold_and_a_warm_start(tmp_path, fake_server):
    """Two server starts on one fresh compilation cache folder: the seconds to /health and to the first
    completion, the server's own load / warm-up / ready seconds from its log."""
    started = []

    def start(flags, log_path):
        started.append(flags)
        log_path.write_text("INFO start-up weights: 1.50 s (16.0 GB, 10.7 GB/s)\nINFO start-up warm-up: 2.00 s\n"
                            "INFO start-up engine-core hand-shake: 0.10 s\n")
    fake_server.append(start)
    assert runner.main(["--config", "cpu-smoke-startup", "--out", str(tmp_path)]) == 0
    (result,) = [json.loads(p.read_text()) for p in tmp_path.glob("*/result.json")]
    cold, warm = result["jaxserve"]["cold"], result["jaxserve"]["warm"]
    assert cold["health_s"] <= cold["first_completion_s"] and cold["phases_s"]["warm-up"] == 2.0
    assert warm["phases_s"]["weights"] == 1.5 and warm["phases_s"]["engine-core hand-shake"] == 0.1
    cache = [f[f.index("--compilation-cache-dir") + 1] for f in started]
    assert cache[0] == cache[1] and started[0][:2] == ["--dtype", "float32"]


def test_startup_mode_loads_a_checkpoint_it_wrote_to_the_disk(tmp_path, fake_server, capsys):
    """`model.write_checkpoint`: a random safetensors checkpoint of the model's shape on the disk (sharded, with
    its index, config and tokenizer) that loads, the disk's read rates, the server started on the folder, its
    weights phase against the disk; the folder removed afterwards."""
    import jax

    from jaxserve.models.loader import load_model
    started = []

    def start(flags, log_path):
        folder = Path(flags[0])
        started.append(sorted(p.name for p in folder.iterdir()))
        jax.block_until_ready(load_model(str(folder)).params)                 # the folder loads
        log_path.write_text("INFO start-up weights: 0.01 s (0.01 GB, 1.0 GB/s)\n")
    fake_server.append(start)
    out, disk_dir = tmp_path / "out", tmp_path / "disk"
    assert runner.main(["--config", "cpu-smoke-safetensors-load", "--out", str(out), "--no-plots",
                        "--set", f"model.path={Path(__file__).parents[1] / 'fixtures/models/tiny-llama3'}",
                        "--set", f"model.write_checkpoint.dir={disk_dir}"]) == 0
    (result,) = [json.loads(p.read_text()) for p in out.glob("*/result.json")]
    shards = [f"model-0000{k}-of-00004.safetensors" for k in (1, 2, 3, 4)]
    assert started[0] == started[1] and set(shards + ["config.json", "model.safetensors.index.json",
                                                      "tokenizer.json"]) <= set(started[0])
    disk, cold = result["disk"], result["jaxserve"]["cold"]
    assert disk["files"] == 4 and min(disk["cold_one_stream_GBps"], disk["page_cache_GBps"]) > 0
    assert cold["weights_GBps"] == pytest.approx(disk["GB"] / 0.01)
    assert cold["weights_of_disk"] == pytest.approx(cold["weights_GBps"] / disk["disk_GBps"])
    assert list(disk_dir.iterdir()) == []                          # the checkpoint is removed
    assert "% of the disk's read" in capsys.readouterr().out.split("== summary ==")[-1]
