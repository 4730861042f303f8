"""Expert slots (models/moe_routing.py, ExpertSlots) built by one small Triton kernel in two passes.

`expert_slots_ref` (torch) takes about 25 kernel launches (sort, cumsums, scatters), more
time at decode than the expert GEMVs themselves. Here every assignment a = token * K + k
finds its place by comparing its expert with every other assignment's (A^2 comparisons:
16M at A = 4096, a prefill of 512 tokens at top-8, nothing for a GPU). Up to ONE_PROGRAM
assignments (decode) one program runs both passes in one launch, its own writes visible
to it after a barrier; beyond, each pass is a launch:

    pass 1, per a:  count[a] = #{b : e_b = e_a}      rank[a] = #{b < a : e_b = e_a}
    pass 2, per a:  before[a] = sum of ceil(count / 8) over the experts below e_a
                    slot = before[a] + rank[a] // 8,  column = rank[a] % 8

A slot's first assignment (rank % 8 == 0) also writes the slot's expert and count and
repeats its id into the slot's unused columns; slots past the used ones get expert E.
The result equals `expert_slots_ref` exactly (tests), and no step waits on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_node.models.moe_routing import SLOT_TOKENS, ExpertSlots

BLOCK_A = 64  # assignments a program places
BLOCK_B = 128  # assignments compared against per step
ONE_PROGRAM = 128  # up to this many assignments (16 tokens at top-8), one program does both passes
# The one program's comparison step: [A, 32] tiles stay in registers ([128, 128] spilled, 50 us).
ONE_PROGRAM_B = 32


@triton.jit
def _count_rank(ids_ptr, count_ptr, rank_ptr, A, pid, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    offs_a = pid * BLOCK_A + tl.arange(0, BLOCK_A)
    ids_a = tl.load(ids_ptr + offs_a, mask=offs_a < A, other=-1)
    count = tl.zeros((BLOCK_A,), tl.int32)
    rank = tl.zeros((BLOCK_A,), tl.int32)
    for b0 in range(0, A, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        ids_b = tl.load(ids_ptr + offs_b, mask=offs_b < A, other=-2)
        same = ids_b[None, :] == ids_a[:, None]  # [BLOCK_A, BLOCK_B]
        count += tl.sum(same.to(tl.int32), axis=1)
        rank += tl.sum((same & (offs_b[None, :] < offs_a[:, None])).to(tl.int32), axis=1)
    tl.store(count_ptr + offs_a, count, mask=offs_a < A)
    tl.store(rank_ptr + offs_a, rank, mask=offs_a < A)


@triton.jit
def _place(
    ids_ptr,
    count_ptr,
    rank_ptr,
    slot_experts_ptr,
    slot_ids_ptr,
    slot_counts_ptr,
    A,
    num_experts,
    pid,
    SLOT: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    offs_a = pid * BLOCK_A + tl.arange(0, BLOCK_A)
    in_a = offs_a < A
    ids_a = tl.load(ids_ptr + offs_a, mask=in_a, other=0)
    count_a = tl.load(count_ptr + offs_a, mask=in_a, other=0)
    rank_a = tl.load(rank_ptr + offs_a, mask=in_a, other=1)
    before = tl.zeros((BLOCK_A,), tl.int32)
    total = tl.zeros((1,), tl.int32)  # slots used
    for b0 in range(0, A, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        in_b = offs_b < A
        ids_b = tl.load(ids_ptr + offs_b, mask=in_b, other=0)
        rank_b = tl.load(rank_ptr + offs_b, mask=in_b, other=1)
        count_b = tl.load(count_ptr + offs_b, mask=in_b, other=0)
        # Each expert counted once, at its first assignment: its number of slots.
        slots_b = tl.where(in_b & (rank_b == 0), (count_b + SLOT - 1) // SLOT, 0)
        below = ids_b[None, :] < ids_a[:, None]
        before += tl.sum(tl.where(below, slots_b[None, :], 0), axis=1)
        total += tl.sum(slots_b, axis=0)
    slot = before + rank_a // SLOT
    column = rank_a % SLOT
    tl.store(slot_ids_ptr + slot * SLOT + column, offs_a.to(tl.int32), mask=in_a)
    first = in_a & (column == 0)
    slot_count = tl.minimum(count_a - rank_a, SLOT)
    tl.store(slot_experts_ptr + slot, ids_a.to(tl.int32), mask=first)
    tl.store(slot_counts_ptr + slot, slot_count, mask=first)
    cols = tl.arange(0, SLOT)[None, :]
    fill = first[:, None] & (cols >= slot_count[:, None])
    repeat = tl.zeros((BLOCK_A, SLOT), tl.int32) + offs_a[:, None]
    tl.store(slot_ids_ptr + slot[:, None] * SLOT + cols, repeat, mask=fill)
    # This program's range of slot indices, where no assignment lands: unused.
    unused = in_a & (offs_a >= total)
    tl.store(slot_experts_ptr + offs_a, num_experts + tl.zeros_like(offs_a), mask=unused)
    tl.store(slot_counts_ptr + offs_a, tl.zeros_like(offs_a), mask=unused)
    tl.store(
        slot_ids_ptr + offs_a[:, None] * SLOT + cols,
        tl.zeros((BLOCK_A, SLOT), tl.int32),
        mask=unused[:, None] & (cols >= 0),
    )


@triton.jit
def _slots_kernel(
    ids_ptr,
    count_ptr,
    rank_ptr,
    slot_experts_ptr,
    slot_ids_ptr,
    slot_counts_ptr,
    A,
    num_experts,
    COUNT: tl.constexpr,  # pass 1
    PLACE: tl.constexpr,  # pass 2 (both: one program holding every assignment)
    SLOT: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    pid = tl.program_id(0)
    if COUNT:
        _count_rank(ids_ptr, count_ptr, rank_ptr, A, pid, BLOCK_A, BLOCK_B)
    if COUNT and PLACE:
        tl.debug_barrier()  # the program's own counts and ranks, visible to all its threads
    if PLACE:
        _place(
            ids_ptr, count_ptr, rank_ptr, slot_experts_ptr, slot_ids_ptr, slot_counts_ptr,
            A, num_experts, pid, SLOT, BLOCK_A, BLOCK_B,
        )  # fmt: skip


def expert_slots(topk_ids: torch.Tensor, num_experts: int) -> ExpertSlots:
    """`expert_slots_ref` in one or two launches: [T, K] expert choices -> ExpertSlots (S = T * K)."""
    flat = topk_ids.reshape(-1).contiguous()  # [A]
    num_assignments = flat.numel()
    device = flat.device
    scratch = torch.empty(2, num_assignments, dtype=torch.int32, device=device)
    slot_experts = torch.empty(num_assignments, dtype=torch.int32, device=device)
    slot_ids = torch.empty(num_assignments, SLOT_TOKENS, dtype=torch.int32, device=device)
    slot_counts = torch.empty(num_assignments, dtype=torch.int32, device=device)
    if num_assignments:
        args = (flat, *scratch, slot_experts, slot_ids, slot_counts, num_assignments, num_experts)
        if num_assignments <= ONE_PROGRAM:  # decode: one launch
            _slots_kernel[(1,)](
                *args, COUNT=True, PLACE=True, SLOT=SLOT_TOKENS,
                BLOCK_A=max(16, triton.next_power_of_2(num_assignments)), BLOCK_B=ONE_PROGRAM_B,
            )  # fmt: skip
        else:
            grid = (triton.cdiv(num_assignments, BLOCK_A),)
            for count, place in ((True, False), (False, True)):
                _slots_kernel[grid](
                    *args, COUNT=count, PLACE=place, SLOT=SLOT_TOKENS, BLOCK_A=BLOCK_A,
                    BLOCK_B=BLOCK_B,
                )  # fmt: skip
    return ExpertSlots(
        slot_experts=slot_experts,
        slot_ids=slot_ids,
        slot_counts=slot_counts,
        num_assignments=num_assignments,
    )
