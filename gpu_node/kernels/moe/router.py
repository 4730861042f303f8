"""The MoE router in one launch: logits, scores, top-k, renormalisation, always-on experts.

Letters: T tokens, H hidden, E routed experts, K top-k, S always-on (folded shared) experts.

`Router` in torch is about a dozen launches at decode (two casts, the logits GEMV, the
softmax, a stable sort, slices, the renormalisation, the scaling, and the always-on
experts' cat), more time than its arithmetic. Here one launch computes, per token (its
logits split over H across up to MAX_SPLITS programs at decode, the last one to finish
summing them in a fixed order)

    logits[e] = x . W[e]                 (fp32, H in steps of BLOCK_H)
    scores    = softmax(logits) | sigmoid(logits)
    top-k     = K rounds of: the highest score, ties to the lowest expert id (as `route`)
    weights   = scores of the top-k (/ their sum if renormalising) * routed_scaling
    then experts E .. E + S - 1 with weight 1

and writes topk_ids [T, K + S] (int64) and topk_weights [T, K + S] (fp32), the `Routing`
that `route` + `with_always_on` give (tests: equal ids, weights within fp32 rounding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from gpu_node.kernels.w4a16.gemv import split_counters
from gpu_node.models.moe_routing import Routing

if TYPE_CHECKING:
    from gpu_node.models.moe import MoeConfig

MAX_EXPERTS = 1024  # one program holds every expert's score
MAX_SPLITS = 16  # programs a token's logits are split over, H-wise
SPLIT_TOKENS = 64  # up to this many tokens (decode) the logits are split


@triton.jit
def _select(
    logits, experts, valid, ids_ptr, weights_ptr, out, routed_scaling,
    E: tl.constexpr, K: tl.constexpr, S: tl.constexpr, BLOCK_S: tl.constexpr,
    SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    """One token's logits [BLOCK_E] -> its K + S (expert, weight) pairs at ids/weights + out."""
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        shifted = tl.where(valid, logits - tl.max(tl.where(valid, logits, -float("inf"))), 0.0)
        e = tl.where(valid, tl.exp(shifted), 0.0)
        scores = e / tl.sum(e)
    # Scores are >= 0; chosen ones become -1 and padding is -2, so K rounds pick K distinct
    # real experts even when scores are NaN (those rank as -0.5: below every number).
    remaining = tl.where(valid, tl.where(scores == scores, scores, -0.5), -2.0)
    chosen_ids = tl.zeros(experts.shape, tl.int32)  # slot k of the top-k at position k
    chosen = tl.zeros(experts.shape, tl.float32)
    for k in tl.static_range(K):
        best = tl.max(remaining)
        pick = tl.min(tl.where(remaining == best, experts, E))  # ties: the lowest id
        chosen_ids = tl.where(experts == k, pick, chosen_ids)
        chosen = tl.where(experts == k, best, chosen)
        remaining = tl.where(experts == pick, -1.0, remaining)
    in_k = experts < K
    if RENORMALIZE:
        chosen = chosen / tl.sum(tl.where(in_k, chosen, 0.0))
    chosen = chosen * routed_scaling
    tl.store(ids_ptr + out + experts, chosen_ids.to(tl.int64), mask=in_k)
    tl.store(weights_ptr + out + experts, chosen, mask=in_k)
    if S > 0:
        always = tl.arange(0, BLOCK_S)
        in_s = always < S
        tl.store(ids_ptr + out + K + always, (E + always).to(tl.int64), mask=in_s)
        tl.store(weights_ptr + out + K + always, tl.full(always.shape, 1.0, tl.float32), mask=in_s)


