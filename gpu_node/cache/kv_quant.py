"""FP8 KV storage: the scales, the reference quantize/dequantize, and capacity arithmetic.

The layout of the pools and of their scales is drawn once, in `gpu_node/cache/kv_cache.py`:
per layer, K and V [P, S, H, D] (P pages, S page size, H kv heads, D head dim) and, for fp8,
one bf16 scale per (token, head) row in [P, H, S].

What an fp8 pool's bytes hold (figures in docs/benchmarks.md, "FP8 KV accuracy"): K and V
rows alike, the int8 codes of the row rotated by the Hadamard matrix H_D (entries +-1, D a
power of two), row = H_D (codes * scale) / D. Keys carry outlier channels, and both K and V
rows sit far below the max that sets their scale; the rotation spreads every row evenly
over the D dims, where a uniform 8-bit grid beats e4m3's 3 mantissa bits. Attention needs
no inverse per token: q . k = (H_D q / D) . (H_D k), so the decode kernels take queries
rotated once (`rotate`) and read K as stored; and sum_i p_i v_i = H_D (sum_i p_i H_D v_i)
/ D, so they sum stored V rows and the merge of their splits rotates each output row back
once. The CPU path dequantizes and rotates both back (`dequantize_rows`). The rotation is
a fixed butterfly of adds and subtracts (`hadamard`), the same in torch and Triton bit
for bit.

Why one bf16 scale per token and head (figures in docs/benchmarks.md):

- A token's K/V are written once, when the token is computed, and never change. A scale
  per token is fixed at that moment, so decode appends need no re-quantization. A scale
  per page (or per layer) must be chosen before the page's later tokens exist: fixed at
  a page's first token it clipped later tokens (attention-output error 0.99 on K/V with
  outliers), and only re-quantizing whole pages on every append would avoid that.
- It had the lowest error of the granularities compared (per layer; per page and head;
  per token and head with fp32, bf16 or power-of-two scales).
- Bytes: at SmolLM2's shape (3 kv heads, head dim 64) 64 code bytes + a bf16 scale is 66
  bytes a row against bf16's 128, so a budget holds 1.94x the tokens (the target is 1.9x;
  an fp32 scale would give 1.88x).

Arithmetic, shared bit for bit by the torch reference and the Triton write kernel:
y = hadamard(fp32(x)); scale = bf16_rne(max(amax(y) / 127, 2**-126));
code = rne(clamp(y / scale, +-127)) with IEEE division, stored as int8 bytes;
codes * scale is exact in fp32.
"""

from __future__ import annotations

import functools

import torch

FP8_DTYPE = torch.float8_e4m3fn  # the pools' element type: one byte, holding an int8 code
SCALE_DTYPE = torch.bfloat16  # one scale per (token, head) row
MIN_SCALE = 2.0**-126  # an all-zero row still gets a finite, non-zero scale
CODE_MAX = 127.0  # int8 codes in [-127, 127]

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
    """fp8 pools rotate rows by H_D, which needs a power-of-two head dim."""
    if head_dim <= 0 or head_dim & (head_dim - 1):
        raise ValueError(f"fp8 KV needs a power-of-two head dim, got {head_dim}")


def rotate(x: torch.Tensor) -> torch.Tensor:
    """H_D x / D over the last dim `[..., D]`, one matrix product in x's dtype (H_D / D is
    exact in every float dtype): queries into the basis fp8 pools keep rows in (their
    scores against stored keys are then q . k), and sums of stored V rows out of it."""
    return x @ _rotation(x.shape[-1], x.dtype, x.device)


@functools.cache
def _rotation(dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    check_head_dim(dim)
    return (hadamard(torch.eye(dim, device=device)) / dim).to(dtype)  # symmetric


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize K or V rows: `[..., D]` -> (int8 codes of H_D x as fp8-typed bytes
    `[..., D]`, bf16 scale `[...]`). A bf16 scale may round below amax / 127; the clamp
    then saturates."""
    y = hadamard(x.float())
    amax = y.abs().amax(dim=-1)
    scale = (amax / torch.full_like(amax, CODE_MAX)).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
    codes = (y / scale.float().unsqueeze(-1)).clamp(-CODE_MAX, CODE_MAX).round()
    return codes.to(torch.int8).view(FP8_DTYPE), scale


def dequantize_rotated(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Stored rows as the decode kernels see them, still rotated: codes * scale (exact)."""
    return (codes.view(torch.int8).float() * scale.float().unsqueeze(-1)).to(dtype)


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize_rows`: (codes `[..., D]`, scale `[...]`) -> rows `[..., D]`."""
    rotated = dequantize_rotated(codes, scale, torch.float32)
    return (hadamard(rotated) / codes.shape[-1]).to(dtype)


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
