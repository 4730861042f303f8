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
from gpu_node.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeScaling
from gpu_node.models.families import (
    GEMMA3_SLIDING_PATTERN,
    GEMMA3_SLIDING_ROPE_THETA,
    gemma3_changes,
    gemma3_layer_types,
)


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
        """The architecture the metadata describes (llama or gemma3); ModelNotFoundError for
        another, or for missing or inconsistent metadata."""
        arch = self.field("general.architecture")
        if arch not in ("llama", "gemma3"):
            raise ModelNotFoundError(
                f"{self.path}: architecture {arch!r} is not supported (llama, gemma3)"
            )
        hidden = int(self._need(arch, "embedding_length"))
        num_heads = int(self._need(arch, "attention.head_count"))
        head_dim = (
            self.field(f"{arch}.attention.key_length")
            or self.field(f"{arch}.rope.dimension_count")
            or hidden // num_heads
        )
        vocab = self.field(f"{arch}.vocab_size") or len(self.field("tokenizer.ggml.tokens") or [])
        fields: dict[str, Any] = {
            "architecture": arch,
            "num_layers": int(self._need(arch, "block_count")),
            "hidden_size": hidden,
            "intermediate_size": int(self._need(arch, "feed_forward_length")),
            "num_heads": num_heads,
            "num_kv_heads": int(self.field(f"{arch}.attention.head_count_kv") or num_heads),
            "head_dim": int(head_dim),
            "vocab_size": int(vocab),
            "max_position_embeddings": int(self._need(arch, "context_length")),
            "rope_theta": float(self.field(f"{arch}.rope.freq_base") or 10000.0),
            "rms_norm_eps": float(self._need(arch, "attention.layer_norm_rms_epsilon")),
            "tie_word_embeddings": not self.has("output.weight"),
        }
        if arch == "gemma3":
            fields |= self._gemma3(fields)
        try:
            return ModelConfig(**fields)
        except ValueError as exc:
            raise ModelNotFoundError(f"{self.path}: {exc}") from exc

    def _need(self, arch: str, key: str) -> Any:
        value = self.field(f"{arch}.{key}")
        if value is None:
            raise ModelNotFoundError(f"{self.path}: metadata {arch}.{key} is missing")
        return value

    def _gemma3(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Gemma 3's changes on llama, from its metadata and, where the file is silent,
        the values llama.cpp fixes for the family (families.py's Gemma 3 defaults)."""
        if self.field("gemma3.attn_logit_softcapping") is not None:
            raise ModelNotFoundError(f"{self.path}: Gemma 3 with attention soft-capping")
        value_length = self.field("gemma3.attention.value_length")
        if value_length is not None and int(value_length) != fields["head_dim"]:
            raise ModelNotFoundError(f"{self.path}: key and value lengths differ")
        layers = fields["num_layers"]
        # Per layer (True: sliding), or every n-th layer global; absent in most files.
        pattern = self.field("gemma3.attention.sliding_window_pattern")
        if isinstance(pattern, list):
            types = tuple(SLIDING_ATTENTION if s else FULL_ATTENTION for s in pattern)
        else:
            types = gemma3_layer_types(layers, int(pattern or GEMMA3_SLIDING_PATTERN))
        # llama.cpp scales queries by head_dim ** -0.5, but the 27B (62 layers) by
        # (D / H) ** -0.5: the query_pre_attn_scalar of each model's config.json.
        scalar = (
            fields["hidden_size"] // fields["num_heads"] if layers == 62 else fields["head_dim"]
        )
        theta = self.field("gemma3.rope.freq_base_swa") or GEMMA3_SLIDING_ROPE_THETA
        return {
            # llama.cpp keeps Gemma's Q/K rows as trained (it rotates halves for Gemma).
            "rope_interleaved": False,
            "hidden_act": "gelu_tanh",
            "rope_scaling": self._linear_rope_scaling("gemma3"),
            **gemma3_changes(
                layer_types=types,
                sliding_window=int(self._need("gemma3", "attention.sliding_window")),
                sliding_rope_theta=float(theta),
                query_pre_attn_scalar=float(scalar),
                final_logit_softcap=self.field("gemma3.final_logit_softcapping"),
            ),
        }

    def _linear_rope_scaling(self, arch: str) -> RopeScaling | None:
        kind = self.field(f"{arch}.rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind != "linear":
            raise ModelNotFoundError(f"{self.path}: RoPE scaling {kind!r} is not supported")
        return RopeScaling("linear", float(self._need(arch, "rope.scaling.factor")))

