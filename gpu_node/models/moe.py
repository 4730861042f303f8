"""The Mixture-of-Experts MLP: a router, top-k routed experts and optional shared experts.

Letters: T tokens, H hidden size, E experts, K top-k, I expert hidden size.
Routing (top-k, assignments grouped by expert) is in moe_routing.py.

`MoeMLP` maps [T, H] -> [T, H] and drops in for a dense layer's `mlp`. Each
token picks K of E experts (the router); each routed expert is a SwiGLU MLP
whose gate and up projections are stored stacked, `w13` [E, 2I, H] (rows 0..I
gate, I..2I up), and down projection `w2` [E, H, I]; the token's output is the
routing-weighted sum of its experts' outputs, plus the shared experts' output.

The plain model holds float experts (`MoeExperts`); `quantize_model` turns them
into `Int4MoeExperts` through `to_int4`, which run the fused Triton kernel on
CUDA and the torch reference elsewhere. Everything in this module is pure
torch, so CPU-only hosts need no Triton.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gpu_node.kernels.moe.reference import moe_experts_ref
from gpu_node.models.moe_routing import (
    Routing,
    route,
    with_always_on,
)
from gpu_node.quant.int4 import (
    Int4ExpertsMMA,
    Int4Weight,
    experts_from_mma,
    experts_to_mma,
    int4_from_gguf_q4_1,
    mma_fits,
    quantize_int4,
)
from gpu_node.quant.linear import Int4Linear, KeepsInt4Dtypes


@dataclass(frozen=True)
class MoeConfig:
    """Shape and routing rule of one MoE MLP (the same for every MoE layer of a model)."""

    hidden_size: int
    num_experts: int
    top_k: int
    expert_hidden_size: int
    num_shared_experts: int = 0
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = True
    routed_scaling: float = 1.0  # multiplies routed weights after renormalisation (DeepSeek-V3)
    # Group-limited routing (DeepSeek-V2's "group_limited_greedy"): the experts split into
    # `num_groups` groups and a token picks its top-k from its `topk_groups` best groups
    # (moe_routing.limit_to_groups); 1: one group, plain top-k.
    num_groups: int = 1
    topk_groups: int = 1

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_experts", "top_k", "expert_hidden_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MoeConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_shared_experts < 0:
            raise ValueError(
                f"MoeConfig.num_shared_experts must be >= 0, got {self.num_shared_experts}"
            )
        if self.top_k > self.num_experts:
            raise ValueError(f"MoeConfig.top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(
                f"MoeConfig.scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}"
            )
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(
                f"MoeConfig.num_groups {self.num_groups} does not divide num_experts "
                f"{self.num_experts}"
            )
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"MoeConfig.topk_groups {self.topk_groups} not in 1..{self.num_groups}"
            )


MOE_CONFIGS: Mapping[str, MoeConfig] = MappingProxyType(
    {
        # Tiny, for CPU tests and `--model moe-small` (dummy weights).
        "moe-small": MoeConfig(
            hidden_size=128, num_experts=8, top_k=2, expert_hidden_size=64, num_shared_experts=1
        ),
        # DeepSeek-V2-Lite's layer shape with one shared expert and top-8: the benchmark config.
        "moe-medium": MoeConfig(
            hidden_size=2048, num_experts=64, top_k=8, expert_hidden_size=1408, num_shared_experts=1
        ),
        # One layer of Kimi-K2 / DeepSeek-V3 (sigmoid routing); used for memory accounting.
        "moe-large": MoeConfig(
            hidden_size=7168,
            num_experts=256,
            top_k=8,
            expert_hidden_size=2048,
            num_shared_experts=1,
            scoring="sigmoid",
            routed_scaling=2.5,
        ),
    }
)


def _map_int4(fn: Callable[..., torch.Tensor], *weights: Int4Weight) -> Int4Weight:
    """Applies `fn` alike to the packed codes, the scales and the mins of `weights` (its
    reshapes and cats move whole groups, so whole 32-value packing chunks)."""
    packed, scales, mins = (
        fn(*(getattr(w, name) for w in weights)).contiguous()
        for name in ("packed", "scales", "mins")
    )
    shape = (*packed.shape[:-1], packed.shape[-1] * 2)
    return Int4Weight(packed, scales, mins, shape, weights[0].group_size)


class Router(nn.Module):
    """Scores experts per token; its weight [E, H] stays in full precision."""

    def __init__(self, config: MoeConfig, weight: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor, num_always_on: int = 0) -> Routing:  # [T, H]
        """Routing [T, K + num_always_on]: the top-k, then experts E .. E + num_always_on - 1
        with weight 1 (folded shared experts). On CUDA in one launch (moe/router.py), but
        for group-limited routing, which the kernel does not do: that runs in torch."""
        c = self.config
        if x.is_cuda and c.num_groups == 1:
            from gpu_node.kernels.moe import router as moe_router
            from gpu_node.kernels.w4a16.dot import is_interpreted

            if not is_interpreted(x) and c.num_experts <= moe_router.MAX_EXPERTS:
                return moe_router.route_fused(x, self.weight, c, num_always_on)
        logits = x.float() @ self.weight.float().T  # [T, E]
        routing = route(
            logits, c.top_k, c.scoring, c.renormalize, c.routed_scaling, c.num_groups,
            c.topk_groups,
        )  # fmt: skip
        if num_always_on:
            routing = with_always_on(routing, c.num_experts, num_always_on)
        return routing


class MoeExperts(nn.Module):
    """The routed experts in full precision: w13 [E, 2I, H], w2 [E, H, I]. On CUDA a GEMV a
    token and expert (kernels/moe/dense.py: nothing waits for the host, so decode steps can
    be recorded in CUDA graphs); elsewhere the reference loop."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)

    @property
    def waits_for_host(self) -> bool:
        """Whether forward asks the host anything (the reference loop, off CUDA), so that a
        step through it cannot be recorded in a CUDA graph."""
        return not self.w13.is_cuda

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        if x.is_cuda:
            from gpu_node.kernels.moe.dense import moe_experts_dense

            return moe_experts_dense(x, self.w13, self.w2, routing)
        return moe_experts_ref(x, self.w13, self.w2, routing)

    def to_int4(self, group_size: int, symmetric: bool = False) -> Int4MoeExperts:
        return Int4MoeExperts(
            quantize_int4(self.w13, group_size, symmetric),
            quantize_int4(self.w2, group_size, symmetric),
        )


