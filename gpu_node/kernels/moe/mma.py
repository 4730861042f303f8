"""Fused INT4 MoE on tensor cores: the dense decode GEMV (w4a16/mma.py) over expert slots.

Letters: T tokens, H hidden, E experts, K top-k, I expert hidden, A = T * K assignments,
S slots (A at most), G group size (32, 64 or 128; a loop step is max(G, 64) k),
W warps per program.

    x [T, H] --router--> topk_ids, topk_weights [T, K]
      expert_slots: assignments in slots of up to 8 of one expert        [S, 8]
      GEMM 1 (this kernel): h[a] = x[a // K] @ W13[e]^T                   [2I]
        and in its epilogue  act[a] = silu(h[:I]) * h[I:]                 [A, I]
      GEMM 2 (this kernel): y[a] = w[a] * (act[a] @ W2[e]^T)              [A, H]
      out[t] = sum over slots of y[t * K + slot]                          [T, H]

A slot is one mma.m16n8k16 problem: the expert's weights are the A operand, as in the
dense kernel, and the slot's (up to 8) activation rows are the B operand's 8 columns,
gathered by assignment id instead of read in order. So an expert's INT4 weights are
read once per 8 of its tokens, and at decode (T * K assignments spread over many
experts) the kernel is the dense GEMV run on every active expert at once: programs
along (slot, row blocks) and split K, each reading its tiles one group ahead, the
split-K partials summed by the last program of each (slot, row blocks) column.
W13's rows are interleaved (gated_row_order, int4.py) so that a lane's C fragment holds a
feature's gate (row g) and up (row g + 8) together: the activation is applied in
registers and only act [A, I] is written.

One token (single-stream decode) needs no slot tables: its K assignments are the slots,
and GEMM 2 treats their rows as split-K partials of one sum (the last program of a
row-block column adds all (slot, split) partials in a fixed order), so the layer is two
launches after the router.

On Hopper both GEMMs launch early (programmatic dependent launch, as the dense kernel):
GEMM 2's programs start while GEMM 1 finishes, read their slot and first weight group,
and wait for GEMM 1 only before loading the activations.

Unused slots (expert E) exit at once, so the grid is sized by the upper bound A and
building it never waits on the GPU (CUDA graphs can capture the whole layer). The
interpreter cannot run inline asm, so this kernel is GPU-only; the slots have CPU
tests and the kernel GPU tests against the torch reference.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from gpu_node.kernels.launch import has_mma_sync, int32_pairs, launches_early
from gpu_node.kernels.moe.slots import expert_slots
from gpu_node.kernels.w4a16.dot import is_interpreted, num_sms
from gpu_node.kernels.w4a16.gemv import MAX_TILES, split_counters
from gpu_node.kernels.w4a16.mma_asm import MAGIC, group_step_constants
from gpu_node.kernels.w4a16.mma_plan import LEAST_WARPS
from gpu_node.kernels.w4a16.mma_step import fragment, load_step_fp16, mma_group_step
from gpu_node.models.moe_routing import SLOT_TOKENS, ExpertSlots, Routing
from gpu_node.quant.int4 import MMA_GROUP_SIZES, MMA_ROWS, Int4ExpertsMMA, mma_step

WARPS = 4
CHAINS = 2  # one row block a warp, each mma chain split in two (as the dense kernel's)
# Warps a launch should bring per multiprocessor. In the H200 sweep (docs/benchmarks.md,
# moe-medium, T = 1) the best splits launched 21-23 warps a multiprocessor; the dense
# kernel's 24 chose splits half as long, 1.5 us slower in each GEMM.
MOE_WAVE_WARPS = 20


@triton.jit
def _moe_mma_kernel(
    a_ptr,  # int32 [rows, K / 2]: bf16/fp16 pairs; row of assignment a = a // A_ROW_DIV
    tiles_ptr,  # int32 [E, N16 / 16, steps, ...] (Int4ExpertsMMA: a step is max(G, 64) k)
    stride_te,  # tiles' strides (int32) along experts, row blocks and groups
    stride_tr,
    stride_tg,
    slot_experts_ptr,  # int32 [S]: E for an unused slot (ONE_TOKEN: int64 topk_ids [A])
    slot_ids_ptr,  # int32 [S, 8]: assignments
    slot_counts_ptr,  # int32 [S]
    weights_ptr,  # fp32 [A]: routing weights (read when MUL_ROUTED_WEIGHT)
    part_ptr,  # fp32 [splits, programs, E_TILE]
    count_ptr,  # int32 [programs]: 0 between calls
    out_ptr,  # [A, N], or [A, N / 2] when GATED
    N,
    num_experts,
    num_row_blocks,
    programs_n,  # programs along N per slot
    stride_am,  # in int32 pairs
    stride_om,
    num_groups,
    groups_per_split,
    A_ROW_DIV: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    GATED: tl.constexpr,  # rows in gated_row_order: store silu(gate) * up [A, N / 2]
    GROUP_SIZE: tl.constexpr,
    WARPS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    OFFSET: tl.constexpr,
    HIGH: tl.constexpr,
    D_ASM: tl.constexpr,
    D_CONSTRAINTS: tl.constexpr,
    S_ASM: tl.constexpr,
    S_CONSTRAINTS: tl.constexpr,
    SM_ASM: tl.constexpr,  # unused here: this kernel's scales are fp16 (FP16_SCALES)
    SLOT: tl.constexpr,  # SLOT_TOKENS
    EARLY: tl.constexpr,  # launched early (PDL) behind the previous kernel
    SLOTS_READY: tl.constexpr,  # the slots were complete before the previous kernel began
    ONE_TOKEN: tl.constexpr,  # T = 1: slot s is assignment s, of expert topk_ids[s]; no tables
    SUM_SLOTS: tl.constexpr,  # (ONE_TOKEN) out [1, N] = the sum of every slot's rows
):
    tl.static_assert(GROUP_SIZE == 32 or GROUP_SIZE == 64 or GROUP_SIZE == 128)
    CPG: tl.constexpr = (GROUP_SIZE + 63) // 64  # chunks per step (T = max(G, 64) k)
    SUBS: tl.constexpr = 64 * CPG // GROUP_SIZE  # groups per step: 2 (g32) or 1
    E: tl.constexpr = 128 * WARPS
    pid = tl.program_id(0)  # slot * programs_n + program along N
    pid_s = tl.program_id(1)
    slot = pid // programs_n
    pid_n = pid % programs_n
    # GEMM 1 waits for the slots kernel before anything; GEMM 2 (SLOTS_READY: GEMM 1
    # started its dependents only after its own wait) reads the slots and its first
    # weights first and waits only before the activations, GEMM 1's output.
    if EARLY and not SLOTS_READY:
        gdc_wait()
    raw = tl.load(slot_experts_ptr + slot).to(tl.int32)
    in_range = (raw >= 0) & (raw < num_experts)
    expert = tl.where(in_range, raw, 0)
    # Unused slots (expert E) exit at once. One token's never do: with SUM_SLOTS every
    # (slot, split) program must reach its column's counter, so an id out of range runs
    # with its loads masked off (its rows are 0) rather than reading outside the weights.
    if in_range | ONE_TOKEN:
        count = 1 if ONE_TOKEN else tl.load(slot_counts_ptr + slot)
        # One row block a warp ([1, E] tensors): the dense kernel's layout with R = 1.
        i = tl.arange(0, 1)[:, None]
        e = tl.arange(0, E)[None, :]
        j, g, t = fragment(e)
        rb = pid_n * WARPS + e // 128 + i  # [1, E]
        rb_ok = rb < num_row_blocks
        load_ok = rb_ok & in_range  # results are still stored (0) for an id out of range
        tile_at = tiles_ptr + expert.to(tl.int64) * stride_te + rb * stride_tr
        words_at = tile_at + e % 128
        sm_at = (tile_at + 128 * CPG).to(tl.pointer_type(tl.float16)) + g * 4 + j  # +32: group 2
        # [1, E]: the assignment of column g
        ids_g = tl.zeros_like(g) + slot if ONE_TOKEN else tl.load(slot_ids_ptr + slot * SLOT + g)
        x_at = a_ptr + (ids_g // A_ROW_DIV).to(tl.int64) * stride_am + t * (8 // SUBS) + j
        sm_mul = tl.where(j == 2, 1.0 / HIGH, 1.0)

        g_begin = pid_s * groups_per_split
        g_end = tl.minimum(g_begin + groups_per_split, num_groups)
        acc = tl.full((1, E), 0.0, tl.float32)
        a = load_step_fp16(words_at, sm_at, g_begin, stride_tg, load_ok, CPG, SUBS, 16)
        if EARLY and SLOTS_READY:
            gdc_wait()
        for grp in range(g_begin, g_end):
            b_mask = load_ok & (grp + 1 < g_end)
            b = load_step_fp16(words_at, sm_at, grp + 1, stride_tg, b_mask, CPG, SUBS, 16)
            acc = mma_group_step(
                acc, a, None, x_at, grp * CPG, CPG, 2, SUBS, D_ASM,
                D_CONSTRAINTS, S_ASM, S_CONSTRAINTS, SM_ASM, sm_mul, True, OFFSET, HIGH,
            )  # fmt: skip
            a = b
        if EARLY:
            gdc_launch_dependents()  # this program's weights are read: the next may start

        m_of = 2 * t + (j % 2)  # [1, E]: slot column of C element j
        if ONE_TOKEN:
            ids_m = tl.zeros_like(m_of) + slot
        else:
            ids_m = tl.load(slot_ids_ptr + slot * SLOT + m_of)  # its assignment
        if SUM_SLOTS:
            # One token: its experts' rows are split-K partials of one sum. Every (slot,
            # split) program stores its weighted partial; the last of a row-block column
            # adds them all in a fixed order: the sum over experts needs no launch.
            acc = acc * tl.load(weights_ptr + slot)
            slab = programs_n * E
            column_at = part_ptr + pid_n * E + e
            part_mask = rb_ok & (t == 0)  # column 0: the token
            tl.store(column_at + (slot * SPLIT_K + pid_s) * slab, acc, mask=part_mask)
            tl.debug_barrier()
            arrivals = (tl.num_programs(0) // programs_n) * SPLIT_K
            done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            if done == arrivals - 1:
                total = tl.full((1, E), 0.0, tl.float32)
                for p in range(0, arrivals):
                    total += tl.load(
                        column_at + p * slab, mask=part_mask, other=0.0, cache_modifier=".cg"
                    )
                _store(
                    total, out_ptr, weights_ptr, tl.zeros_like(m_of), rb, g, j, m_of < 1,
                    rb_ok, N, stride_om, False, False, E,
                )  # fmt: skip
                tl.atomic_xchg(count_ptr + pid_n, 0)
        elif SPLIT_K == 1:
            _store(
                acc, out_ptr, weights_ptr, ids_m, rb, g, j, m_of < count, rb_ok, N, stride_om,
                MUL_ROUTED_WEIGHT, GATED, E,
            )  # fmt: skip
        else:
            split_stride = tl.num_programs(0) * E
            part_at = part_ptr + pid * E + e
            part_mask = rb_ok & (2 * t < count)
            tl.store(part_at + pid_s * split_stride, acc, mask=part_mask)
            # As in w4a16/mma.py: the last program of the column sums the partials.
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
            if done == SPLIT_K - 1:
                total = tl.full((1, E), 0.0, tl.float32)
                for p in tl.static_range(SPLIT_K):
                    total += tl.load(
                        part_at + p * split_stride, mask=part_mask, other=0.0, cache_modifier=".cg"
                    )
                _store(
                    total, out_ptr, weights_ptr, ids_m, rb, g, j, m_of < count, rb_ok, N,
                    stride_om, MUL_ROUTED_WEIGHT, GATED, E,
                )  # fmt: skip
                tl.atomic_xchg(count_ptr + pid, 0)


@triton.jit
def _halves(v, E4: tl.constexpr):
    """[1, E], four elements a lane -> the lane's elements (0, 1) and (2, 3), each [E / 4, 2]."""
    return tl.split(tl.permute(tl.reshape(v, (E4, 2, 2)), (0, 2, 1)))


