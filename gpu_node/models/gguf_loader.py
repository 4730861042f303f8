"""Reads a GGUF file: the architecture into a `ModelConfig`, tensors on demand.

Tensors are dequantized one at a time when asked for (`tensor(name)`), and the
raw quantized blocks stay reachable (`raw(name)`) so a quantized runner can use
them without ever materialising full-precision weights.
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter
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


@dataclass(frozen=True)
class GGUFSummary:
    """What a GGUF's header says of it: its family and the type of its weights."""

    architecture: str
    weight_type: str  # the file type it states ("Q4_K_M"), else the type of most weights


# GGUF's value types (gguf.GGUFValueType) of fixed size, as struct formats.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Reads GGUF's little-endian header fields one after another."""

    def __init__(self, data: mmap.mmap):
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        self.pos += size
        return self.data[self.pos - size : self.pos].decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        """A scalar or string; an array is skipped (None)."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALAR_FORMATS:
                self.pos += count * struct.calcsize(_SCALAR_FORMATS[item])
            elif item == _STRING:  # a vocabulary: 100k strings and more, skipped in a tight loop
                pos, data = self.pos, self.data
                for _ in range(count):
                    pos += 8 + struct.unpack_from("<Q", data, pos)[0]
                self.pos = pos
            else:
                for _ in range(count):
                    self.value(item)
            return None
        return self.unpack(_SCALAR_FORMATS[kind])


def read_summary(path: str | Path) -> GGUFSummary:
    """A GGUF's summary from its header alone, in a fraction of the time GGUFModel takes
    to open it (which reads the whole vocabulary). ModelNotFoundError when unreadable."""
    import gguf

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data)
            if cursor.unpack("<I") != gguf.GGUF_MAGIC or cursor.unpack("<I") < 2:
                raise ModelNotFoundError(f"{path} is not a GGUF file of version 2 or later")
            num_tensors, num_fields = cursor.unpack("<Q"), cursor.unpack("<Q")
            fields = {}
            for _ in range(num_fields):
                key = cursor.string()
                fields[key] = cursor.value(cursor.unpack("<I"))
            elements: Counter[int] = Counter()  # weights' elements by GGML type
            for _ in range(num_tensors):
                cursor.string()
                dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
                kind = cursor.unpack("<I")
                cursor.unpack("<Q")  # offset
                if len(dims) >= 2:
                    elements[kind] += int(np.prod(dims))
    except (OSError, ValueError, KeyError, struct.error) as exc:
        raise ModelNotFoundError(f"{path} is not a readable GGUF file: {exc}") from exc
    weight_type = None
    if fields.get("general.file_type") is not None:
        try:
            name = gguf.LlamaFileType(fields["general.file_type"]).name
            weight_type = name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    if weight_type is None:
        most = elements.most_common(1)
        weight_type = gguf.GGMLQuantizationType(most[0][0]).name if most else "none"
    return GGUFSummary(str(fields.get("general.architecture", "unknown")), weight_type)
