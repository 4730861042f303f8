"""Checkpoints that arrive already quantized (config.json's `quantization_config`).

We import a format only where its arithmetic maps exactly onto our INT4 (int4.py: codes
0..15, an fp16 scale and an fp16 min per group of 32, 64 or 128 consecutive inputs,
w = scale * q + min in fp32); anything else is refused with a message, never approximated.

Each format stores 4-bit codes q, a scale s and an integer zero point z per group, and
means w = s * (q - z). That is ours with min = -z * s, provided that:

- s is an fp16 value. GPTQ and AWQ store fp16 scales; compressed-tensors stores them in
  the model's dtype, and a bf16 scale is an fp16 value whenever it lies between 2^-17 and
  65504 (checked, tensor by tensor).
- -z * s is an fp16 value. In fp32 the product is exact (11 by 5 significant bits); it
  survives fp16 when z's odd part and s's significand fit 11 bits together. Symmetric
  checkpoints have z = 8 everywhere, exact for every s (a power-of-two multiple); for other
  zero points it holds only for some groups, so every group is checked and a tensor with
  one that does not map is refused (our mins are fp16, and the kernels read them so).
  Tools' scales use all their bits, so asymmetric checkpoints (AWQ's always) mostly do
  not map; symmetric ones (GPTQ's default, compressed-tensors' W4A16 recipe) always do.
- Each of our groups lies inside one of the checkpoint's: its group size (or, for one
  group a row, the row) is a multiple of 32, and its `g_idx`, where stored, keeps
  consecutive inputs together. desc_act / act-order checkpoints scatter a group's inputs
  across the row, and those do not map.

Then scale * q + min equals s * (q - z) exactly in fp32 (both products are exact, and so
is their sum), so dequantize_int4 of an import is bit for bit the format's own value.

Layouts (N out features, K in features, Gc the checkpoint's groups, nibble i = bits 4i..4i+3):

    GPTQ (quant_method gptq, bits 4; format gptq = v1 or gptq_v2)
        qweight  int32 [K/8, N]     nibble i of [r, n]: q of input 8r + i, output n
        qzeros   int32 [Gc, N/8]    nibble i of [g, c]: zero of output 8c + i; v1 stores z - 1
        scales   fp16  [Gc, N]      (any float dtype is taken when its values are fp16's)
        g_idx    int32 [K]          the group of each input (optional)
    AWQ (quant_method awq, bits 4, zero_point, version gemm)
        qweight  int32 [K, N/8]     nibble i of [k, c]: q of output 8c + AWQ_ORDER[i]
        qzeros   int32 [Gc, N/8]    the same order
        scales   fp16  [Gc, N]
    compressed-tensors (format pack-quantized, int, 4 bits, strategy group, weights only)
        weight_packed      int32 [N, K/8]     nibble i of [n, w]: q + 8 of input 8w + i
        weight_scale       float [N, Gc]
        weight_zero_point  int32 [N/8, Gc]    nibble i of [r, g]: z + 8 of output 8r + i
                                              (asymmetric only; symmetric means z = 0)
        weight_shape       int   [2]          (N, K)
        weight_g_idx       int32 [K]          (act-order "group" only)

compressed-tensors' signed codes and zero points are both offset by 8, so its stored
nibbles are q and z of the unsigned form directly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from gpu_node.errors import ModelNotFoundError
from gpu_node.quant.int4 import GROUP_SIZES, Int4Weight, pack_int4

Method = Literal["gptq", "awq", "compressed-tensors"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output 8c + AWQ_ORDER[i] sits in nibble i of word c
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # format -> what each stored zero point lacks
SYMMETRIC_ZERO = 8

# Each method's tensors of one module: the first is the one that marks a module quantized,
# then the others it needs, then the optional ones.
_PARTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx", "bias")),
    "awq": (("qweight", "qzeros", "scales"), ("bias",)),
    "compressed-tensors": (
        ("weight_packed", "weight_scale"),
        ("weight_zero_point", "weight_shape", "weight_g_idx", "bias"),
    ),
}


@dataclass(frozen=True)
class QuantizedFormat:
    """What a checkpoint's quantization_config says, once we know it maps onto our INT4."""

    method: Method
    group_size: int  # along the input; -1: one group a row
    symmetric: bool
    zero_offset: int = 0  # added to each stored zero point (GPTQ v1 stores z - 1)