@triton.jit
def _store(
    acc, out_ptr, weights_ptr, ids_m, rb, g, j, column_ok, rb_ok, N, stride_om,
    MUL_ROUTED_WEIGHT: tl.constexpr, GATED: tl.constexpr, E: tl.constexpr,
):  # fmt: skip
    """acc [1, E]: C element j of lane 4g + t is row 16 rb + g + 8 (j // 2) of the slot's
    column 2t + j % 2 (assignment ids_m). Stores it (times the routing weight), or, GATED
    (rows in gated_row_order), silu(gate) * up of feature 8 rb + g: rows g and g + 8 of
    the block are that feature's gate and up, so both are in the lane (elements j, j + 2)."""
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(weights_ptr + ids_m)
    if GATED:
        E4: tl.constexpr = E // 4
        gate, up = _halves(acc, E4)  # [E / 4, 2]: (lane, column)
        ids, _ = _halves(ids_m, E4)
        feature = rb * 8 + g  # [1, E]
        feat, _ = _halves(feature, E4)
        ok = (rb_ok & (feature < N // 2) & column_ok).to(tl.int32)
        ok2, _ = _halves(ok, E4)
        act = gate / (1.0 + tl.exp(-gate)) * up
        out_at = out_ptr + ids.to(tl.int64) * stride_om + feat
        tl.store(out_at, act.to(out_ptr.dtype.element_ty), mask=ok2 != 0)
    else:
        n_of = rb * 16 + g + 8 * (j // 2)  # [1, E]
        out_at = out_ptr + ids_m.to(tl.int64) * stride_om + n_of
        mask = rb_ok & (n_of < N) & column_ok
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def moe_mma_config(num_slots: int, n: int, k: int, group_size: int, num_sms: int) -> int:
    """Groups per split for a launch over `num_slots` slots (the upper bound, not the used).

    As the dense heuristic (mma_gemv_config): the longest splits that still launch about
    a wave of warps (MOE_WAVE_WARPS a multiprocessor), else LEAST_WARPS, else the
    shortest; whole-K (no split) first, so prefill-sized launches never split. Split
    launches keep their (slot, row blocks) columns within the split-K counters.
    """
    num_groups = k // mma_step(group_size)  # loop steps
    warps_n = -(-n // MMA_ROWS)  # one row block a warp
    programs = num_slots * -(-warps_n // WARPS)
    candidates = [num_groups] + [c for c in (32, 16, 8, 4, 2) if c < num_groups]
    if programs > MAX_TILES:
        return num_groups
    for least in (MOE_WAVE_WARPS, LEAST_WARPS):
        for per_split in candidates:
            if num_slots * warps_n * -(-num_groups // per_split) >= least * num_sms:
                return per_split
    return candidates[-1]


def takes(x: torch.Tensor, group_size: int) -> bool:
    """Whether fused_moe_mma takes activations like x and experts of this group size."""
    return (
        x.is_cuda
        and not is_interpreted(x)
        and has_mma_sync(x.device)
        and x.dtype in MAGIC
        and group_size in MMA_GROUP_SIZES
    )


def _grouped_gemv(
    a: torch.Tensor,
    w: Int4ExpertsMMA,
    slots: ExpertSlots | torch.Tensor,
    topk_weights: torch.Tensor | None,
    a_row_div: int,
    per_split: int | None = None,  # groups per split: benchmarks' override of moe_mma_config
    slots_ready: bool = False,  # the launch before this one did not write the slots
    early: bool | None = None,  # launched early (PDL); by default where the GPU can
    sum_slots: bool = False,
) -> torch.Tensor:
    """out[a] = (routing weight *) A[a // a_row_div] @ W[expert(a)]^T for every assignment a,
    or silu(gate) * up of it when W is gated.

    `slots` may be one token's expert ids (int64 [A]) instead of ExpertSlots: slot s is
    then assignment s. With `sum_slots` (one token, weighted) the result is their sum,
    out [1, N]."""
    num_experts, n, k = w.shape
    one_token = isinstance(slots, torch.Tensor)
    if sum_slots and not (one_token and topk_weights is not None and not w.gated):
        raise ValueError("sum_slots takes one token's expert ids, routing weights, plain rows")
    if isinstance(slots, torch.Tensor):
        ids = slots.contiguous()
        num_slots = num_assignments = ids.numel()
        tables = (ids, ids, ids)  # experts; the id and count tables are unread
    else:
        num_slots, num_assignments = slots.slot_experts.numel(), slots.num_assignments
        tables = (slots.slot_experts, slots.slot_ids, slots.slot_counts)
    if per_split is None:
        per_split = moe_mma_config(num_slots, n, k, w.group_size, num_sms(a.device))
    num_groups = k // mma_step(w.group_size)  # loop steps
    splits = triton.cdiv(num_groups, per_split)
    row_blocks = w.tiles.shape[1]
    programs_n = triton.cdiv(row_blocks, WARPS)
    programs = num_slots * programs_n
    if splits > 1 and not sum_slots and programs > MAX_TILES:  # a per_split override
        raise ValueError(f"{programs} programs with split K exceed the {MAX_TILES} counters")
    pairs = int32_pairs(a)
    cols = n // 2 if w.gated else n
    out = torch.empty(1 if sum_slots else num_assignments, cols, device=a.device, dtype=a.dtype)
    if sum_slots:  # one slab per (slot, split)
        part = torch.empty(num_slots * splits, programs_n, 128 * WARPS, device=a.device)
    elif splits > 1:
        part = torch.empty(splits, programs, 128 * WARPS, device=a.device)
    else:
        part = out
    if early is None:
        early = launches_early(a.device)
    weights = topk_weights if topk_weights is not None else part  # unread when not multiplying
    _moe_mma_kernel[(programs, splits)](
        pairs,
        w.tiles,
        w.tiles.stride(0),
        w.tiles.stride(1),
        w.tiles.stride(2),
        *tables,
        weights,
        part,
        split_counters(a.device),
        out,
        n,
        num_experts,
        row_blocks,
        programs_n,
        pairs.stride(0),
        out.stride(0),
        num_groups,
        per_split,
        A_ROW_DIV=a_row_div,
        MUL_ROUTED_WEIGHT=topk_weights is not None,
        GATED=w.gated,
        GROUP_SIZE=w.group_size,
        WARPS=WARPS,
        SPLIT_K=splits,
        **group_step_constants(a.dtype, CHAINS, w.group_size),
        SLOT=SLOT_TOKENS,
        EARLY=early,
        SLOTS_READY=slots_ready,
        ONE_TOKEN=one_token,
        SUM_SLOTS=sum_slots,
        num_warps=WARPS,
        **({"launch_pdl": True} if early else {}),
    )
    return out


def fused_moe_mma(
    x: torch.Tensor,
    w13: Int4ExpertsMMA,
    w2: Int4ExpertsMMA,
    routing: Routing,
    one_token: bool = True,  # T = 1 without slot tables or a separate sum (False: tests)
) -> torch.Tensor:
    """Routed experts on tensor cores: x [T, H] bf16/fp16 on CUDA -> [T, H] in x's dtype.

    w13: [E, 2I, H] (gate rows then up rows) laid out gated (`experts_to_mma(w13,
    gated=True)`); w2: [E, H, I]; groups of 32, 64 or 128 (H and I multiples of 64).
    """
    t, h = x.shape
    num_experts, two_i, h13 = w13.shape
    if h13 != h or w2.shape != (num_experts, h, two_i // 2) or w2.group_size != w13.group_size:
        raise ValueError(f"x [{t}, {h}] does not fit w13 {w13.shape} and w2 {w2.shape}")
    if not w13.gated or w2.gated:
        raise ValueError("w13 must be laid out gated (experts_to_mma(w13, gated=True)), w2 not")
    if not takes(x, w13.group_size):
        raise ValueError(
            f"fused_moe_mma takes bf16/fp16 x on CUDA (sm_80+, compiled, not interpreted) and "
            f"experts in Int4ExpertsMMA with groups of {MMA_GROUP_SIZES}; got {x.dtype} on "
            f"{x.device}, group {w13.group_size}"
        )
    if t == 0:
        return x.clone()
    top_k = routing.topk_ids.shape[1]
    weights = routing.topk_weights.reshape(-1).float().contiguous()  # [A]
    if t == 1 and one_token:
        # Two launches: the token's assignments are the slots, and GEMM 2 sums them.
        ids = routing.topk_ids.reshape(-1)
        act = _grouped_gemv(x, w13, ids, None, top_k)  # [A, I]
        return _grouped_gemv(act, w2, ids, weights, 1, slots_ready=True, sum_slots=True)
    # Four launches: the slots, GEMM 1 with the activation, GEMM 2, the sum.
    slots = expert_slots(routing.topk_ids, num_experts)
    act = _grouped_gemv(x, w13, slots, None, top_k)  # [A, I]: silu(gate) * up
    # Right behind GEMM 1, so its slots are long complete: GEMM 2 reads them early.
    y = _grouped_gemv(act, w2, slots, weights, 1, slots_ready=True)  # [A, H]
    return y.view(t, top_k, h).sum(dim=1)  # fp32 sums on CUDA, one rounding
