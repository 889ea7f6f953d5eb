"""Benchmarks: config loading / --set, metrics math, workloads, the cpu-smoke configs end to end (on the engine
and against the real server), and the serve mode's glue. Roofline numbers: test_bench_roofline.py; the load
generator against a scripted SSE server: test_bench_loadgen.py."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

from jaxserve.benchmarks import config as bcfg
from jaxserve.benchmarks import metrics, workloads
from jaxserve.benchmarks.metrics import RequestTiming
from jaxserve.config import ModelConfig


# ------------------------------------------------------------------------------------------------- config
def test_config_load_and_set_overrides():
    cfg = bcfg.load_config("cpu-smoke", ["workload.num_prompts=3", "engine.max_num_seqs=2",
                                         "engine.enable_prefix_caching=false", "workload.output_len={dist: uniform, min: 2, max: 4}",
                                         "seed=7", "model.name=llama-3.2-1b", "model.load_format=dummy"])
    assert cfg["name"] == "cpu-smoke" and cfg["mode"] == "throughput" and cfg["seed"] == 7
    assert cfg["workload"]["num_prompts"] == 3
    assert cfg["workload"]["output_len"] == {"dist": "uniform", "min": 2, "max": 4}
    assert cfg["workload"]["ignore_eos"] is True                          # default filled
    kw = bcfg.engine_kwargs(cfg)
    assert kw["model"] == "llama-3.2-1b" and kw["load_format"] == "dummy" and kw["max_num_seqs"] == 2
    assert kw["seed"] == 7
    flags = bcfg.server_flags(cfg)
    assert flags[0] == "llama-3.2-1b"
    assert "--no-enable-prefix-caching" in flags
    assert flags[flags.index("--max-num-seqs") + 1] == "2"


def test_parse_set_values():
    assert bcfg.parse_set("a.b=3") == (["a", "b"], 3)
    assert bcfg.parse_set("x=1.5e3") == (["x"], 1500.0)
    assert bcfg.parse_set("x=[1, 2]") == (["x"], [1, 2])
    assert bcfg.parse_set("x=null") == (["x"], None)
    assert bcfg.parse_set("x=inf")[1] == "inf"
    assert bcfg.parse_set("serve.base_url=http://h:1/v1") == (["serve", "base_url"], "http://h:1/v1")
    with pytest.raises(bcfg.ConfigError, match="expected key=value"):
        bcfg.parse_set("workload.num_prompts")


def test_config_errors_name_the_problem():
    with pytest.raises(bcfg.ConfigError, match="unknown config key.*wrkload"):
        bcfg.load_config("cpu-smoke", ["wrkload.num_prompts=3"])
    with pytest.raises(bcfg.ConfigError, match="not used by mode 'throughput'.*known"):
        bcfg.load_config("cpu-smoke", ["workload.batch_size=3"])
    with pytest.raises(bcfg.ConfigError, match="mode is 'fast'"):
        bcfg.load_config("cpu-smoke", ["mode=fast"])
    with pytest.raises(bcfg.ConfigError, match="not found .*cpu-smoke"):
        bcfg.load_config("no-such-config")
    with pytest.raises(bcfg.ConfigError, match="is a int, not a section"):
        bcfg.load_config("cpu-smoke", ["seed.x=1"])


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "bench").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_configs_validate(path):
    cfg = bcfg.load_config(str(path))
    assert cfg["name"] == path.stem
    if cfg["mode"] in ("throughput", "latency", "serve"):
        rng = np.random.default_rng(0)
        wl = cfg["workload"]
        n = wl.get("num_prompts") or wl.get("batch_size")
        n = max(n) if isinstance(n, list) else n
        lens = workloads.sample_lengths(wl["input_len"], n, rng, "input_len") + \
            workloads.sample_lengths(wl["output_len"], n, rng, "output_len")
        max_len = cfg["engine"].get("max_model_len")
        assert max_len is None or lens.max() + (wl.get("prefix_len", 0) if wl.get("dataset") == "prefix" else 0) <= max_len


# ------------------------------------------------------------------------------------------------ metrics
def test_percentiles_and_summary():
    v = list(range(1, 101))
    s = metrics.summarize(v)
    assert s["p50"] == 50.5 and s["p99"] == pytest.approx(99.01)      # linear interpolation (numpy's default)
    assert s["mean"] == 50.5 and s["min"] == 1 and s["max"] == 100 and s["p10"] == pytest.approx(10.9)
    assert s["p10"] <= s["p25"] <= s["median"] <= s["p75"] <= s["p90"] <= s["p99"]
    assert np.isnan(metrics.summarize([])["mean"])


def _timing(ttft, e2e, n, ok=True, prompt=10):
    itl = [(e2e - ttft) / (n - 1)] * (n - 1) if n > 1 else []
    return RequestTiming(prompt_tokens=prompt, output_tokens=n, ttft=ttft, e2e=e2e, itl=itl, success=ok,
                         error="" if ok else "HTTP 500: boom")


def test_serving_metrics_and_goodput():
    rs = [_timing(0.1, 1.1, 11), _timing(0.2, 2.2, 11), _timing(0.5, 1.5, 11), _timing(0.1, 0.1, 1),
          _timing(0, 0, 0, ok=False)]
    assert rs[0].tpot == pytest.approx(0.1) and rs[3].tpot is None
    m = metrics.serving_metrics(rs, duration_s=4.0, slo_ms={"ttft_ms": 300, "tpot_ms": 150})
    assert m["completed"] == 4 and m["failed"] == 1 and m["errors"] == {"HTTP 500: boom": 1}
    assert m["output_tokens"] == 34 and m["prompt_tokens"] == 40
    assert m["output_throughput"] == pytest.approx(34 / 4) and m["request_throughput"] == 1.0
    assert m["total_token_throughput"] == pytest.approx(74 / 4)
    # within both SLOs: #0 (100 ms, 100 ms/token) and #3 (single token: no TPOT); #1 TPOT 200 ms; #2 TTFT 500 ms
    assert m["goodput"] == pytest.approx(2 / 4)
    assert m["ttft_ms"]["median"] == pytest.approx(150.0)
    assert m["tpot_ms"]["mean"] == pytest.approx((100 + 200 + 100) / 3)
    assert m["e2el_ms"]["p99"] == pytest.approx(np.percentile([1100, 2200, 1500, 100], 99))
    assert len([g for r in rs if r.success for g in r.itl]) == 30
    assert metrics.serving_metrics(rs, 4.0)["goodput"] is None
    with pytest.raises(ValueError, match="unknown SLO"):
        metrics.serving_metrics(rs, 4.0, {"ttfb_ms": 1})


def test_a_request_that_streamed_no_text_completes_untimed():
    """Its tokens (usage) count; its TTFT / TPOT are unknown, so it stays out of them and out of goodput."""
    untimed = RequestTiming(prompt_tokens=10, output_tokens=11, ttft=None, e2e=1.0, success=True)
    assert untimed.tpot is None
    m = metrics.serving_metrics([_timing(0.1, 1.1, 11), untimed], 2.0, slo_ms={"ttft_ms": 300})
    assert m["completed"] == 2 and m["untimed"] == 1 and m["output_tokens"] == 22
    assert m["ttft_ms"]["mean"] == pytest.approx(100.0) and m["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert m["goodput"] == pytest.approx(1 / 2)


# ---------------------------------------------------------------------------------------------- workloads
def test_lengths_and_prompts_are_seeded_and_in_range():
    rng = np.random.default_rng(0)
    assert workloads.sample_lengths(5, 3, rng, "x").tolist() == [5, 5, 5]
    u = workloads.sample_lengths({"dist": "uniform", "min": 3, "max": 6}, 2000, rng, "x")
    assert u.min() == 3 and u.max() == 6
    n = workloads.sample_lengths({"dist": "normal", "mean": 100, "std": 50, "min": 10, "max": 150}, 2000, rng, "x")
    assert n.min() >= 10 and n.max() <= 150 and abs(n.mean() - 100) < 5
    assert set(workloads.sample_lengths({"dist": "choice", "values": [7, 9]}, 50, rng, "x")) == {7, 9}
    with pytest.raises(ValueError, match="workload.input_len"):
        workloads.sample_lengths({"dist": "zipf"}, 2, rng, "input_len")
    a = workloads.random_requests(np.random.default_rng(1), 4, 16, 8, 49152)
    b = workloads.random_requests(np.random.default_rng(1), 4, 16, 8, 49152)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    lo, hi = workloads.token_id_range(49152)
    assert all(lo <= t < hi for r in a for t in r.prompt) and all(r.prompt_len == 16 for r in a)


def test_prefix_requests_share_prefixes():
    reqs = workloads.prefix_requests(np.random.default_rng(0), 20, num_prefixes=2, prefix_len=32,
                                     input_len=8, output_len=4, vocab_size=49152)
    assert all(r.prompt_len == 40 for r in reqs)
    assert len({tuple(r.prompt[:32]) for r in reqs}) == 2
    assert len({tuple(r.prompt[32:]) for r in reqs}) == 20


def test_sharegpt_requests(tmp_path):
    data = [{"conversations": [{"from": "human", "value": "one two three"},
                               {"from": "gpt", "value": " ".join(["w"] * 30)}]},
            {"conversations": [{"from": "human", "value": "only a question"}]}]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(data))
    reqs = workloads.sharegpt_requests(np.random.default_rng(0), str(p), 3)
    assert len(reqs) == 3 and reqs[0].prompt == "one two three" and reqs[0].output_len == 40
    assert workloads.sharegpt_requests(np.random.default_rng(0), str(p), 1, output_len=5)[0].output_len == 5
    with pytest.raises(ValueError, match="file not found"):
        workloads.sharegpt_requests(np.random.default_rng(0), str(tmp_path / "none.json"), 1)


def test_arrivals_poisson_and_gamma():
    rng = np.random.default_rng(0)
    d = workloads.arrival_delays(rng, 20000, request_rate=10.0)
    assert d.mean() == pytest.approx(0.1, rel=0.03) and d.std() / d.mean() == pytest.approx(1.0, rel=0.05)
    bursty = workloads.arrival_delays(rng, 20000, request_rate=10.0, burstiness=0.25)
    assert bursty.mean() == pytest.approx(0.1, rel=0.05)
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(4.0, rel=0.1)   # CV^2 = 1 / burstiness
    assert not workloads.arrival_delays(rng, 5, float("inf")).any()


# ------------------------------------------------------------------------------- end to end on the engine
def _run_main(args: list[str], out: Path) -> dict[str, dict]:
    from jaxserve.benchmarks.runner import main
    assert main([*args, "--out", str(out)]) == 0
    found = {}
    for d in out.iterdir():
        found[d.name] = json.loads((d / "result.json").read_text())
        assert (d / "result.md").is_file() and (d / "config.yaml").is_file()
    return found


def test_cpu_smoke_throughput_and_latency_end_to_end(tmp_path):
    res = _run_main(["--config", "cpu-smoke", "--config", "cpu-smoke-latency"], tmp_path)
    thr = next(r for r in res.values() if r["mode"] == "throughput")
    lat = next(r for r in res.values() if r["mode"] == "latency")
    j = thr["jaxserve"]
    assert j["num_requests"] == 6 and j["output_tokens"] == 6 * 8                # ignore_eos: exact lengths
    assert j["output_tok_per_s"] == pytest.approx(j["output_tokens"] / j["elapsed_s"])
    # the engine cannot beat the roofline by much; if it does, the roofline or the timing is wrong (the CPU's
    # limits are measured in a second at start-up, as loaded as the other test worker makes it: a margin)
    assert 0 < j["output_tok_per_s"] < 1.5 * thr["roofline"]["output_tok_s"]
    env = thr["environment"]
    assert env["jax"] and env["platform"] == "cpu" and env["command"].startswith("python -m jaxserve bench")
    assert thr["config"]["workload"]["num_prompts"] == 6
    lj = lat["jaxserve"]
    assert len(lj["e2e_samples_s"]) == 3 and lj["e2e_s"]["p10"] <= lj["e2e_s"]["p50"] <= lj["e2e_s"]["p99"]
    assert 0 < lj["prefill_s"]["mean"] < lj["e2e_s"]["mean"]
    # every timed run draws fresh prompts: nothing is served from the prefix cache
    assert lj["engine_steps"]["prefix_cache_hits"] == 0 and j["engine_steps"]["prefix_cache_hits"] == 0
    assert j["engine_steps"]["prefix_cache_queries"] > 0
    assert lat["roofline"]["e2e_bound_s"] < 1.5 * lj["e2e_s"]["mean"]
    assert lat["model"]["params"] == 134_515_008
    from jaxserve.benchmarks import plots
    if plots.available():
        assert any(p.suffix == ".png" for p in tmp_path.rglob("*.png"))


@pytest.mark.slow
def test_cpu_smoke_serve_against_a_real_server(tmp_path):
    res = _run_main(["--config", "cpu-smoke-serve"], tmp_path)
    (r,) = res.values()
    assert r["sweep_param"] == "max_concurrency" and [p["sweep_value"] for p in r["points"]] == [1, 4]
    for p in r["points"]:
        assert p["failed"] == 0 and p["completed"] == 8 and p["output_tokens"] == 8 * 6
        assert p["ttft_ms"]["median"] > 0 and p["tpot_ms"]["median"] > 0 and p["goodput"] is not None


ORACLE_PYTHON = ROOT / ".venv-oracle" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not ORACLE_PYTHON.exists(), reason="needs the torch env .venv-oracle (tools/oracle_env.sh)")
def test_hf_baseline_subprocess_on_a_tiny_shape(tmp_path):
    import subprocess
    from jaxserve.benchmarks.models import hf_config_from_model_config
    tiny = ModelConfig("LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16)
    spec = {"hf_config": hf_config_from_model_config(tiny), "dtype": "float32", "device": "cpu",
            "prompts": [[5, 6, 7, 8]] * 3, "output_lens": [6] * 3, "methods": ["generate", "generate_batch"],
            "iters": 2, "warmup_iters": 1}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    subprocess.run([str(ORACLE_PYTHON), "-m", "benchmarks.hf_baseline", str(tmp_path / "spec.json"),
                    str(tmp_path / "out.json")], cwd=ROOT, check=True, timeout=600,
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})
    out = json.loads((tmp_path / "out.json").read_text())["results"]
    assert out["generate"]["output_tokens"] == 18 and len(out["generate"]["e2e_samples_s"]) == 2
    assert out["generate_batch"]["output_tokens"] == 18 and out["generate_batch"]["num_requests"] == 3


# ------------------------------------------------------------------------------------- serve / kernels glue
def test_sweep_and_prompt_counts():
    from jaxserve.benchmarks.serve import prompt_counts, sweep_points
    assert sweep_points({"sweep": None}) == (None, [None])
    assert sweep_points({"sweep": {"request_rate": [1, 2]}}) == ("request_rate", [1, 2])
    with pytest.raises(ValueError, match="workload.sweep"):
        sweep_points({"sweep": {"batch": [1]}})
    assert prompt_counts({"num_prompts": 5}, [1, 2]) == [5, 5]
    assert prompt_counts({"num_prompts": [4, 8]}, [1, 2]) == [4, 8]
    with pytest.raises(ValueError, match="2 counts for 3 sweep values"):
        prompt_counts({"num_prompts": [4, 8]}, [1, 2, 3])


def test_server_flags_use_the_cli_names():
    cfg = bcfg.load_config("cpu-smoke-serve", ["engine.kv_cache_memory_bytes=1000",
                                               "serve.server_args=[--api-key, k]"])
    flags = bcfg.server_flags(cfg)
    assert flags[flags.index("--kv-cache-memory") + 1] == "1000" and flags[-2:] == ["--api-key", "k"]
    assert flags[0] == "--dtype"                         # no model: the server's default (embedded SmolLM2)


def test_metrics_scrape_parsing(scripted_server):
    from jaxserve.benchmarks import serve
    text = ('# HELP x\njaxserve:prefix_cache_queries_total{model_name="m"} 120.0\n'
            'jaxserve:prefix_cache_hits_total{model_name="m"} 90.0\njaxserve:num_preemptions_total{model_name="m"} 2.0\n'
            'jaxserve:num_requests_running{model_name="m"} 1.0\njaxserve:images_encoded_total{model_name="m"} 4.0\n'
            'jaxserve:encoder_seconds_total{model_name="m"} 0.2\njaxserve:engine_steps_total{model_name="m"} 50.0\n'
            'jaxserve:engine_step_ms_total{model_name="m"} 400.0\n'
            'jaxserve:engine_device_wait_ms_total{model_name="m"} 300.0\n'
            'jaxserve:engine_tokens_total{model_name="m"} 150.0\n'
            'jaxserve:engine_padded_tokens_total{model_name="m"} 200.0\n')
    got = {}
    for line in text.splitlines():
        m = serve._COUNTER.match(line)
        if m:
            got[m.group(1)] = float(m.group(2))
    assert got == {"prefix_cache_queries": 120.0, "prefix_cache_hits": 90.0, "num_preemptions": 2.0,
                   "images_encoded": 4.0, "encoder_seconds": 0.2, "engine_steps": 50.0, "engine_step_ms": 400.0,
                   "engine_device_wait_ms": 300.0, "engine_tokens": 150.0, "engine_padded_tokens": 200.0}
    d = serve.counter_delta({"prefix_cache_queries": 20.0, "prefix_cache_hits": 10.0}, got)
    assert d["prefix_cache_hit_rate"] == pytest.approx(80 / 100) and d["num_preemptions"] == 2.0
    assert d["encoder_ms_per_image"] == pytest.approx(50.0)
    assert d["engine_ms_per_step"] == pytest.approx(8.0) and d["engine_device_wait_ms_per_step"] == pytest.approx(6.0)
    assert d["engine_padding_fraction"] == pytest.approx(0.25)
    _, url = scripted_server
    assert serve.scrape_counters(url) == {}          # a server without those counters: nothing, no error


def test_a_point_begun_with_compiles_pending_is_noted():
    from jaxserve.benchmarks import serve
    points = [{"sweep_value": 1, "server_counters": {"compiles_pending_at_start": 0.0}},
              {"sweep_value": 64, "server_counters": {"compiles_pending_at_start": 3.0}}]
    assert serve.pending_compile_notes(points, "max_concurrency") == [
        "max_concurrency=64: 3 background compiles were still pending when the point began: its figures include them"]


def test_set_overrides_across_configs_of_different_modes():
    thr, lat = bcfg.load_configs(["cpu-smoke", "cpu-smoke-latency"], ["workload.num_prompts=3", "workload.batch_size=5",
                                                                      "workload.output_len=2"])
    assert thr["workload"]["num_prompts"] == 3 and thr["workload"]["output_len"] == 2
    assert lat["workload"]["batch_size"] == 5 and lat["workload"]["output_len"] == 2
    with pytest.raises(bcfg.ConfigError, match="num_prompt"):
        bcfg.load_configs(["cpu-smoke", "cpu-smoke-latency"], ["workload.num_prompt=3"])


@pytest.mark.slow
@pytest.mark.skipif(not ORACLE_PYTHON.exists(), reason="needs the torch env .venv-oracle (tools/oracle_env.sh)")
def test_hf_baseline_runs_first_on_the_same_prompts(tmp_path):
    """The two-phase flow: HF (subprocess, torch env) on the first 3 prompts, then jaxserve on all 6."""
    res = _run_main(["--config", "cpu-smoke", "--set", "model.path=tests/fixtures/models/tiny-llama3",
                     "--set", "baseline.hf=true", "--set", "baseline.python=.venv-oracle/bin/python",
                     "--set", "baseline.device=cpu", "--set", "baseline.num_prompts=3"], tmp_path)
    (r,) = res.values()
    spec = bcfg.load_config("cpu-smoke")["workload"]["input_len"]
    lens = workloads.sample_lengths(spec, 6, np.random.default_rng(0), "input_len")
    hf = r["hf_baseline"]
    assert hf["method"] == "generate_batch" and hf["num_requests"] == 3 and hf["output_tokens"] == 3 * 8
    assert hf["prompt_tokens"] == lens[:3].sum()                  # the same prompts as jaxserve's first 3
    assert r["jaxserve"]["prompt_tokens"] == lens.sum()
    md = next(tmp_path.iterdir()) / "result.md"
    assert "jaxserve / HF" in md.read_text() and "on the first 3 of 6 prompts" in md.read_text()


def test_serve_mode_end_to_end_against_a_base_url(scripted_server, tmp_path):
    """The serve mode's whole path (ShareGPT dataset, request-rate sweep, SLOs, report) against --base-url."""
    app, url = scripted_server
    data = [{"conversations": [{"from": "human", "value": f"question {i}"},
                               {"from": "gpt", "value": " ".join(["word"] * (3 * i + 3))}]} for i in range(4)]
    (tmp_path / "sg.json").write_text(json.dumps(data))
    out = tmp_path / "results"
    res = _run_main(["--config", "cpu-smoke-serve", "--base-url", url, "--set", "workload.dataset=sharegpt",
                     "--set", f"workload.dataset_path={tmp_path / 'sg.json'}", "--set", "workload.num_prompts=4",
                     "--set", "workload.output_len=null",        # ShareGPT: the replies' lengths
                     "--set", "workload.sweep={request_rate: [100, inf]}", "--set", "workload.max_concurrency=null",
                     "--set", "workload.slo={ttft_ms: 10000, e2el_ms: 1}", "--set", "workload.warmup_requests=0"], out)
    (r,) = res.values()
    assert r["base_url"] == url and r["sweep_param"] == "request_rate"
    assert [p["sweep_value"] for p in r["points"]] == [100, "inf"]
    for p in r["points"]:
        assert p["completed"] == 4 and p["failed"] == 0
        assert p["output_tokens"] == sum(round(len(("word " * (3 * i + 3)).split()) * 4 / 3) for i in range(4))
        assert p["goodput"] == 0.0                        # nobody finishes within 1 ms
        assert p["ttft_ms"]["median"] >= 15               # the scripted 20 ms before each chunk
    prompts = {b["prompt"] for b in app.bodies[-8:]}
    assert prompts == {f"question {i}" for i in range(4)}
    assert "| request_rate |" in (next(out.iterdir()) / "result.md").read_text()