@dataclass(frozen=True)
class ImportedLinear:
    """One quantized projection of a checkpoint, in our INT4."""

    name: str  # the module's name in our model
    weight: Int4Weight
    bias: torch.Tensor | None


def quantized_format(quantization: Mapping[str, Any]) -> QuantizedFormat:
    """The checkpoint's format if it maps onto our INT4; ModelNotFoundError saying why not."""
    method = quantization.get("quant_method", "unknown")
    if method == "gptq":
        return _gptq_format(quantization)
    if method == "awq":
        return _awq_format(quantization)
    if method == "compressed-tensors":
        return _compressed_tensors_format(quantization)
    raise ModelNotFoundError(
        f"checkpoints quantized with {method!r} are not imported (we import 4-bit 'gptq', "
        f"'awq' and 'compressed-tensors'); serve the original (bf16/fp16) checkpoint with "
        f"--weights int4 to quantize it on load"
    )


def _refuse(method: str, why: str) -> ModelNotFoundError:
    return ModelNotFoundError(f"{method} checkpoint not imported: {why}")


def _check_bits_and_group(method: str, bits: Any, group_size: Any) -> int:
    if bits != 4:
        raise _refuse(method, f"bits {bits}; only 4-bit weights map onto our INT4")
    is_multiple = isinstance(group_size, int) and group_size > 0 and group_size % 32 == 0
    if group_size != -1 and not is_multiple:
        raise _refuse(
            method,
            f"group_size {group_size}; our INT4 groups are {', '.join(map(str, GROUP_SIZES))} "
            f"inputs, so a checkpoint's group must be a multiple of 32 (or -1, one a row)",
        )
    return int(group_size)


def _gptq_format(config: Mapping[str, Any]) -> QuantizedFormat:
    group_size = _check_bits_and_group("GPTQ", config.get("bits"), config.get("group_size", 128))
    layout = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
    if layout not in GPTQ_FORMATS:
        raise _refuse("GPTQ", f"format {layout!r}; only 'gptq' and 'gptq_v2' are imported")
    if config.get("dynamic"):
        raise _refuse("GPTQ", "per-module overrides ('dynamic') are not imported")
    return QuantizedFormat(
        method="gptq",
        group_size=group_size,
        symmetric=bool(config.get("sym", True)),
        zero_offset=GPTQ_FORMATS[layout],
    )


def _awq_format(config: Mapping[str, Any]) -> QuantizedFormat:
    bits = config.get("bits", config.get("w_bit"))
    group_size = _check_bits_and_group(
        "AWQ", bits, config.get("group_size", config.get("q_group_size", 128))
    )
    version = str(config.get("version") or config.get("format") or "gemm").lower()
    if version != "gemm":
        raise _refuse(
            "AWQ", f"version {version!r} packs for its own kernel; only 'gemm' is imported"
        )
    if not config.get("zero_point", True):
        raise _refuse("AWQ", "zero_point false; only AWQ with zero points is imported")
    return QuantizedFormat(method="awq", group_size=group_size, symmetric=False)


