"""The merge step of split-K decode attention, shared by both decode kernels.

A split kernel leaves, for each (sequence, query head, split), a running max, a sum of
exponentials and an output sum; `merge_splits` weighs them into one output row per head
(the log-sum-exp merge of flash-decoding) and folds the splits' ownership-violation flags
into one flag per sequence. Over fp8 pages the splits sum V rows as stored, in the
Hadamard basis (kv_quant); the merge rotates each output row back, once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gpu_node.kernels.combine import add_tl, maximum_tl
from gpu_node.kernels.kv_write.kernel import hadamard_tl
from gpu_node.kernels.launch import releases_next


@triton.jit
def _paged_decode_merge_kernel(
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    part_bad_ptr,
    out_ptr,
    violation_ptr,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROTATE: tl.constexpr,  # out = H_D out / D (BLOCK_D == HEAD_DIM, a power of two)
    WAIT_PRIOR: tl.constexpr,  # launched early (PDL): wait for the split kernel's writes
    RELEASE_NEXT: tl.constexpr,  # the next kernel may launch now (launch.py)
):
    if RELEASE_NEXT:
        gdc_launch_dependents()
    if WAIT_PRIOR:
        gdc_wait()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < NUM_SPLITS
    part = (seq * NUM_HEADS + head) * NUM_SPLITS + splits  # [BLOCK_S]
    part_max = tl.load(part_max_ptr + part, mask=split_mask, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + part, mask=split_mask, other=0.0)
    part_acc = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    # Empty splits have max -inf and weigh 0; an empty context would make every weight
    # NaN, so the global max is floored at 0 there (the sum is 0 and the output 0).
    global_max = tl.reduce(part_max, 0, maximum_tl)
    global_max = tl.where(global_max == float("-inf"), 0.0, global_max)
    weights = tl.exp2(part_max - global_max)  # [BLOCK_S]
    total = tl.reduce(part_sum * weights, 0, add_tl)
    out = tl.reduce(part_acc * weights[:, None], 0, add_tl) / tl.where(total == 0.0, 1.0, total)
    if ROTATE:
        rotated = hadamard_tl(tl.reshape(out, [1, BLOCK_D]), 1, BLOCK_D)
        out = tl.reshape(rotated, [BLOCK_D]) * (1.0 / HEAD_DIM)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )
    is_bad = tl.reduce(
        tl.load(part_bad_ptr + seq * NUM_SPLITS + splits, mask=split_mask, other=0), 0, maximum_tl
    )
    tl.store(violation_ptr + seq, is_bad > 0, mask=head == 0)  # bool [B]


def split_partials(
    batch: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty partials of a split kernel, as merge_splits takes them: running max and sum
    [B, Q, N], output sums [B, Q, N, D] (fp32), violation flags [B, N] (int8)."""
    part_max = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=device)
    part_acc = torch.empty(
        batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=device
    )
    part_bad = torch.empty(batch, num_splits, dtype=torch.int8, device=device)
    return part_max, torch.empty_like(part_max), part_acc, part_bad


def merge_splits(
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    part_acc: torch.Tensor,
    part_bad: torch.Tensor,
    out: torch.Tensor,
    violations: torch.Tensor,
    early: bool = False,
    rotate: bool = False,
) -> None:
    """Merge a split kernel's partials ([B, Q, N] max and sum, [B, Q, N, D] sums, [B, N]
    flags) into `out` [B, Q, D] and `violations` bool [B], in place (every element of
    both is written). `early` (sm_90+, right after the split kernel on the same stream):
    a programmatic dependent launch, so the merge grid is launched while the split
    kernel runs and waits on the device for its writes (griddepcontrol.wait) instead of
    being launched after it ends. `rotate`: each output row is H_D row / D (sums of
    fp8 pages' V rows, which are stored rotated; kv_quant)."""
    batch, num_heads, num_splits, head_dim = part_acc.shape
    _paged_decode_merge_kernel[(batch, num_heads)](
        part_max,
        part_sum,
        part_acc,
        part_bad,
        out,
        violations,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=triton.next_power_of_2(head_dim),
        ROTATE=rotate,
        WAIT_PRIOR=early,
        RELEASE_NEXT=releases_next(out.device),
        num_warps=1 if num_splits * head_dim <= 4096 else 4,
        **({"launch_pdl": True} if early else {}),
    )
