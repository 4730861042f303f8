"""KV handoffs over a pair group (gloo here; NCCL between GPUs): a prefill node's handoff
arrives in another process bit for bit as the HTTP path's bytes carry it."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from gpu_node.parallel.kv_transfer import PairGroup
from scheduler.sequence import SamplingParams
from tests.conftest import free_port
from tests.gpu_node.engine.test_handoff import prefill
from tests.gpu_node.parallel.pair_peer import receive

pytestmark = pytest.mark.slow


def test_handoffs_cross_a_pair_group_bit_for_bit_as_over_http(make_engine, chat_ids) -> None:
    ids = chat_ids("Name three colours.")
    sampled = SamplingParams(max_tokens=4, temperature=0.8, seed=11)  # a generator state too
    handoffs = [
        prefill(make_engine(kv_dtype="fp8"), ids, sampled),  # uint8 rows and bf16 scales
        prefill(make_engine(kv_dtype="bf16"), ids, SamplingParams(max_tokens=4)),
    ]
    assert handoffs[0].k_scale is not None and handoffs[0].generator_state is not None
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    receiver = context.Process(target=receive, args=(port, len(handoffs), results), daemon=True)
    receiver.start()
    try:
        pair = PairGroup.join("127.0.0.1", port, rank=0, timeout_s=60)
        for handoff in handoffs:
            pair.send(handoff)
        pair._send(torch.tensor([0], dtype=torch.int64))  # a header of no bytes
        received = [results.get(timeout=60) for _ in range(len(handoffs) + 1)]
        pair.close()
    finally:
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
    assert received[:-1] == [h.to_bytes() for h in handoffs]
    assert received[-1] == "not a KV handoff: a header of 0 bytes"
    assert receiver.exitcode == 0


def test_a_pair_has_two_ranks() -> None:
    with pytest.raises(ValueError, match="a pair has ranks 0 and 1, got 2"):
        PairGroup.join("127.0.0.1", free_port(), rank=2)
