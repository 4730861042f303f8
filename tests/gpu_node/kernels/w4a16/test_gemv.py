"""The W4A16 kernels over Int4WeightKN equal their torch reference (interpreter on CPU, native on CUDA)."""

from __future__ import annotations

import pytest
import torch

import gpu_node.kernels.w4a16.gemv as gemv_module
from gpu_node.kernels.w4a16.reference import dequantize_ref, w4a16_matmul_ref
from gpu_node.quant.int4 import (
    Int4Weight,
    Int4WeightKN,
    dequantize_int4,
    from_kn,
    pack_int4,
    quantize_int4,
    to_kn,
)
from gpu_node.quant.linear import Int4Linear, model_bytes

w4a16_gemv = gemv_module.w4a16_gemv
w4a16_kn_matmul = gemv_module.w4a16_kn_matmul
dequantize_kn = gemv_module.dequantize_kn
gemv_config = gemv_module.gemv_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Max |kernel - reference| over max |reference|: both accumulate in fp32, so what is
# left is the summation order plus one rounding of the output (and, for the
# tensor-core kernel on a GPU, the 16-bit rounding of the dequantized weight).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max())


def kn_weight(n: int, k: int, group_size: int, seed: int) -> Int4WeightKN:
    gen = torch.Generator().manual_seed(seed)
    kn = to_kn(quantize_int4(torch.randn(n, k, generator=gen), group_size))
    return Int4WeightKN(
        kn.words.to(DEVICE), kn.scales.to(DEVICE), kn.mins.to(DEVICE), kn.shape, group_size
    )


def test_kn_layout_is_lossless_and_as_documented() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = quantize_int4(torch.randn(12, 64, generator=gen), 32)
    kn = to_kn(weight)
    assert kn.words.shape == (8, 12) and kn.words.dtype == torch.int32
    assert kn.scales.shape == (2, 12) and kn.nbytes == weight.nbytes
    back = from_kn(kn)
    for name in ("packed", "scales", "mins"):
        assert torch.equal(getattr(back, name), getattr(weight, name))
    # bits 4p..4p+3 of words[kw, n] hold the code of W[n, 8kw + p]
    codes = torch.round(
        (dequantize_int4(weight) - weight.mins.float().repeat_interleave(32, 1))
        / weight.scales.float().repeat_interleave(32, 1)
    ).to(torch.int64)
    word = int(kn.words[3, 5]) & 0xFFFFFFFF
    assert [(word >> (4 * p)) & 15 for p in range(8)] == codes[5, 24:32].tolist()


