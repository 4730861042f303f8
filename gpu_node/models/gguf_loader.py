"""Reads a GGUF file: the architecture into a `ModelConfig`, tensors on demand.

Tensors are dequantized one at a time when asked for (`tensor(name)`), and the
raw quantized blocks stay reachable (`raw(name)`) so a quantized runner can use
them without ever materialising full-precision weights. The file is mapped in memory
and its header read here (metadata, tensor index); tensors are views of the map.
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
        self.path = Path(path)
        self._fields, self._tensors = _read_gguf(self.path)

    def field(self, key: str, default: Any = None) -> Any:
        value = self._fields.get(key)
        return default if value is None else value

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def raw(self, name: str) -> RawTensor:
        t = self._tensors[name]
        return RawTensor(name=name, ggml_type=t.ggml_type.name, data=t.data, shape=t.shape)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantizes one tensor with the gguf package's own arithmetic."""
        import gguf

        t = self._tensors[name]
        values = gguf.quants.dequantize(t.data, t.ggml_type)
        # np.array copies: F32 tensors come straight from the read-only memory map.
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(t.shape)).to(dtype)

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


# GGUF's value types (gguf.GGUFValueType) of fixed size, as numpy types.
_NUMPY_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9
# GGML types stored as plain arrays; every other type is stored as blocks of bytes.
_ELEMENT_TYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2",
                  "I32": "<i4", "I64": "<i8"}  # fmt: skip


@dataclass(frozen=True)
class _Tensor:
    ggml_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: [out, in] for matrices
    # The stored values over the memory map: elements, or [..., bytes of a row's blocks]
    data: np.ndarray


class _Cursor:
    """Reads GGUF's little-endian header fields one after another. Arrays are read with
    numpy, and strings in a tight loop: gguf.GGUFReader takes seconds over a vocabulary of
    250k strings, which this reads in a fraction of one."""

    def __init__(self, data: mmap.mmap, keep_arrays: bool):
        self.data = data
        self.pos = 0
        self.keep_arrays = keep_arrays

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        self.pos += size
        return self.data[self.pos - size : self.pos].decode("utf-8")

    def value(self, kind: int) -> Any:
        """A scalar, string or list; without `keep_arrays`, an array is skipped (None)."""
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            (value,) = np.frombuffer(self.data, _NUMPY_TYPES[kind], 1, self.pos).tolist()
            self.pos += np.dtype(_NUMPY_TYPES[kind]).itemsize
            return value
        item, count = self.unpack("<I"), self.unpack("<Q")
        keep = self.keep_arrays
        if item in _NUMPY_TYPES:
            dtype = np.dtype(_NUMPY_TYPES[item])
            values = np.frombuffer(self.data, dtype, count, self.pos).tolist() if keep else None
            self.pos += count * dtype.itemsize
            return values
        if item == _STRING:
            strings, pos, data = [], self.pos, self.data
            for _ in range(count):
                end = pos + 8 + struct.unpack_from("<Q", data, pos)[0]
                if keep:
                    strings.append(data[pos + 8 : end].decode("utf-8"))
                pos = end
            self.pos = pos
            return strings if keep else None
        nested = [self.value(item) for _ in range(count)]
        return nested if keep else None


def _read_gguf(path: Path, keep_arrays: bool = True) -> tuple[dict[str, Any], dict[str, _Tensor]]:
    """A GGUF's metadata fields and its tensors (views of the file, mapped in memory)."""
    import gguf

    try:
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cursor = _Cursor(data, keep_arrays)
        if cursor.unpack("<I") != gguf.GGUF_MAGIC or cursor.unpack("<I") < 2:
            raise ValueError("not a GGUF file of version 2 or later")
        num_tensors, num_fields = cursor.unpack("<Q"), cursor.unpack("<Q")
        fields = {}
        for _ in range(num_fields):
            key = cursor.string()
            fields[key] = cursor.value(cursor.unpack("<I"))
        infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]  # innermost first
            infos.append((name, dims, gguf.GGMLQuantizationType(cursor.unpack("<I")),
                          cursor.unpack("<Q")))  # fmt: skip
        alignment = int(fields.get("general.alignment") or 32)
        start = -(-cursor.pos // alignment) * alignment
        tensors = {name: _tensor(data, start + offset, dims, kind)
                   for name, dims, kind, offset in infos}  # fmt: skip
        if len(tensors) != len(infos):
            raise ValueError("two tensors share a name")
    except (OSError, ValueError, KeyError, struct.error) as exc:
        raise ModelNotFoundError(f"{path} is not a readable GGUF file: {exc}") from exc
    return fields, tensors


def _tensor(data: mmap.mmap, offset: int, dims: list[int], kind: Any) -> _Tensor:
    import gguf

    shape = tuple(reversed(dims))
    count = int(np.prod(dims))
    if kind.name in _ELEMENT_TYPES:
        array = np.frombuffer(data, _ELEMENT_TYPES[kind.name], count, offset).reshape(shape)
        return _Tensor(kind, shape, array)
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    stored = (*shape[:-1], shape[-1] // block_size * type_size)
    array = np.frombuffer(data, np.uint8, count // block_size * type_size, offset)
    return _Tensor(kind, shape, array.reshape(stored))


@dataclass(frozen=True)
class GGUFSummary:
    """What a GGUF's header says of it: its family and the type of its weights."""

    architecture: str
    weight_type: str  # the file type it states ("Q4_K_M"), else the type of most weights


def read_summary(path: str | Path) -> GGUFSummary:
    """A GGUF's summary from its header, its arrays (the vocabulary) skipped.
    ModelNotFoundError when unreadable."""
    import gguf

    fields, tensors = _read_gguf(Path(path), keep_arrays=False)
    elements: Counter[str] = Counter()  # weights' elements by GGML type
    for t in tensors.values():
        if len(t.shape) >= 2:
            elements[t.ggml_type.name] += int(np.prod(t.shape))
    weight_type = None
    if fields.get("general.file_type") is not None:
        try:
            name = gguf.LlamaFileType(fields["general.file_type"]).name
            weight_type = name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    if weight_type is None:
        most = elements.most_common(1)
        weight_type = most[0][0] if most else "none"
    return GGUFSummary(str(fields.get("general.architecture", "unknown")), weight_type)
