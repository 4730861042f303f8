"""FP8 KV storage: the scales, the reference quantize/dequantize, and capacity arithmetic.

The layout of the pools and of their scales is drawn once, in `gpu_node/cache/kv_cache.py`:
per layer, K and V [P, S, H, D] (P pages, S page size, H kv heads, D head dim) and, for fp8,
one bf16 scale per (token, head) row in [P, H, S].

What an fp8 pool's bytes hold (figures in docs/benchmarks.md, "FP8 KV accuracy"):

- V rows: float8_e4m3fn values, value = fp8 * scale.
- K rows: int8 codes of the row rotated by the Hadamard matrix H_D (entries +-1, D a
  power of two), key = H_D (codes * scale) / D. Keys carry outlier channels that e4m3's
  3 mantissa bits cannot resolve around; the rotation spreads every row evenly over the
  D dims, where a uniform 8-bit grid beats e4m3 (mean KL to fp32 KV on SmolLM2 ~12x
  lower than e4m3 keys, unrotated or rotated). Attention needs no inverse: q . k =
  (H_D q / D) . (H_D k), so the decode kernels take queries rotated once
  (`rotate_queries`) and read K as stored; the CPU path dequantizes and rotates K back
  (`dequantize_keys`). The rotation is a fixed butterfly of adds and subtracts
  (`hadamard`), the same in torch and Triton bit for bit.

Why one bf16 scale per token and head (figures in docs/benchmarks.md):

- A token's K/V are written once, when the token is computed, and never change. A scale
  per token is fixed at that moment, so decode appends need no re-quantization. A scale
  per page (or per layer) must be chosen before the page's later tokens exist: fixed at
  a page's first token it clipped later tokens (attention-output error 0.99 on K/V with
  outliers), and only re-quantizing whole pages on every append would avoid that.
- It had the lowest error of the granularities compared (per layer; per page and head;
  per token and head with fp32, bf16 or power-of-two scales): the row max maps onto
  448, so the loud channels that dominate K keep full precision. A power-of-two scale
  (1 byte) left the max anywhere in (224, 448] and gave 1.5x the attention error.
- Bytes: at SmolLM2's shape (3 kv heads, head dim 64) fp8 + a bf16 scale is 66 bytes a
  row against bf16's 128, so a budget holds 1.94x the tokens (the target is 1.9x; an fp32
  scale would give 1.88x).

Arithmetic, shared bit for bit by the torch reference and the Triton kernels:
V: scale = bf16_rne(max(amax / 448, 2**-126)); q = fp8_rne(clamp(x / scale, +-448)) with
IEEE division; dequantized value = fp32(q) * fp32(scale), which is exact.
K: y = hadamard(fp32(x)); scale = bf16_rne(max(amax(y) / 127, 2**-126));
code = rne(clamp(y / scale, +-127)) with IEEE division, stored as int8 bytes.
"""

from __future__ import annotations

import functools

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_DTYPE = torch.bfloat16  # one scale per (token, head) row
MIN_SCALE = 2.0**-126  # an all-zero row still gets a finite, non-zero scale
KEY_CODE_MAX = 127.0  # K rows: int8 codes in [-127, 127]

KV_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": FP8_DTYPE,
}
# The short name of each (the names of the dtypes a model computes in too: fp32, bf16, fp16)
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in KV_DTYPES.items()}


def kv_torch_dtype(kv_dtype: str) -> torch.dtype:
    """The storage dtype of a KV dtype name ('fp32', 'bf16', 'fp16', 'fp8')."""
    try:
        return KV_DTYPES[kv_dtype]
    except KeyError:
        raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}") from None


def is_fp8(kv_dtype: str) -> bool:
    return kv_torch_dtype(kv_dtype) == FP8_DTYPE


def scale_shape(num_pages: int, page_size: int, num_kv_heads: int) -> tuple[int, int, int]:
    """Shape of `k_scale` / `v_scale` beside a `[P, S, H, D]` fp8 cache: `[P, H, S]`."""
    return (num_pages, num_kv_heads, page_size)


