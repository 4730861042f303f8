"""Already-quantized checkpoints: GPTQ, AWQ and compressed-tensors tensors written here by
each format's spec (a round-to-nearest quantizer, then the format's own packing) import
into Int4Weights whose dequantization is the spec's value bit for bit; what does not map
is refused with its reason.

The spec's value is s * (q - z) with s the stored scale, q and z integers: computed in
fp32 it is exact (at most 15 significant bits), so equality is the test.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_node.errors import ModelNotFoundError
from gpu_node.quant.checkpoint_formats import (
    AWQ_ORDER,
    QuantizedFormat,
    import_awq,
    import_compressed_tensors,
    import_gptq,
    quantized_format,
)
from gpu_node.quant.int4 import dequantize_int4

# The quantization_config each tool writes (GPTQModel / AutoGPTQ, AutoAWQ, llm-compressor).
GPTQ_CONFIG = {
    "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
    "lm_head": False, "true_sequential": True, "damp_percent": 0.01, "static_groups": False,
    "checkpoint_format": "gptq", "meta": {"quantizer": ["gptqmodel:2.2.0"]},
}  # fmt: skip
AWQ_CONFIG = {
    "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
    "modules_to_not_convert": None,
}  # fmt: skip
CT_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed", "global_compression_ratio": None, "ignore": ["lm_head"],
    "kv_cache_scheme": None, "sparsity_config": {},
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 128, "block_structure": None, "dynamic": False,
                    "actorder": None, "observer": "minmax", "observer_kwargs": {}},
    }},
}  # fmt: skip


def with_weights(config: dict, **weights) -> dict:
    """CT_CONFIG with its one scheme's weights args changed."""
    config = json.loads(json.dumps(config))
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


# --- the spec's quantizer and packings, written from each format's description ----------


