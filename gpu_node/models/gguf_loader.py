"""Reads a GGUF file: the architecture into a `ModelConfig`, tensors on demand.

Tensors are dequantized one at a time when asked for (`tensor(name)`), and the
raw quantized blocks stay reachable (`raw(name)`) so a quantized runner can use
them without ever materialising full-precision weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu_node.errors import ModelNotFoundError
from gpu_node.models.config import ModelConfig


@dataclass(frozen=True)
class RawTensor:
    """A tensor as stored: GGML type name, rows of quantized bytes, logical [rows, cols]."""

    name: str
    ggml_type: str
    data: np.ndarray  # Q4_1: uint8 [rows, cols // 32 * 20]; F32: float32 [rows, cols]
    shape: tuple[int, ...]  # torch order: [out, in] for matrices


class GGUFModel:
    """An opened GGUF file. Raises ModelNotFoundError when unreadable or unsupported."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(self.path)
        except (OSError, ValueError, KeyError, IndexError) as exc:
            raise ModelNotFoundError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        self._tensors = {t.name: t for t in self._reader.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def raw(self, name: str) -> RawTensor:
        t = self._tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return RawTensor(name=name, ggml_type=t.tensor_type.name, data=t.data, shape=shape)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantizes one tensor with the gguf package's own arithmetic."""
        import gguf

        t = self._tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        # np.array copies: F32 tensors come straight from the read-only memory map.
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape)).to(dtype)

    def config(self) -> ModelConfig:
        arch = self.field("general.architecture")
        if arch != "llama":
            raise ModelNotFoundError(
                f"{self.path}: architecture {arch!r} is not supported (llama only)"
            )

        def need(key: str) -> Any:
            value = self.field(f"{arch}.{key}")
            if value is None:
                raise ModelNotFoundError(f"{self.path}: metadata {arch}.{key} is missing")
            return value

        hidden = int(need("embedding_length"))
        num_heads = int(need("attention.head_count"))
        vocab = self.field(f"{arch}.vocab_size") or len(self.field("tokenizer.ggml.tokens") or [])
        return ModelConfig(
            architecture=arch,
            num_layers=int(need("block_count")),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_heads=num_heads,
            num_kv_heads=int(self.field(f"{arch}.attention.head_count_kv") or num_heads),
            head_dim=int(self.field(f"{arch}.rope.dimension_count") or hidden // num_heads),
            vocab_size=int(vocab),
            max_position_embeddings=int(need("context_length")),
            rope_theta=float(self.field(f"{arch}.rope.freq_base") or 10000.0),
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            tie_word_embeddings=not self.has("output.weight"),
        )