class Int4MoeExperts(KeepsInt4Dtypes, nn.Module):
    """The routed experts in INT4; the fused Triton kernel on CUDA, the reference elsewhere."""

    w13_packed: torch.Tensor  # buffers, named for the type checker
    w13_scales: torch.Tensor
    w13_mins: torch.Tensor
    w2_packed: torch.Tensor
    w2_scales: torch.Tensor
    w2_mins: torch.Tensor

    def __init__(self, w13: Int4Weight, w2: Int4Weight) -> None:
        super().__init__()
        if len(w13.shape) != 3 or len(w2.shape) != 3 or w13.group_size != w2.group_size:
            raise ValueError(
                f"expert stacks must be 3-D with one group size: {w13.shape}, {w2.shape}"
            )
        self.w13_shape, self.w2_shape, self.group_size = w13.shape, w2.shape, w13.group_size
        for prefix, w in (("w13", w13), ("w2", w2)):
            self.register_buffer(f"{prefix}_packed", w.packed)
            self.register_buffer(f"{prefix}_scales", w.scales)
            self.register_buffer(f"{prefix}_mins", w.mins)

    @property
    def layout(self) -> Literal["int4", "mma"]:
        """Int4Weight's (uint8 codes) or Int4ExpertsMMA's (int32 tiles, on CUDA)."""
        return "mma" if self.w13_packed.dtype == torch.int32 else "int4"

    def weights(self) -> tuple[Int4Weight, Int4Weight]:
        if self.layout == "mma":
            w13_mma, w2_mma = self.weights_mma()
            return experts_from_mma(w13_mma), experts_from_mma(w2_mma)
        w13 = Int4Weight(
            self.w13_packed, self.w13_scales, self.w13_mins, self.w13_shape, self.group_size
        )
        w2 = Int4Weight(
            self.w2_packed, self.w2_scales, self.w2_mins, self.w2_shape, self.group_size
        )
        return w13, w2

    def weights_mma(self) -> tuple[Int4ExpertsMMA, Int4ExpertsMMA]:
        if self.layout != "mma":
            w13, w2 = self.weights()
            return experts_to_mma(w13, gated=True), experts_to_mma(w2)
        return (
            Int4ExpertsMMA(self.w13_packed, self.w13_shape, self.group_size, gated=True),
            Int4ExpertsMMA(self.w2_packed, self.w2_shape, self.group_size),
        )

    def use_mma_layout(self) -> None:
        """Re-lay the buffers out as Int4ExpertsMMA, in place (the tensor-core kernel's)."""
        if self.layout != "mma":  # experts_to_mma refuses group sizes the kernel cannot take
            w13, w2 = self.weights_mma()
            self.w13_packed, self.w2_packed = w13.tiles, w2.tiles
            empty = self.w13_scales.new_empty(0)  # inside the tiles
            self.w13_scales = self.w13_mins = self.w2_scales = self.w2_mins = empty

    def use_int4_layout(self) -> None:
        """Re-lay the buffers back as Int4Weight, in place (the CUDA-core kernel's and the
        reference's), so callers the tensor-core kernel cannot take convert once, not per call."""
        if self.layout != "int4":
            w13, w2 = self.weights()
            self.w13_packed, self.w13_scales, self.w13_mins = w13.packed, w13.scales, w13.mins
            self.w2_packed, self.w2_scales, self.w2_mins = w2.packed, w2.scales, w2.mins

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        tensor_cores = False
        if x.is_cuda:
            from gpu_node.kernels.moe import mma as moe_mma

            tensor_cores = (
                moe_mma.takes(x, self.group_size)
                and mma_fits(self.w13_shape[2], self.group_size)
                and mma_fits(self.w2_shape[2], self.group_size)
            )
        # bf16/fp16 on CUDA with groups of 32 (K a multiple of 64), 64 or 128: the tensor-core kernel over expert
        # slots; otherwise the fused CUDA-core kernel (CUDA) or the reference. Each path's
        # layout is taken in place when the path changes.
        if tensor_cores:
            self.use_mma_layout()
            return moe_mma.fused_moe_mma(x, *self.weights_mma(), routing)
        self.use_int4_layout()
        if x.is_cuda:
            from gpu_node.kernels.moe.grouped import fused_moe_int4

            return fused_moe_int4(x, *self.weights(), routing)
        return moe_experts_ref(x, *self.weights(), routing)