def test_plots_are_optional(tmp_path, monkeypatch):
    from jaxserve.benchmarks import plots
    if plots.available():
        assert plots.cdf(tmp_path / "a.png", {"x": [1.0, 2.0, 3.0]}, "s", "t") and (tmp_path / "a.png").stat().st_size
    monkeypatch.setitem(sys.modules, "matplotlib", None)          # as if not installed: import fails
    assert not plots.available()
    assert not plots.cdf(tmp_path / "b.png", {"x": [1.0]}, "s", "t") and not (tmp_path / "b.png").exists()
    assert not plots.sweep(tmp_path / "c.png", [{"output_throughput": 1}], "p", "t")


def test_bench_without_its_configs_says_where_to_find_them(tmp_path, monkeypatch, capsys):
    """An installed jaxserve has no configs/ beside benchmarks/: `jaxserve bench` exits 2 naming
    JAXSERVE_CONFIGS; with them it reaches the runner (a bad config is its own exit 2)."""
    from jaxserve import cli
    monkeypatch.setattr(bcfg, "BENCH_CONFIG_DIR", tmp_path / "configs" / "bench")
    assert cli.main(["bench", "--config", "x.yaml"]) == 2
    assert "JAXSERVE_CONFIGS" in capsys.readouterr().err
    monkeypatch.undo()
    assert cli.main(["bench", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err.startswith("bench: ")


def test_image_requests_stay_in_a_small_vocab():
    """Random-weight vision models are served with the embedded SmolLM2 tokenizer and its chat template: the image
    workload's rendered chats must tokenize below LLaVA-7B's 32,064 ids (its default system prompt and a line-led
    word did not), and a word a token."""
    from jaxserve.models.tokenizers import embedded_tokenizer
    tok = embedded_tokenizer()
    for req in workloads.image_requests(np.random.default_rng(0), 20, 32, 24, 8):
        system, user = req.extra["messages"]
        text = user["content"][1]["text"]
        chat = [system, {"role": "user", "content": "<image>\n" + text}]
        rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        ids = [i for piece in rendered.split("<image>") for i in tok.encode(piece, add_special_tokens=False)]
        assert max(ids) < 32064, rendered
        assert len(tok.encode(text, add_special_tokens=False)) == req.prompt_len