@triton.jit
def _route_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, H]
    ids_ptr,  # int64 [T, K + S]
    weights_ptr,  # fp32 [T, K + S]
    part_ptr,  # fp32 [T, SPLITS, BLOCK_E]: partial logits (SPLITS > 1)
    count_ptr,  # int32 [T]: 0 between calls (SPLITS > 1)
    H,
    h_per_split,
    stride_xt,
    stride_we,
    routed_scaling,
    E: tl.constexpr,
    K: tl.constexpr,
    S: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    logits = tl.zeros((BLOCK_E,), tl.float32)
    h_begin = split * h_per_split
    h_end = tl.minimum(h_begin + h_per_split, H)
    for h0 in range(h_begin, h_end, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        in_h = offs < h_end
        x = tl.load(x_ptr + token * stride_xt + offs, mask=in_h, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + experts[:, None] * stride_we + offs[None, :],
            mask=valid[:, None] & in_h[None, :],
            other=0.0,
        ).to(tl.float32)
        logits += tl.sum(w * x[None, :], axis=1)
    out = token * (K + S)
    if SPLITS == 1:
        _select(
            logits, experts, valid, ids_ptr, weights_ptr, out, routed_scaling,
            E, K, S, BLOCK_S, SIGMOID, RENORMALIZE,
        )  # fmt: skip
    else:
        # Split over H, as the GEMVs split K: the last program of the token sums the
        # partial logits in a fixed order (a release/acquire counter) and selects.
        part_at = part_ptr + token * SPLITS * BLOCK_E + experts
        tl.store(part_at + split * BLOCK_E, logits)
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + token, 1, sem="acq_rel")
        if done == SPLITS - 1:
            total = tl.zeros((BLOCK_E,), tl.float32)
            for p in tl.static_range(SPLITS):
                total += tl.load(part_at + p * BLOCK_E, cache_modifier=".cg")
            _select(
                total, experts, valid, ids_ptr, weights_ptr, out, routed_scaling,
                E, K, S, BLOCK_S, SIGMOID, RENORMALIZE,
            )  # fmt: skip
            tl.atomic_xchg(count_ptr + token, 0)


def route_fused(
    x: torch.Tensor, weight: torch.Tensor, config: MoeConfig, num_always_on: int = 0
) -> Routing:
    """x [T, H] and router weight [E, H] -> Routing [T, K + num_always_on], in one launch."""
    t, h = x.shape
    num_experts = weight.shape[0]
    if weight.shape != (config.num_experts, h) or num_experts > MAX_EXPERTS:
        raise ValueError(
            f"router weight {tuple(weight.shape)} does not fit x [{t}, {h}] and "
            f"{config.num_experts} experts (at most {MAX_EXPERTS})"
        )
    width = config.top_k + num_always_on
    ids = torch.empty(t, width, dtype=torch.int64, device=x.device)
    weights = torch.empty(t, width, dtype=torch.float32, device=x.device)
    if t:
        x = x.contiguous()
        weight = weight.contiguous()
        block_e = triton.next_power_of_2(num_experts)
        block_h = max(16, min(triton.next_power_of_2(h), 8192 // block_e))
        # Decode: split H so that the weight streams in through many multiprocessors
        # (one program reading all of it waits on memory H / BLOCK_H times in a row).
        splits = min(MAX_SPLITS, triton.cdiv(h, block_h)) if t <= SPLIT_TOKENS else 1
        h_per_split = triton.cdiv(triton.cdiv(h, splits), block_h) * block_h
        splits = triton.cdiv(h, h_per_split)
        part = torch.empty(t, splits, block_e, device=x.device) if splits > 1 else weights
        _route_kernel[(t, splits)](
            x,
            weight,
            ids,
            weights,
            part,
            split_counters(x.device),
            h,
            h_per_split,
            x.stride(0),
            weight.stride(0),
            float(config.routed_scaling),
            E=num_experts,
            K=config.top_k,
            S=num_always_on,
            BLOCK_S=triton.next_power_of_2(max(num_always_on, 1)),
            SIGMOID=config.scoring == "sigmoid",
            RENORMALIZE=config.renormalize,
            SPLITS=splits,
            BLOCK_E=block_e,
            BLOCK_H=block_h,
        )
    return Routing(topk_ids=ids, topk_weights=weights)