SHAPES = [  # m, n, k, group size, groups per split (None: the heuristic's)
    (1, 36, 64, 32, None),  # N off the row block
    (3, 52, 512, 128, 1),  # 4 splits, M padded to 4
    (8, 20, 256, 64, 2),  # 2 splits of 2 groups
    (1, 300, 384, 32, 5),  # 12 groups in splits of 5: the last split is short
    (2, 576, 576, 64, None),  # SmolLM2's hidden size
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize(
    ("m", "n", "k", "group_size", "groups_per_split", "dtype"),
    [(*shape, dtype) for dtype in DTYPES for shape in SHAPES]
    # K > 4096: the heuristic's one-warp programs, 36 splits (one dtype: the interpreter
    # takes ~30 s a call here, and the dtype paths are the shapes' above)
    + [(1, 128, 4608, 128, None, torch.float32)],
)
def test_gemv_equals_reference(
    m: int, n: int, k: int, group_size: int, groups_per_split: int | None, dtype: torch.dtype
) -> None:
    weight = kn_weight(n, k, group_size, seed=m * 1000 + n + k)
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    config = None if groups_per_split is None else {"GROUPS_PER_SPLIT": groups_per_split}
    y = w4a16_gemv(x, weight, config)
    ref = w4a16_matmul_ref(x.float(), weight)
    assert y.shape == (m, n) and y.dtype == dtype and y.device == x.device
    assert relative_error(y, ref) <= TOLERANCE[dtype]
    # The split-K counters are left at zero: a second call (a graph replay) agrees bit for bit.
    assert torch.equal(w4a16_gemv(x, weight, config), y)


def test_split_k_counters_return_to_zero() -> None:
    weight = kn_weight(260, 256, 32, seed=1)
    x = torch.randn(1, 256).to(DEVICE)
    y = w4a16_gemv(x, weight, {"GROUPS_PER_SPLIT": 1, "BLOCK_N": 128, "num_warps": 1})
    assert relative_error(y, w4a16_matmul_ref(x, weight)) <= 1e-5
    counters = gemv_module.split_counters(x.device)
    assert int(counters.abs().sum()) == 0


def test_extreme_codes_and_scales() -> None:
    n, k = 8, 256
    codes = torch.tensor([0, 15]).repeat(n * k // 2).reshape(n, k).to(torch.uint8)
    base = quantize_int4(torch.randn(n, k), 128)
    scales = torch.full_like(base.scales, 2.0**-24)  # the smallest fp16 subnormal
    scales[::2] = 60000.0
    mins = torch.full_like(base.mins, -3.0)
    extreme = Int4Weight(pack_int4(codes), scales, mins, (n, k), 128)
    kn = to_kn(extreme)
    kn = Int4WeightKN(kn.words.to(DEVICE), kn.scales.to(DEVICE), kn.mins.to(DEVICE), kn.shape, 128)
    x = torch.linspace(0.5, 1, k).reshape(1, k).to(DEVICE)  # one sign: no cancellation
    torch.testing.assert_close(w4a16_gemv(x, kn), w4a16_matmul_ref(x, kn), rtol=1e-6, atol=1e-3)


@pytest.mark.parametrize(("m", "k", "group_size"), [(9, 256, 64), (40, 512, 128), (17, 576, 32)])
def test_larger_batches_dequantize_then_matmul(m: int, k: int, group_size: int) -> None:
    # K = 576 (SmolLM2): 72 word rows, the last step partly past K.
    weight = kn_weight(72, k, group_size, seed=m)
    x = torch.randn(m, k).to(DEVICE)
    y = w4a16_kn_matmul(x, weight)
    assert y.shape == (m, 72)
    assert relative_error(y, w4a16_matmul_ref(x, weight)) <= 1e-5
    x16 = x.to(torch.bfloat16)
    assert (
        relative_error(w4a16_kn_matmul(x16, weight), w4a16_matmul_ref(x16.float(), weight)) <= 8e-3
    )


@pytest.mark.parametrize(("n", "k", "group_size"), [(36, 576, 32), (64, 256, 128)])
def test_dequantize_kernel_is_exact(n: int, k: int, group_size: int) -> None:
    weight = kn_weight(n, k, group_size, seed=n + k)
    dense = dequantize_ref(weight)  # [N, K] fp32
    assert torch.equal(dequantize_kn(weight, torch.float32), dense.T)
    assert torch.equal(dequantize_kn(weight, torch.bfloat16), dense.T.to(torch.bfloat16))


def test_matmul_sends_decode_batches_to_the_gemv() -> None:
    weight = kn_weight(48, 256, 32, seed=3)
    x = torch.randn(2, 3, 256).to(DEVICE, torch.bfloat16)  # M = 6
    y = w4a16_kn_matmul(x, weight)
    assert y.shape == (2, 3, 48)
    assert torch.equal(y, w4a16_gemv(x.reshape(6, 256), weight).reshape(2, 3, 48))
    assert w4a16_kn_matmul(torch.empty(0, 256, device=DEVICE), weight).shape == (0, 48)


def test_int4_linear_relays_out_without_loss() -> None:
    gen = torch.Generator().manual_seed(4)
    linear = Int4Linear(quantize_int4(torch.randn(64, 128, generator=gen), 32))
    x = torch.randn(3, 128, generator=gen)
    before = linear(x)
    dense, size = dequantize_int4(linear.weight_int4), model_bytes(linear)
    linear.use_kn_layout()
    assert linear.is_kn and linear.packed.dtype == torch.int32
    assert torch.equal(dequantize_int4(linear.weight_int4), dense)
    assert model_bytes(linear) == size
    assert torch.equal(linear(x), before)  # the CPU path reads the re-laid weight


def test_bad_input_is_refused() -> None:
    weight = kn_weight(64, 128, 32, seed=5)
    with pytest.raises(ValueError, match=r"1\.\.8 rows, got 9"):
        w4a16_gemv(torch.randn(9, 128, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"1\.\.8 rows, got 0"):
        w4a16_gemv(torch.randn(0, 128, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"x must be \[M, 128\], got \(2, 64\)"):
        w4a16_gemv(torch.randn(2, 64, device=DEVICE), weight)
    with pytest.raises(ValueError, match="x has 64 features, weight expects 128"):
        w4a16_kn_matmul(torch.randn(2, 64, device=DEVICE), weight)
    with pytest.raises(TypeError, match=r"torch\.int32"):
        w4a16_gemv(torch.ones(2, 128, dtype=torch.int32, device=DEVICE), weight)
    with pytest.raises(ValueError, match="UNROLL 3 must divide 4"):
        w4a16_gemv(torch.randn(1, 128, device=DEVICE), weight, {"UNROLL": 3})
    odd = kn_weight(6, 128, 32, seed=6)
    with pytest.raises(ValueError, match="multiple of 4, got 6"):
        w4a16_gemv(torch.randn(1, 128, device=DEVICE), odd)


def test_config_for_decode_shapes() -> None:
    # 4096 out x 4096 in, group 128: row blocks of 512 rows (4 warps x 32 lanes x 4
    # rows), a whole group's 16 words per row in flight, K cut into 32 splits of one group.
    assert gemv_config(1, 4096, 4096, 128, num_sms=132) == {
        "BLOCK_M": 1,
        "BLOCK_N": 512,
        "UNROLL": 16,
        "GROUPS_PER_SPLIT": 1,
        "num_warps": 4,
    }
    # Past 4096 values of K: one warp per program (row blocks of 128); splits stay 128
    # values (one group of 128, four of 32).
    long_k = gemv_config(1, 4096, 14336, 128, num_sms=132)
    assert (long_k["BLOCK_N"], long_k["num_warps"], long_k["GROUPS_PER_SPLIT"]) == (128, 1, 1)
    assert gemv_config(1, 4096, 14336, 32, num_sms=132)["GROUPS_PER_SPLIT"] == 4
    # Eight rows of x keep 8 words per row in flight (the accumulators need the registers).
    assert gemv_config(8, 4096, 4096, 128, num_sms=132)["UNROLL"] == 8
    # A small N takes fewer warps; M = 3 pads to 4; group 32 unrolls its 4 words.
    small = gemv_config(3, 192, 576, 32, num_sms=132)
    assert (small["BLOCK_N"], small["num_warps"], small["BLOCK_M"], small["UNROLL"]) == (
        128,
        1,
        4,
        4,
    )
