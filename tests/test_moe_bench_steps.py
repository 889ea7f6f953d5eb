"""The MoE measurements before they meet a GPU: moe_gemm's rows on CPU (interpreted) and the configs and
variants run_h200.sh's moe-ab / moe-serve steps run (one engine per variant process)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from jaxserve.benchmarks.config import engine_kwargs, load_config, load_configs
from jaxserve.kernels import ragged_dot
from jaxserve.llm import engine_config_from_kwargs

ROOT = Path(__file__).resolve().parent.parent
RUN_H200 = (ROOT / "benchmarks" / "run_h200.sh").read_text()


# ------------------------------------------------------------------------------------------- run_h200.sh
def _function(name: str) -> str:
    start = RUN_H200.index(f"{name}() {{")
    return RUN_H200[start:RUN_H200.index("\n}\n", start)]


MOE_MODELS = ("qwen3-30b-a3b", "mixtral-8x7b")


@pytest.mark.parametrize("model", MOE_MODELS)
def test_moe_ab_runs_batch_1_4_16_on_one_engine(model):
    """moe-ab's --set words make h200-MODEL-latency-bs1's engine the one bs4 and bs16 have, so one process loads
    and compiles once for the three; each of its variants' engines is a valid LLM(...) option set."""
    body = _function("moe_ab")
    sets = re.findall(r'--set "?([\w.]+=[^\s"]+)"?', body)
    assert any(s.startswith("engine.token_buckets=") for s in sets)
    fixed = [s for s in sets if "$" not in s]
    names = [f"h200-{model}-latency-bs{b}" for b in (1, 4, 16)]
    for nss in (1, 4):
        cfgs = load_configs(names, fixed + [f"engine.num_scheduler_steps={nss}"])
        engines = [engine_kwargs(c) for c in cfgs]
        assert engines[0] == engines[1] == engines[2]
        assert [c["workload"]["batch_size"] for c in cfgs] == [1, 4, 16]
        config = engine_config_from_kwargs(**engines[0])
        assert config.scheduler.num_scheduler_steps == nss
        # every batch decodes within the sort-free MoE kernels' 16 tokens, in a bucket of its own size or less
        buckets = config.scheduler.token_buckets
        assert all(min(b for b in buckets if b >= batch) <= 16 for batch in (1, 4, 16))
    engine_sets = [s for s in fixed if s.startswith("engine.")]
    for name in names[1:]:           # no-ops there: the bs4 / bs16 files alone run what moe-ab ran
        assert load_config(name, engine_sets)["engine"] == load_config(name)["engine"]


def test_moe_ab_default_variants_and_the_other_moe_steps_name_real_things():
    default = re.search(r"MOE_AB_VARIANTS=\$\{MOE_AB_VARIANTS:-([^}]*)\}", RUN_H200).group(1).replace("\\\n", " ")
    variants = [v.split(":") for v in default.split()]
    assert {m for m, _, _ in variants} == set(MOE_MODELS)
    assert {g for _, g, _ in variants} <= {"auto", "rows", *ragged_dot.IMPLEMENTATIONS}
    assert {s for _, _, s in variants} == {"1", "4"}
    assert len({tuple(v) for v in variants}) == len(variants) == 4   # auto is rows on a GPU: not both
    assert variants[0] == ["qwen3-30b-a3b", "auto", "1"]           # the table's baseline runs first
    serve = load_config("h200-qwen3-30b-a3b-serve-sweep")
    assert serve["mode"] == "serve" and serve["workload"]["sweep"] == {"max_concurrency": [1, 16, 64, 256]}
    assert "moe-serve) bench" in RUN_H200 and "--config h200-qwen3-30b-a3b-serve-sweep" in RUN_H200


def _bash(script: str, results: Path, *functions: str) -> str:
    """``script`` after run_h200.sh's ``functions``, RESULTS=``results``; its stdout."""
    import subprocess
    import sys
    text = "\n".join(_function(f) + "\n}" for f in functions) + "\n" + script
    env = {"PATH": "/usr/bin:/bin", "RESULTS": str(results), "PY": sys.executable}
    return subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True, check=True).stdout


def test_moe_ab_table_reads_each_variants_results(tmp_path):
    """A MODEL:GEMM:STEPS variant's results land in MODEL-GEMM-nssSTEPS, which the table reads, each row against
    the model's first variant."""
    for name, tok in (("auto-nss1", 100.0), ("pallas-nss1", 125.0)):
        run = tmp_path / "moe-ab" / f"qwen3-30b-a3b-{name}" / "h200-qwen3-30b-a3b-latency-bs1"
        run.mkdir(parents=True)
        (run / "result.json").write_text(
            f'{{"jaxserve": {{"batch_size": 1, "output_tok_per_s": {tok}, "decode_step_s": 0.008}}}}')
    table = _bash('moe_ab_table "qwen3-30b-a3b:auto:1 qwen3-30b-a3b:pallas:1"', tmp_path, "moe_ab_table")
    assert "| qwen3-30b-a3b | 1 | auto 1 | 100.0 | 8.00 | 1.00 |" in table
    assert "| qwen3-30b-a3b | 1 | pallas 1 | 125.0 | 8.00 | 1.25 |" in table


def test_moe_ab_runs_each_variant_with_its_gemm_and_steps(tmp_path):
    """moe_ab with its runner replaced by an echo: each variant's GEMM in the engine's variable and its own
    results folder, in the order given, then the table (no rows here: nothing wrote a result)."""
    script = ('SUMMARY=$RESULTS/summary.txt\n'
              'bench() { echo "gemm=$JAXSERVE_MOE_GROUPED_GEMM name=$2 out=${*: -1}"; }\n'
              'MOE_AB_VARIANTS="qwen3-30b-a3b:auto:1 mixtral-8x7b:pallas:4"\nmoe_ab')
    out = _bash(script, tmp_path, "run_limit", "moe_ab", "moe_ab_table").splitlines()
    assert [line for line in out if line.startswith("gemm=")] == [
        f"gemm=auto name=moe-ab-qwen3-30b-a3b-auto-nss1 out={tmp_path}/moe-ab/qwen3-30b-a3b-auto-nss1",
        f"gemm=pallas name=moe-ab-mixtral-8x7b-pallas-nss4 out={tmp_path}/moe-ab/mixtral-8x7b-pallas-nss4"]
    assert any(line.startswith("| model | batch | JAXSERVE_MOE_GROUPED_GEMM, num_scheduler_steps |") for line in out)
