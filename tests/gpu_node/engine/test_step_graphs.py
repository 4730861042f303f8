"""Prefill and mixed steps from piecewise CUDA graphs (step_graphs.py), what a CPU can
check: the token buckets, which steps are taken, the context index built once a step, and,
with the pieces run eagerly (`capture=False`), that the padded pieces give the engine's own
tokens and write nothing but the step's own slots. The captured graphs run in
tests/gpu_node/engine/test_step_graphs_gpu.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from gpu_node.config import EngineConfig
from gpu_node.engine.attention import ContextIndex, gathering_chunks
from gpu_node.engine.step_graphs import StepGraphs, token_bucket
from scheduler.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = [
    "What is the capital of France?",
    "Name three colours, then write a short sentence about each of them.",
    "Count from one to five, then say done.",
]


def pieces(engine, max_tokens: int = 64) -> list[tuple[int, int]]:
    """Routes the engine's steps through the padded pieces, run eagerly; returns the list
    that each step's (tokens, bucket) is appended to."""
    graphs = StepGraphs.for_runner(engine.runner, max_tokens, capture=False)
    engine.runner.step_graphs = graphs
    calls: list[tuple[int, int]] = []
    run = graphs.run

    def record(ids, positions, attention, logits_indices):
        calls.append((len(ids), token_bucket(len(ids), max_tokens)))
        return run(ids, positions, attention, logits_indices)

    graphs.run = record
    return calls


def test_token_buckets_are_powers_of_two_and_three_quarters_of_them() -> None:
    sizes = (1, 2, 3, 5, 8, 9, 16, 17, 24, 25, 32, 33, 48, 49, 64, 65, 100, 1500, 1536, 1537)
    assert [token_bucket(n, 2048) for n in sizes] == [
        1, 2, 4, 8, 8, 16, 16, 24, 24, 32, 32, 48, 48, 64, 64, 96, 128, 1536, 1536, 2048,
    ]  # fmt: skip
    assert token_bucket(2048, 2048) == 2048
    assert token_bucket(700, 640) is None
    assert token_bucket(600, 640) == 640  # the cap itself is a bucket
    assert token_bucket(5, 6) == 6
    assert token_bucket(0, 2048) is None
    assert token_bucket(2049, 2048) is None


def test_only_steps_within_the_largest_bucket_are_taken(make_engine) -> None:
    graphs = StepGraphs.for_runner(make_engine().runner, 640, capture=False)
    assert graphs.takes(1) and graphs.takes(640)
    assert not graphs.takes(641)
    graphs.disabled = True
    assert not graphs.takes(16)
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        StepGraphs.for_runner(make_engine().runner, 0)


def test_the_padded_pieces_give_the_engines_own_tokens(make_engine, chat_ids) -> None:
    """A 32-token budget splits the prompts into chunks beside the decode rows of the
    others: prefill, mixed and decode steps all go through the pieces, most of them padded."""
    prompts = {f"r{i}": chat_ids(text) for i, text in enumerate(PROMPTS)}
    plain = make_engine(max_num_batched_tokens=32).generate(prompts, GREEDY)
    engine = make_engine(max_num_batched_tokens=32)
    calls = pieces(engine, 32)
    assert engine.generate(prompts, GREEDY) == plain
    assert all(len(tokens) == GREEDY.max_tokens for tokens in plain.values())
    assert (32, 32) in calls  # full prefill steps
    assert (3, 4) in calls  # three decode rows, padded to 4
    assert any(t not in (3, 32) and t != b for t, b in calls)  # a mixed step, padded
    prompt_tokens = sum(len(ids) for ids in prompts.values())
    decode_tokens = (GREEDY.max_tokens - 1) * len(prompts)
    assert sum(t for t, _ in calls) == prompt_tokens + decode_tokens


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
def test_pad_rows_write_no_kv(make_engine, chat_ids, kv_dtype) -> None:
    """A 21-token prompt runs in a bucket of 24: the pool changes at its 21 slots only."""
    engine = make_engine(kv_dtype=kv_dtype)
    calls = pieces(engine)
    ids = chat_ids("Hello there")[:21]
    assert len(ids) == 21
    kv = engine.kv_cache
    before = [t.clone() for t in kv.k_cache + kv.v_cache]
    engine.add_request("r0", ids, GREEDY)
    engine.step()
    assert calls == [(21, 24)]
    (seq,) = engine.scheduler.running
    slots = {seq.block_table[p // 16] * 16 + p % 16 for p in range(21)}
    changed = set()
    for old, new in zip(before, kv.k_cache + kv.v_cache, strict=True):
        rows = (old != new).reshape(kv.num_pages * 16, -1).any(dim=1)  # [slots]
        changed |= set(torch.nonzero(rows).flatten().tolist())
    assert changed == slots


def test_a_foreign_page_is_refused_with_the_pieces_as_without(make_engine, chat_ids) -> None:
    from gpu_node.faults import FaultInjector

    finals = []
    for use_pieces in (False, True):
        engine = make_engine(max_num_batched_tokens=32)
        if use_pieces:
            pieces(engine, 32)
        for i, text in enumerate(PROMPTS):
            engine.add_request(f"r{i}", chat_ids(text), GREEDY)
        outcome, tokens = {}, {f"r{i}": 0 for i in range(len(PROMPTS))}
        for step in range(1000):
            if step == 3:  # r1's prompt is still being computed
                FaultInjector(engine, random.Random(0)).point_at_foreign_page("r1", "r0")
            if not engine.has_unfinished():
                break
            for out in engine.step():
                tokens[out.request_id] += len(out.token_ids)
                if out.finished:
                    outcome[out.request_id] = (out.finish_reason, tokens[out.request_id])
        finals.append(outcome)
    assert finals[0] == finals[1]
    assert finals[1]["r1"][0] == "error"
    assert finals[1]["r0"] == ("length", GREEDY.max_tokens)


def test_the_context_index_is_each_gathering_chunks_pages_and_offsets() -> None:
    tables = np.array([[7, 2, 0], [5, 0, 0], [3, 4, 6]], dtype=np.int64)
    assert gathering_chunks([5, 1, 3], uses_kernels=True) == [0, 2]
    assert gathering_chunks([5, 1, 3], uses_kernels=False) == [0, 1, 2]
    index = ContextIndex.on_host(tables, [6, 2, 9], [0, 2], 4, 8, torch.device("cpu"))
    assert index.starts == {0: 0, 2: 6}
    pages, offsets = index.of(0, 6)
    assert pages.tolist() == [7, 7, 7, 7, 2, 2] and offsets.tolist() == [0, 1, 2, 3, 0, 1]
    pages, offsets = index.of(2, 9)
    assert pages.tolist() == [3] * 4 + [4] * 4 + [6]
    assert offsets.tolist() == [0, 1, 2, 3] * 2 + [0]
    with pytest.raises(ValueError, match=r"page id outside \[0, 6\)"):
        ContextIndex.on_host(tables, [6, 2, 9], [2], 4, 6, torch.device("cpu"))
    with pytest.raises(ValueError, match="chunk 1: 13 tokens do not fit its block table"):
        ContextIndex.on_host(tables, [6, 13, 9], [1], 4, 8, torch.device("cpu"))


def test_cuda_graph_tokens_defaults_to_2048_and_refuses_negatives() -> None:
    assert EngineConfig().cuda_graph_tokens == 2048
    with pytest.raises(ValueError, match="cuda_graph_tokens must be >= 0, got -1"):
        EngineConfig(cuda_graph_tokens=-1)


def test_a_cpu_engine_has_no_step_graphs(make_engine) -> None:
    assert make_engine().runner.step_graphs is None
