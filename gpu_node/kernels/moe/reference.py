"""The torch reference of the routed experts, which every MoE kernel is compared with."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_node.models.moe_routing import Routing
from gpu_node.quant.int4 import Int4Weight, dequantize_int4, int4_expert


def _expert_weight(w: torch.Tensor | Int4Weight, e: int) -> torch.Tensor:
    """One expert's dense weight [rows, cols]: INT4 dequantized to fp32, float as stored."""
    if isinstance(w, Int4Weight):
        return dequantize_int4(int4_expert(w, e))
    return w[e]


def moe_experts_ref(
    x: torch.Tensor, w13: torch.Tensor | Int4Weight, w2: torch.Tensor | Int4Weight, routing: Routing
) -> torch.Tensor:
    """Plain torch reference of the routed experts: x [T, H] -> [T, H] in x's dtype.

    Loops over the experts that received tokens. INT4 weights are dequantized
    one expert at a time and multiplied in fp32; float weights are multiplied
    in their own dtype (the bf16 serving path; fp32 accumulation on GPU).
    """
    dtype = torch.float32 if isinstance(w13, Int4Weight) else w13.dtype
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    ids = routing.topk_ids
    for e in torch.unique(ids).tolist():
        tokens, ks = torch.nonzero(ids == e, as_tuple=True)
        gate_up = x[tokens].to(dtype) @ _expert_weight(w13, e).T  # [t, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ _expert_weight(w2, e).T  # [t, H]
        out.index_add_(0, tokens, y.float() * routing.topk_weights[tokens, ks, None])
    return out.to(x.dtype)
