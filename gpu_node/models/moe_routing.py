"""Routing of tokens to experts: the top-k rule, and assignments grouped for the kernels.

Letters: T tokens, E experts, K top-k, A = T * K assignments (assignment a = t * K + k),
P padded assignments (a multiple of a kernel's block), S slots.

Pure torch (the references of gpu_node/kernels/moe/router.py and moe/slots.py); the MoE
model (moe.py) and the kernels both build on these types.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Routing:
    """Which experts each token uses, and with what weight."""

    topk_ids: torch.Tensor  # int64 [T, K], per token in descending score
    topk_weights: torch.Tensor  # fp32 [T, K]


def route(
    logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    routed_scaling: float = 1.0,
    num_groups: int = 1,
    topk_groups: int = 1,
) -> Routing:
    """Top-k experts of each token from router logits [T, E]; with `num_groups` > 1, only
    from the experts of its `topk_groups` best groups (`limit_to_groups`).

    Ties break towards the lower expert id (a stable descending sort), so the
    choice never depends on the device or the sort algorithm.
    """
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got shape {tuple(logits.shape)}")
    if not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"top_k {top_k} not in 1..{logits.shape[1]}")
    logits = logits.float()
    if scoring == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if num_groups > 1:
        scores = limit_to_groups(scores, num_groups, topk_groups)
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    weights = sorted_scores[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(topk_ids=order[:, :top_k].contiguous(), topk_weights=weights * routed_scaling)


def limit_to_groups(scores: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Scores [T, E] with the experts outside each token's `topk_groups` best groups set to 0
    (DeepSeek-V2's group-limited routing): the experts split into `num_groups` runs of
    consecutive ids, a group ranked by its best expert's score, ties towards the lower group."""
    t, e = scores.shape
    if e % num_groups or not 0 < topk_groups <= num_groups:
        raise ValueError(f"{e} experts do not split into {num_groups} groups, top {topk_groups}")
    grouped = scores.view(t, num_groups, e // num_groups)  # [T, G, E/G]
    best = grouped.amax(dim=-1)  # [T, G]
    chosen = torch.sort(best, dim=-1, descending=True, stable=True).indices[:, :topk_groups]
    kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, chosen, True)  # [T, G]
    return grouped.masked_fill(~kept[..., None], 0.0).view(t, e)


@dataclass(frozen=True)
class ExpertBlocks:
    """Token-expert assignments grouped by expert, each expert's run padded to `block_m`.

    An assignment is `token * K + slot`. `sorted_ids` holds them expert by
    expert (in token order within an expert); padding and the unused tail hold
    the sentinel T * K. Block b (rows b*block_m .. b*block_m+block_m-1) belongs
    to expert `block_experts[b]`; blocks past the last used one say E. Sized by
    an upper bound so that building it never waits on the GPU.
    """

    sorted_ids: torch.Tensor  # int32 [P]
    block_experts: torch.Tensor  # int32 [P // block_m]
    block_m: int
    num_assignments: int  # T * K, the sentinel


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Groups [T, K] expert choices by expert, padding each expert's run to `block_m`."""
    flat = topk_ids.reshape(-1)  # [T*K]
    num_assignments = flat.numel()
    device = flat.device
    # Every used expert wastes < block_m rows, and no more experts than assignments are used.
    num_padded = min(
        num_assignments * block_m,
        num_assignments + min(num_experts, num_assignments) * (block_m - 1),
    )
    num_padded = -(-num_padded // block_m) * block_m
    # scatter_add, not bincount: bincount sizes its output from the data, a GPU->host sync.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_starts = torch.cumsum(padded_counts, 0) - padded_counts
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # assignments, expert by expert
    experts = flat[order]
    rank = torch.arange(num_assignments, device=device) - starts[experts]
    sorted_ids = torch.full((num_padded,), num_assignments, dtype=torch.int32, device=device)
    sorted_ids[padded_starts[experts] + rank] = order.to(torch.int32)
    block_ends = torch.cumsum(padded_counts // block_m, 0)  # [E]
    blocks = torch.arange(num_padded // block_m, device=device)
    block_experts = torch.searchsorted(block_ends, blocks, right=True).to(torch.int32)
    return ExpertBlocks(
        sorted_ids=sorted_ids,
        block_experts=block_experts,
        block_m=block_m,
        num_assignments=num_assignments,
    )


SLOT_TOKENS = 8  # columns of one mma.m16n8k16: the tokens an expert's weights are read once for


@dataclass(frozen=True)
class ExpertSlots:
    """Token-expert assignments grouped by expert in slots of up to SLOT_TOKENS (decode).

    Slot s holds `slot_counts[s]` assignments of expert `slot_experts[s]` in
    `slot_ids[s, :count]`, in token order; its other columns repeat `slot_ids[s, 0]`, so a
    kernel may read them (and never stores them). An expert with more than SLOT_TOKENS
    assignments takes several slots. Slots past the used ones say expert E, count 0.
    Sized by the upper bound T * K (one slot per assignment) so that building it never
    waits on the GPU.
    """

    slot_experts: torch.Tensor  # int32 [S]
    slot_ids: torch.Tensor  # int32 [S, SLOT_TOKENS]
    slot_counts: torch.Tensor  # int32 [S]
    num_assignments: int  # T * K = S


def expert_slots_ref(topk_ids: torch.Tensor, num_experts: int) -> ExpertSlots:
    """Groups [T, K] expert choices into slots of up to SLOT_TOKENS assignments of one expert
    (torch; gpu_node/kernels/moe/slots.py builds the same in one or two launches)."""
    flat = topk_ids.reshape(-1)  # [A = T*K]
    num_assignments = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # assignments, expert by expert
    experts = flat[order]
    rank = torch.arange(num_assignments, device=device) - starts[experts]  # within the expert
    column = rank % SLOT_TOKENS
    slot = torch.cumsum(column == 0, 0) - 1  # [A]: a new slot every SLOT_TOKENS of an expert
    # Scatters with repeated indices below always write equal values.
    slot_experts = torch.full((num_assignments,), num_experts, dtype=torch.int64, device=device)
    slot_experts.scatter_(0, slot, experts)
    slot_ids = torch.zeros(num_assignments, SLOT_TOKENS, dtype=torch.int64, device=device)
    slot_ids[slot, column] = order
    slot_counts = torch.zeros(num_assignments, dtype=torch.int64, device=device)
    slot_counts.scatter_add_(0, slot, torch.ones_like(slot))
    filled = torch.arange(SLOT_TOKENS, device=device) < slot_counts[:, None]
    slot_ids = torch.where(filled, slot_ids, slot_ids[:, :1])
    return ExpertSlots(
        slot_experts=slot_experts.to(torch.int32),
        slot_ids=slot_ids.to(torch.int32),
        slot_counts=slot_counts.to(torch.int32),
        num_assignments=num_assignments,
    )


def with_always_on(routing: Routing, first: int, count: int) -> Routing:
    """Routing [T, K] -> [T, K + count]: experts first .. first + count - 1 appended to every
    token with weight 1 (the shared experts, folded into the expert stack)."""
    t = routing.topk_ids.shape[0]
    ids = torch.arange(first, first + count, device=routing.topk_ids.device)
    weights = routing.topk_weights.new_ones(t, count)
    return Routing(
        topk_ids=torch.cat([routing.topk_ids, ids.expand(t, count)], dim=1),
        topk_weights=torch.cat([routing.topk_weights, weights], dim=1),
    )