def _compressed_tensors_format(config: Mapping[str, Any]) -> QuantizedFormat:
    method = "compressed-tensors"
    if config.get("format") != "pack-quantized":
        raise _refuse(method, f"format {config.get('format')!r}; only 'pack-quantized' is imported")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if config.get(key):
            raise _refuse(method, f"{key} is set; only weight quantization is imported")
    schemes = list((config.get("config_groups") or {}).values())
    weights = [scheme.get("weights") or {} for scheme in schemes]
    if not schemes or any(w != weights[0] for w in weights):
        raise _refuse(method, "it needs exactly one weights scheme across config_groups")
    for scheme in schemes:
        if scheme.get("input_activations") or scheme.get("output_activations"):
            raise _refuse(method, "activations are quantized; only weight-only INT4 maps")
        if scheme.get("format", "pack-quantized") != "pack-quantized":
            raise _refuse(method, f"group format {scheme['format']!r}; only 'pack-quantized'")
    args = weights[0]
    if args.get("type") != "int":
        raise _refuse(method, f"weights of type {args.get('type')!r}; only 'int' maps")
    if args.get("strategy") != "group":
        raise _refuse(
            method, f"strategy {args.get('strategy')!r}; only 'group' (scales per group) maps"
        )
    group_size = _check_bits_and_group(method, args.get("num_bits"), args.get("group_size"))
    if args.get("dynamic"):
        raise _refuse(method, "dynamic weight scales are not imported")
    return QuantizedFormat(
        method="compressed-tensors", group_size=group_size, symmetric=bool(args.get("symmetric"))
    )


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., 8W]: nibble i of word w at 8w + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8).flatten(-2)


def _awq_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, N/8] in AWQ's interleaved order -> uint8 [R, N] in output order."""
    rows = words.shape[0]
    inverse = torch.argsort(torch.tensor(AWQ_ORDER, device=words.device))
    return _nibbles(words).reshape(rows, -1, 8)[..., inverse].reshape(rows, -1)


def _contiguous_groups(k: int, group_size: int, device: torch.device) -> torch.Tensor:
    """The checkpoint group of each input when no g_idx says otherwise: int64 [K]."""
    inputs = torch.arange(k, device=device)
    return torch.zeros_like(inputs) if group_size == -1 else inputs // group_size


def _expect(
    name: str, part: str, tensor: torch.Tensor, dtype: torch.dtype | None, shape: tuple[int, ...]
) -> None:
    """Refuses `tensor` unless it is `dtype` (None: any float; _int4_weight checks the values)
    and `shape`."""
    is_dtype = tensor.is_floating_point() if dtype is None else tensor.dtype == dtype
    if not is_dtype or tuple(tensor.shape) != shape:
        raise ModelNotFoundError(
            f"{name}.{part}: expected {dtype or 'float'} {list(shape)}, got {tensor.dtype} "
            f"{list(tensor.shape)}"
        )


