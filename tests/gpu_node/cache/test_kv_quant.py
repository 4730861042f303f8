"""FP8 KV quantization arithmetic and capacity accounting (pure torch, exact values)."""

import pytest
import torch

from gpu_node.cache.kv_quant import (
    FP8_DTYPE,
    bytes_per_token,
    dequantize_fp8,
    kv_torch_dtype,
    pages_for_budget,
    quantize_fp8,
    row_scale,
    scale_shape,
    tokens_for_budget,
    validate_kv_layer,
)

# SmolLM2-135M: 30 layers, 3 kv heads of dim 64.
SMOLLM2 = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}


def test_bytes_per_token_counts_scales():
    assert bytes_per_token("fp8", 3, 64, 16) == 2 * 3 * (64 + 2)  # 396: one bf16 scale a row
    assert bytes_per_token("bf16", 3, 64, 16) == 2 * 3 * 64 * 2  # 768
    assert bytes_per_token("fp16", 3, 64, 32) == 768
    assert bytes_per_token("fp32", 3, 64, 16) == 1536
    # The per-token layout has no per-page bytes: page size does not change the figure.
    assert bytes_per_token("fp8", 3, 64, 64) == 396


def test_fp8_admits_at_least_1_9x_the_tokens_of_bf16_at_one_budget():
    budget = 1 << 30  # 1 GiB of KV
    bf16 = tokens_for_budget(budget, "bf16", page_size=16, **SMOLLM2)
    fp8 = tokens_for_budget(budget, "fp8", page_size=16, **SMOLLM2)
    # bf16: 2**30 // (16 * 768 * 30) = 2912 pages; fp8: 2**30 // (16 * 396 * 30) = 5648 pages.
    assert bf16 == 2912 * 16 == 46592
    assert fp8 == 5648 * 16 == 90368
    assert pages_for_budget(budget, "fp8", page_size=16, **SMOLLM2) == 5648
    assert fp8 / bf16 >= 1.9  # 1.9396


def test_budget_smaller_than_one_page_gives_zero_tokens():
    assert tokens_for_budget(16 * 396 * 30 - 1, "fp8", page_size=16, **SMOLLM2) == 0
    assert tokens_for_budget(16 * 396 * 30, "fp8", page_size=16, **SMOLLM2) == 16


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: kv_torch_dtype("int8"), "kv_dtype must be one of"),
        (lambda: bytes_per_token("fp8", 0, 64, 16), "num_kv_heads must be positive"),
        (lambda: tokens_for_budget(-1, "fp8", 30, 3, 64, 16), "budget_bytes must be >= 0"),
        (lambda: tokens_for_budget(10, "fp8", 0, 3, 64, 16), "num_layers must be positive"),
    ],
)
def test_bad_arguments_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_row_scale_maps_the_row_max_onto_448():
    amax = torch.tensor([448.0, 896.0, 1.0, 0.0, 1e-40, 3.0])
    scale = row_scale(amax)
    assert scale.dtype == torch.bfloat16
    # 1 / 448 and 3 / 448 round to bf16; zero and denormal rows get the floor 2**-126.
    expected = [1.0, 2.0, 0.002227783203125, 2.0**-126, 2.0**-126, 0.006683349609375]
    assert scale.float().tolist() == expected


def test_quantize_round_trips_representable_values_exactly():
    # Every finite e4m3 value times a bf16 scale; each row's max is 448 * scale.
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    values = values[values.isfinite()].view(-1, 2)
    values[:, 0] = 448.0  # pin each row's max so its scale is exactly the one below
    row_scales = torch.tensor([2.0**-5, 0.75, 3.0]).repeat(values.shape[0] // 3 + 1)
    row_scales = row_scales[: values.shape[0]]
    x = values * row_scales[:, None]
    q, scale = quantize_fp8(x)
    assert torch.equal(scale.float(), row_scales)
    assert torch.equal(dequantize_fp8(q, scale, torch.float32), x)


def test_quantize_error_is_within_half_an_fp8_step():
    torch.manual_seed(0)
    x = torch.randn(64, 3, 64) * torch.logspace(-3, 3, 64).view(64, 1, 1)  # rows of every size
    q, scale = quantize_fp8(x)
    assert q.shape == (64, 3, 64) and scale.shape == (64, 3)
    restored = dequantize_fp8(q, scale, torch.float32)
    s = scale.float().unsqueeze(-1)
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 for normals; below 2**-6 * scale
    # (subnormals) the step is 2**-9 * scale, so the absolute error is <= 2**-10 * scale.
    bound = torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10)
    assert bool(((restored - x).abs() <= bound).all())
    # Each row's max comes back within bf16 rounding of the scale (2**-8), not a whole
    # fp8 step: the loud elements keep full precision.
    row_max = x.abs().amax(-1)
    restored_max = restored.abs().amax(-1)
    assert bool(((restored_max - row_max).abs() <= row_max * 2.0**-8).all())


def test_validate_kv_layer_names_the_problem():
    cache = torch.zeros(4, 16, 3, 64, dtype=FP8_DTYPE)
    scale = torch.zeros(scale_shape(4, 16, 3), dtype=torch.bfloat16)
    assert validate_kv_layer(cache, cache.clone(), scale, scale.clone()) == (4, 16, 3, 64)
    with pytest.raises(ValueError, match="an fp8 cache needs k_scale"):
        validate_kv_layer(cache, cache.clone(), None, scale)
    with pytest.raises(ValueError, match=r"v_scale must be torch\.bfloat16"):
        validate_kv_layer(cache, cache.clone(), scale, scale.float())
    bf16 = torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scales are for fp8 caches only"):
        validate_kv_layer(bf16, bf16.clone(), scale, scale)
    with pytest.raises(ValueError, match="must match"):
        validate_kv_layer(bf16, cache, None, None)
