"""The loop of a tensor-parallel rank past 0: it holds its shard of the model and its share
of the KV pool (its KV heads, every page), and runs each step rank 0 broadcasts.

Rank 0 runs the engine (scheduler, block manager, sampling) with `StepSender` as its
`step_broadcast`; its forward and every worker's meet in the same collectives, layer by
layer. A worker computes the whole logits too (the head all-gathers them) and drops them.
"""

from __future__ import annotations

import torch

from gpu_node.cache.kv_cache import build_kv_cache
from gpu_node.config import EngineConfig
from gpu_node.engine.attention import PagedAttention
from gpu_node.models.llama import LlamaModel
from gpu_node.parallel.group import ParallelGroup
from gpu_node.parallel.step import StepReceiver


@torch.inference_mode()
def run_worker(model: LlamaModel, config: EngineConfig, group: ParallelGroup) -> int:
    """Runs rank `group.rank`'s shard (`model`, from shard_llama) of every step rank 0
    sends, until it stops; returns how many steps ran. `config` is rank 0's engine config,
    which sizes the pool alike on every rank."""
    if group.rank == 0:
        raise ValueError("rank 0 runs the engine, not a worker loop")
    mc = model.config
    kv_cache = build_kv_cache(config, mc)
    receiver = StepReceiver(group, kv_cache.uses_kernels)
    num_steps = 0
    while (step := receiver.receive()) is not None:
        num_pages = len(step.metadata.page_owner)
        if num_pages != kv_cache.num_pages:
            raise ValueError(
                f"rank 0's pool has {num_pages} pages, rank {group.rank}'s {kv_cache.num_pages}: "
                f"the ranks were given different engine configs"
            )
        attention = PagedAttention(
            kv_cache, step.metadata, mc.attention_scale, config.check_integrity, mc.layer_windows
        )
        model(step.input_ids, step.positions, attention, logits_indices=step.logits_indices)
        num_steps += 1
    return num_steps
