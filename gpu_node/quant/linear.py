"""INT4 modules swapped into a model after it is built, and the bytes a model holds.

The model code stays plain (`nn.Linear(in, out, bias=False)` everywhere);
`quantize_model` walks it and replaces, in place:

    nn.Linear                     -> Int4Linear
    any module with `to_int4(group_size, symmetric)` (MoE experts) -> what that returns

Int4Linear runs the Triton W4A16 kernels on CUDA. Its first CUDA call re-lays its
buffers out, in place and losslessly, for the GPU kernels (`weight_int4` converts
back on demand): bf16/fp16 activations on an sm_80+ GPU with a group size of 64 or
128, or of 32 with K a multiple of 64, get Int4WeightMMA (the tensor-core decode GEMV of w4a16/mma.py; its tiles hold the
scales and mins too, so `packed` holds them and `scales`/`mins` are left empty),
anything else Int4WeightKN (the CUDA-core GEMV of w4a16/gemv.py, same bytes).
The layout is chosen once, from the first CUDA call. On a CPU it uses torch's own
int4 CPU kernel (`_weight_int4pack_mm_for_cpu`, bf16 activations in, fp32 out)
when torch has it: the weights stay 4-bit and a decode step reads a quarter of
the bytes of fp32. That kernel wants its own packing and `(q - 8) * scale + zero`
with bf16 scale and zero, so each module keeps a second, CPU-packed copy of its
codes (made once, on first use) and `zero = min + 8 * scale` rounded to bf16.
`forward_ref` is the W4A16 op's torch reference (`w4a16_matmul_ref`: dequantize, then an
fp32 matmul).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from gpu_node.kernels import cpu as cpu_kernels
from gpu_node.kernels.w4a16.reference import w4a16_matmul_ref
from gpu_node.quant.int4 import (
    Int4Weight,
    Int4WeightKN,
    Int4WeightMMA,
    from_kn,
    from_mma,
    int4_from_gguf_q4_1,
    is_symmetric,
    mma_fits,
    mma_tile_width,
    quantize_int4,
    to_kn,
    to_mma,
    unpack_int4,
)

INT4_BUFFERS = ("packed", "scales", "mins")
_HAS_CPU_INT4 = hasattr(
    torch.ops.aten, "_weight_int4pack_mm_for_cpu"
)  # buffer-name suffixes that hold INT4 weights


class KeepsInt4Dtypes:
    """nn.Module mixin for modules whose buffers are all INT4 data: `.to(dtype)`, `.half()`,
    `.to(memory_format=...)` and the like move them but never cast or re-stride them, so
    the scales and mins stay fp16 when a whole model is cast to bf16 (a bf16 copy would
    drop 3 bits of each) and the kernels' tile layouts keep their strides."""

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        before = dict(self.named_buffers(recurse=False))  # type: ignore[attr-defined]
        super()._apply(fn, recurse)  # type: ignore[misc]
        for name, old in before.items():
            new = getattr(self, name)
            if new.dtype != old.dtype or new.stride() != old.stride():  # redo it as a move
                setattr(self, name, old.to(new.device))
        return self


