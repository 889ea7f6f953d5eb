"""The MoE measurements before they meet a GPU: moe_gemm's ``fused[...]`` row names and the fused kernels' block
rounding its tuning search relies on, a non-default block setting still computing the layer, and the configs
run_h200.sh's moe-ab / moe-serve steps run (one engine per variant process)."""
from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.config import engine_kwargs, load_config, load_configs
from benchmarks.diagnostics import moe_gemm
from jaxserve.kernels import fused_moe
from jaxserve.llm import engine_config_from_kwargs

ROOT = Path(__file__).resolve().parent.parent
RUN_H200 = (ROOT / "benchmarks" / "run_h200.sh").read_text()


@pytest.mark.parametrize("name, blocks", [
    ("fused[32,128,8]", {"block_i": 32, "block_h": 128, "splits": 8}),
    ("fused[32,64,4,256,3]", {"block_i": 32, "block_h": 64, "splits": 4, "block_k": 256, "num_stages": 3}),
    ("fused[dk=128,w=8]", {"down_block_k": 128, "num_warps": 8}),
    ("fused[bi=16,bh=32,s=2,bk=64,dk=32,st=2,w=8]", {"block_i": 16, "block_h": 32, "splits": 2, "block_k": 64,
                                                     "down_block_k": 32, "num_stages": 2, "num_warps": 8}),
])
def test_fused_row_names_give_the_kernel_arguments(name, blocks):
    assert moe_gemm.fused_blocks(name) == blocks


@pytest.mark.parametrize("name, why", [
    ("fused[32,64]", "3 to 5 positional"), ("fused[1,2,3,4,5,6]", "3 to 5 positional"),
    ("fused[bi=32,64,4]", "not both"), ("fused[x=1]", "unknown key x"), ("fused[bi=1,bi=2]", "given twice"),
    ("fused[bi=0]", "positive integer"), ("fused[bi=a]", "positive integer"), ("fused[]", "expected"),
    ("fused[32,,4]", "expected"), ("layer:fused", "expected"),
])
def test_fused_row_names_that_are_not_say_why(name, why):
    with pytest.raises(ValueError, match=why):
        moe_gemm.fused_blocks(name)


def test_fused_name_spells_out_every_block_and_reads_back():
    blocks = fused_moe.resolve_blocks(2048, 768)
    name = moe_gemm.fused_name(blocks)
    assert name == "fused[bi=32,bh=64,s=4,bk=128,dk=64,st=3,w=4]"      # GPU_BLOCKS at Qwen3-30B-A3B's widths
    assert moe_gemm.fused_blocks(name) == blocks


def test_impls_and_tune_refuse_what_they_cannot_time():
    with pytest.raises(SystemExit):
        moe_gemm.main(["--smoke", "--decode", "--impls", "layer:fused,fused[bi=16,q=3]"])
    with pytest.raises(SystemExit):
        moe_gemm.main(["--smoke", "--tune", "--tokens", "32"])         # the decode kernels stop at 16 tokens


def test_resolve_blocks_rounds_each_block_to_its_dimension():
    """Settings that resolve alike are the same kernels (the tuning search times them once)."""
    qwen, mixtral = fused_moe.resolve_blocks(2048, 768), fused_moe.resolve_blocks(4096, 14336)
    assert qwen == mixtral == fused_moe.GPU_BLOCKS
    # 768 / 4 = 192 rows a split: down's step rounds to 64; one split of 768 takes 256
    assert fused_moe.resolve_blocks(2048, 768, down_block_k=128)["down_block_k"] == 64
    assert fused_moe.resolve_blocks(2048, 768, splits=1, down_block_k=512)["down_block_k"] == 256
    assert fused_moe.resolve_blocks(2048, 768, block_i=512)["block_i"] == 256           # 768 = 3 x 256
    tiny = fused_moe.resolve_blocks(64, 32, splits=4, block_h=256)
    assert (tiny["splits"], tiny["block_h"], tiny["down_block_k"]) == (2, 64, 16)       # 32 / 4 = 8 rows: halved
    interpreted = fused_moe.resolve_blocks(64, 32, interpret=True)
    assert (interpreted["block_i"], interpreted["block_h"], interpreted["splits"]) == (32, 64, 1)
    assert fused_moe.resolve_blocks(2048, 768, num_warps=8, num_stages=2) == fused_moe.GPU_BLOCKS | {
        "num_warps": 8, "num_stages": 2}
    with pytest.raises(TypeError, match="unknown block_q"):
        fused_moe.resolve_blocks(2048, 768, block_q=16)


class _FakeTimer:
    """moe_gemm.Timer's interface with made-up µs: a row per fused setting, faster with more warps and bigger
    block_i; the settings in ``wrong`` fail the reference check."""

    def __init__(self, wrong=()):
        self.shape, self.tokens, self.best, self.wrong, self.timed = "qwen", 4, None, set(wrong), []

    def __call__(self, impl):
        self.timed.append(impl)
        if impl.startswith("layer:"):
            return {"impl": impl, "us": 100.0}
        b = moe_gemm.fused_blocks(impl)
        return {"impl": impl, "us": 100.0 - b["num_warps"] - b["block_i"] / 16}

    def verify(self, impl):
        return "mismatch" if impl in self.wrong else None


