"""Prefill and mixed steps from piecewise CUDA graphs (step_graphs.py). What a CPU can
check: the token buckets, which steps are taken, the context index built once a step, and,
with the pieces run eagerly (`capture=False`), that the padded pieces give the engine's own
tokens and write nothing but the step's own slots. On a GPU, the pieces replayed: the eager
steps' tokens, bit for bit the logits of the same padded pieces launched eagerly, and page
ownership still checked by the eager attention between the pieces (seeded weights: the GGUF
does not reach the GPU machine)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from gpu_node.config import EngineConfig
from gpu_node.engine.attention import ContextIndex, gathering_chunks
from gpu_node.engine.step_graphs import StepGraphs, token_bucket
from scheduler.sequence import SamplingParams
from tests.gpu_node.helpers import (
    SEEDED_MAX_TOKENS,
    SEEDED_PROMPTS,
    StubTokenizer,
    needs_cuda,
    record_logits,
    seeded_model,
)

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


# -- captured pieces on a GPU ----------------------------------------------------------


# The seeded prompts, 9 to 101 tokens, under a 48-token budget: chunked prefill beside
# decode rows
BUDGET = 48


def _engine(model, kv_dtype, graphs: bool):
    from gpu_node.config import EngineConfig
    from gpu_node.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model="seeded", device="cuda", kv_dtype=kv_dtype, num_pages=64,
        max_num_batched_tokens=BUDGET, cuda_graph_batch=8 if graphs else 0,
        cuda_graph_tokens=BUDGET if graphs else 0,
    )  # fmt: skip
    return LLMEngine(config, model, StubTokenizer())


def _generate(engine, prompts=SEEDED_PROMPTS):
    for rid, ids in prompts.items():
        engine.add_request(
            rid, ids, SamplingParams(max_tokens=SEEDED_MAX_TOKENS[rid], ignore_eos=True)
        )
    tokens = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    return tokens


def _piecewise_buckets(runner):
    """The bucket of each step from now on that the decode graphs do not take (more than 8
    rows, or a prompt chunk among them), as the step graphs will pad it."""
    from gpu_node.engine.step_graphs import token_bucket

    buckets, run = set(), runner.run

    def record(chunks, tables=None):
        if len(chunks) > 8 or any(c.num_new_tokens > 1 for c in chunks):
            buckets.add(token_bucket(sum(c.num_new_tokens for c in chunks), BUDGET))
        return run(chunks, tables)

    runner.run = record
    return buckets


@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("weights", ["bf16", "int4 g32", "int4 g128"])
def test_step_graphs_give_the_eager_tokens(weights, kv_dtype):
    model = seeded_model(weights)
    eager_engine = _engine(model, kv_dtype, graphs=False)
    assert eager_engine.runner.step_graphs is None
    eager = _generate(eager_engine)
    engine = _engine(model, kv_dtype, graphs=True)
    buckets = _piecewise_buckets(engine.runner)
    assert _generate(engine) == eager
    assert [len(eager[r]) for r in SEEDED_PROMPTS] == list(SEEDED_MAX_TOKENS.values())
    # full 48-token steps of chunks and decode rows, and the last prompt chunks' small steps
    assert buckets == {8, 48}
    assert engine.runner.step_graphs.captured == [8, 48]


@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_a_replay_equals_the_same_padded_pieces_launched_eagerly(kv_dtype):
    """Each step's logits, the pieces replayed from graphs or launched eagerly: the same
    bits, with several buckets captured into the one pool and replayed in turn."""
    from gpu_node.engine.step_graphs import StepGraphs

    model = seeded_model("int4 g32")
    runs = []
    for capture in (False, True):
        engine = _engine(model, kv_dtype, graphs=False)
        runner = engine.runner
        runner.step_graphs = StepGraphs.for_runner(runner, BUDGET, capture=capture)
        steps = record_logits(runner)
        _generate(engine)
        runs.append((torch.cat(steps), runner.step_graphs.captured))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1] == [] and len(runs[1][1]) >= 3, runs[1][1]


@needs_cuda
def test_attention_between_the_pieces_refuses_a_foreign_page():
    """The host check is bypassed, so only the eager attention's kernels between the
    replayed pieces can see that r4's table points at r0's page while r4's prompt is still
    being computed; r4 is aborted, the others finish with the eager tokens."""
    from gpu_node.faults import FaultInjector

    model = seeded_model("int4 g32")
    expected = _generate(_engine(model, "fp8", graphs=False))
    engine = _engine(model, "fp8", graphs=True)
    engine.runner.find_violations = lambda chunks, tables=None: [False] * len(chunks)
    for rid, ids in SEEDED_PROMPTS.items():
        engine.add_request(
            rid, ids, SamplingParams(max_tokens=SEEDED_MAX_TOKENS[rid], ignore_eos=True)
        )
    tokens = {rid: [] for rid in SEEDED_PROMPTS}
    finals = {}
    for step in range(1000):
        if step == 4:  # buckets captured and replayed; r4's prompt not done
            assert engine.runner.step_graphs.captured
            r4 = next(s for s in engine.scheduler.running if s.request_id == "r4")
            assert r4.num_computed_tokens < r4.num_prompt_tokens
            FaultInjector(engine, random.Random(0)).point_at_foreign_page("r4", "r0")
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                finals[out.request_id] = out.finish_reason
    assert finals == {"r0": "length", "r1": "length", "r2": "length", "r3": "length", "r4": "error"}
    assert engine.num_integrity_violations == 1
    assert {r: t for r, t in tokens.items() if r != "r4"} == {
        r: t for r, t in expected.items() if r != "r4"
    }


@needs_cuda
@pytest.mark.parametrize("experts", ["int4", "bf16"])
def test_moe_steps_from_the_pieces_equal_the_pieces_launched_eagerly(experts):
    """MoE steps replay too. Against the unpadded eager step the tokens may differ: the
    expert kernels' split of K is planned from the step's token count (moe_mma_config),
    and one token takes its own two-launch path, so padding can change the order of a sum.
    Against the same padded pieces launched eagerly, each step's logits are the same bits."""
    from gpu_node.engine.step_graphs import StepGraphs
    from gpu_node.models.llama import fuse_projections
    from gpu_node.models.weights import moe_model
    from gpu_node.quant.linear import quantize_model

    model = moe_model("moe-small", device="cuda").to(torch.bfloat16)
    if experts == "int4":
        quantize_model(model, group_size=32, skip=("lm_head", "embed_tokens", "router"))
    model = fuse_projections(model)
    runs = []
    for capture in (False, True):
        engine = _engine(model, "fp8", graphs=False)
        runner = engine.runner
        runner.step_graphs = StepGraphs.for_runner(runner, BUDGET, capture=capture)
        steps = record_logits(runner)
        tokens = _generate(engine)
        runs.append((torch.cat(steps), tokens, runner.step_graphs.captured))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]
    assert runs[0][2] == [] and len(runs[1][2]) >= 3, runs[1][2]
