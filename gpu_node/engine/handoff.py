"""Prefill/decode disaggregation: a prompt's KV moved from the node that prefilled it
to the node that decodes it.

The prefill node runs the prompt and samples the first token, then exports what its
pool holds for the prompt's positions: the K and V rows of every layer in the pool's
own storage (fp8 bytes and their bf16 scales for fp8 pools), so the decode node's pool
ends up bit for bit as if it had prefilled the prompt itself. With the first token
and, for sampled requests, the state of the request's random generator after it, the
decode node continues exactly where the prefill node stopped: greedy and seeded
outputs equal a single node's.

Wire format (`to_bytes` / `from_bytes`), all little-endian:

    u32 header length | header (JSON, space-padded so the tensors start 8-byte aligned)
    | tensor bytes, in the header's order

    header: {"version", "spec": {kv_dtype, num_layers, num_kv_heads, head_dim, activations},
             "prompt_token_ids", "first_token", "generator_state" (base64 or null),
             "first_logprob" ([logprob, [[token, logprob], ...]]; only when asked for),
             "tensors": [{"name", "dtype", "shape"}, ...]}

A request with a grammar carries it in its parameters to both nodes: the decode node
replays the first token into a fresh matcher, and goes on from there.
    tensors: k, v  [layers, prompt tokens, kv heads, head dim]  (uint8 for fp8 pools)
             k_scale, v_scale  [layers, prompt tokens, kv heads]  (bf16; fp8 pools only)
"""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import dataclass

import torch

from gpu_node.cache.kv_cache import KVCache, raw_storage
from gpu_node.cache.kv_quant import DTYPE_NAMES
from gpu_node.engine.outputs import SampledLogprob

