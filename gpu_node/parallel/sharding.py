"""Tensor parallelism for the dense llama family, applied to a built model by module
replacement (the model code knows nothing of it).

Rank r of N keeps, per layer:

    q/k/v_proj   column-parallel by heads: query heads [r H/N, (r+1) H/N), KV heads
                 [r K/N, (r+1) K/N) (a query head's KV head stays on its rank)
    o_proj       row-parallel over those heads' columns, then all-reduce
    gate/up_proj column-parallel: F/N rows each
    down_proj    row-parallel over those F/N columns, then all-reduce

and the embedding and the head vocabulary-parallel (layers.py). An MoE block is expert-
parallel instead (ExpertParallelMoe): the router on every rank, rank r's experts of the
stack [r E/N, (r+1) E/N) (rounded up; shared experts folded into the stack count as
experts), unfolded shared experts column- then row-parallel, one all-reduce. Fused projections
(`fuse_projections`) are sharded part by part. Weights are plain or INT4 (`Int4Linear`,
whose row-parallel columns must not cut a quantization group).

The model's `config` becomes the rank's: its heads and MLP width are the shard's (what the
KV pool and the attention are sized by), its hidden size and vocabulary the whole model's
(the embedding takes and the head gives whole rows).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from gpu_node.models.config import ModelConfig
from gpu_node.models.llama import LlamaAttention, LlamaMLP, LlamaModel
from gpu_node.models.moe import Int4MoeExperts, MoeExperts, MoeMLP, SharedExperts
from gpu_node.parallel.layers import (
    ExpertParallelMoe,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    expert_range,
    take_columns,
    take_rows,
    vocab_range,
)
from gpu_node.quant.int4 import Int4Weight
from gpu_node.quant.linear import Int4Linear


def shard_problems(model: LlamaModel, world_size: int) -> list[str]:
    """Why `model` cannot be split across `world_size` ranks (empty: it can)."""
    config = model.config
    problems = []
    if config.num_heads % world_size:
        problems.append(f"{config.num_heads} query heads do not divide by {world_size} ranks")
    if config.num_kv_heads % world_size:
        problems.append(f"{config.num_kv_heads} KV heads do not divide by {world_size} ranks")
    has_dense_mlp = any(isinstance(getattr(la, "mlp", None), LlamaMLP) for la in model.layers)
    if has_dense_mlp and config.intermediate_size % world_size:
        problems.append(
            f"the MLP's {config.intermediate_size} features do not divide by {world_size} ranks"
        )
    start, end = vocab_range(config.vocab_size, world_size - 1, world_size)
    if start == end:
        problems.append(f"a vocabulary of {config.vocab_size} leaves rank {world_size - 1} none")
    if problems:
        return problems
    heads_width = config.num_heads // world_size * config.head_dim
    mlp_width = config.intermediate_size // world_size
    for i, layer in enumerate(model.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not isinstance(attn, LlamaAttention) or not isinstance(mlp, LlamaMLP | MoeMLP):
            problems.append(
                f"layer {i} is a {type(attn).__name__} and a {type(mlp).__name__}: only "
                f"LlamaAttention with a LlamaMLP or a MoeMLP is sharded"
            )
            continue
        checked = [("o_proj", attn.o_proj, heads_width)]
        if isinstance(mlp, MoeMLP):
            problems += _moe_problems(i, mlp, world_size)
        else:
            checked.append(("down_proj", mlp.down_proj, mlp_width))
        for name, module, width in checked:
            if isinstance(module, Int4Linear) and width % module.group_size:
                problems.append(
                    f"layer {i}'s {name}: {width} columns a rank cut its INT4 groups of "
                    f"{module.group_size}"
                )
    if not isinstance(model.embed_tokens, nn.Embedding):
        problems.append(f"embed_tokens is a {type(model.embed_tokens).__name__}, not sharded")
    if not isinstance(model.lm_head, nn.Linear | Int4Linear):
        problems.append(f"lm_head is a {type(model.lm_head).__name__}, not sharded")
    return problems


def _moe_problems(i: int, mlp: MoeMLP, world_size: int) -> list[str]:
    problems = []
    if not isinstance(mlp.experts, MoeExperts | Int4MoeExperts):
        problems.append(f"layer {i}'s experts are a {type(mlp.experts).__name__}, not sharded")
        return problems
    num_experts = (
        mlp.experts.w13.shape[0]
        if isinstance(mlp.experts, MoeExperts)
        else (mlp.experts.w13_shape[0])
    )
    if expert_range(num_experts, world_size - 1, world_size)[0] >= num_experts:
        problems.append(f"layer {i}'s {num_experts} experts leave rank {world_size - 1} none")
    if mlp.shared is not None:
        inner = mlp.shared.gate_proj.weight.shape[0]
        if inner % world_size:
            problems.append(
                f"layer {i}'s shared experts' {inner} features do not divide by {world_size} ranks"
            )
        if any(not isinstance(p, nn.Linear) for p in _shared_projections(mlp.shared)):
            problems.append(f"layer {i}'s shared experts are not plain linears, not sharded")
    return problems


def _shared_projections(shared: SharedExperts) -> tuple[nn.Module, nn.Module, nn.Module]:
    return shared.gate_proj, shared.up_proj, shared.down_proj


def shard_llama(
    model: LlamaModel,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None = None,
) -> LlamaModel:
    """Keeps rank `rank`'s shard of `model` for a group of `world_size` ranks, in place, and
    returns it; its collectives run on `group` (None: the default group, looked up at each
    call, so a shard can be built before its process joins the group).

    Raises ValueError, `model` untouched, where the model cannot be split so (heads, KV
    heads or the MLP not divisible by `world_size`; a layer not of the dense llama kind).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if problems := shard_problems(model, world_size):
        raise ValueError(
            f"cannot shard {model.config.architecture} across {world_size} ranks: "
            + "; ".join(problems)
        )
    if world_size == 1:
        return model
    config = model.config
    model.cpu_kernels = False  # the C decode plan covers whole models only
    for layer in model.layers:
        _shard_attention(layer.self_attn, config, rank, world_size, group)
        if isinstance(layer.mlp, MoeMLP):
            layer.mlp = _shard_moe(layer.mlp, rank, world_size, group)
        else:
            _shard_mlp(layer.mlp, config, rank, world_size, group)
    _shard_vocabulary(model, rank, world_size, group)
    model.config = _rank_config(config, world_size)
    return model


