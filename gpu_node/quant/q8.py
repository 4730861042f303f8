"""Q8_0 linears: int8 codes with one fp16 scale a block of 32 input values (GGUF's Q8_0).

The CPU decode step's output head: a SmolLM2-sized vocabulary makes it the widest
product of a step, and GGUF files commonly store it (or the tied embedding) as Q8_0.
`Q8Linear.from_gguf` keeps the file's own blocks (weight = code * scale, the values the
fp32 model dequantizes to); `from_weight` quantizes a float weight the way GGUF does
(scale = absmax / 127 of each block, codes rounded to nearest).

Inside `cpu_kernels.active()` fp32 rows run the C GEMV (kernels/cpu: activations
quantized to int8 a block of 32 as well); elsewhere the weight is dequantized and the
product taken in the input's dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gpu_node.kernels import cpu as cpu_kernels

BLOCK = 32
GGUF_BLOCK_BYTES = 2 + BLOCK  # fp16 scale, then 32 int8 codes


class Q8Linear(nn.Module):
    """y = x @ W^T, W [out, in] as codes int8 [out, in] and fp16 scales [out, in / 32]."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        n, k = codes.shape
        if codes.dtype != torch.int8 or k % BLOCK:
            raise ValueError(f"codes must be int8 [N, K] with K a multiple of {BLOCK}")
        if scales.dtype != torch.float16 or tuple(scales.shape) != (n, k // BLOCK):
            raise ValueError(f"scales must be fp16 [{n}, {k // BLOCK}], got {tuple(scales.shape)}")
        self.out_features, self.in_features = n, k
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.contiguous())

    @classmethod
    def from_gguf(cls, raw_blocks: Any, shape: tuple[int, int]) -> Q8Linear:
        """GGUF Q8_0 blocks (uint8 [rows, K / 32 * 34]) of a weight of `shape` [out, in]."""
        n, k = (int(d) for d in shape)
        data = np.asarray(raw_blocks)
        if data.dtype != np.uint8 or data.size != n * (k // BLOCK) * GGUF_BLOCK_BYTES:
            raise ValueError(f"Q8_0 data of {data.size} bytes does not hold shape {shape}")
        blocks = data.reshape(n, k // BLOCK, GGUF_BLOCK_BYTES)
        scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16).reshape(n, k // BLOCK)
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
        return cls(torch.from_numpy(codes), torch.from_numpy(scales))

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> Q8Linear:
        """Quantizes a float weight [out, in] as GGUF's Q8_0 does."""
        n, k = weight.shape
        blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
        scales = (blocks.abs().amax(-1) / 127).half()  # [N, K/32]
        safe = torch.where(scales > 0, scales.float(), torch.ones_like(scales, dtype=torch.float32))
        codes = torch.round(blocks / safe[..., None]).clamp(-127, 127).to(torch.int8)
        return cls(codes.reshape(n, k), scales)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        blocks = self.codes.float().reshape(self.out_features, -1, BLOCK)
        return (blocks * self.scales.float()[..., None]).reshape(self.codes.shape).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if cpu_kernels.use_kernels(x) and x.numel():
            rows = x.reshape(-1, self.in_features)
            parts = [
                cpu_kernels.q8_matmul(rows[i : i + cpu_kernels.MAX_ROWS], self.codes, self.scales)
                for i in range(0, rows.shape[0], cpu_kernels.MAX_ROWS)
            ]
            y = parts[0] if len(parts) == 1 else torch.cat(parts)
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dequantized(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q8_0"