class SharedExperts(nn.Module):
    """The always-on experts, merged into one SwiGLU MLP of hidden I * num_shared."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        hidden, inner = gate.shape[1], gate.shape[0]
        self.gate_proj = nn.Linear(hidden, inner, bias=False, device=gate.device, dtype=gate.dtype)
        self.up_proj = nn.Linear(hidden, inner, bias=False, device=gate.device, dtype=gate.dtype)
        self.down_proj = nn.Linear(inner, hidden, bias=False, device=gate.device, dtype=gate.dtype)
        with torch.no_grad():
            self.gate_proj.weight.copy_(gate)
            self.up_proj.weight.copy_(up)
            self.down_proj.weight.copy_(down)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoeMLP(nn.Module):
    """[T, H] -> [T, H]: routed experts weighted by the router, plus the shared experts."""

    def __init__(
        self, config: MoeConfig, router: Router, experts: nn.Module, shared: SharedExperts | None
    ) -> None:
        super().__init__()
        self.config = config
        self.router = router
        self.experts = experts
        self.shared = shared
        self.num_always_on = 0  # shared experts folded into `experts`, after the routed ones

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = self.router(x, self.num_always_on)
        y = self.experts(x, routing)
        if self.shared is not None:
            y = y + self.shared(x)
        return y

    def fold_shared_experts(self) -> bool:
        """Moves the shared experts into the expert stack as experts E .. E + S - 1 that
        every token uses with weight 1, so one fused call computes routed and shared
        together (at decode the shared MLP's three GEMVs, its activation and the final
        add were more launches than the routed experts). Same arithmetic: the merged
        shared MLP of hidden S * I is the sum of S SwiGLU experts of hidden I. Float
        stacks take float shared weights, INT4 stacks INT4 ones of the same group size;
        returns False (and changes nothing) for any other mix."""
        shared, experts = self.shared, self.experts
        num_shared, inner = self.config.num_shared_experts, self.config.expert_hidden_size
        if shared is None or not num_shared:
            return False
        projections: tuple[nn.Module, ...] = (shared.gate_proj, shared.up_proj, shared.down_proj)
        if isinstance(experts, MoeExperts) and all(isinstance(p, nn.Linear) for p in projections):
            # [S*I, H], [S*I, H], [H, S*I]
            gate, up, down = (p.weight.data for p in projections if isinstance(p, nn.Linear))
            h = int(gate.shape[1])
            w13 = torch.cat([gate.view(num_shared, inner, h), up.view(num_shared, inner, h)], 1)
            w2 = down.view(h, num_shared, inner).transpose(0, 1)
            self.experts = MoeExperts(
                torch.cat([experts.w13.data, w13]), torch.cat([experts.w2.data, w2])
            )
        elif isinstance(experts, Int4MoeExperts) and all(
            isinstance(p, Int4Linear) and p.group_size == experts.group_size for p in projections
        ):
            gate4, up4, down4 = (p.weight_int4 for p in projections if isinstance(p, Int4Linear))
            w13_e, w2_e = experts.weights()

            def split_rows(t: torch.Tensor) -> torch.Tensor:  # [S*I, C] -> [S, I, C]
                return t.view(num_shared, inner, -1)

            def split_columns(t: torch.Tensor) -> torch.Tensor:  # [H, S*C] -> [S, H, C]
                return t.view(t.shape[0], num_shared, -1).transpose(0, 1)

            def cat_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                return torch.cat([split_rows(a), split_rows(b)], dim=1)

            w13_s = _map_int4(cat_rows, gate4, up4)  # [S, 2I, H]
            w2_s = _map_int4(split_columns, down4)  # [S, H, I]
            self.experts = Int4MoeExperts(
                _map_int4(lambda a, b: torch.cat([a, b]), w13_e, w13_s),
                _map_int4(lambda a, b: torch.cat([a, b]), w2_e, w2_s),
            )
        else:
            return False
        self.shared = None
        self.num_always_on = num_shared
        return True

    @classmethod
    def dummy(
        cls,
        config: MoeConfig,
        seed: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> MoeMLP:
        """Seeded random weights at the config's shape (std 1/sqrt(fan_in), so activations stay O(1))."""
        gen = torch.Generator(device=device).manual_seed(seed)
        h, e, i = config.hidden_size, config.num_experts, config.expert_hidden_size

        def randn(*shape: int) -> torch.Tensor:
            w = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
            return (w / shape[-1] ** 0.5).to(dtype)

        router = Router(config, randn(e, h))
        experts = MoeExperts(randn(e, 2 * i, h), randn(e, h, i))
        shared = None
        if config.num_shared_experts:
            inner = i * config.num_shared_experts
            shared = SharedExperts(randn(inner, h), randn(inner, h), randn(h, inner))
        return cls(config, router, experts, shared)


