"""The MoE rows kernel's launch sweep: its launch syntax, the env's, and one tiny run on CPU (interpret mode)."""
import pytest

from jaxserve.benchmarks import moe_rows_launch
from jaxserve.kernels import ragged_dot
from jaxserve.models.layers import moe


def test_launches_parse_and_bad_ones_name_the_format():
    assert moe_rows_launch.parse_launches("64/128/4/3, 32/64/8/4") == [(64, 128, 4, 3), (32, 64, 8, 4)]
    assert len(moe_rows_launch.parse_launches("grid")) == len(moe_rows_launch.GRID)
    for bad in ("64/128/4", "48/128/4/3", "64/8/4/3", "64/128/3/3", "a/b/c/d"):
        with pytest.raises(ValueError, match="BLOCK_N/BLOCK_K/WARPS/STAGES"):
            ragged_dot.parse_rows_launch(bad)


def test_the_env_gives_gate_up_and_down_launches():
    assert moe._rows_launch("") == (None, None)
    assert moe._rows_launch("32/64/8/4") == ((32, 64, 8, 4),) * 2
    assert moe._rows_launch("32/64/8/4,128/128/4/3") == ((32, 64, 8, 4), (128, 128, 4, 3))
    with pytest.raises(ValueError, match="at most two"):
        moe._rows_launch("32/64/8/4,32/64/8/4,32/64/8/4")


def test_rows_launch_shrinks_blocks_to_divide_the_shape():
    assert ragged_dot.rows_launch(1408, 2048, (128, 256, 8, 4)) == (128, 128, 8, 4)     # 1408 = 11 * 128
    assert ragged_dot.rows_launch(768, 1408) == (64, 128, 4, 3)
    assert ragged_dot.rows_launch(2048, 1408, gated=True) == (128, 128, 4, 3)


@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("gated", [False, True])
def test_rows_launch_fits_shared_memory(itemsize, gated):
    """What Triton stages (``num_stages - 1`` copies of the rows' and weight columns' tiles) fits an SM: a
    float32 gated product at the default launch asked for 272 KB on an H100 (DeepSeek in float32 did not
    compile); the 16-bit and fp8 defaults stay as they were."""
    for k, n, block_m in ((2048, 1408, 16), (7168, 2048, 64), (1408, 2048, 16)):
        block_n, block_k, _, stages = ragged_dot.rows_launch(k, n, gated=gated, block_m=block_m, itemsize=itemsize)
        assert (stages - 1) * (block_m + block_n * (1 + gated)) * block_k * itemsize <= ragged_dot.SHARED_MEMORY
        if itemsize < 4:
            assert (block_n, block_k) == ragged_dot.rows_launch(k, n, gated=gated)[:2]
    assert ragged_dot.rows_launch(2048, 1408, gated=True, itemsize=4)[1] == 64


def test_a_tiny_sweep_runs_and_names_the_fastest(capsys):
    assert moe_rows_launch.main(["--shapes", "tiny", "--launches", "32/64/8/3", "--rounds", "1", "--tokens", "4",
                                 "--valid", "2", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    assert "### tiny gate/up" in out and "### tiny down" in out
    assert "| 32/64/8/3 |" in out and "| 64/128/4/3 |" in out      # the default launch is always timed
    assert out.count("fastest tiny:") == 2
