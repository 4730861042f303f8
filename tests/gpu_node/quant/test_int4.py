"""INT4 quantization, the GGUF Q4_1 import, Int4Linear and model byte accounting."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from gpu_node.errors import ModelNotFoundError
from gpu_node.models.model_store import resolve_model
from gpu_node.quant.int4 import (
    Int4Weight,
    dequantize_int4,
    int4_from_gguf_q4_1,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from gpu_node.quant.linear import Int4Linear, ModelBytes, model_bytes, quantize_model

EPS32 = float(torch.finfo(torch.float32).eps)


@pytest.fixture(scope="module")
def smollm2_reader() -> gguf.GGUFReader:
    try:
        path: Path = resolve_model("smollm2")
    except ModelNotFoundError as exc:
        pytest.skip(f"SmolLM2 weights not pulled: {exc}")
    return gguf.GGUFReader(path)


def _weights(seed: int) -> torch.Tensor:
    """[3, 48, 256]: Gaussian rows at very different scales, one constant group, one outlier."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 48, 256, generator=gen)
    w = w * torch.logspace(-3, 1, 48).view(1, 48, 1)
    w[0, 0, :128] = 0.75  # a constant group: scale 0
    w[1, 5, 17] = 40.0
    return w


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [False, True])
def test_round_trip_error_is_within_half_a_step(group_size: int, symmetric: bool) -> None:
    w = _weights(seed=group_size)
    q = quantize_int4(w, group_size, symmetric)
    assert q.packed.shape == (3, 48, 128) and q.packed.dtype == torch.uint8
    assert q.scales.shape == (3, 48, 256 // group_size) and q.scales.dtype == torch.float16
    err = (dequantize_int4(q) - w).abs().reshape(3, 48, -1, group_size)
    scale = q.scales.float().unsqueeze(-1)
    # Round to nearest: half a step, plus the fp32 rounding of scale * q + min.
    magnitude = q.mins.float().abs().unsqueeze(-1) + 15 * scale
    bound = scale / 2 + 4 * EPS32 * magnitude
    assert bool((err <= bound).all())
    # The bound is attained (the error is real rounding, not zero).
    assert float((err / scale.clamp_min(1e-30)).max()) > 0.45
    if symmetric:
        assert torch.equal(q.mins.float(), -8 * q.scales.float())


def test_exactly_representable_values_round_trip_exactly() -> None:
    codes = torch.arange(64).remainder(16).float()  # [64]
    w = (codes * 0.5 - 3.0).repeat(2, 1)  # scale 0.5, min -3: exact in fp16
    q = quantize_int4(w, 32)
    assert torch.equal(q.scales, torch.full((2, 2), 0.5, dtype=torch.float16))
    assert torch.equal(q.mins, torch.full((2, 2), -3.0, dtype=torch.float16))
    assert torch.equal(dequantize_int4(q), w)


def test_packing_layout_is_q4_1s() -> None:
    codes = torch.cat([torch.arange(16), torch.arange(15, -1, -1)]).to(torch.uint8)  # one chunk
    packed = pack_int4(codes.view(1, 32))
    expected = [i | ((15 - i) << 4) for i in range(16)]
    assert packed.view(-1).tolist() == expected
    assert torch.equal(unpack_int4(packed), codes.view(1, 32))


def test_constant_group_has_zero_scale_and_no_error() -> None:
    w = torch.full((1, 32), -1.25)
    q = quantize_int4(w, 32)
    assert q.scales.tolist() == [[0.0]] and q.mins.tolist() == [[-1.25]]
    assert torch.equal(dequantize_int4(q), w)


@pytest.mark.parametrize(
    ("shape", "group_size", "error"),
    [((4, 64), 48, ValueError), ((4, 96), 64, ValueError), ((0,), 32, ValueError)],
)
def test_bad_shapes_are_refused(shape: tuple[int, ...], group_size: int, error: type) -> None:
    with pytest.raises(error):
        quantize_int4(torch.ones(shape), group_size)


def test_non_finite_and_integer_weights_are_refused() -> None:
    w = torch.ones(2, 32)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="nan"):
        quantize_int4(w, 32)
    with pytest.raises(TypeError):
        quantize_int4(torch.ones(2, 32, dtype=torch.int32), 32)


def test_q4_1_import_is_bit_exact_on_smollm2(smollm2_reader: gguf.GGUFReader) -> None:
    names = {
        f"blk.{b}.{p}.weight" for b in (0, 29) for p in ("attn_q", "attn_k", "ffn_down", "ffn_up")
    }
    tensors = [t for t in smollm2_reader.tensors if t.name in names]
    assert len(tensors) == 8
    for t in tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        q = int4_from_gguf_q4_1(t.data, shape)
        # No float weights: the import holds exactly the file's bytes.
        assert q.nbytes == t.data.nbytes and q.packed.dtype == torch.uint8
        ours = dequantize_int4(q).numpy()
        theirs = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        assert ours.dtype == theirs.dtype == np.float32
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), t.name