def trim_significand(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x rounded to `bits` significant bits (then s * z is an fp16 value for every 4-bit z)."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 2**bits) / 2**bits, exponent)


def rtn(w: torch.Tensor, group: int, symmetric: bool, scale_dtype=torch.float16, scale_bits=None):
    """Round-to-nearest per group of `group` inputs (-1: the row) as the tools' min-max
    observers do: codes q in 0..15, scales s [N, Gc] in `scale_dtype` and zero points z
    [N, Gc] with w ~ s * (q - z). Symmetric: s = absmax / 7.5, z = 8; otherwise the range
    [min(w, 0), max(w, 0)] in 15 steps, z = round(-low / s)."""
    n, k = w.shape
    size = k if group == -1 else group
    x = w.float().reshape(n, k // size, size)
    if symmetric:
        scale = x.abs().amax(-1) / 7.5
    else:
        low, high = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
        scale = (high - low) / 15
    if scale_bits is not None:
        scale = trim_significand(scale, scale_bits)
    scale = scale.to(scale_dtype)
    if symmetric:
        zero = torch.full_like(scale, 8, dtype=torch.int64)
    else:
        zero = torch.round(-low / scale.float()).clamp(0, 15).long()
    codes = torch.round(x / scale.float().unsqueeze(-1)) + zero.unsqueeze(-1)
    return codes.clamp(0, 15).long().reshape(n, k), scale, zero


def spec_value(codes, scale, zero, group: int) -> torch.Tensor:
    """s * (q - z) for every weight, fp32 [N, K] (exact)."""
    n, k = codes.shape
    size = k if group == -1 else group
    q = codes.reshape(n, k // size, size)
    return (scale.float().unsqueeze(-1) * (q - zero.unsqueeze(-1)).float()).reshape(n, k)


def words(values: torch.Tensor) -> torch.Tensor:
    """Integers 0..15 [..., 8W] -> int32 [..., W]: value 8w + i in bits 4i..4i+3 of word w."""
    v = values.numpy().astype(np.uint32).reshape(*values.shape[:-1], -1, 8)
    packed = np.zeros(v.shape[:-1], dtype=np.uint32)
    for i in range(8):
        packed |= v[..., i] << np.uint32(4 * i)
    return torch.from_numpy(packed.view(np.int32))


def gptq_tensors(codes, scale, zero, group: int, v2: bool = False, g_idx=None) -> dict:
    """GPTQ: qweight [K/8, N] packed along the input, qzeros [Gc, N/8] (v1: z - 1, 4 bits),
    scales [Gc, N], g_idx [K]."""
    k = codes.shape[1]
    stored_zero = zero if v2 else (zero - 1) % 16
    if g_idx is None:
        g_idx = torch.zeros(k) if group == -1 else torch.arange(k) // group
    return {
        "qweight": words(codes).T.contiguous(),
        "qzeros": words(stored_zero.T.contiguous()),
        "scales": scale.T.contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def awq_tensors(codes, scale, zero) -> dict:
    """AWQ GEMM: qweight [K, N/8] packed along the output in AWQ_ORDER, qzeros [Gc, N/8]
    likewise, scales [Gc, N]."""

    def interleaved(rows_by_output):  # [R, N] -> int32 [R, N/8]
        r, n = rows_by_output.shape
        return words(rows_by_output.reshape(r, n // 8, 8)[..., list(AWQ_ORDER)].reshape(r, n))

    return {
        "qweight": interleaved(codes.T.contiguous()),
        "qzeros": interleaved(zero.T.contiguous()),
        "scales": scale.T.contiguous(),
    }


def ct_tensors(codes, scale, zero, symmetric: bool) -> dict:
    """compressed-tensors pack-quantized: weight_packed [N, K/8] of q + 8 (its signed codes
    offset, i.e. our unsigned q), weight_scale [N, Gc], weight_zero_point [N/8, Gc] of z + 8
    packed along the output (asymmetric only), weight_shape."""
    n, k = codes.shape
    tensors = {
        "weight_packed": words(codes),
        "weight_scale": scale,
        "weight_shape": torch.tensor([n, k]),
    }
    if not symmetric:
        tensors["weight_zero_point"] = words(zero.T.contiguous()).T.contiguous()
    return tensors


def _weight(n=64, k=256, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n).unsqueeze(1)
    return rows + 0.3 * torch.rand(n, 1, generator=gen)  # groups off-centre: zeros vary


def _assert_imports_exactly(weight, codes, scale, zero, group, expected_group):
    assert weight.group_size == expected_group
    assert torch.equal(dequantize_int4(weight), spec_value(codes, scale, zero, group))


# --- imports ------------------------------------------------------------------------------


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize(("group", "ours"), [(128, 128), (256, 128), (-1, 128), (32, 32)])
def test_gptq_symmetric_imports_exactly(v2, group, ours):
    codes, scale, zero = rtn(_weight(), group, symmetric=True)
    layout = "gptq_v2" if v2 else "gptq"
    fmt = quantized_format({**GPTQ_CONFIG, "group_size": group, "checkpoint_format": layout})
    assert fmt == QuantizedFormat("gptq", group, symmetric=True, zero_offset=0 if v2 else 1)
    weight = import_gptq("w", gptq_tensors(codes, scale, zero, group, v2=v2), fmt)
    _assert_imports_exactly(weight, codes, scale, zero, group, ours)
    assert torch.equal(weight.mins, (-8 * weight.scales.float()).half())


def test_gptq_v1_stores_each_zero_point_minus_one():
    """v1 zero points run 1..16: 16 is stored as 15, and 1 as 0."""
    codes, scale, _ = rtn(_weight(n=8, k=128), 128, symmetric=True)
    zero = torch.tensor([[16], [1], [2], [4], [8], [16], [1], [8]])
    tensors = gptq_tensors(codes, scale, zero, 128)
    assert (tensors["qzeros"] & 0xF).item() == 15
    weight = import_gptq("w", tensors, quantized_format(GPTQ_CONFIG))
    _assert_imports_exactly(weight, codes, scale, zero, 128, 128)


def test_gptq_asymmetric_imports_where_every_min_is_an_fp16_value():
    codes, scale, zero = rtn(_weight(), 128, symmetric=False, scale_bits=7)
    assert len(zero.unique()) > 4
    fmt = quantized_format({**GPTQ_CONFIG, "sym": False})
    weight = import_gptq("w", gptq_tensors(codes, scale, zero, 128), fmt)
    # v1 stores z - 1 in four bits, so what the tools meant as z = 0 reads back as 16
    assert bool((zero == 0).any())
    _assert_imports_exactly(weight, codes, scale, (zero - 1) % 16 + 1, 128, 128)


def test_gptq_desc_act_with_contiguous_groups_imports():
    codes, scale, zero = rtn(_weight(), 128, symmetric=True)
    fmt = quantized_format({**GPTQ_CONFIG, "desc_act": True})
    weight = import_gptq("w", gptq_tensors(codes, scale, zero, 128), fmt)
    _assert_imports_exactly(weight, codes, scale, zero, 128, 128)


def test_awq_imports_exactly_in_its_interleaved_order():
    codes, scale, zero = rtn(_weight(), 128, symmetric=False, scale_bits=7)
    tensors = awq_tensors(codes, scale, zero)
    # nibble 1 of word 0 of row 0 holds output 2, nibble 4 output 1
    assert (tensors["qweight"][0, 0] >> 4 & 0xF).item() == codes[2, 0].item()
    assert (tensors["qweight"][0, 0] >> 16 & 0xF).item() == codes[1, 0].item()
    weight = import_awq("w", tensors, quantized_format(AWQ_CONFIG))
    _assert_imports_exactly(weight, codes, scale, zero, 128, 128)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compressed_tensors_symmetric_imports_exactly(scale_dtype):
    codes, scale, zero = rtn(_weight(), 128, symmetric=True, scale_dtype=scale_dtype,
                             scale_bits=None if scale_dtype != torch.float32 else 11)  # fmt: skip
    fmt = quantized_format(CT_CONFIG)
    assert fmt == QuantizedFormat("compressed-tensors", 128, symmetric=True)
    weight = import_compressed_tensors("w", ct_tensors(codes, scale, zero, True), fmt)
    _assert_imports_exactly(weight, codes, scale, zero, 128, 128)


def test_compressed_tensors_asymmetric_imports_exactly():
    codes, scale, zero = rtn(_weight(), 128, False, scale_dtype=torch.bfloat16, scale_bits=7)
    fmt = quantized_format(with_weights(CT_CONFIG, symmetric=False))
    weight = import_compressed_tensors("w", ct_tensors(codes, scale, zero, False), fmt)
    _assert_imports_exactly(weight, codes, scale, zero, 128, 128)


# --- refusals -----------------------------------------------------------------------------


def _refused(quantization: dict) -> str:
    with pytest.raises(ModelNotFoundError) as info:
        quantized_format(quantization)
    return str(info.value)


CONFIG_REFUSALS = [
    ({**GPTQ_CONFIG, "bits": 8},
     "GPTQ checkpoint not imported: bits 8; only 4-bit weights map onto our INT4"),
    ({**GPTQ_CONFIG, "group_size": 16},
     "GPTQ checkpoint not imported: group_size 16; our INT4 groups are 32, 64, 128 inputs, so "
     "a checkpoint's group must be a multiple of 32 (or -1, one a row)"),
    ({**GPTQ_CONFIG, "checkpoint_format": "marlin"},
     "GPTQ checkpoint not imported: format 'marlin'; only 'gptq' and 'gptq_v2' are imported"),
    ({**AWQ_CONFIG, "version": "gemv"},
     "AWQ checkpoint not imported: version 'gemv' packs for its own kernel; only 'gemm' is "
     "imported"),
    ({**AWQ_CONFIG, "zero_point": False},
     "AWQ checkpoint not imported: zero_point false; only AWQ with zero points is imported"),
    (with_weights(CT_CONFIG, strategy="channel", group_size=None),
     "compressed-tensors checkpoint not imported: strategy 'channel'; only 'group' (scales "
     "per group) maps"),
    (with_weights(CT_CONFIG, type="float", num_bits=8),
     "compressed-tensors checkpoint not imported: weights of type 'float'; only 'int' maps"),
    (with_weights(CT_CONFIG, num_bits=8),
     "compressed-tensors checkpoint not imported: bits 8; only 4-bit weights map onto our INT4"),
    ({**CT_CONFIG, "format": "float-quantized"},
     "compressed-tensors checkpoint not imported: format 'float-quantized'; only "
     "'pack-quantized' is imported"),
    ({**CT_CONFIG, "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
     "compressed-tensors checkpoint not imported: kv_cache_scheme is set; only weight "
     "quantization is imported"),
    ({**CT_CONFIG, "config_groups": {"group_0": {
        **CT_CONFIG["config_groups"]["group_0"],
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token"}}}},
     "compressed-tensors checkpoint not imported: activations are quantized; only weight-only "
     "INT4 maps"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     "checkpoints quantized with 'bitsandbytes' are not imported (we import 4-bit 'gptq', "
     "'awq' and 'compressed-tensors'); serve the original (bf16/fp16) checkpoint with "
     "--weights int4 to quantize it on load"),
]  # fmt: skip


@pytest.mark.parametrize(("quantization", "message"), CONFIG_REFUSALS)
def test_configs_that_do_not_map_are_refused_naming_why(quantization, message):
    assert _refused(quantization) == message


def test_a_permuted_g_idx_is_refused():
    """desc_act quantizes inputs in a permuted order: g_idx then puts input k in group
    g_idx[k] with every group's inputs spread over the row."""
    codes, scale, zero = rtn(_weight(), 128, symmetric=True)
    order = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    g_idx = (torch.arange(256) // 128)[order]
    tensors = gptq_tensors(codes, scale, zero, 128, g_idx=g_idx)
    fmt = quantized_format({**GPTQ_CONFIG, "desc_act": True})
    with pytest.raises(ModelNotFoundError) as info:
        import_gptq("layers.0.mlp.down_proj", tensors, fmt)
    assert str(info.value) == (
        "layers.0.mlp.down_proj: g_idx scatters each group's inputs across the row (desc_act / "
        "act-order); our INT4 groups are runs of consecutive inputs, so these groups do not map"
    )


def test_zero_points_whose_min_is_not_an_fp16_value_are_refused():
    """Full 11-bit fp16 scales: -z * s needs up to 15 bits for most z, so only some groups
    map; the tensor is refused rather than rounded."""
    codes, scale, zero = rtn(_weight(), 128, symmetric=False)
    mins = -zero.float() * scale.float()
    inexact = int((mins.half().float() != mins).sum())
    assert 0 < inexact < mins.numel()
    with pytest.raises(ModelNotFoundError) as info:
        import_awq("w", awq_tensors(codes, scale, zero), quantized_format(AWQ_CONFIG))
    assert str(info.value) == (
        f"w: {inexact} of {mins.numel()} groups have a zero point z whose min -z * scale is not "
        f"an fp16 value; our INT4 stores fp16 mins, so they would only import approximately"
    )


def test_scales_that_are_not_fp16_values_are_refused():
    codes, scale, zero = rtn(_weight(), 128, symmetric=True, scale_dtype=torch.float32)
    tensors = ct_tensors(codes, scale, zero, True)
    message = re.escape("w: 128 of 128 group scales are not fp16 values; our INT4 stores fp16")
    with pytest.raises(ModelNotFoundError, match=message):
        import_compressed_tensors("w", tensors, quantized_format(CT_CONFIG))


def test_inputs_not_a_multiple_of_32_are_refused():
    codes, scale, zero = rtn(_weight(k=48), -1, symmetric=True)
    fmt = quantized_format({**GPTQ_CONFIG, "group_size": -1})
    with pytest.raises(ModelNotFoundError) as info:
        import_gptq("w", gptq_tensors(codes, scale, zero, -1), fmt)
    assert str(info.value) == "w: 48 inputs, not a multiple of 32 (our smallest group)"


def test_tensors_of_the_wrong_shape_are_refused():
    codes, scale, zero = rtn(_weight(), 128, symmetric=True)
    tensors = gptq_tensors(codes, scale, zero, 128)
    tensors["qzeros"] = tensors["qzeros"][:, :4]
    with pytest.raises(ModelNotFoundError) as info:
        import_gptq("w", tensors, quantized_format(GPTQ_CONFIG))
    assert str(info.value) == "w.qzeros: expected torch.int32 [2, 8], got torch.int32 [2, 4]"


# --- whole checkpoints, for the loader's tests (tests/gpu_node/models/test_hf_checkpoint.py) -

# Wide enough for groups of 128: every projection's input is 128 or 256.
WIDE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=32)

FORMATS = {
    "gptq": GPTQ_CONFIG,
    "gptq_v2_asym": {**GPTQ_CONFIG, "sym": False, "checkpoint_format": "gptq_v2"},
    "awq": AWQ_CONFIG,
    "ct_sym": CT_CONFIG,
    "ct_asym": with_weights(CT_CONFIG, symmetric=False),
}


def wide_hf_model(family: str, seed: int = 0):
    """hf_tiny's model of `family`, with widths that groups of 128 divide."""
    import transformers

    from tests.gpu_node.models import hf_tiny

    config_name, model_name, settings = hf_tiny.FAMILIES[family]
    wide = {**WIDE, "moe_intermediate_size": 128} if "moe_intermediate_size" in settings else WIDE
    config = getattr(transformers, config_name)(**{**hf_tiny._COMMON, **settings, **wide})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(noise * param.shape[-1] ** -0.5 + 0.01)
    return model


def quantize_by_spec(kind: str, weight: torch.Tensor):
    """(the format's tensors of one projection, the spec's value of its weight)."""
    quantization = FORMATS[kind]
    method = quantization["quant_method"]
    if method == "compressed-tensors":
        symmetric = quantization["config_groups"]["group_0"]["weights"]["symmetric"]
        codes, scale, zero = rtn(weight, 128, symmetric, torch.bfloat16, None if symmetric else 7)
        tensors = ct_tensors(codes, scale, zero, symmetric)
    elif method == "awq":
        codes, scale, zero = rtn(weight, 128, symmetric=False, scale_bits=7)
        tensors = awq_tensors(codes, scale, zero)
    else:
        symmetric = quantization["sym"]
        codes, scale, zero = rtn(weight, 128, symmetric, scale_bits=None if symmetric else 7)
        tensors = gptq_tensors(codes, scale, zero, 128, v2="v2" in kind)
    return tensors, spec_value(codes, scale, zero, 128)


def set_weight(hf, module: str, value: torch.Tensor) -> None:
    """Puts `value` in as the weight of the checkpoint's `module`; transformers holds an MoE
    layer's experts fused, as gate_up_proj [E, 2I, H] (gate rows, then up) and down_proj."""
    with torch.no_grad():
        expert = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj", module)
        if expert is None:
            hf.get_submodule(module).weight.copy_(value)
            return
        experts, e, part = hf.get_submodule(expert[1]), int(expert[2]), expert[3]
        if part == "down":
            experts.down_proj[e].copy_(value)
        else:
            inner = experts.gate_up_proj.shape[1] // 2
            rows = slice(0, inner) if part == "gate" else slice(inner, None)
            experts.gate_up_proj[e, rows].copy_(value)


def write_quantized_checkpoint(kind: str, family: str, directory: Path, lm_head: bool = False):
    """A tiny checkpoint of `family` whose projections (and output head with `lm_head`) are
    quantized by `kind`'s spec, and packed as that format packs them; returns (the spec's
    value of each, by our module name; the transformers model holding those values)."""
    from safetensors.torch import load_file, save_file

    from tests.gpu_node.models.hf_tiny import write_tokenizer

    hf = wide_hf_model(family)
    hf.save_pretrained(directory)
    write_tokenizer(directory)
    state = load_file(directory / "model.safetensors")
    tensors, values = {}, {}
    for name, tensor in state.items():
        if not (name.endswith("_proj.weight") or (lm_head and name == "lm_head.weight")):
            tensors[name] = tensor
            continue
        module = name.removesuffix(".weight")
        parts, value = quantize_by_spec(kind, tensor)
        tensors.update({f"{module}.{part}": t for part, t in parts.items()})
        values[module.removeprefix("model.")] = value
        set_weight(hf, module, value)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {**FORMATS[kind], **({"lm_head": True} if lm_head else {})}
    (directory / "config.json").write_text(json.dumps(config))
    return values, hf
