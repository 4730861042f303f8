"""Prefill and mixed steps replayed from piecewise CUDA graphs on a GPU
(gpu_node/engine/step_graphs.py): the eager steps' tokens, bit for bit the logits of the same
padded pieces launched eagerly, and page ownership still checked by the eager attention
between the pieces (seeded weights: the GGUF does not reach the GPU machine)."""

from __future__ import annotations

import random

import pytest
import torch

from scheduler.sequence import SamplingParams
from tests.gpu_node.engine.test_decode_graphs_gpu import (
    _model,
    _record_logits,
    _Tokens,
    needs_cuda,
)

# Prompts of 9 to 101 tokens under a 48-token budget: chunked prefill beside decode rows
PROMPTS = {f"r{i}": [(13 * i + 7 * j) % 4000 + 1 for j in range(9 + 23 * i)] for i in range(5)}
MAX_TOKENS = {"r0": 6, "r1": 30, "r2": 14, "r3": 38, "r4": 22}
BUDGET = 48


def _engine(model, kv_dtype, graphs: bool):
    from gpu_node.config import EngineConfig
    from gpu_node.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model="seeded", device="cuda", kv_dtype=kv_dtype, num_pages=64,
        max_num_batched_tokens=BUDGET, cuda_graph_batch=8 if graphs else 0,
        cuda_graph_tokens=BUDGET if graphs else 0,
    )  # fmt: skip
    return LLMEngine(config, model, _Tokens())


def _generate(engine, prompts=PROMPTS):
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=MAX_TOKENS[rid], ignore_eos=True))
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
    model = _model(weights)
    eager_engine = _engine(model, kv_dtype, graphs=False)
    assert eager_engine.runner.step_graphs is None
    eager = _generate(eager_engine)
    engine = _engine(model, kv_dtype, graphs=True)
    buckets = _piecewise_buckets(engine.runner)
    assert _generate(engine) == eager
    assert [len(eager[r]) for r in PROMPTS] == list(MAX_TOKENS.values())
    # full 48-token steps of chunks and decode rows, and the last prompt chunks' small steps
    assert buckets == {8, 48}
    assert engine.runner.step_graphs.captured == [8, 48]


@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_a_replay_equals_the_same_padded_pieces_launched_eagerly(kv_dtype):
    """Each step's logits, the pieces replayed from graphs or launched eagerly: the same
    bits, with several buckets captured into the one pool and replayed in turn."""
    from gpu_node.engine.step_graphs import StepGraphs

    model = _model("int4 g32")
    runs = []
    for capture in (False, True):
        engine = _engine(model, kv_dtype, graphs=False)
        runner = engine.runner
        runner.step_graphs = StepGraphs.for_runner(runner, BUDGET, capture=capture)
        steps = _record_logits(runner)
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

    model = _model("int4 g32")
    expected = _generate(_engine(model, "fp8", graphs=False))
    engine = _engine(model, "fp8", graphs=True)
    engine.runner.find_violations = lambda chunks, tables=None: [False] * len(chunks)
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=MAX_TOKENS[rid], ignore_eos=True))
    tokens = {rid: [] for rid in PROMPTS}
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
        steps = _record_logits(runner)
        tokens = _generate(engine)
        runs.append((torch.cat(steps), tokens, runner.step_graphs.captured))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]
    assert runs[0][2] == [] and len(runs[1][2]) >= 3, runs[1][2]
