"""The tensor-parallel modules a sharded model holds, and the slicing of a linear's rows or
columns (plain or INT4) they are built from.

A column-parallel linear is a plain module over its rank's rows of the weight: its output
is the rank's slice of the features, and needs no communication. The others end in a
collective over the group (None: the default group):

    RowParallelLinear       x [T, I/N] -> all_reduce(x @ W_r^T) [T, O]    (+ bias once)
    VocabParallelEmbedding  ids [T] -> all_reduce(rows of ids in [start, end), else 0) [T, D]
    VocabParallelHead       x [T, D] -> all_gather(x @ W_r^T) [T, V]

Letters: T tokens, I in features, O out features, D hidden size, V vocabulary, N ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpu_node.quant.int4 import Int4Weight
from gpu_node.quant.linear import Int4Linear


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank `rank`'s rows [start, end) of the vocabulary: ceil(V / N) each, the last fewer."""
    shard = -(-vocab_size // world_size)
    return min(rank * shard, vocab_size), min((rank + 1) * shard, vocab_size)


def _plain_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return linear


def take_rows(module: nn.Module, ranges: list[tuple[int, int]]) -> nn.Module:
    """A linear of the output features in `ranges` ([start, end) each, concatenated in order)
    of `module`, an nn.Linear or an Int4Linear; copies, so the whole weight can be freed."""
    if isinstance(module, nn.Linear):
        weight = torch.cat([module.weight.detach()[a:b] for a, b in ranges])
        bias = module.bias
        rows_bias = None if bias is None else torch.cat([bias.detach()[a:b] for a, b in ranges])
        return _plain_linear(weight, rows_bias)
    if isinstance(module, Int4Linear):
        w = module.weight_int4
        n = sum(b - a for a, b in ranges)
        part = Int4Weight(
            packed=torch.cat([w.packed[a:b] for a, b in ranges]),
            scales=torch.cat([w.scales[a:b] for a, b in ranges]),
            mins=torch.cat([w.mins[a:b] for a, b in ranges]),
            shape=(n, w.shape[1]),
            group_size=w.group_size,
        )
        bias = module.bias
        rows_bias = None if bias is None else torch.cat([bias.detach()[a:b] for a, b in ranges])
        return Int4Linear(part, rows_bias)
    raise ValueError(f"cannot shard a {type(module).__name__}: an nn.Linear or Int4Linear only")


def take_columns(module: nn.Module, start: int, end: int) -> nn.Module:
    """A linear, without bias, of the input features [start, end) of `module` (an nn.Linear,
    or an Int4Linear whose groups the bounds do not cut)."""
    if isinstance(module, nn.Linear):
        return _plain_linear(module.weight.detach()[:, start:end].clone(), None)
    if isinstance(module, Int4Linear):
        w = module.weight_int4
        g = w.group_size
        if start % g or end % g:
            raise ValueError(
                f"columns [{start}, {end}) cut the INT4 groups of {g} of {module.extra_repr()}"
            )
        part = Int4Weight(
            packed=w.packed[:, start // 2 : end // 2].contiguous(),  # two codes a byte
            scales=w.scales[:, start // g : end // g].contiguous(),
            mins=w.mins[:, start // g : end // g].contiguous(),
            shape=(w.shape[0], end - start),
            group_size=g,
        )
        return Int4Linear(part)
    raise ValueError(f"cannot shard a {type(module).__name__}: an nn.Linear or Int4Linear only")


class RowParallelLinear(nn.Module):
    """This rank's input columns of a linear; the ranks' partial products summed by an
    all-reduce, the bias added once after it."""

    def __init__(
        self,
        local: nn.Module,
        bias: torch.Tensor | None = None,
        group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.local = local
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, I/N] -> [T, O]
        y = self.local(x)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, end) of the embedding: ids outside them look up zeros, and an
    all-reduce sums the ranks' rows (one of them non-zero: the sum is exact)."""

    def __init__(self, weight: torch.Tensor, start: int, group: dist.ProcessGroup | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.start, self.end = start, start + weight.shape[0]
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        is_local = (input_ids >= self.start) & (input_ids < self.end)
        local_ids = torch.where(is_local, input_ids - self.start, 0)
        out = F.embedding(local_ids, self.weight).masked_fill_(~is_local[..., None], 0)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(nn.Module):
    """This rank's vocabulary rows of the output head (`local`, any linear); each rank's
    logits padded to ceil(V / N) columns and all-gathered into the whole [T, V]."""

    def __init__(
        self,
        local: nn.Module,
        vocab_size: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.local = local
        self.vocab_size = vocab_size
        self.world_size = world_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, V]
        y = self.local(x)  # [T, V_r]
        if y.shape[0] == 0:  # every rank has the same rows: all skip the collective
            return y.new_empty(0, self.vocab_size)
        shard = -(-self.vocab_size // self.world_size)
        if y.shape[-1] < shard:
            y = F.pad(y, (0, shard - y.shape[-1]))
        parts = [torch.empty_like(y) for _ in range(self.world_size)]
        dist.all_gather(parts, y.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def expert_range(num_experts: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank `rank`'s experts [start, end) of a stack of `num_experts`: ceil(E / N) each, the
    last fewer (vocab_range's rule)."""
    return vocab_range(num_experts, rank, world_size)


class ExpertParallelMoe(nn.Module):
    """One MoE block under expert parallelism: the router on every rank (each sees every
    token's whole routing), this rank's experts [start, end) of the stack (shared experts
    folded into it are experts like any other), the shared experts that are not folded split
    as a column- then row-parallel MLP, and one all-reduce summing the ranks' parts.

    A token's slots that route to another rank's experts point at this rank's first expert
    with weight 0, so every kernel takes the routing as it is ([T, K]): exact, since the
    experts' outputs are summed in fp32 and a zero weight adds nothing."""

    def __init__(
        self,
        mlp: nn.Module,
        experts: nn.Module,
        start: int,
        end: int,
        shared: nn.Module | None,
        group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        self.config = mlp.config
        self.router = mlp.router
        self.num_always_on = mlp.num_always_on
        self.experts = experts
        self.start, self.end = start, end
        self.shared = shared
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        from gpu_node.models.moe_routing import Routing

        routing = self.router(x, self.num_always_on)
        ids = routing.topk_ids
        is_local = (ids >= self.start) & (ids < self.end)
        local = Routing(
            torch.where(is_local, ids - self.start, 0),
            torch.where(is_local, routing.topk_weights, 0.0),
        )
        y = self.experts(x, local)
        if self.shared is not None:
            y = y + self.shared(x)
        dist.all_reduce(y, group=self.group)
        return y
