"""The torch reference of the KV write (`kv_write_ref`), which the kernel is compared with bit
for bit, and the input checks both share. Arguments and layout as in `kernel.py`."""

from __future__ import annotations

import torch

from gpu_node.cache.kv_quant import FP8_DTYPE, quantize_rows, set_scale_rows, validate_kv_layer

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kv_write_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_owner: torch.Tensor,
    token_tags: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    check_owner: bool = True,
) -> torch.Tensor:
    """Pure-torch `kv_write`: same arguments, same in-place effect, same violations."""
    num_pages, page_size, _, _ = validate_write_inputs(
        key, value, k_cache, v_cache, slot_mapping, page_owner, token_tags, k_scale, v_scale
    )
    num_slots = num_pages * page_size
    is_real = slot_mapping >= 0
    is_ok = is_real & (slot_mapping < num_slots)
    if check_owner:
        pages = torch.where(is_ok, slot_mapping // page_size, 0)
        is_ok &= page_owner[pages] == token_tags
    slots = slot_mapping[is_ok]  # [W] the tokens actually written
    pages, offsets = slots // page_size, slots % page_size  # indexing: either memory order
    if k_cache.dtype == FP8_DTYPE:
        assert k_scale is not None and v_scale is not None  # validated above
        k_q, k_e = quantize_rows(key[is_ok])
        v_q, v_e = quantize_rows(value[is_ok])
        k_cache[pages, offsets] = k_q
        v_cache[pages, offsets] = v_q
        set_scale_rows(k_scale, slots, k_e)
        set_scale_rows(v_scale, slots, v_e)
    else:
        k_cache[pages, offsets] = key[is_ok].to(k_cache.dtype)
        v_cache[pages, offsets] = value[is_ok].to(v_cache.dtype)
    return is_real & ~is_ok


def validate_write_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    page_owner: torch.Tensor,
    token_tags: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[int, int, int, int]:
    """(pages, page size, kv heads, head dim) of a write both `kv_write` and the reference
    take; ValueError naming what is wrong otherwise."""
    num_pages, page_size, num_kv_heads, head_dim = validate_kv_layer(
        k_cache, v_cache, k_scale, v_scale
    )
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"key must be [T, {num_kv_heads}, {head_dim}], got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value {tuple(value.shape)} must match key {tuple(key.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in head_dim")
    if key.dtype not in _INPUT_DTYPES or value.dtype != key.dtype:
        raise ValueError(
            f"key and value must share one of fp32/bf16/fp16, got {key.dtype} and {value.dtype}"
        )
    num_tokens = key.shape[0]
    for name, tensor, shape in (
        ("slot_mapping", slot_mapping, (num_tokens,)),
        ("token_tags", token_tags, (num_tokens,)),
        ("page_owner", page_owner, (num_pages,)),
    ):
        if tensor.dtype != torch.int64 or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} must be int64 {shape}, got {tensor.dtype} {tuple(tensor.shape)}"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    devices = {t.device for t in (key, value, k_cache, slot_mapping, page_owner, token_tags)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return num_pages, page_size, num_kv_heads, head_dim