def test_q4_1_import_of_gguf_quantized_experts_is_bit_exact() -> None:
    gen = np.random.default_rng(3)
    w = gen.standard_normal((4, 8, 64), dtype=np.float32)  # [E, N, K]
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    q = int4_from_gguf_q4_1(blocks, (4, 8, 64))
    theirs = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1).reshape(4, 8, 64)
    assert np.array_equal(dequantize_int4(q).numpy(), theirs)


def test_q4_1_import_refuses_wrong_sizes() -> None:
    with pytest.raises(ValueError, match="needs 40"):
        int4_from_gguf_q4_1(np.zeros((1, 20), dtype=np.uint8), (1, 64))
    with pytest.raises(TypeError):
        int4_from_gguf_q4_1(np.zeros((1, 20), dtype=np.float32), (1, 32))


def test_int4_linear_equals_dequantized_linear() -> None:
    gen = torch.Generator().manual_seed(7)
    linear = nn.Linear(128, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 128, generator=gen))
        linear.bias.copy_(torch.randn(48, generator=gen))
    q = Int4Linear.from_linear(linear, group_size=64)
    x = torch.randn(2, 3, 128, generator=gen)
    expected = x @ dequantize_int4(q.weight_int4).T + linear.bias
    assert q(x).shape == (2, 3, 48)
    torch.testing.assert_close(q.forward_ref(x), expected, rtol=1e-5, atol=1e-5)
    # torch's CPU int4 kernel rounds activations, scales and zeros to bf16 (2**-9 relative
    # each): every product is off by < 2**-7 of itself, so |error| < 2**-7 * sum |x w|.
    dense = dequantize_int4(q.weight_int4)
    zero_term = (q.mins.float() + 8 * q.scales.float()).abs().repeat_interleave(64, dim=1)
    bound = 2**-7 * (x.abs() @ (dense.abs() + zero_term).T)
    assert ((q(x) - expected).abs() <= bound).all()


class _TinyDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(100, 64)
        self.norm = nn.LayerNorm(64, elementwise_affine=False)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {"q_proj": nn.Linear(64, 64, bias=False), "odd": nn.Linear(96, 64, bias=False)}
            )
            for _ in range(2)
        )
        self.lm_head = nn.Linear(64, 100, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied


def test_quantize_model_swaps_linears_and_counts_bytes() -> None:
    model = _TinyDecoder()
    before = model_bytes(model)
    # Tied head counted once: embedding 100*64 + 2 * (64*64 + 96*64) linears, fp32.
    assert before == ModelBytes(
        packed=0, scales=0, mins=0, unquantized=4 * (6400 + 2 * (4096 + 6144))
    )
    quantize_model(model, group_size=32)
    assert isinstance(model.layers[0]["q_proj"], Int4Linear)
    assert isinstance(model.layers[1]["odd"], Int4Linear)
    assert isinstance(model.lm_head, nn.Linear)  # skipped by default
    after = model_bytes(model)
    int4_values = 2 * (4096 + 6144)
    assert after == ModelBytes(
        packed=int4_values // 2,
        scales=2 * int4_values // 32,
        mins=2 * int4_values // 32,
        unquantized=4 * 6400,
    )


def test_quantize_model_leaves_linears_that_do_not_fit_the_group() -> None:
    model = _TinyDecoder()
    quantize_model(model, group_size=64)
    assert isinstance(model.layers[0]["q_proj"], Int4Linear)
    assert isinstance(model.layers[0]["odd"], nn.Linear)  # in_features 96 % 64 != 0


def test_int4_weight_moves_between_devices_intact() -> None:
    q = quantize_int4(torch.randn(4, 64), 32)
    moved = q.to("cpu")
    assert isinstance(moved, Int4Weight) and torch.equal(moved.packed, q.packed)


def test_casting_a_model_moves_int4_buffers_without_rounding_them() -> None:
    gen = torch.Generator().manual_seed(21)
    linear = Int4Linear(quantize_int4(torch.randn(24, 64, generator=gen), 32))
    model = torch.nn.Sequential(linear, torch.nn.LayerNorm(24))
    scales, mins = linear.scales.clone(), linear.mins.clone()
    model.to(torch.bfloat16)
    assert model[1].weight.dtype == torch.bfloat16  # the float parts are cast
    assert linear.scales.dtype == torch.float16 and torch.equal(linear.scales, scales)
    assert linear.mins.dtype == torch.float16 and torch.equal(linear.mins, mins)
    model.float()
    assert torch.equal(linear.scales, scales)