VERSION = 3  # 2: the spec names the activations' dtype; 3: fp8 V rows are int8 codes (kv_quant)
_DTYPES = {
    "uint8": torch.uint8,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


@dataclass(frozen=True)
class KVSpec:
    """What two pools must share for one to take the other's rows: their storage, and the
    dtype the rows were computed in (fp32, bf16 or fp16: a node computing in another would
    continue from them to other tokens than one node alone)."""

    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    activations: str

    @classmethod
    def of(cls, cache: KVCache, activations: torch.dtype) -> KVSpec:
        num_kv_heads, head_dim = cache.k_cache[0].shape[2:]
        return cls(
            cache.kv_dtype, len(cache.k_cache), int(num_kv_heads), int(head_dim),
            DTYPE_NAMES[activations],
        )  # fmt: skip


@dataclass(frozen=True)
class KVHandoff:
    """A prefilled prompt: its KV rows, its first token and the generator state after it."""

    spec: KVSpec
    prompt_token_ids: tuple[int, ...]
    first_token: int
    generator_state: bytes | None  # torch.Generator.get_state() after the first sample
    k: torch.Tensor  # [L, T, H, D]: the pool's dtype, uint8 for fp8
    v: torch.Tensor
    k_scale: torch.Tensor | None  # [L, T, H] bf16: fp8 pools only
    v_scale: torch.Tensor | None
    first_logprob: SampledLogprob | None = None  # the first token's, for a request asking

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        named = [("k", self.k), ("v", self.v)]
        if self.k_scale is not None and self.v_scale is not None:
            named += [("k_scale", self.k_scale), ("v_scale", self.v_scale)]
        return named

    def header(self) -> dict:
        """Everything but the rows, as JSON-ready values: the wire format's header."""
        return {
            "version": VERSION,
            "spec": self.spec.__dict__,
            "prompt_token_ids": list(self.prompt_token_ids),
            "first_token": self.first_token,
            "generator_state": None
            if self.generator_state is None
            else base64.b64encode(self.generator_state).decode(),
            **(
                {}
                if self.first_logprob is None
                else {
                    "first_logprob": [
                        self.first_logprob.logprob,
                        [list(pair) for pair in self.first_logprob.top],
                    ]
                }
            ),
            "tensors": [
                {"name": name, "dtype": _NAMES[t.dtype], "shape": list(t.shape)}
                for name, t in self._tensors()
            ],
        }

    def tensors(self) -> list[torch.Tensor]:
        """The rows, in the header's order."""
        return [t for _, t in self._tensors()]

    def to_bytes(self) -> bytes:
        head = json.dumps(self.header(), separators=(",", ":")).encode()
        head += b" " * (-(4 + len(head)) % 8)  # the rows start 8-byte aligned
        arrays = [t.detach().cpu().contiguous().view(torch.uint8).numpy() for t in self.tensors()]
        # join reads the arrays' buffers in place: the rows are copied once
        return b"".join([struct.pack("<I", len(head)), head, *(a.reshape(-1).data for a in arrays)])

    @staticmethod
    def tensor_layout(header: dict) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of each tensor a header announces; ValueError on a bad one."""
        try:
            return [
                (str(e["name"]), _DTYPES[e["dtype"]], tuple(int(d) for d in e["shape"]))
                for e in header["tensors"]
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a KV handoff: {type(exc).__name__}: {exc}") from None

    @classmethod
    def from_parts(cls, header: dict, tensors: dict[str, torch.Tensor]) -> KVHandoff:
        """A handoff from its header and its named tensors; ValueError on anything else."""
        try:
            if header["version"] != VERSION:
                raise ValueError(f"handoff version {header['version']}, this node reads {VERSION}")
            state = header["generator_state"]
            first_logprob = None
            if (entry := header.get("first_logprob")) is not None:
                first_logprob = SampledLogprob(
                    int(header["first_token"]),
                    float(entry[0]),
                    tuple((int(t), float(lp)) for t, lp in entry[1]),
                )
            return cls(
                spec=KVSpec(**header["spec"]),
                prompt_token_ids=tuple(int(t) for t in header["prompt_token_ids"]),
                first_token=int(header["first_token"]),
                generator_state=None if state is None else base64.b64decode(state),
                k=tensors["k"],
                v=tensors["v"],
                k_scale=tensors.get("k_scale"),
                v_scale=tensors.get("v_scale"),
                first_logprob=first_logprob,
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a KV handoff: {type(exc).__name__}: {exc}") from None

    @classmethod
    def from_bytes(cls, data: bytes) -> KVHandoff:
        """Parses `to_bytes`' output; ValueError, saying what is wrong, on anything else."""
        try:
            (size,) = struct.unpack_from("<I", data)
            header = json.loads(data[4 : 4 + size])
        except (struct.error, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a KV handoff: {type(exc).__name__}: {exc}") from None
        if not isinstance(header, dict):
            raise ValueError("not a KV handoff: its header is not an object")
        if header.get("version") != VERSION:  # before the layout, which versions may change
            return cls.from_parts(header, {})
        offset = 4 + size
        buffer = bytearray(data)  # one copy, which the tensors then share
        tensors: dict[str, torch.Tensor] = {}
        for name, dtype, shape in cls.tensor_layout(header):
            count = torch.Size(shape).numel() * dtype.itemsize
            if offset + count > len(buffer):
                raise ValueError(f"tensor {name!r} is cut short")
            raw = (
                torch.frombuffer(buffer, dtype=torch.uint8, count=count, offset=offset)
                if count
                else torch.empty(0, dtype=torch.uint8)
            )
            tensors[name] = raw.view(dtype).reshape(shape)
            offset += count
        if offset != len(data):
            raise ValueError(f"{len(data) - offset} bytes past the last tensor")
        return cls.from_parts(header, tensors)

    def problems(self, spec: KVSpec, prompt_token_ids: list[int]) -> list[str]:
        """Why a pool of `spec` cannot take this handoff for that prompt (none: it can)."""
        found = []
        if self.spec != spec:
            found.append(f"the handoff's KV is {self.spec}, this node's {spec}")
        if list(self.prompt_token_ids) != list(prompt_token_ids):
            found.append("the handoff was prefilled for another prompt")
        n = len(self.prompt_token_ids)
        rows = (self.spec.num_layers, n, self.spec.num_kv_heads, self.spec.head_dim)
        if tuple(self.k.shape) != rows or tuple(self.v.shape) != rows:
            found.append(f"K/V rows must be {list(rows)}")
        scaled = self.spec.kv_dtype == "fp8"
        if scaled != (self.k_scale is not None and self.v_scale is not None):
            found.append("fp8 rows come with their scales, other rows without")
        elif scaled and (
            tuple(self.k_scale.shape) != rows[:3] or tuple(self.v_scale.shape) != rows[:3]  # type: ignore[union-attr]
        ):
            found.append(f"scales must be {list(rows[:3])}")
        return found


def _slots(
    block_table: list[int], num_tokens: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(num_tokens)
    pages = torch.tensor(block_table, dtype=torch.long)[positions // page_size]
    return pages, positions % page_size


def export_rows(
    cache: KVCache, block_table: list[int], num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The first `num_tokens` positions of the sequence holding `block_table`: k, v
    [L, T, H, D] (raw storage) and, for fp8 pools, k_scale, v_scale [L, T, H]; on CPU."""
    pages, offsets = _slots(block_table, num_tokens, cache.page_size)
    pages, offsets = pages.to(cache.device), offsets.to(cache.device)
    k = torch.stack([raw_storage(layer)[pages, offsets] for layer in cache.k_cache]).cpu()
    v = torch.stack([raw_storage(layer)[pages, offsets] for layer in cache.v_cache]).cpu()
    if cache.k_scale[0] is None:
        return k, v, None, None
    k_scale = torch.stack([s[pages, :, offsets] for s in cache.k_scale if s is not None]).cpu()
    v_scale = torch.stack([s[pages, :, offsets] for s in cache.v_scale if s is not None]).cpu()
    return k, v, k_scale, v_scale


def import_rows(cache: KVCache, block_table: list[int], handoff: KVHandoff) -> None:
    """Writes the handoff's rows into the first positions of `block_table`'s pages."""
    pages, offsets = _slots(block_table, len(handoff.prompt_token_ids), cache.page_size)
    pages, offsets = pages.to(cache.device), offsets.to(cache.device)
    for layer in range(len(cache.k_cache)):
        raw_storage(cache.k_cache[layer])[pages, offsets] = handoff.k[layer].to(cache.device)
        raw_storage(cache.v_cache[layer])[pages, offsets] = handoff.v[layer].to(cache.device)
        k_scale, v_scale = cache.k_scale[layer], cache.v_scale[layer]
        if k_scale is not None and v_scale is not None:
            assert handoff.k_scale is not None and handoff.v_scale is not None
            k_scale[pages, :, offsets] = handoff.k_scale[layer].to(cache.device)
            v_scale[pages, :, offsets] = handoff.v_scale[layer].to(cache.device)