def _rank_config(config: ModelConfig, world_size: int) -> ModelConfig:
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // world_size,
        num_kv_heads=config.num_kv_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
    )


def _shard_attention(
    attn: LlamaAttention,
    config: ModelConfig,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
) -> None:
    e = config.head_dim
    h, kv = config.num_heads // world_size, config.num_kv_heads // world_size
    q = (rank * h * e, (rank + 1) * h * e)  # this rank's rows of q_proj
    k = (rank * kv * e, (rank + 1) * kv * e)  # of k_proj, and of v_proj
    if attn.qkv_proj is not None:  # rows [q | k | v] of one weight
        q_rows, k_rows = config.num_heads * e, config.num_kv_heads * e
        attn.qkv_proj = take_rows(
            attn.qkv_proj,
            [q, (q_rows + k[0], q_rows + k[1]), (q_rows + k_rows + k[0], q_rows + k_rows + k[1])],
        )
    else:
        attn.q_proj = take_rows(attn.q_proj, [q])
        attn.k_proj = take_rows(attn.k_proj, [k])
        attn.v_proj = take_rows(attn.v_proj, [k])
    attn.o_proj = _row_parallel(attn.o_proj, *q, group)
    attn.num_heads, attn.num_kv_heads = h, kv


def _shard_mlp(
    mlp: LlamaMLP,
    config: ModelConfig,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
) -> None:
    f = config.intermediate_size
    part = f // world_size
    rows = (rank * part, (rank + 1) * part)
    if mlp.gate_up_proj is not None:  # rows [gate | up]: the local [gate_r | up_r] chunks alike
        mlp.gate_up_proj = take_rows(mlp.gate_up_proj, [rows, (f + rows[0], f + rows[1])])
    else:
        mlp.gate_proj = take_rows(mlp.gate_proj, [rows])
        mlp.up_proj = take_rows(mlp.up_proj, [rows])
    mlp.down_proj = _row_parallel(mlp.down_proj, *rows, group)


def _shard_moe(
    mlp: MoeMLP, rank: int, world_size: int, group: dist.ProcessGroup | None
) -> ExpertParallelMoe:
    experts = mlp.experts
    if isinstance(experts, Int4MoeExperts):
        experts.use_int4_layout()  # slicing takes Int4Weight's rows of whole experts
        w13, w2 = experts.weights()
        start, end = expert_range(w13.shape[0], rank, world_size)
        local: torch.nn.Module = Int4MoeExperts(
            _experts_of(w13, start, end), _experts_of(w2, start, end)
        )
    else:
        assert isinstance(experts, MoeExperts)
        start, end = expert_range(experts.w13.shape[0], rank, world_size)
        local = MoeExperts(
            experts.w13.detach()[start:end].clone(), experts.w2.detach()[start:end].clone()
        )
    shared = None
    if mlp.shared is not None:
        gate, up, down = _shared_projections(mlp.shared)
        inner = gate.weight.shape[0] // world_size
        rows = (rank * inner, (rank + 1) * inner)
        shared = SharedExperts(
            gate.weight.detach()[rows[0] : rows[1]],
            up.weight.detach()[rows[0] : rows[1]],
            down.weight.detach()[:, rows[0] : rows[1]],
        )  # its partial sum joins the experts' in the block's one all-reduce
    return ExpertParallelMoe(mlp, local, start, end, shared, group)


def _experts_of(w: Int4Weight, start: int, end: int) -> Int4Weight:
    return Int4Weight(
        w.packed[start:end].clone(), w.scales[start:end].clone(), w.mins[start:end].clone(),
        (end - start, *w.shape[1:]), w.group_size,
    )  # fmt: skip


def _row_parallel(
    module: nn.Module, start: int, end: int, group: dist.ProcessGroup | None
) -> RowParallelLinear:
    bias = getattr(module, "bias", None)
    return RowParallelLinear(take_columns(module, start, end), bias, group)


def _shard_vocabulary(
    model: LlamaModel, rank: int, world_size: int, group: dist.ProcessGroup | None
) -> None:
    config = model.config
    start, end = vocab_range(config.vocab_size, rank, world_size)
    tied = isinstance(model.lm_head, nn.Linear) and (
        model.lm_head.weight is model.embed_tokens.weight
    )
    embedding = VocabParallelEmbedding(model.embed_tokens.weight[start:end].clone(), start, group)
    if tied:  # one tensor for both, as in the whole model
        head: nn.Module = nn.Linear(config.hidden_size, end - start, bias=False, device="meta")
        head.weight = embedding.weight
    else:
        head = take_rows(model.lm_head, [(start, end)])
    model.embed_tokens = embedding  # type: ignore[assignment]
    model.lm_head = VocabParallelHead(head, config.vocab_size, world_size, group)  # type: ignore[assignment]