def _gguf_tensor(reader: Any, name: str) -> Any:
    for t in reader.tensors:
        if t.name == name:
            return t
    raise KeyError(f"GGUF has no tensor {name!r}")


def _gguf_float(reader: Any, name: str, dtype: torch.dtype) -> torch.Tensor:
    import gguf

    t = _gguf_tensor(reader, name)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    values = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape)).to(dtype)


def moe_mlp_from_gguf(
    path: str | Path, layer: int, config: MoeConfig, dtype: torch.dtype = torch.bfloat16
) -> MoeMLP:
    """Loads layer `layer`'s MoE MLP from a GGUF with llama.cpp's tensor names.

    blk.N.ffn_gate_inp.weight [E, H] (router), ffn_{gate,up}_exps [E, I, H],
    ffn_down_exps [E, H, I], and when the config has shared experts
    ffn_{gate,up,down}_shexp. Q4_1 expert stacks become Int4MoeExperts without a
    float copy; any other type is dequantized by the gguf package.
    """
    import gguf

    reader = gguf.GGUFReader(str(path))
    prefix = f"blk.{layer}."
    router = Router(config, _gguf_float(reader, prefix + "ffn_gate_inp.weight", torch.float32))
    names = [prefix + f"ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
    tensors = [_gguf_tensor(reader, n) for n in names]
    experts: nn.Module
    if all(t.tensor_type == gguf.GGMLQuantizationType.Q4_1 for t in tensors):
        gate, up, down = (
            int4_from_gguf_q4_1(t.data, tuple(int(d) for d in reversed(t.shape.tolist())))
            for t in tensors
        )
        w13 = Int4Weight(
            packed=torch.cat([gate.packed, up.packed], dim=1),
            scales=torch.cat([gate.scales, up.scales], dim=1),
            mins=torch.cat([gate.mins, up.mins], dim=1),
            shape=(gate.shape[0], gate.shape[1] * 2, gate.shape[2]),
            group_size=32,
        )
        experts = Int4MoeExperts(w13, down)
    else:
        gate_f, up_f, down_f = (_gguf_float(reader, n, dtype) for n in names)
        experts = MoeExperts(torch.cat([gate_f, up_f], dim=1), down_f)
    shared = None
    if config.num_shared_experts:
        shared = SharedExperts(
            *(
                _gguf_float(reader, prefix + f"ffn_{p}_shexp.weight", dtype)
                for p in ("gate", "up", "down")
            )
        )
    return MoeMLP(config, router, experts, shared)