def import_gptq(name: str, parts: Mapping[str, torch.Tensor], fmt: QuantizedFormat) -> Int4Weight:
    """One GPTQ projection (qweight, qzeros, scales, optional g_idx) as our Int4Weight."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    num_groups = scales.shape[0]
    _expect(name, "qweight", qweight, torch.int32, (k // 8, n))
    _expect(name, "qzeros", qzeros, torch.int32, (num_groups, -(-n // 8)))
    _expect(name, "scales", scales, None, (num_groups, n))
    codes = _nibbles(qweight.T.contiguous())  # [N, K]
    zeros = _nibbles(qzeros)[:, :n].T.to(torch.int32) + fmt.zero_offset  # [N, Gc]
    groups = parts.get("g_idx")
    if groups is None:
        groups = _contiguous_groups(k, fmt.group_size, qweight.device)
    return _int4_weight(name, codes, scales.T, zeros, groups)


def import_awq(name: str, parts: Mapping[str, torch.Tensor], fmt: QuantizedFormat) -> Int4Weight:
    """One AWQ GEMM projection (qweight, qzeros, scales) as our Int4Weight."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    num_groups = scales.shape[0]
    _expect(name, "qweight", qweight, torch.int32, (k, n // 8))
    _expect(name, "qzeros", qzeros, torch.int32, (num_groups, n // 8))
    _expect(name, "scales", scales, None, (num_groups, n))
    codes = _awq_nibbles(qweight).T  # [N, K]
    zeros = _awq_nibbles(qzeros).T.to(torch.int32)  # [N, Gc]
    groups = _contiguous_groups(k, fmt.group_size, qweight.device)
    return _int4_weight(name, codes, scales.T, zeros, groups)


def import_compressed_tensors(
    name: str, parts: Mapping[str, torch.Tensor], fmt: QuantizedFormat
) -> Int4Weight:
    """One compressed-tensors pack-quantized projection as our Int4Weight."""
    packed, scales = parts["weight_packed"], parts["weight_scale"]
    shape = parts.get("weight_shape")
    n, k = packed.shape[0], packed.shape[1] * 8
    if shape is not None:
        n, k = (int(d) for d in shape.tolist())
    num_groups = scales.shape[-1]
    _expect(name, "weight_packed", packed, torch.int32, (n, -(-k // 8)))
    _expect(name, "weight_scale", scales, None, (n, num_groups))
    codes = _nibbles(packed)[:, :k]  # [N, K]
    zero_point = parts.get("weight_zero_point")
    if zero_point is None:
        zeros = torch.full((n, num_groups), SYMMETRIC_ZERO, dtype=torch.int32, device=packed.device)
    elif zero_point.dtype == torch.int8:  # unpacked, signed
        _expect(name, "weight_zero_point", zero_point, torch.int8, (n, num_groups))
        zeros = zero_point.to(torch.int32) + SYMMETRIC_ZERO
    else:
        _expect(name, "weight_zero_point", zero_point, torch.int32, (-(-n // 8), num_groups))
        zeros = _nibbles(zero_point.T.contiguous())[:, :n].T.to(torch.int32)
    groups = parts.get("weight_g_idx")
    if groups is None:
        groups = _contiguous_groups(k, fmt.group_size, packed.device)
    return _int4_weight(name, codes, scales, zeros, groups)


_IMPORTERS = {
    "gptq": import_gptq,
    "awq": import_awq,
    "compressed-tensors": import_compressed_tensors,
}


def _our_group_size(name: str, groups: torch.Tensor) -> int:
    """The largest of our group sizes whose every group lies inside one checkpoint group."""
    k = groups.numel()
    for size in sorted(GROUP_SIZES, reverse=True):
        if k % size == 0:
            runs = groups.reshape(-1, size)
            if bool((runs == runs[:, :1]).all()):
                return size
    if k % min(GROUP_SIZES):
        raise ModelNotFoundError(
            f"{name}: {k} inputs, not a multiple of {min(GROUP_SIZES)} (our smallest group)"
        )
    raise ModelNotFoundError(
        f"{name}: g_idx scatters each group's inputs across the row (desc_act / act-order); "
        f"our INT4 groups are runs of consecutive inputs, so these groups do not map"
    )


def _int4_weight(
    name: str,
    codes: torch.Tensor,  # uint8 [N, K], 0..15
    scales: torch.Tensor,  # float [N, Gc]
    zeros: torch.Tensor,  # int32 [N, Gc]: w = scale * (q - zero)
    groups: torch.Tensor,  # int [K]: the checkpoint group of each input
) -> Int4Weight:
    n, k = codes.shape
    num_groups = scales.shape[1]
    groups = groups.long()
    if groups.shape != (k,) or int(groups.min()) < 0 or int(groups.max()) >= num_groups:
        raise ModelNotFoundError(f"{name}: g_idx is not a group of each of the {k} inputs")
    size = _our_group_size(name, groups)
    scales16 = scales.to(torch.float16)
    inexact = scales16.float() != scales.float()  # nan counts as inexact too
    if bool(inexact.any()):
        raise ModelNotFoundError(
            f"{name}: {int(inexact.sum())} of {scales.numel()} group scales are not fp16 "
            f"values; our INT4 stores fp16 scales, so they would only import approximately"
        )
    mins = -zeros.float() * scales16.float()  # exact in fp32
    mins16 = mins.to(torch.float16)
    inexact = mins16.float() != mins
    if bool(inexact.any()):
        raise ModelNotFoundError(
            f"{name}: {int(inexact.sum())} of {mins.numel()} groups have a zero point z whose "
            f"min -z * scale is not an fp16 value; our INT4 stores fp16 mins, so they would "
            f"only import approximately"
        )
    ours = groups[::size]  # the checkpoint group of each of ours, [K / G]
    return Int4Weight(
        packed=pack_int4(codes.contiguous()),
        scales=scales16[:, ours].contiguous(),
        mins=mins16[:, ours].contiguous(),
        shape=(n, k),
        group_size=size,
    )


def _regroup(weight: Int4Weight, group_size: int) -> Int4Weight:
    """The same weight in groups of `group_size` (a divisor of its own): each scale and min
    repeats over its parts, so the values stay as they are."""
    repeat = weight.group_size // group_size
    return Int4Weight(
        packed=weight.packed,
        scales=weight.scales.repeat_interleave(repeat, dim=-1),
        mins=weight.mins.repeat_interleave(repeat, dim=-1),
        shape=weight.shape,
        group_size=group_size,
    )


def _stack(weights: list[Int4Weight], group_size: int) -> Int4Weight:
    """[N, K] weights of one shape -> one [E, N, K] weight in groups of `group_size`."""
    parts = [_regroup(w, group_size) for w in weights]
    return Int4Weight(
        packed=torch.stack([w.packed for w in parts]),
        scales=torch.stack([w.scales for w in parts]),
        mins=torch.stack([w.mins for w in parts]),
        shape=(len(parts), *parts[0].shape),
        group_size=group_size,
    )


def stack_experts(
    gate: list[Int4Weight], up: list[Int4Weight], down: list[Int4Weight]
) -> tuple[Int4Weight, Int4Weight]:
    """Each expert's imported projections -> the stacks Int4MoeExperts takes, in one group
    size (the smallest among them): w13 [E, 2I, H] (gate rows, then up) and w2 [E, H, I]."""
    shapes = {w.shape for w in (*gate, *up)}, {w.shape for w in down}
    if len(shapes[0]) != 1 or len(shapes[1]) != 1:
        raise ModelNotFoundError(f"experts of different shapes: {sorted(set.union(*shapes))}")
    size = min(w.group_size for w in (*gate, *up, *down))
    gate_up = [
        Int4Weight(
            packed=torch.cat([g.packed, u.packed]),
            scales=torch.cat([g.scales, u.scales]),
            mins=torch.cat([g.mins, u.mins]),
            shape=(g.shape[0] + u.shape[0], g.shape[1]),
            group_size=g.group_size,
        )
        for g, u in ((_regroup(g, size), _regroup(u, size)) for g, u in zip(gate, up, strict=True))
    ]
    return _stack(gate_up, size), _stack(down, size)


class QuantizedModules:
    """The quantized projections of a checkpoint, collected as their tensors stream in (one
    module's tensors may sit in different shards); each becomes an ImportedLinear as soon
    as its last tensor arrives. `names`: every tensor of the checkpoint, by our names."""

    def __init__(self, fmt: QuantizedFormat, names: Iterable[str]) -> None:
        self.format = fmt
        required, optional = _PARTS[fmt.method]
        if fmt.method == "compressed-tensors" and not fmt.symmetric:
            required = (*required, "weight_zero_point")
        present = set(names)
        marker = f".{required[0]}"
        self.expected: dict[str, set[str]] = {}
        for tensor in sorted(present):
            if not tensor.endswith(marker):
                continue
            module = tensor.removesuffix(marker)
            missing = [p for p in required if f"{module}.{p}" not in present]
            if missing:
                raise ModelNotFoundError(f"{module}: quantized, but {', '.join(missing)} missing")
            parts = (*required, *optional)
            self.expected[module] = {p for p in parts if f"{module}.{p}" in present}
        self.parts: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)

    @property
    def modules(self) -> tuple[str, ...]:
        """Every quantized module's name, by our names."""
        return tuple(self.expected)

    def owns(self, name: str) -> bool:
        module, _, part = name.rpartition(".")
        return part in self.expected.get(module, ())

    def add(self, name: str, tensor: torch.Tensor) -> ImportedLinear | None:
        module, _, part = name.rpartition(".")
        parts = self.parts[module]
        parts[part] = tensor
        if set(parts) != self.expected[module]:
            return None
        del self.parts[module]
        bias = parts.pop("bias", None)
        weight = _IMPORTERS[self.format.method](module, parts, self.format)
        return ImportedLinear(name=module, weight=weight, bias=bias)

    def finish(self) -> None:
        if self.parts:
            raise ModelNotFoundError(f"quantized tensors missing for {', '.join(self.parts)}")