def scale_rows(scale: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The scales of the tokens at `slots` (any shape [...]): `[..., H]`, a copy."""
    page_size = scale.shape[2]
    return scale_rows_at(scale, slots // page_size, slots % page_size)


def scale_rows_at(scale: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The scales of the tokens at (`pages`, `offsets`) (one shape [...]): `[..., H]`, a copy."""
    return scale[pages, :, offsets]


def set_scale_rows(scale: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Write `values` [T, H] as the scales of the tokens at `slots` [T], in place."""
    page_size = scale.shape[2]
    scale[slots // page_size, :, slots % page_size] = values


def bytes_per_token(kv_dtype: str, num_kv_heads: int, head_dim: int, page_size: int) -> float:
    """Bytes one token's K and V take in one layer, scales included.

    `page_size` is part of the signature because a per-page scale would add
    bytes / page_size; the per-token layout used here adds nothing per page, so the
    figure is the same for every page size.
    """
    _check_positive(num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size)
    element_bytes = kv_torch_dtype(kv_dtype).itemsize
    row_bytes = head_dim * element_bytes
    if is_fp8(kv_dtype):
        row_bytes += SCALE_DTYPE.itemsize
    return float(2 * num_kv_heads * row_bytes)  # 2: K and V


def pages_for_budget(
    budget_bytes: int,
    kv_dtype: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
) -> int:
    """How many whole pages (across all layers) fit in `budget_bytes`."""
    _check_positive(num_layers=num_layers)
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    page_bytes = bytes_per_token(kv_dtype, num_kv_heads, head_dim, page_size) * page_size
    return int(budget_bytes // (page_bytes * num_layers))


def tokens_for_budget(
    budget_bytes: int,
    kv_dtype: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
) -> int:
    """How many tokens the KV pool holds in `budget_bytes`, counted in whole pages."""
    num_pages = pages_for_budget(
        budget_bytes, kv_dtype, num_layers, num_kv_heads, head_dim, page_size
    )
    return num_pages * page_size


def row_scale(amax: torch.Tensor) -> torch.Tensor:
    """The bf16 scale of rows whose absolute max is `amax` (any shape -> same shape)."""
    amax = amax.float()
    # Divide by a tensor: CUDA torch turns division by a Python scalar into a multiply by
    # its reciprocal, which is not the IEEE quotient the kernels compute.
    return (amax / torch.full_like(amax, FP8_MAX)).clamp_min(MIN_SCALE).to(SCALE_DTYPE)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """H_D x over the last dim (D a power of two; entries +-1, unnormalised), fp32 in and
    out: log2(D) butterfly stages (a + b, a - b) at strides 1, 2, .., D / 2, the order the
    KV write kernel uses, so the two agree bit for bit."""
    *lead, dim = x.shape
    half = 1
    while half < dim:
        pairs = x.reshape(*lead, dim // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, dim)
        half *= 2
    return x


def check_head_dim(head_dim: int) -> None:
    """fp8 pools rotate keys by H_D, which needs a power-of-two head dim."""
    if head_dim <= 0 or head_dim & (head_dim - 1):
        raise ValueError(f"fp8 KV needs a power-of-two head dim, got {head_dim}")


def rotate_queries(q: torch.Tensor) -> torch.Tensor:
    """Queries `[..., D]` into the basis fp8 pools keep keys in: H_D q / D (the scores
    against stored keys are then q . k), one matrix product in q's dtype (H_D / D is
    exact in every float dtype)."""
    return q @ _query_rotation(q.shape[-1], q.dtype, q.device)


@functools.cache
def _query_rotation(dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    check_head_dim(dim)
    return (hadamard(torch.eye(dim, device=device)) / dim).to(dtype)  # symmetric


def quantize_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize K rows: `[..., D]` -> (int8 codes of H_D x as fp8-typed bytes `[..., D]`,
    bf16 scale `[...]`). A bf16 scale may round below amax / 127; the clamp then saturates."""
    y = hadamard(x.float())
    amax = y.abs().amax(dim=-1)
    scale = (amax / torch.full_like(amax, KEY_CODE_MAX)).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
    codes = (y / scale.float().unsqueeze(-1)).clamp(-KEY_CODE_MAX, KEY_CODE_MAX).round()
    return codes.to(torch.int8).view(FP8_DTYPE), scale


def dequantize_rotated_keys(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Stored keys as the decode kernels see them, still rotated: codes * scale (exact)."""
    return (codes.view(torch.int8).float() * scale.float().unsqueeze(-1)).to(dtype)


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_keys`: (codes `[..., D]`, scale `[...]`) -> keys `[..., D]`."""
    rotated = dequantize_rotated_keys(codes, scale, torch.float32)
    return (hadamard(rotated) / codes.shape[-1]).to(dtype)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize V rows (e4m3): `[..., D]` -> (fp8 `[..., D]`, bf16 scale `[...]`).

    A bf16 scale may round below amax / 448; the clamp then saturates the row max at
    448 (an error of at most 2**-8 of it) instead of overflowing.
    """
    x32 = x.float()
    scale = row_scale(x32.abs().amax(dim=-1))
    scaled = x32 / scale.float().unsqueeze(-1)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_fp8`: (fp8 `[..., D]`, scale `[...]`) -> `[..., D]` in `dtype`."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def kv_pool(
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    head_major: bool = False,
) -> torch.Tensor:
    """A zeroed K or V pool of one layer, indexed [P, S, H, D] whatever its memory order:
    token-major (a contiguous [P, S, H, D]) or, with `head_major`, a contiguous
    [P, H, S, D] viewed as [P, S, H, D] (see the module docstring)."""
    if not head_major:
        return torch.zeros(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    pool = torch.zeros(num_pages, num_kv_heads, page_size, head_dim, dtype=dtype, device=device)
    return pool.permute(0, 2, 1, 3)


_ORDERS = (
    "k_cache and v_cache must be contiguous [P, S, H, D] tensors or [P, H, S, D] ones "
    "viewed as [P, S, H, D] (kv_pool), both alike"
)


def pool_strides(cache: torch.Tensor) -> tuple[int, int]:
    """(token stride, head stride) in elements of a [P, S, H, D] pool in one of kv_pool's
    two memory orders; ValueError for any other. Pages are contiguous in both: page p
    starts at p * S * H * D. With one kv head the two orders are the same memory,
    reported as token-major (D, D). The kernels take these strides, not the tensor's own
    (a size-1 dimension's stride is arbitrary)."""
    if cache.dim() == 4:
        _, page_size, num_kv_heads, head_dim = cache.shape
        if cache.is_contiguous():
            return num_kv_heads * head_dim, head_dim
        if cache.permute(0, 2, 1, 3).is_contiguous():
            return head_dim, page_size * head_dim
    raise ValueError(f"{_ORDERS}; got strides {cache.stride()}")


def validate_kv_layer(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[int, int, int, int]:
    """Check one layer's KV tensors against the layout above; return (P, S, H, D)."""
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [P, S, H, D], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match "
            f"k_cache {tuple(k_cache.shape)} {k_cache.dtype}"
        )
    if k_cache.dtype not in KV_DTYPES.values():
        raise ValueError(f"KV cache dtype {k_cache.dtype} is not one of {list(KV_DTYPES)}")
    if pool_strides(v_cache) != pool_strides(k_cache):
        raise ValueError(_ORDERS)
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    if k_cache.dtype == FP8_DTYPE:
        check_head_dim(head_dim)
        expected = scale_shape(num_pages, page_size, num_kv_heads)
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is None:
                raise ValueError(f"an fp8 cache needs {name}")
            if tuple(scale.shape) != expected or scale.dtype != SCALE_DTYPE:
                raise ValueError(
                    f"{name} must be {SCALE_DTYPE} {expected}, got {scale.dtype} "
                    f"{tuple(scale.shape)}"
                )
            if not scale.is_contiguous() or scale.device != k_cache.device:
                raise ValueError(f"{name} must be contiguous and on {k_cache.device}")
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"scales are for fp8 caches only, the cache is {k_cache.dtype}")
    return num_pages, page_size, num_kv_heads, head_dim


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
