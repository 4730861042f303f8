"""Paged decode attention in plain torch: the kernels' references and the CPU path.

Shapes, the cache layout and the integrity rule are those of
`gpu_node/kernels/paged_attention/dot.py` (its docstring draws them): `check_page_ownership`
is the rule as one vectorised expression, `gather_paged_kv` the CPU engine's read of a
sequence's K/V, `paged_decode_attention_ref` the fp32 answer the kernels must match,
and `validate_decode_inputs` the checks both sides make of their inputs.
"""

from __future__ import annotations

import torch

from gpu_node.cache.kv_quant import (
    FP8_DTYPE,
    dequantize_rows,
    scale_rows,
    scale_rows_at,
    validate_kv_layer,
)


def check_page_ownership(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    page_size: int,
    page_owner: torch.Tensor,
    seq_tags: torch.Tensor,
) -> torch.Tensor:
    """Violations of the read-side ownership rule, bool [B] (True = the sequence is bad).

    A sequence is bad if any of its first ceil(L / S) block-table entries is outside
    [0, P) or owned by another tag, or if L needs more pages than its block table has.
    The same rule the attention kernel applies, as one vectorised torch expression.
    """
    num_pages = page_owner.shape[0]
    max_pages = block_tables.shape[1]
    pages_needed = (context_lens.long() + page_size - 1) // page_size  # [B]
    is_used = torch.arange(max_pages, device=block_tables.device) < pages_needed[:, None]
    pages = block_tables.long()  # [B, M]
    is_in_range = (pages >= 0) & (pages < num_pages)
    owners = page_owner[pages.clamp(0, num_pages - 1)]  # [B, M]
    is_bad = is_used & (~is_in_range | (owners != seq_tags[:, None]))
    return is_bad.any(dim=1) | (pages_needed > max_pages)


def gather_paged_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    dtype: torch.dtype,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V out of the pages, dequantized: two [L, H, D] in `dtype`.

    For prefill over the paged cache (attention over cached prefix + new chunk). It
    reads pages as given: run `check_page_ownership` on the step's sequences first.
    The engine builds the index once a step (attention.ContextIndex) and calls `gather_kv`.
    """
    num_pages, page_size, _, _ = validate_kv_layer(k_cache, v_cache, k_scale, v_scale)
    positions = torch.arange(context_len, device=k_cache.device)
    pages = block_table[positions // page_size].long()
    if context_len and not bool(((pages >= 0) & (pages < num_pages)).all()):
        raise ValueError(f"block_table holds a page id outside [0, {num_pages})")
    return gather_kv(k_cache, v_cache, pages, positions % page_size, dtype, k_scale, v_scale)


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    offsets: torch.Tensor,
    dtype: torch.dtype,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V of the tokens at (`pages`, `offsets`) (int64 [L], pages within the pool),
    dequantized: two [L, H, D] in `dtype`."""
    k = k_cache[pages, offsets]  # [L, H, D], either pool memory order
    v = v_cache[pages, offsets]
    if k_cache.dtype == FP8_DTYPE:
        assert k_scale is not None and v_scale is not None  # validated by the caller
        k_e = scale_rows_at(k_scale, pages, offsets)
        v_e = scale_rows_at(v_scale, pages, offsets)
        return dequantize_rows(k, k_e, dtype), dequantize_rows(v, v_e, dtype)
    return k.to(dtype), v.to(dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    page_owner: torch.Tensor,
    seq_tags: torch.Tensor,
    sm_scale: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch decode attention: (out [B, Q, D] in q's dtype, violations bool [B]).

    Computes in fp32 over all sequences at once (padded to the longest context).
    """
    num_pages, page_size, num_kv_heads, head_dim = validate_decode_inputs(
        q, k_cache, v_cache, block_tables, context_lens, page_owner, seq_tags, k_scale, v_scale
    )
    batch, num_heads, _ = q.shape
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    violations = check_page_ownership(block_tables, context_lens, page_size, page_owner, seq_tags)
    max_len = int(context_lens.max()) if batch else 0
    positions = torch.arange(max_len, device=q.device)  # [L]
    columns = (positions // page_size).clamp(max=block_tables.shape[1] - 1)
    pages = block_tables.long()[:, columns].clamp(0, num_pages - 1)  # [B, L]
    offsets = positions % page_size
    slots = pages * page_size + offsets
    k = k_cache[pages, offsets]  # [B, L, H, D]
    v = v_cache[pages, offsets]
    if k_cache.dtype == FP8_DTYPE:
        assert k_scale is not None and v_scale is not None  # validated above
        k = dequantize_rows(k, scale_rows(k_scale, slots), torch.float32)
        v = dequantize_rows(v, scale_rows(v_scale, slots), torch.float32)
    k, v = k.float(), v.float()
    q_groups = q.float().view(batch, num_kv_heads, group, head_dim)  # [B, H, G, D]
    scores = torch.einsum("bhgd,blhd->bhgl", q_groups, k) * scale  # [B, H, G, L]
    is_past_end = positions[None, :] >= context_lens.long()[:, None]  # [B, L]
    scores = scores.masked_fill(is_past_end[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty context gives 0
    out = torch.einsum("bhgl,blhd->bhgd", probs, v)  # [B, H, G, D]
    return out.reshape(batch, num_heads, head_dim).to(q.dtype), violations


def validate_decode_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    page_owner: torch.Tensor,
    seq_tags: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[int, int, int, int]:
    """(P, S, H, D) of a decode call's inputs; ValueError naming the first bad one."""
    num_pages, page_size, num_kv_heads, head_dim = validate_kv_layer(
        k_cache, v_cache, k_scale, v_scale
    )
    if page_size % 16 != 0:
        raise ValueError(f"page_size must be a multiple of 16, got {page_size}")
    if num_pages == 0:
        raise ValueError("the KV cache has no pages")
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [B, num_heads, {head_dim}], got {tuple(q.shape)}")
    if q.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"num_heads {q.shape[1]} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or q.stride(2) != 1:
        raise ValueError(f"q must be fp32/bf16/fp16, contiguous in head_dim, got {q.dtype}")
    batch = q.shape[0]
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be int32 [B, M], got {block_tables.dtype}")
    if block_tables.shape[0] != batch or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must have {batch} rows, contiguous in M")
    for name, tensor, dtype, shape in (
        ("context_lens", context_lens, torch.int32, (batch,)),
        ("seq_tags", seq_tags, torch.int64, (batch,)),
        ("page_owner", page_owner, torch.int64, (num_pages,)),
    ):
        if tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous {dtype} {shape}, got {tensor.dtype} "
                f"{tuple(tensor.shape)}"
            )
    devices = {t.device for t in (q, k_cache, block_tables, context_lens, page_owner, seq_tags)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return num_pages, page_size, num_kv_heads, head_dim
