"""The CPU decode kernels of `ops.c`, compiled once per machine and called through ctypes.

A decode step on a CPU reads every weight once for a handful of rows; torch's eager ops
pay a dispatch each and read fp32 where the file holds 4 or 8 bits. `ops.c` holds the
step's heavy parts in C: the INT4 and Q8_0 GEMVs (activations quantized to int16 a block
of 32, so integer multiply-adds do the work at a rounding finer than bf16's), paged
attention reading fp32 pages in place, the KV write with its ownership check, and the
norms, RoPE and activation fused.

The library is built with the machine's C compiler and its own instruction set
(`-march=native`) into `$EDGESERVE_HOME/cpu-kernels` (else the user's cache dir, where
models go too), keyed by the source and the machine, at install (`python -m gpu_node.kernels.cpu`) or on
first use. Without a compiler, or with `EDGESERVE_CPU_KERNELS=0`, `library()` is None
and the engine keeps its torch path. Calls release the GIL (ctypes does), and the C
loops share torch's OpenMP runtime and thread count.

Every wrapper takes fp32 tensors on the CPU and checks what the C code relies on.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("ops.c")
BLOCK = 32  # activations are quantized to int16 a block of this many values
MAX_ROWS = 64  # rows a GEMV call takes (ops.c MAX_ROWS)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ARG_TYPES = {"p": _P, "l": _I, "i": ctypes.c_int, "f": _F}  # pointer, int64, int, float
# Each function's arguments, a letter each, and whether it returns an int.
_SIGNATURES = {
    "es_set_threads": ("i", False),
    "es_quantize_rows": ("pllppp", False),
    "es_q4_gemv": ("pppllpppllp", False),
    "es_q8_gemv": ("ppllpplp", False),
    "es_paged_decode": ("plpplllplpppillllllfpp", False),
    "es_kv_write": ("plplpplllpppilllllp", False),
    "es_rms_norm": ("plpfllp", False),
    "es_add_rms_norm": ("pppfllpp", False),
    "es_rope": ("pllllppi", False),
    "es_silu_mul": ("plplllp", False),
    "es_llama_decode": ("pplppppplpppip", True),
}


def _user_cache() -> Path:
    try:
        from platformdirs import user_cache_dir
    except ImportError:  # a GPU machine's bare environment: the CPU kernels are not used there
        return Path.home() / ".cache" / "edgeserve"
    return Path(user_cache_dir("edgeserve"))


def cache_dir() -> Path:
    """Where this machine's build goes: `$EDGESERVE_HOME/cpu-kernels`, else the user's cache
    dir (the model store's rule: gpu_node/models/model_store.py `edgeserve_home`)."""
    home = os.environ.get("EDGESERVE_HOME")
    return (Path(home).expanduser() if home else _user_cache()) / "cpu-kernels"


def compiler() -> str | None:
    """The C compiler to build with: $CC, else cc or gcc on PATH; None if there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def library_path(cc: str) -> Path:
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), cc.encode(), _cpu_signature().encode()):
        key.update(part)
    return cache_dir() / f"ops-{key.hexdigest()[:16]}.so"


def build(cc: str | None = None) -> Path:
    """Compiles ops.c (if this machine's build is not cached) and returns the library's path;
    RuntimeError saying why if it cannot."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on PATH")
    path = library_path(cc)
    if path.exists():
        return path
    # A build install.sh left in the user's cache serves a home elsewhere too (read only).
    installed = _user_cache() / "cpu-kernels" / path.name
    if installed.exists():
        return installed
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        command = [
            cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11",
            str(SOURCE), "-o", str(out), "-lm",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr.strip()}")
        out.replace(path)  # atomic: a concurrent build finds a whole file or none
    return path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (no compiler, a failed build, or EDGESERVE_CPU_KERNELS=0)."""
    if os.environ.get("EDGESERVE_CPU_KERNELS", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        log.warning("CPU decode kernels unavailable, using torch's ops: %s", e)
        return None
    for name, (args, returns_int) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = [_ARG_TYPES[a] for a in args]
        fn.restype = ctypes.c_int if returns_int else None
    return lib


def available() -> bool:
    return library() is not None


_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("cpu_kernels", default=False)


@contextlib.contextmanager
def active(on: bool = True) -> Iterator[None]:
    """Within the block, `use_kernels` says yes for fp32 CPU tensors (where the library
    loaded): a model built for the CPU kernels runs its forward inside it."""
    token = _ACTIVE.set(on and available())
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def use_kernels(x: torch.Tensor) -> bool:
    """Whether to call these kernels for `x`: inside `active()`, fp32, on the CPU."""
    return _ACTIVE.get() and x.dtype == torch.float32 and x.device.type == "cpu"


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU decode kernels are not built (see gpu_node/kernels/cpu)")
    lib.es_set_threads(torch.get_num_threads())
    return lib


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _f32(*tensors: torch.Tensor) -> None:
    for t in tensors:
        _check(
            t.dtype == torch.float32 and t.device.type == "cpu", "CPU kernels take fp32 on the CPU"
        )


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x fp32 [M, K] -> (codes int16 [M, K], scales fp32 [M, K/32], scale * sum of codes
    fp32 [M, K/32]): each block of 32 as int16 codes, its absolute max over 32767 a step."""
    _f32(x)
    m, k = x.shape
    _check(k % BLOCK == 0, f"K = {k} must be a multiple of {BLOCK}")
    x = x.contiguous()
    q = torch.empty((m, k), dtype=torch.int16)
    d = torch.empty((m, k // BLOCK), dtype=torch.float32)
    qd = torch.empty_like(d)
    _lib().es_quantize_rows(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), qd.data_ptr())
    return q, d, qd


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x fp32 [M, K] @ W^T -> fp32 [M, N]; W as Int4Weight's buffers (packed uint8 [N, K/2],
    fp16 scales and mins [N, K/G]); M <= MAX_ROWS."""
    m, k = x.shape
    n = packed.shape[0]
    _check(m <= MAX_ROWS, f"{m} rows; the GEMV takes at most {MAX_ROWS}")
    _check(group_size % BLOCK == 0 and k % group_size == 0, f"group {group_size}, K {k}")
    _check(
        packed.dtype == torch.uint8 and packed.shape == (n, k // 2), "packed must be uint8 [N, K/2]"
    )
    _check(
        scales.dtype == mins.dtype == torch.float16
        and scales.shape == mins.shape == (n, k // group_size),
        "scales and mins must be fp16 [N, K/G]",
    )
    for t in (packed, scales, mins):
        _check(t.is_contiguous(), "weights must be contiguous")
    q, d, qd = quantize_rows(x)
    y = torch.empty((m, n), dtype=torch.float32)
    _lib().es_q4_gemv(
        q.data_ptr(), d.data_ptr(), qd.data_ptr(), m, k, packed.data_ptr(), scales.data_ptr(),
        mins.data_ptr(), group_size, n, y.data_ptr(),
    )  # fmt: skip
    return y


def q8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x fp32 [M, K] @ W^T -> fp32 [M, N]; W as Q8_0 (codes int8 [N, K], fp16 scales
    [N, K/32]); M <= MAX_ROWS."""
    m, k = x.shape
    n = codes.shape[0]
    _check(m <= MAX_ROWS, f"{m} rows; the GEMV takes at most {MAX_ROWS}")
    _check(codes.dtype == torch.int8 and codes.shape == (n, k), "codes must be int8 [N, K]")
    _check(
        scales.dtype == torch.float16 and scales.shape == (n, k // BLOCK), "scales: fp16 [N, K/32]"
    )
    _check(codes.is_contiguous() and scales.is_contiguous(), "weights must be contiguous")
    q, d, _ = quantize_rows(x)
    y = torch.empty((m, n), dtype=torch.float32)
    _lib().es_q8_gemv(
        q.data_ptr(), d.data_ptr(), m, k, codes.data_ptr(), scales.data_ptr(), n, y.data_ptr()
    )
    return y


def _pool_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    """(page, token, head) strides of a [P, S, K, E] pool whose rows are contiguous."""
    _check(cache.stride(3) == 1, "KV rows must be contiguous")
    return cache.stride(0), cache.stride(1), cache.stride(2)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    page_owner: torch.Tensor,
    seq_tags: torch.Tensor,
    scale: float,
    check_owner: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query a sequence, q [B, H, E], over its context's fp32 pages read in place ->
    (out [B, H, E], foreign int32 [B]). The ownership rule of the GPU kernels
    (paged_attention/reference.py `check_page_ownership`): a sequence that breaks it is
    not attended (zeros) and flagged."""
    _f32(q, k_cache, v_cache)
    b, h, e = q.shape
    num_pages, page_size, kv_heads, head_dim = k_cache.shape
    _check(head_dim == e and h % kv_heads == 0, "q and the cache disagree on heads")
    _check(
        v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride(), "k/v pools differ"
    )
    _check(q.stride(2) == 1 and q.stride(1) == e, "q's heads must be contiguous")
    _check(block_tables.dtype == torch.int32 and block_tables.is_contiguous(), "tables: int32")
    _check(context_lens.dtype == torch.int32 and context_lens.is_contiguous(), "lens: int32")
    _check(page_owner.dtype == seq_tags.dtype == torch.int64, "owners and tags: int64")
    page_stride, token_stride, head_stride = _pool_strides(k_cache)
    out = torch.empty((b, h, e), dtype=torch.float32)
    foreign = torch.empty(b, dtype=torch.int32)
    _lib().es_paged_decode(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), page_stride,
        token_stride, head_stride, block_tables.data_ptr(), block_tables.shape[1],
        context_lens.data_ptr(), page_owner.contiguous().data_ptr(),
        seq_tags.contiguous().data_ptr(), int(check_owner), num_pages, b, h, kv_heads, e,
        page_size, scale, out.data_ptr(), foreign.data_ptr(),
    )  # fmt: skip
    return out, foreign


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_owner: torch.Tensor,
    token_tags: torch.Tensor,
    check_owner: bool = True,
) -> torch.Tensor:
    """kv_write_ref for fp32 pools: k, v [T, K, E] into their slots; bool [T], True where
    the write was refused (a slot past the pool or on a page another tag owns)."""
    _f32(k, v, k_cache, v_cache)
    t, kv_heads, e = k.shape
    _check(k_cache.shape[2:] == (kv_heads, e) and v.shape == k.shape, "k/v and the pool disagree")
    _check(k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == e, "heads contiguous")
    _check(v_cache.stride() == k_cache.stride(), "k/v pools differ")
    _check(slot_mapping.dtype == page_owner.dtype == token_tags.dtype == torch.int64, "int64 ids")
    page_stride, token_stride, head_stride = _pool_strides(k_cache)
    refused = torch.empty(t, dtype=torch.bool)
    _lib().es_kv_write(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
        v_cache.data_ptr(), page_stride, token_stride, head_stride,
        slot_mapping.contiguous().data_ptr(), page_owner.contiguous().data_ptr(),
        token_tags.contiguous().data_ptr(), int(check_owner), k_cache.shape[0],
        k_cache.shape[1], t, kv_heads, e, refused.data_ptr(),
    )  # fmt: skip
    return refused


def _rows(x: torch.Tensor) -> torch.Tensor:
    _f32(x)
    _check(x.dim() == 2 and x.stride(1) == 1, "rows must be contiguous")
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of rows x [T, D] (fp32 arithmetic of llama.RMSNorm)."""
    _rows(x)
    t, d = x.shape
    _check(
        weight.shape == (d,) and weight.dtype == torch.float32 and weight.is_contiguous(), "weight"
    )
    out = torch.empty((t, d), dtype=torch.float32)
    _lib().es_rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), eps, t, d, out.data_ptr())
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) of rows [T, D]."""
    x, residual = _rows(x).contiguous(), _rows(residual).contiguous()
    t, d = x.shape
    _check(
        residual.shape == x.shape and weight.shape == (d,) and weight.dtype == torch.float32,
        "shapes",
    )
    out, summed = torch.empty_like(x), torch.empty_like(x)
    _lib().es_add_rms_norm(
        x.data_ptr(), residual.data_ptr(), weight.contiguous().data_ptr(), eps, t, d,
        out.data_ptr(), summed.data_ptr(),
    )  # fmt: skip
    return out, summed


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE applied in place to x [T, N, E] (heads contiguous); cos, sin [T, 1, E/2]."""
    _f32(x, cos, sin)
    t, n, e = x.shape
    _check(x.stride(2) == 1 and x.stride(1) == e, "x's heads must be contiguous")
    cos, sin = cos.reshape(t, e // 2).contiguous(), sin.reshape(t, e // 2).contiguous()
    _lib().es_rope(
        x.data_ptr(), x.stride(0), t, n, e, cos.data_ptr(), sin.data_ptr(), int(interleaved)
    )
    return x


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [T, F]."""
    _rows(gate), _rows(up)
    t, f = gate.shape
    _check(up.shape == gate.shape, "gate and up differ in shape")
    out = torch.empty((t, f), dtype=torch.float32)
    _lib().es_silu_mul(
        gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), t, f, out.data_ptr()
    )
    return out


class _Q4(ctypes.Structure):
    _fields_ = [
        ("packed", _P), ("scales", _P), ("mins", _P), ("group", _I), ("n", _I), ("k", _I),
    ]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", _P), ("mlp_norm", _P), ("qkv", _Q4), ("o", _Q4), ("gate_up", _Q4),
        ("down", _Q4), ("k_cache", _P), ("v_cache", _P),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        ("layers", _I), ("D", _I), ("H", _I), ("KH", _I), ("E", _I), ("F", _I), ("eps", _F),
        ("attn_scale", _F), ("interleaved", ctypes.c_int), ("page_stride", _I),
        ("token_stride", _I), ("head_stride", _I), ("num_pages", _I), ("S", _I),
        ("layer", ctypes.POINTER(_Layer)),
    ]  # fmt: skip


class LlamaDecodePlan:
    """A llama-family model's decode step as one C call (ops.c `es_llama_decode`): every
    layer's norm, fused q/k/v GEMV, RoPE, KV write, paged attention, output GEMV, fused
    gate/up GEMV, activation and down GEMV, with the arithmetic of the kernels above.

    `layers`: per layer (attention norm weight, MLP norm weight, q|k|v, o, gate|up, down),
    each projection an INT4 linear in Int4Weight's layout without bias (its `packed`,
    `scales`, `mins`, `group_size`, `out_features`, `in_features`; llama.py `c_decode_plan`
    picks the layers this covers). `dims`: D, H, KH, E, F, eps, interleaved. The caller
    runs it only where no layer's window cuts a context (attention.PagedAttention
    .decode_in_c). The plan holds pointers into the model's buffers, which stay put."""

    def __init__(self, layers: list[tuple[Any, ...]], dims: dict[str, float]):
        self._tensors = layers  # kept alive: the structs point into them
        self._layers = (_Layer * len(layers))()
        for i, (attn_norm, mlp_norm, *projections) in enumerate(layers):
            entry = self._layers[i]
            entry.attn_norm, entry.mlp_norm = attn_norm.data_ptr(), mlp_norm.data_ptr()
            for field, module in zip(("qkv", "o", "gate_up", "down"), projections, strict=True):
                setattr(entry, field, _Q4(
                    module.packed.data_ptr(), module.scales.data_ptr(), module.mins.data_ptr(),
                    module.group_size, module.out_features, module.in_features,
                ))  # fmt: skip
        self.dims = dims
        self._pools: tuple[int, ...] = ()

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        slot_mapping: torch.Tensor,
        token_tags: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        page_owner: torch.Tensor,
        seq_tags: torch.Tensor,
        scale: float,
        check_owner: bool,
    ) -> torch.Tensor:
        """x [B, D] fp32 (one new token a sequence), updated in place through every layer;
        returns int32 [B]: refused writes and foreign pages of each sequence, summed over
        the layers (the per-layer kernels' counts)."""
        b, e = x.shape[0], self.dims["E"]
        _check(x.dtype == torch.float32 and x.is_contiguous() and b <= MAX_ROWS, "x: fp32 [B, D]")
        _check(block_tables.dtype == context_lens.dtype == torch.int32, "tables, lens: int32")
        _check(block_tables.is_contiguous() and context_lens.is_contiguous(), "contiguous tables")
        for t in (slot_mapping, token_tags, page_owner, seq_tags):
            _check(t.dtype == torch.int64 and t.is_contiguous(), "ids: contiguous int64")
        pools = tuple(t.data_ptr() for t in (*k_caches, *v_caches))
        if pools != self._pools:
            first = k_caches[0]
            _check(first.dtype == torch.float32 and first.shape[2:] == (self.dims["KH"], e), "pool")
            for i, (k, v) in enumerate(zip(k_caches, v_caches, strict=True)):
                _check(
                    k.stride() == v.stride() == first.stride() and k.shape == first.shape, "pools"
                )
                self._layers[i].k_cache, self._layers[i].v_cache = k.data_ptr(), v.data_ptr()
            self._pools = pools
        model = _Model(
            len(self._tensors), self.dims["D"], self.dims["H"], self.dims["KH"], e,
            self.dims["F"], self.dims["eps"], scale, self.dims["interleaved"],
            *_pool_strides(k_caches[0]), k_caches[0].shape[0], k_caches[0].shape[1],
            self._layers,
        )  # fmt: skip
        cos, sin = cos.reshape(b, e // 2).contiguous(), sin.reshape(b, e // 2).contiguous()
        violations = torch.empty(b, dtype=torch.int32)
        status = _lib().es_llama_decode(
            ctypes.byref(model), x.data_ptr(), b, cos.data_ptr(), sin.data_ptr(),
            slot_mapping.data_ptr(), token_tags.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], context_lens.data_ptr(), page_owner.data_ptr(),
            seq_tags.data_ptr(), int(check_owner), violations.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("the CPU decode step could not allocate its scratch")
        return violations