class Int4Linear(KeepsInt4Dtypes, nn.Module):
    """y = x @ W^T (+ bias) with W [out, in] held as INT4 (packed codes, fp16 scales and mins)."""

    packed: torch.Tensor  # buffers, named for the type checker
    scales: torch.Tensor
    mins: torch.Tensor

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if len(weight.shape) != 2:
            raise ValueError(f"Int4Linear takes a 2-D weight, got shape {weight.shape}")
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)
        self._cpu_pack: tuple[torch.Tensor, torch.Tensor] | None = None  # see the module docstring
        self._mma_view: Int4WeightMMA | None = None  # weight_mma's last wrapper
        self.bias = (
            None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int, symmetric: bool = False) -> Int4Linear:
        weight = quantize_int4(linear.weight.detach(), group_size, symmetric)
        return cls(weight.to(linear.weight.device), linear.bias)

    @classmethod
    def from_q4_1(cls, raw_blocks: object, shape: tuple[int, int]) -> Int4Linear:
        """Straight from GGUF Q4_1 blocks (`shape` in torch order [out, in]); no float copy."""
        return cls(int4_from_gguf_q4_1(raw_blocks, shape))

    @property
    def layout(self) -> Literal["int4", "kn", "mma"]:
        """Whose layout the buffers hold, read off `packed`: Int4Weight's (uint8 codes),
        Int4WeightKN's (int32 words [K/8, N]) or Int4WeightMMA's (int32 tiles, 3-D)."""
        if self.packed.dtype != torch.int32:
            return "int4"
        return "mma" if self.packed.dim() == 3 else "kn"

    @property
    def is_kn(self) -> bool:
        """Buffers in Int4WeightKN's layout (the CUDA-core GEMV's)."""
        return self.layout == "kn"

    @property
    def weight_int4(self) -> Int4Weight:
        if self.layout == "kn":
            return from_kn(self.weight_kn)
        if self.layout == "mma":
            return from_mma(self.weight_mma)
        return Int4Weight(
            packed=self.packed,
            scales=self.scales,
            mins=self.mins,
            shape=(self.out_features, self.in_features),
            group_size=self.group_size,
        )

    @property
    def weight_mma(self) -> Int4WeightMMA:
        if self.layout != "mma":
            return to_mma(self.weight_int4)
        # Kept while `packed` is the same tensor (a move or a re-layout replaces it): the
        # wrapper's checks cost more host time than the GPU's whole GEMV at decode sizes.
        wrapped = self._mma_view
        if wrapped is None or wrapped.tiles is not self.packed:
            asymmetric_width = mma_tile_width(self.group_size, symmetric=False)
            wrapped = Int4WeightMMA(
                tiles=self.packed,
                shape=(self.out_features, self.in_features),
                group_size=self.group_size,
                symmetric=self.packed.shape[-1] != asymmetric_width,  # its tiles say which
            )
            self._mma_view = wrapped
        return wrapped

    @property
    def weight_kn(self) -> Int4WeightKN:
        if self.layout != "kn":
            return to_kn(self.weight_int4)
        return Int4WeightKN(
            words=self.packed,
            scales=self.scales,
            mins=self.mins,
            shape=(self.out_features, self.in_features),
            group_size=self.group_size,
        )

    def use_kn_layout(self) -> None:
        """Re-lay the buffers out as Int4WeightKN, in place (the CUDA-core GEMV's layout)."""
        if self.layout != "kn":
            kn = to_kn(self.weight_int4)
            self.packed, self.scales, self.mins = kn.words, kn.scales, kn.mins
            self._cpu_pack = None

    def use_mma_layout(self) -> None:
        """Re-lay the buffers out as Int4WeightMMA, in place (the tensor-core GEMV's layout).

        A symmetric weight (every min -8 * its scale: `quantize_int4(..., symmetric=True)`)
        gets symmetric tiles, the scales alone: 2 bytes a group and row fewer, and the
        kernel's symmetric launches (w4a16_mma_plan), faster at several shapes
        (docs/benchmarks.md)."""
        if self.layout != "mma":  # to_mma refuses group sizes the kernels cannot take
            weight = self.weight_int4
            mma = to_mma(weight, symmetric=is_symmetric(weight))
            self.packed = mma.tiles
            self.scales = self.mins = self.scales.new_empty(0)  # inside the tiles
            self._cpu_pack = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.is_cuda:
            from gpu_node.kernels.launch import has_mma_sync
            from gpu_node.kernels.w4a16.gemv import w4a16_kn_matmul
            from gpu_node.kernels.w4a16.mma import w4a16_mma_matmul

            if self.layout == "int4":
                tensor_cores = x.dtype in (torch.bfloat16, torch.float16) and has_mma_sync(x.device)
                if tensor_cores and mma_fits(self.in_features, self.group_size):
                    self.use_mma_layout()
                else:
                    self.use_kn_layout()
            if self.layout == "mma":
                y = w4a16_mma_matmul(x, self.weight_mma)
            else:
                y = w4a16_kn_matmul(x, self.weight_kn)
        elif self._takes_cpu_kernels(x):
            y = self._forward_c(x)
        elif _HAS_CPU_INT4:
            y = self._forward_cpu(x)
        else:
            return self.forward_ref(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _takes_cpu_kernels(self, x: torch.Tensor) -> bool:
        """fp32 rows inside cpu_kernels.active(): the C GEMV (kernels/cpu)."""
        return (
            cpu_kernels.use_kernels(x)
            and self.layout == "int4"
            and self.group_size % cpu_kernels.BLOCK == 0
            and x.numel() > 0
        )

    def _forward_c(self, x: torch.Tensor) -> torch.Tensor:
        """The C GEMV over every row, MAX_ROWS a call: each row's answer the same whatever
        rows share its step."""
        rows, step = x.reshape(-1, self.in_features), cpu_kernels.MAX_ROWS
        weight = (self.packed, self.scales, self.mins, self.group_size)
        parts = [
            cpu_kernels.int4_matmul(rows[i : i + step], *weight)
            for i in range(0, rows.shape[0], step)
        ]
        y = parts[0] if len(parts) == 1 else torch.cat(parts)
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_ref(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize, then an fp32 matmul: the arithmetic every path is checked against."""
        y = w4a16_matmul_ref(x, self.weight_int4)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if self._cpu_pack is None:
            n, k = self.out_features, self.in_features
            weight = self.weight_int4
            codes = unpack_int4(weight.packed).reshape(n, k).to(torch.int32)  # [N, K] in 0..15
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            scale, low = weight.scales.float(), weight.mins.float()  # [N, K/G]
            scale_zero = torch.stack([scale.T, (low + 8 * scale).T], dim=-1)  # [K/G, N, 2]
            self._cpu_pack = (packed, scale_zero.to(torch.bfloat16).contiguous())
        packed, scale_zero = self._cpu_pack
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, K]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, self.group_size, scale_zero)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


def _is_skipped(name: str, skip: Iterable[str]) -> bool:
    parts = name.split(".")
    return any(s == name or s in parts for s in skip)


def quantize_model(
    model: nn.Module,
    group_size: int = 32,
    symmetric: bool = False,
    skip: Iterable[str] = ("lm_head",),
) -> nn.Module:
    """Swaps every quantizable submodule for its INT4 form, in place; returns `model`.

    `skip`: qualified names or name components left in full precision (the
    output head by default: it is tied to the embedding in small models).
    Linears whose in_features is not a multiple of `group_size` stay as they are
    (model_bytes counts them as unquantized).
    """
    skip = tuple(skip)
    targets: list[tuple[nn.Module, str, nn.Module]] = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if _is_skipped(full, skip):
                continue
            if hasattr(child, "to_int4"):
                targets.append((module, child_name, child.to_int4(group_size, symmetric)))
            elif isinstance(child, nn.Linear) and child.in_features % group_size == 0:
                targets.append(
                    (module, child_name, Int4Linear.from_linear(child, group_size, symmetric))
                )
    for parent, child_name, replacement in targets:
        setattr(parent, child_name, replacement)
    return model


@dataclass(frozen=True)
class ModelBytes:
    """Bytes of a model's weights by kind; tied tensors count once.

    An Int4Linear re-laid for the tensor-core GEMV (layout "mma") keeps its scales and
    mins inside the `packed` tiles, with its rows padded to a multiple of 16: there
    `packed` counts all of it and `scales`/`mins` count 0.
    """

    packed: int  # INT4 codes
    scales: int
    mins: int
    unquantized: int  # everything else: embeddings, norms, router, skipped linears, Q8_0 heads

    @property
    def total(self) -> int:
        return self.packed + self.scales + self.mins + self.unquantized


def model_bytes(model: nn.Module) -> ModelBytes:
    """Counts the parameters and buffers of `model` by kind: the INT4 modules' buffers by
    their names, everything else (a Q8_0 head's codes and scales too) as unquantized."""
    seen: set[tuple[int, int, torch.device]] = set()  # storage, offset, device
    sizes = dict.fromkeys((*INT4_BUFFERS, "unquantized"), 0)
    for module in model.modules():
        is_int4 = isinstance(module, KeepsInt4Dtypes)
        tensors = [
            *module.named_parameters(recurse=False, remove_duplicate=False),
            *module.named_buffers(recurse=False, remove_duplicate=False),
        ]
        for name, tensor in tensors:
            key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tensor.device)
            if key in seen:
                continue
            seen.add(key)
            kinds = INT4_BUFFERS if is_int4 else ()
            kind = next((k for k in kinds if name == k or name.endswith(f"_{k}")), "unquantized")
            sizes[kind] += tensor.numel() * tensor.element_size()
    return ModelBytes(**sizes)
