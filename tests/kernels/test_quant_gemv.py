"""The CUDA int4 GEMV (``kernels/quant_gemv.{cu,py}``) on CPU: its launch arithmetic, its fragment mapping
emulated lane by lane in numpy against the reference (the mma's K labels, the activation pairing, the output
placement), and that the .cu compiles with this machine's nvcc for Hopper. The kernel itself runs in
``test_int4_gemv_gpu.py``."""
from __future__ import annotations

import numpy as np
import pytest

from jaxserve.kernels import cuda_build, quant_gemv
from jaxserve.quantization import int4_formats

MAGIC = 0x43004300


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 → bf16 bit patterns (round to nearest even), as uint32."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)


def _halves(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A bf16x2 register's (low, high) elements as float32."""
    return (((v & 0xFFFF) << 16).astype(np.uint32).view(np.float32),
            (v & 0xFFFF0000).astype(np.uint32).view(np.float32))


def _pack_halves(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (lo.astype(np.float32).view(np.uint32) >> 16) | (hi.astype(np.float32).view(np.uint32) & 0xFFFF0000)


def _dequant(q: np.ndarray, shift: int, zz: np.ndarray) -> np.ndarray:
    """``sub_bf16x2(lop3((q >> shift) & 0x000f000f | MAGIC), zz)`` (exact: small integers)."""
    lo, hi = _halves(((q >> shift) & 0x000F000F) | MAGIC)
    zlo, zhi = _halves(zz)
    return _pack_halves(lo - zlo, hi - zhi)


def _byte_perm(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    """CUDA's ``__byte_perm(a, b, sel)``: result byte i is byte ``(sel >> 4i) & 7`` of ``b:a``."""
    both = (np.asarray(b, np.uint64) << 32) | np.asarray(a, np.uint64)
    out = np.zeros(np.shape(both), np.uint64)
    for i in range(4):
        out |= ((both >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i)
    return out.astype(np.uint32)


def _mma(a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    """m16n8k16 from the 32 lanes' fragments (PTX ISA layout) → each lane's 4 C values ``[32, 4]``."""
    lane = np.arange(32)
    g, c = lane // 4, lane % 4
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for reg, (row, col) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
        lo, hi = _halves(a[reg])
        A[g + row, 2 * c + col], A[g + row, 2 * c + col + 1] = lo, hi
    for reg, row in enumerate([0, 8]):
        lo, hi = _halves(b[reg])
        B[2 * c + row, g], B[2 * c + row + 1, g] = lo, hi
    C = A @ B
    return np.stack([C[g, 2 * c], C[g, 2 * c + 1], C[g + 8, 2 * c], C[g + 8, 2 * c + 1]], axis=1)


def _emulate(x: np.ndarray, packed: np.ndarray, scales: np.ndarray, zeros: np.ndarray, group: int) -> np.ndarray:
    """What ``quant_gemv.cu`` computes, one warp step and column tile at a time (the order of the sums aside):
    the weights are the mma's A operand (rows g / g + 8 = the lane's columns 2j / 2j + 1), x its B operand."""
    m, k = x.shape
    n = packed.shape[1]
    xbits = _bf16_bits(x)
    words = packed.view(np.uint32)
    lane = np.arange(32)
    g, c = lane // 4, lane % 4
    out = np.zeros((16, n + 32), np.float64)
    for n0 in range(0, n, 32):
        wcol = np.minimum(n0 + 4 * g, n - 4)        # columns past N read a valid one (never written)
        acc = np.zeros((32, 2, 2, 4))               # [lane, mma j, row block, C register]
        for s in range(k // 32):
            r, grp = 4 * s + c, s * 32 // group

            def x_words(rows):        # the lane's 16-byte load of x[row, 8r .. 8r + 7]: 4 words of 2 bf16
                rows = np.minimum(rows, m - 1)      # rows past M read a valid one (never written)
                return [xbits[rows, 8 * r + 2 * q] | (xbits[rows, 8 * r + 2 * q + 1] << 16) for q in range(4)]
            b = [[_byte_perm(xw[lo], xw[hi], sel) for lo, hi in ((0, 2), (1, 3)) for sel in (0x5410, 0x7632)]
                 for xw in (x_words(g), x_words(g + 8))]
            zw = np.zeros(32, np.uint32)            # the lane's 4 zero points, one byte each
            for i in range(4):
                zw |= zeros[grp, wcol + i].astype(np.uint32) << (8 * i)
            sc = np.stack([scales[grp, wcol + i] for i in range(4)], 1)
            d = []
            for i in range(4):
                zz = _byte_perm(zw, np.full(32, 0x43434343, np.uint32), 0x4040 | (0x101 * i))
                d.append([_dequant(words[r, wcol + i], 4 * p, zz) for p in range(4)])
            for j in range(2):
                for blk in range(2):
                    t = (_mma([d[2 * j][0], d[2 * j + 1][0], d[2 * j][1], d[2 * j + 1][1]], b[blk][:2])
                         + _mma([d[2 * j][2], d[2 * j + 1][2], d[2 * j][3], d[2 * j + 1][3]], b[blk][2:]))
                    acc[:, j, blk] += t * np.stack([sc[:, 2 * j], sc[:, 2 * j], sc[:, 2 * j + 1], sc[:, 2 * j + 1]], 1)
        for idx in range(512):       # output_place
            v, ln = idx >> 5, idx & 31
            j, blk, e = v >> 3, (v >> 2) & 1, v & 3
            row = 2 * (ln & 3) + (e & 1) + 8 * blk
            out[row, n0 + 4 * (ln >> 2) + 2 * j + (e >> 1)] = acc[ln, j, blk, e]
    return out[:m, :n]


@pytest.mark.parametrize("m,k,n,group", [(1, 64, 32, 32), (3, 256, 40, 64), (16, 128, 72, 128), (9, 96, 8, 32),
                                         (8, 64, 16, 64)])
def test_the_fragment_mapping_computes_the_product(m, k, n, group):
    rng = np.random.default_rng(m + k + n)
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    scales = (rng.random((k // group, n)) * 0.02 + 0.001).astype(np.float32)
    zeros = rng.integers(0, 16, (k // group, n)).astype(np.int8)
    x = rng.standard_normal((m, k)).astype(np.float32)
    xr = _halves(_bf16_bits(x))[0]                  # x as the kernel sees it (bf16)
    w = (q.astype(np.float64) - np.repeat(zeros, group, 0)) * np.repeat(scales.astype(np.float64), group, 0)
    got = _emulate(x, int4_formats.pack(q), scales, zeros.astype(np.uint8), group)
    np.testing.assert_allclose(got, xr.astype(np.float64) @ w, rtol=1e-9, atol=1e-9)


def _emulate_fp8(x: np.ndarray, w8: np.ndarray, scale: np.ndarray, block: bool) -> np.ndarray:
    """What ``fp8_gemv.cuh`` computes per 64-row step and 32-row tile (the order of the sums aside): lane (g, c)
    loads 16 bytes at k0 + 16c of rows n0 + g, + 8, + 16, + 24; mma q of a tile takes bytes 4q .. 4q + 3."""
    import ml_dtypes
    m, k = x.shape
    n = w8.shape[0]
    xbits = _bf16_bits(x)
    wbits = _bf16_bits(w8.view(ml_dtypes.float8_e4m3fn).astype(np.float32))   # e4m3 -> bf16 is exact
    lane = np.arange(32)
    g, c = lane // 4, lane % 4
    out = np.zeros((16, n + 32), np.float64)
    for n0 in range(0, n, 32):
        rows = [np.minimum(n0 + 8 * i + g, n - 1) for i in range(4)]
        acc = np.zeros((32, 2, 2, 4))
        for k0 in range(0, k, 64):
            s = scale[k0 // 128, n0 // 128] if block else 1.0
            for tile in range(2):
                for q in range(4):
                    kk = k0 + 16 * c + 4 * q
                    a = [wbits[rows[2 * tile], kk] | (wbits[rows[2 * tile], kk + 1] << 16),
                         wbits[rows[2 * tile + 1], kk] | (wbits[rows[2 * tile + 1], kk + 1] << 16),
                         wbits[rows[2 * tile], kk + 2] | (wbits[rows[2 * tile], kk + 3] << 16),
                         wbits[rows[2 * tile + 1], kk + 2] | (wbits[rows[2 * tile + 1], kk + 3] << 16)]
                    for blk in range(2):
                        xr = np.minimum(g + 8 * blk, m - 1)
                        b = [xbits[xr, kk] | (xbits[xr, kk + 1] << 16), xbits[xr, kk + 2] | (xbits[xr, kk + 3] << 16)]
                        acc[:, tile, blk] += s * _mma(a, b)
        for idx in range(512):       # Fp8Columns
            v, ln = idx >> 5, idx & 31
            tile, blk, e = v >> 3, (v >> 2) & 1, v & 3
            row = 2 * (ln & 3) + (e & 1) + 8 * blk
            col = n0 + 16 * tile + (ln >> 2) + 8 * (e >> 1)
            out[row, col] = acc[ln, tile, blk, e] * (1.0 if block else scale[min(col, n - 1)])
    return out[:m, :n]


@pytest.mark.parametrize("m,k,n,block", [(1, 128, 32, False), (3, 192, 40, True), (16, 128, 72, False),
                                         (9, 256, 136, True)])
def test_the_fp8_fragment_mapping_computes_the_product(m, k, n, block):
    import ml_dtypes
    rng = np.random.default_rng(m + k + n)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w8 = w.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    scale = (rng.random((-(-k // 128), -(-n // 128)) if block else n) * 0.02 + 0.001).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    xr = _halves(_bf16_bits(x))[0].astype(np.float64)
    wf = w8.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    if block:
        wf = wf * np.repeat(np.repeat(scale, 128, 0)[:k], 128, 1)[:, :n].T
    else:
        wf = wf * scale[:, None]
    np.testing.assert_allclose(_emulate_fp8(x, w8, scale, block), xr @ wf.T, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("k", [96, 480, 4096, 14336])
@pytest.mark.parametrize("splits", [1, 3, 4, 7])
@pytest.mark.parametrize("chunk", quant_gemv.CHUNKS)
def test_blocks_and_warps_cover_every_step_once(k, splits, chunk):
    """The .cu's K ranges: split ``b`` of ``splits`` takes whole chunks (none when there are fewer chunks than
    splits), warp ``w`` every ``WARPS``-th chunk of them."""
    steps = k // quant_gemv.STEP_K
    chunks = -(-steps // chunk)
    seen = []
    for b in range(splits):
        lo, hi = chunk * (b * chunks // splits), min(steps, chunk * ((b + 1) * chunks // splits))
        for w in range(quant_gemv.WARPS):
            for s0 in range(lo + w * chunk, hi, quant_gemv.WARPS * chunk):
                seen += [s for s in range(s0, s0 + chunk) if s < hi]
    assert sorted(seen) == list(range(steps))


@pytest.mark.parametrize("m,k,n,ok", [(1, 4096, 4096, True), (16, 7168, 2112, True), (17, 4096, 4096, False),
                                      (4, 4096, 4100, False), (4, 4160, 4096, True), (4, 4128, 4096, False)])
def test_supports_fp8(m, k, n, ok):
    import ml_dtypes
    assert quant_gemv.supports_fp8(m, k, n, ml_dtypes.bfloat16) is ok
    assert not quant_gemv.supports_fp8(m, k, n, np.float16)


@pytest.mark.parametrize("m,k,n,group,ok", [
    (1, 4096, 4096, 128, True), (16, 4096, 6144, 32, True), (17, 4096, 4096, 128, False),
    (4, 4096, 4100, 128, False), (4, 4112, 4096, 16, False), (4, 4096, 4096, 4096, True)])
def test_supports(m, k, n, group, ok):
    import ml_dtypes
    assert quant_gemv.supports(m, k, n, group, ml_dtypes.bfloat16) is ok
    assert not quant_gemv.supports(m, k, n, group, np.float32)


@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (256, 64), (64, 8)])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_the_default_launch_splits_k_only_for_long_warps(k, n, m):
    chunk, splits = quant_gemv.default_launch(m, k, n, 128, 132)
    assert chunk == quant_gemv.chunk_steps(m, 128, chunk) and (chunk == 4 or m <= 8)
    assert 1 <= splits <= quant_gemv.max_splits(k, chunk)
    steps_a_warp = k // quant_gemv.STEP_K / quant_gemv.WARPS
    assert steps_a_warp / splits <= quant_gemv.WARP_STEPS
    assert splits == 1 or steps_a_warp / (splits - 1) > quant_gemv.WARP_STEPS
    # the 8B shapes as measured fastest on an H100: one split, two for down's K of 14336
    assert splits == (2 if k == 14336 else 1)


def test_chunks_of_8_only_where_registers_allow():
    assert quant_gemv.chunk_steps(8, 128, 8) == 8 and quant_gemv.chunk_steps(8, 4096, 8) == 8
    assert quant_gemv.chunk_steps(9, 128, 8) == 4 and quant_gemv.chunk_steps(1, 64, 8) == 4
    assert quant_gemv.chunk_steps(1, 128, 4) == 4


@pytest.mark.parametrize("k,n", [(4096, 28672), (14336, 4096), (4096, 4096), (4096, 1024), (96, 8)])
def test_the_variants_launches(k, n):
    """The occupancy variants run chunks of 4 with v1's splits (above 8 rows: the default kernel's launch)."""
    for m in (1, 4, 16):
        if m > 8:
            for variant in ("occ3", "occ4"):
                assert quant_gemv.default_launch(m, k, n, 128, 132, variant) == \
                    quant_gemv.default_launch(m, k, n, 128, 132, "v1")
        for variant in ("occ3", "occ4"):
            chunk, splits = quant_gemv.default_launch(m, k, n, 128, 132, variant)
            assert chunk == 4 and splits == quant_gemv.launch_splits(k, 4)
    assert quant_gemv.blocks_per_sm("occ4", 8) == 4 and quant_gemv.blocks_per_sm("occ4", 9) == 2
    assert quant_gemv.chunk_steps(1, 128, 8, "occ3") == 4


@pytest.mark.parametrize("k,n,splits", [(4096, 28672, 1), (14336, 4096, 1), (4096, 6144, 1), (4096, 1024, 3),
                                        (4096, 64, 32), (128, 8, 1)])
def test_the_fp8_launch_splits_only_narrow_weights(k, n, splits):
    assert quant_gemv.default_fp8_splits(k, n, 132) == splits


@pytest.mark.slow     # nvcc takes about a minute: make test-slow
def test_the_cuda_source_compiles_for_hopper(tmp_path):
    toolchain = cuda_build.Toolchain(cache_dir=tmp_path)
    if toolchain.find_nvcc() is None:
        pytest.skip("no nvcc on this machine")
    lib = quant_gemv.build(toolchain, arch="sm_90a")
    assert lib.exists() and lib.stat().st_size > 0


@pytest.mark.slow     # device code only, about 30 s on two cores: make test-slow
def test_every_int4_variant_compiles_within_its_register_budget(tmp_path):
    """Each variant's kernels compile for Hopper with the registers their launch plans for: v1 never spills,
    the occupancy variants stay under their caps (3 blocks of 256 threads: 80; 4: 64) and spill at most a few
    words at groups of 128 rows (what the engine's int4 weights use)."""
    toolchain = cuda_build.Toolchain(cache_dir=tmp_path)
    if toolchain.find_nvcc() is None:
        pytest.skip("no nvcc on this machine")
    usage = cuda_build.resource_usage(quant_gemv.SOURCE, toolchain, arch="sm_90a")
    int4 = {k: v for k, v in usage.items() if k.startswith("int4_gemv_kernel<")}
    for min_blocks, cap in ((2, 128), (3, 80), (4, 64)):
        kernels = {k: v for k, v in int4.items() if k.endswith(f",{min_blocks}>")}
        assert kernels, min_blocks
        for name, (regs, spill_st, spill_ld) in kernels.items():
            assert regs <= cap, (name, regs)
            if min_blocks == 2:
                assert spill_st == spill_ld == 0, (name, spill_st)
            else:
                tall, group_steps = name.split("<")[1].split(",")[1], int(name.split(",")[3])
                assert tall == "0", name                       # > 8 rows run the default kernel
                if group_steps == 4:
                    assert spill_st <= 8 and spill_ld <= 16, (name, spill_st, spill_ld)
