"""A node's tensor-parallel group, started by rank 0 (`edgeserve node --tensor-parallel N`).

Rank 0 is the node process: it loads the model, keeps its shard and runs the engine, whose
runner broadcasts each step (`StepSender`). Ranks 1..N-1 are processes it spawns, one a
device (cuda:r on a GPU; on the CPU every rank shares the cores, on gloo), each loading the
same checkpoint, keeping its own shard and running the worker loop until rank 0 stops it.

Each rank loads the whole checkpoint and then drops what is not its shard: a rank's peak
host memory is the model's, not its shard's.
"""

from __future__ import annotations

import logging
import multiprocessing
import socket
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_node.config import EngineConfig
from gpu_node.models.llama import LlamaModel
from gpu_node.models.tokenizer import ChatTokenizer
from gpu_node.parallel.group import ParallelConfig, destroy_parallel, init_parallel
from gpu_node.parallel.sharding import shard_llama, shard_problems
from gpu_node.parallel.step import StepSender

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 30.0


def rank_device(device: str, rank: int) -> torch.device:
    """Rank `rank`'s device: its own GPU, or the CPU every rank shares."""
    where = torch.device(device)
    return torch.device("cuda", rank) if where.type == "cuda" else where


def check_devices(config: EngineConfig) -> None:
    """ValueError where `config` asks for more ranks than there are GPUs."""
    if torch.device(config.device).type == "cuda":
        num_gpus = torch.cuda.device_count()
        if config.tensor_parallel > num_gpus:
            raise ValueError(
                f"tensor_parallel {config.tensor_parallel} needs as many GPUs; "
                f"this machine has {num_gpus}"
            )


def load_shard(config: EngineConfig, rank: int) -> tuple[LlamaModel, ChatTokenizer]:
    """Rank `rank`'s shard of `config.model` on its device, and the tokenizer; ValueError
    naming why the model cannot be split across `config.tensor_parallel` ranks."""
    from gpu_node.models.weights import build_model

    world_size = config.tensor_parallel
    model, tokenizer = build_model(
        config.model, config.weights, rank_device(config.device, rank),
        activations=config.activations, cpu_kernels=False,
    )  # fmt: skip
    problems = shard_problems(model, world_size)
    if problems:
        raise ValueError(f"{config.model} cannot run on {world_size} ranks: " + "; ".join(problems))
    return shard_llama(model, rank, world_size), tokenizer


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker_main(rank: int, config: EngineConfig, port: int, errors: Any) -> None:
    """A spawned rank's process: its shard, the group, the worker loop until rank 0 stops."""
    from gpu_node.parallel.worker import run_worker

    try:
        if torch.device(config.device).type == "cpu":  # the ranks share the cores
            torch.set_num_threads(max(1, torch.get_num_threads() // config.tensor_parallel))
        shard, _ = load_shard(config, rank)
        parallel = ParallelConfig(rank, config.tensor_parallel, master_port=port)
        group = init_parallel(parallel, rank_device(config.device, rank))
        run_worker(shard, config, group)
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        destroy_parallel()


@dataclass
class TensorParallelGroup:
    """Rank 0's hold on its group: the sender its engine broadcasts through, the workers."""

    sender: StepSender
    processes: list[Any] = field(default_factory=list)
    errors: Any = None
    is_stopped: bool = False

    def stop(self) -> None:
        """Ends the workers' loops and leaves the group; idempotent."""
        if self.is_stopped:
            return
        self.is_stopped = True
        try:
            self.sender.stop()
        finally:
            for process in self.processes:
                process.join(JOIN_TIMEOUT_S)
                if process.is_alive():
                    log.warning("tensor-parallel rank %s did not stop; killing it", process.name)
                    process.kill()
            destroy_parallel()


def start_tensor_parallel(
    config: EngineConfig,
) -> tuple[LlamaModel, ChatTokenizer, TensorParallelGroup]:
    """Spawns ranks 1..N-1, loads rank 0's shard and joins the group with them."""
    check_devices(config)
    if torch.device(config.device).type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // config.tensor_parallel))
    context = multiprocessing.get_context("spawn")  # CUDA and OpenMP do not survive a fork
    errors = context.Queue()
    port = _free_port()
    processes = [
        context.Process(
            target=_worker_main,
            args=(rank, config, port, errors),
            name=f"tp-rank-{rank}",
            daemon=True,
        )
        for rank in range(1, config.tensor_parallel)
    ]
    for process in processes:
        process.start()
    try:
        model, tokenizer = load_shard(config, 0)
        parallel = ParallelConfig(0, config.tensor_parallel, master_port=port)
        group = init_parallel(parallel, rank_device(config.device, 0))
    except BaseException:
        for process in processes:
            process.kill()
        raise
    return model, tokenizer, TensorParallelGroup(StepSender(group), processes, errors)