def test_tune_keeps_the_fastest_setting_that_computes_the_layer():
    fastest = fused_moe.resolve_blocks(2048, 768, block_i=128, num_warps=8)
    timer = _FakeTimer()
    line = moe_gemm.tune(timer, 2048, 768)
    assert timer.best["impl"] == moe_gemm.fused_name(fastest) and line.endswith(f"| {timer.best['impl']} |")
    assert timer.timed[0] == moe_gemm.fused_name(fused_moe.GPU_BLOCKS)       # the search starts at the default
    # block_i=128 wins its axis but computes wrong: the search goes on from block_i=64
    timer = _FakeTimer(wrong={moe_gemm.fused_name(fused_moe.resolve_blocks(2048, 768, block_i=128))})
    moe_gemm.tune(timer, 2048, 768)
    assert timer.best["impl"] == moe_gemm.fused_name(fused_moe.resolve_blocks(2048, 768, block_i=64, num_warps=8))


def test_fused_moe_at_other_loop_steps_matches_reference():
    """Down's rows per loop step (the knob the tuning search adds) and gate/up's, several steps per split:
    the same layer as the reference (interpreted)."""
    t, e, k, hidden, inter = 4, 8, 2, 64, 64
    rng = np.random.default_rng(7)
    ids = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32))
    h = jnp.asarray(rng.standard_normal((t, hidden)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((e, hidden, 2, inter)) * 0.2, jnp.float32)
    down = jnp.asarray(rng.standard_normal((e, inter, hidden)) * 0.2, jnp.float32)
    weights = jnp.asarray(rng.random((t, k)), jnp.float32)
    want = np.asarray(fused_moe.fused_moe_reference(h, ids, weights, gate_up, down, jax.nn.silu))
    got = np.asarray(fused_moe.fused_moe(h, ids, weights, gate_up, down, jax.nn.silu, block_i=32, block_h=32,
                                         splits=2, block_k=16, down_block_k=16))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


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
    assert {g for _, g, _ in variants} == {"auto", "rows"} and {s for _, _, s in variants} == {"1", "4"}
    assert len({tuple(v) for v in variants}) == len(variants) == 8
    assert variants[0] == ["qwen3-30b-a3b", "auto", "1"]           # the table's baseline runs first
    serve = load_config("h200-qwen3-30b-a3b-serve-sweep")
    assert serve["mode"] == "serve" and serve["workload"]["sweep"] == {"max_concurrency": [1, 16, 64, 256]}
    assert "moe-serve) bench" in RUN_H200 and "--config h200-qwen3-30b-a3b-serve-sweep" in RUN_H200
    assert "benchmarks/diagnostics/moe_gemm.py --tune --skip-models" in RUN_H200


def _bash(script: str, results: Path, *functions: str) -> str:
    """``script`` after run_h200.sh's ``functions``, RESULTS=``results``; its stdout."""
    import subprocess
    import sys
    text = "\n".join(_function(f) + "\n}" for f in functions) + "\n" + script
    env = {"PATH": "/usr/bin:/bin", "RESULTS": str(results), "PY": sys.executable}
    return subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True, check=True).stdout


def test_moe_ab_tuned_blocks_are_moe_tunes_best_over_the_counts(tmp_path):
    """@tuned reads the moe-tune log's summed row for its model (the per-count rows and the other shape's are
    not it); its blocks are a JAXSERVE_MOE_FUSED_BLOCKS value the engine parses; no log or row: nothing."""
    best = fused_moe.resolve_blocks(2048, 768, block_i=16, num_warps=8)
    other = moe_gemm.fused_name(fused_moe.resolve_blocks(2048, 768, splits=8))
    rows = [moe_gemm._tune_row("qwen3-30b-a3b", "1", 9, 8, 7, 6, other),
            moe_gemm._tune_row("qwen3-30b-a3b", "sum 1+4+16", 30, 27, 24, 21, moe_gemm.fused_name(best)),
            moe_gemm._tune_row("mixtral-8x7b", "sum 1+4+16", 90, 80, 70, 60, other)]
    assert _bash("moe_tuned_blocks qwen3-30b-a3b", tmp_path, "moe_tuned_blocks") == ""      # no log yet
    (tmp_path / "moe-tune.log").write_text("\n".join(f"tune: {r}" for r in rows) + "\n" + "\n".join(rows) + "\n")
    got = _bash("moe_tuned_blocks qwen3-30b-a3b", tmp_path, "moe_tuned_blocks").strip()
    assert fused_moe.parse_blocks(got) == best
    assert _bash("moe_tuned_blocks qwen2-57b", tmp_path, "moe_tuned_blocks") == ""


