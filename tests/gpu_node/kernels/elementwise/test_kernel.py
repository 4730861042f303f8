"""The one-launch RMSNorm, RoPE and silu-and-multiply kernels against the model's own torch
code (the CPU path), under the Triton interpreter; on a GPU the same tests run compiled."""

import os

import pytest
import torch
import torch.nn.functional as F

import gpu_node.kernels.elementwise.kernel as elementwise
from gpu_node.models.llama import RMSNorm, RotaryEmbedding

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def max_ulps(dtype: torch.dtype, roundings: int = 1) -> int:
    """What a result may differ by: fp32 sums in another order and another exp or sqrt
    move a few fp32 steps; a bf16 result is within one step of the reference's rounding,
    except that the interpreter truncates fp32 to bf16 (a step for each rounding)."""
    if dtype == torch.float32:
        return 8
    return roundings if DEVICE == "cpu" else 1


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of b's dtype's rounding step at b's magnitude."""
    step = torch.finfo(b.dtype).eps * b.float().abs().clamp_min(torch.finfo(b.dtype).tiny)
    return ((a.float() - b.float()).abs() / step).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "dim"), [(1, 576), (5, 2048), (3, 100), (0, 64)])
def test_rms_norm_equals_the_modules_torch_code(dtype, tokens, dim):
    g = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=g) + 0.5)
    norm = norm.to(DEVICE, dtype)
    x = (torch.randn(tokens, dim, generator=g) * 3).to(DEVICE, dtype)
    got = elementwise.rms_norm(x, norm.weight, norm.eps)
    want = norm(x)  # the module's torch code on CPU; on a GPU, the kernel again
    assert got.dtype == dtype and got.shape == (tokens, dim)
    if tokens:
        x32 = x.float()
        exact = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.float()
        assert ulps(got, exact.to(dtype)) <= max_ulps(dtype)
        assert ulps(got, want) <= max_ulps(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "dim"), [(1, 576), (4, 2048), (2, 100)])
def test_rms_norm_of_a_sum_returns_the_sum_as_torchs_add_leaves_it(dtype, tokens, dim):
    g = torch.Generator().manual_seed(dim + 1)
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=g) + 0.5)
    norm = norm.to(DEVICE, dtype)
    x = (torch.randn(tokens, dim, generator=g) * 3).to(DEVICE, dtype)
    residual = torch.randn(tokens, dim, generator=g).to(DEVICE, dtype)
    got, summed = elementwise.add_rms_norm(x, residual, norm.weight, norm.eps)
    want_sum = x + residual
    if dtype == torch.float32 or DEVICE == "cuda":
        assert torch.equal(summed, want_sum)
    else:  # the interpreter truncates the bf16 sum
        assert ulps(summed, want_sum) <= 1
    s32 = summed.float()
    exact = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.float()
    assert ulps(got, exact.to(dtype)) <= max_ulps(dtype)
    normed, total = norm.add_norm(x, residual)  # the module: torch on CPU, this kernel on a GPU
    assert ulps(normed, exact.to(dtype)) <= max_ulps(dtype, roundings=2)
    assert ulps(total, want_sum) <= max_ulps(dtype)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """The rotation in fp32, written out: what the kernel and the module must give."""
    x32 = x.float()
    if interleaved:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    x1, x2 = x32.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def assert_rotated(got: torch.Tensor, x: torch.Tensor, want: torch.Tensor) -> None:
    """Within one step of the dtype of the exact value, plus what fp32 products fused into
    one rounding (the GPU's FMA) move where the two terms cancel."""
    assert got.shape == x.shape and got.dtype == x.dtype and got.is_contiguous()
    atol = 4 * torch.finfo(torch.float32).eps * x.float().abs().amax().item()
    torch.testing.assert_close(got.float(), want, rtol=torch.finfo(x.dtype).eps, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim"), [(1, 9, 64), (4, 3, 64), (2, 5, 32), (3, 6, 80)]
)  # 80: 40 pairs, no power of two
def test_rope_equals_the_rotation_written_out(dtype, interleaved, tokens, heads, head_dim):
    g = torch.Generator().manual_seed(heads)
    rope = RotaryEmbedding(head_dim, 10000.0, interleaved).to(DEVICE)
    positions = torch.tensor([0, 7, 300, 4095][:tokens], device=DEVICE)
    x = torch.randn(tokens, heads * head_dim, generator=g).to(DEVICE, dtype)
    x = x.view(tokens, heads, head_dim)
    cos, sin = rope.angles(positions)
    want = rotated(x, cos, sin, interleaved)
    assert_rotated(elementwise.rope(x, cos, sin, interleaved), x, want)
    assert_rotated(rope(x, positions), x, want)  # the module: torch on CPU, the kernel on a GPU


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_queries_and_keys_of_one_fused_product_rotate_in_one_launch(interleaved, head_dim):
    """q and k as the model has them after fuse_projections: views of one [T, (H + 2K) E]
    product, rows strided by its width."""
    g = torch.Generator().manual_seed(5)
    rope = RotaryEmbedding(head_dim, 10000.0, interleaved).to(DEVICE)
    positions = torch.tensor([3, 90, 1000], device=DEVICE)
    e = head_dim
    qkv = torch.randn(3, (9 + 2 * 3) * e, generator=g).to(DEVICE, torch.bfloat16)
    q, k, _ = qkv.split((9 * e, 3 * e, 3 * e), dim=-1)
    q, k = q.view(3, 9, e), k.view(3, 3, e)
    assert q.stride(0) == 15 * e and not q.is_contiguous()
    cos, sin = rope.angles(positions)
    q_out, k_out = elementwise.rope_qk(q, k, cos, sin, interleaved)
    assert torch.equal(q_out, elementwise.rope(q, cos, sin, interleaved))
    assert torch.equal(k_out, elementwise.rope(k, cos, sin, interleaved))
    for got, x in ((q_out, q), (k_out, k)):
        assert_rotated(got, x, rotated(x, cos, sin, interleaved))
    for got, x in zip(rope.pair(q, k, positions), (q, k), strict=True):  # the module
        assert_rotated(got, x, rotated(x, cos, sin, interleaved))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "features"), [(1, 1536), (3, 1408), (2, 5000)])
def test_silu_mul_equals_torchs_two_operations(dtype, tokens, features):
    g = torch.Generator().manual_seed(features)
    both = (torch.randn(tokens, 2 * features, generator=g) * 4).to(DEVICE, dtype)
    gate, up = both[:, :features], both[:, features:]  # views with a row stride of 2F
    got = elementwise.silu_mul(gate, up)
    want = F.silu(gate) * up
    assert got.shape == (tokens, features) and got.dtype == dtype
    assert ulps(got, want) <= max_ulps(dtype, roundings=2)


def test_bad_shapes_are_refused_with_what_was_given():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"got \(2, 8\) and \(4,\)"):
        elementwise.rms_norm(x, torch.ones(4, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match=r"got \(1, 2, 24\), \(1, 1, 11\), \(1, 1, 11\)"):
        z = torch.zeros(1, 2, 24, device=DEVICE)
        elementwise.rope(
            z, torch.ones(1, 1, 11, device=DEVICE), torch.ones(1, 1, 11, device=DEVICE), True
        )
    with pytest.raises(ValueError, match="residual must be x's shape and dtype"):
        elementwise.add_rms_norm(x, torch.zeros(2, 8, device=DEVICE, dtype=torch.float64),
                                 torch.ones(8, device=DEVICE), 1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="gate and up"):
        elementwise.silu_mul(x, torch.zeros(2, 9, device=DEVICE))
