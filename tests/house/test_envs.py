"""The environment-variable registry (``jaxserve/envs.py``): reads at access time, typed values, and no
``os.environ`` read anywhere else in the product."""
import pathlib
import re

import pytest

from jaxserve import envs

ROOT = pathlib.Path(__file__).resolve().parents[2]
READ = re.compile(r"os\.environ\.get\(|os\.environ\[|os\.getenv\(|environ\.get\(")


def test_values_are_read_at_access_time(monkeypatch):
    monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)
    assert envs.JAX_NUM_PROCESSES is None
    monkeypatch.setenv("JAX_NUM_PROCESSES", "3")
    assert envs.JAX_NUM_PROCESSES == 3
    monkeypatch.setenv("JAX_NUM_PROCESSES", "three")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='three' is not an integer"):
        envs.JAX_NUM_PROCESSES
    monkeypatch.delenv("JAXSERVE_CUSTOM_ALL_REDUCE_FUSE_NORM", raising=False)
    assert envs.JAXSERVE_CUSTOM_ALL_REDUCE_FUSE_NORM is True
    monkeypatch.setenv("JAXSERVE_CUSTOM_ALL_REDUCE_FUSE_NORM", "0")
    assert envs.JAXSERVE_CUSTOM_ALL_REDUCE_FUSE_NORM is False
    monkeypatch.setenv("JAXSERVE_CUDA_ARCH", "")
    assert envs.JAXSERVE_CUDA_ARCH == "native"
    with pytest.raises(AttributeError, match="JAXSERVE_NO_SUCH_SWITCH"):
        envs.JAXSERVE_NO_SUCH_SWITCH


def test_every_variable_is_documented():
    for name, default, meaning in envs.environment_variables():
        assert name.isupper() and meaning, name
        assert default is None or isinstance(default, str), name


def test_the_product_reads_the_environment_only_through_the_registry():
    sources = [p for d in ("jaxserve", "kernels", "server") for p in (ROOT / d).rglob("*.py")]
    direct = [f"{p.relative_to(ROOT)}:{i}" for p in sources if p.name != "envs.py"
              for i, line in enumerate(p.read_text().splitlines(), 1) if READ.search(line)]
    assert not direct, f"read these through jaxserve/envs.py: {direct}"
    text = "\n".join(p.read_text() for p in sources if p.name != "envs.py")
    unused = [name for name, _, _ in envs.environment_variables() if f"envs.{name}" not in text]
    assert not unused, f"registered but never read: {unused}"


def test_default_xla_flags_join_xla_flags_unless_set_there(monkeypatch):
    from jaxserve import xla_flags
    (name, value), = xla_flags.DEFAULTS.items()
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("JAXSERVE_XLA_FLAGS", raising=False)
    xla_flags.apply()
    assert envs.XLA_FLAGS == f"--{name}={value}"
    xla_flags.apply()                                            # once only
    assert envs.XLA_FLAGS == f"--{name}={value}"
    monkeypatch.setenv("XLA_FLAGS", f"--xla_dump_to=/tmp/x --{name}=ALWAYS_UPDATE")
    xla_flags.apply()                                            # the user's own setting wins
    assert envs.XLA_FLAGS == f"--xla_dump_to=/tmp/x --{name}=ALWAYS_UPDATE"
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    xla_flags.apply()
    assert envs.XLA_FLAGS == f"--xla_dump_to=/tmp/x --{name}={value}"
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    monkeypatch.setenv("JAXSERVE_XLA_FLAGS", "0")
    xla_flags.apply()
    assert envs.XLA_FLAGS == "--xla_dump_to=/tmp/x"
    with pytest.raises(KeyError, match="not a registered"):
        envs.write("JAXSERVE_NO_SUCH_SWITCH", "1")


def test_a_switch_a_trace_reads_is_part_of_the_program_cache_key(monkeypatch):
    """Two values of a registered switch (the MoE grouped GEMM) are two stored-program keys, unset a third."""
    from jaxserve.runner import program_cache
    monkeypatch.delenv("JAXSERVE_MOE_GROUPED_GEMM", raising=False)
    unset = program_cache._environment()
    monkeypatch.setenv("JAXSERVE_MOE_GROUPED_GEMM", "rows")
    rows = program_cache._environment()
    monkeypatch.setenv("JAXSERVE_MOE_GROUPED_GEMM", "pallas")
    assert len({unset, rows, program_cache._environment()}) == 3
    # XLA's flags and memory share act after export: a stored program stays valid across them
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    pallas = program_cache._environment()
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert program_cache._environment() == pallas


def test_a_benchmark_result_records_the_switches_set_but_no_secret(monkeypatch):
    from jaxserve.benchmarks import envinfo
    monkeypatch.setenv("JAXSERVE_MOE_GROUPED_GEMM", "rows")
    monkeypatch.setenv("JAXSERVE_API_KEY", "secret")
    env = envinfo.environment([], with_devices=False)["env"]
    assert env["JAXSERVE_MOE_GROUPED_GEMM"] == "rows" and "JAXSERVE_API_KEY" not in env