def test_moe_ab_table_finds_a_variant_with_blocks(tmp_path):
    """A MODEL:GEMM@BLOCKS:STEPS variant's results land in a plain folder name (moe_ab_tag) that the table reads."""
    tag = _bash('moe_ab_tag "fused@bi=16,w=8"', tmp_path, "moe_ab_tag").strip()
    assert tag == "fused-bi16-w8"
    for name, tok in (("auto-nss1", 100.0), (f"{tag}-nss1", 125.0)):
        run = tmp_path / "moe-ab" / f"qwen3-30b-a3b-{name}" / "h200-qwen3-30b-a3b-latency-bs1"
        run.mkdir(parents=True)
        (run / "result.json").write_text(
            f'{{"jaxserve": {{"batch_size": 1, "output_tok_per_s": {tok}, "decode_step_s": 0.008}}}}')
    table = _bash('moe_ab_table "qwen3-30b-a3b:auto:1 qwen3-30b-a3b:fused@bi=16,w=8:1"', tmp_path, "moe_ab_table")
    assert "| qwen3-30b-a3b | 1 | auto 1 | 100.0 | 8.00 | 1.00 |" in table
    assert "| qwen3-30b-a3b | 1 | fused@bi=16,w=8 1 | 125.0 | 8.00 | 1.25 |" in table


def test_moe_ab_variants_with_blocks_set_the_engines_variable(tmp_path):
    """moe_ab with its runner replaced by an echo: a plain variant runs GPU_BLOCKS (the variable empty), @BLOCKS
    and @tuned (from the moe-tune log) set it, and @tuned without a moe-tune row for its model is skipped."""
    best = moe_gemm.fused_name(fused_moe.resolve_blocks(2048, 768, block_h=128))
    row = moe_gemm._tune_row("qwen3-30b-a3b", "sum 1+4", 9, 8, 7, 6, best)
    (tmp_path / "moe-tune.log").write_text(f"tune: {row}\n")
    script = ('SUMMARY=$RESULTS/summary.txt\n'
              'bench() { echo "gemm=$JAXSERVE_MOE_GROUPED_GEMM blocks=$JAXSERVE_MOE_FUSED_BLOCKS name=$2"; }\n'
              'MOE_AB_VARIANTS="qwen3-30b-a3b:auto:1 qwen3-30b-a3b:fused@bi=16,w=8:4 qwen3-30b-a3b:fused@tuned:1 '
              'mixtral-8x7b:fused@tuned:1"\nmoe_ab')
    out = _bash(script, tmp_path, "moe_ab_tag", "moe_tuned_blocks", "moe_ab", "moe_ab_table").splitlines()
    tuned = best[len("fused["):-1]
    assert [line for line in out if line.startswith("gemm=")] == [
        "gemm=auto blocks= name=moe-ab-qwen3-30b-a3b-auto-nss1",
        "gemm=fused blocks=bi=16,w=8 name=moe-ab-qwen3-30b-a3b-fused-bi16-w8-nss4",
        f"gemm=fused blocks={tuned} name=moe-ab-qwen3-30b-a3b-fused-{tuned.replace(',', '-').replace('=', '')}-nss1"]
    assert any(line.startswith("moe-ab mixtral-8x7b:fused@tuned:1: skipped, no moe-tune best") for line in out)
    assert 'MOE_TUNE_SHAPES:+--shapes "$MOE_TUNE_SHAPES"' in RUN_H200


@pytest.mark.parametrize("blocks", [{"block_i": 128, "block_k": 256, "num_warps": 8, "num_stages": 4},
                                    {"splits": 1, "down_block_k": 128, "block_h": 256, "block_i": 16}])
def test_fused_moe_lowers_to_triton_at_the_searched_extremes(blocks):
    """The tuning search's far ends still lower to the two Triton kernels at both models' widths, with the warps
    and pipeline depth asked for (compiling needs the GPU; a lowering failure would cost the search its rows)."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    hopper = gpu_info.GpuInfo(gpu_version=None, arch_name="9.0", compute_capability=90)
    S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: hopper)
        for e, k, hidden, inter, t in [(128, 8, 2048, 768, 16), (8, 2, 4096, 14336, 1)]:
            f = jax.jit(lambda *a: fused_moe.fused_moe(*a, jax.nn.silu, interpret=False, **blocks))
            text = f.trace(S((t, hidden), bf16), S((t, k), jnp.int32), S((t, k), bf16),
                           S((e, hidden, 2, inter), bf16), S((e, inter, hidden), bf16)
                           ).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("__gpu$xla.gpu.triton") == 2
            b = fused_moe.resolve_blocks(hidden, inter, **blocks)
            warps, stages = f"num_warps = {b['num_warps']} : i32", f"num_stages = {b['num_stages']} : i32"
            assert text.count(warps) == text.count(stages) == 2
