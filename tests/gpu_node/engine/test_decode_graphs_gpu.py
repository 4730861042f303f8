"""Decode steps replayed from CUDA graphs on a GPU (gpu_node/engine/decode_graphs.py): the same
tokens as eager steps, bit for bit the same logits as the same padded step launched
eagerly, and the ownership check inside the captured kernels (seeded weights: the GGUF
does not reach the GPU machine)."""

from __future__ import annotations

import os

import pytest
import torch

from scheduler.sequence import SamplingParams

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU with compiled kernels",
)

# max_tokens differ, so the batch shrinks 5 -> 4 -> 3 -> 2 -> 1: buckets 8, 4, 2 and 1 run
PROMPTS = {f"r{i}": [(13 * i + 7 * j) % 4000 + 1 for j in range(9 + 23 * i)] for i in range(5)}
MAX_TOKENS = {"r0": 6, "r1": 30, "r2": 14, "r3": 38, "r4": 22}


class _Tokens:
    """The engine needs a tokenizer only to detokenize and stop."""

    stop_token_ids = frozenset()
    eos_token_id = -1

    def decode(self, ids, skip_special_tokens=True):
        return ""


def _model(weights):
    from gpu_node.models.config import ModelConfig
    from gpu_node.models.llama import fuse_projections
    from gpu_node.models.weights import seeded_llama
    from gpu_node.quant.linear import quantize_model

    shape = ModelConfig(
        architecture="llama", num_layers=4, hidden_size=256, intermediate_size=512,
        num_heads=8, num_kv_heads=2, head_dim=64, vocab_size=4096,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
    )  # fmt: skip
    model = seeded_llama(shape, seed=1, device="cuda").to(torch.bfloat16)
    if weights != "bf16":
        quantize_model(
            model, group_size=int(weights[len("int4 g") :]), skip=("lm_head", "embed_tokens")
        )
    return fuse_projections(model)  # as a GPU node serves it


def _engine(model, kv_dtype, cuda_graph_batch):
    from gpu_node.config import EngineConfig
    from gpu_node.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model="seeded", device="cuda", kv_dtype=kv_dtype, num_pages=64,
        cuda_graph_batch=cuda_graph_batch, cuda_graph_tokens=0,  # decode graphs alone
    )  # fmt: skip
    return LLMEngine(config, model, _Tokens())


def _generate(engine):
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=MAX_TOKENS[rid], ignore_eos=True))
    tokens = {rid: [] for rid in PROMPTS}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    return tokens


@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("weights", ["bf16", "int4 g32", "int4 g128"])
def test_graph_steps_give_the_eager_tokens(weights, kv_dtype):
    model = _model(weights)
    eager = _generate(_engine(model, kv_dtype, 0))
    engine = _engine(model, kv_dtype, 8)
    assert engine.runner.graphs is not None
    assert _generate(engine) == eager
    assert [len(eager[r]) for r in PROMPTS] == list(MAX_TOKENS.values())
    # buckets 8, 4, 2 and 1, all within the first context bucket (256 tokens)
    assert engine.runner.graphs.captured == [(1, 256), (2, 256), (4, 256), (8, 256)]


def _record_logits(runner):
    """The logits of each step the runner runs from now on."""
    steps, run = [], runner.run

    def record(chunks, tables=None):
        result = run(chunks, tables)
        steps.append(result.logits.clone())
        return result

    runner.run = record
    return steps


@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_a_replay_equals_the_same_padded_step_launched_eagerly(kv_dtype):
    from gpu_node.engine.decode_graphs import DecodeGraphs

    model = _model("int4 g32")
    logits = []
    for capture in (False, True):
        engine = _engine(model, kv_dtype, 0)
        runner = engine.runner
        runner.graphs = DecodeGraphs.for_runner(runner, 8, engine.max_model_len, capture=capture)
        for rid, ids in list(PROMPTS.items())[:3]:
            engine.add_request(rid, ids, SamplingParams(max_tokens=8, ignore_eos=True))
        engine.step()  # the prompts
        steps = _record_logits(runner)
        for _ in range(4):
            engine.step()
        logits.append(torch.cat(steps))
        assert len(runner.graphs.captured) == (1 if capture else 0)
    assert torch.equal(logits[0], logits[1])


@needs_cuda
@pytest.mark.parametrize("weights", ["int4 g128", "bf16"])
def test_small_kernels_releasing_the_next_change_no_bit(weights):
    """RMSNorm, silu-and-multiply and the attention merge let the next kernel launch from
    their start (the INT4 GEMV then waits before it reads their output): the replayed
    steps' logits are the same bits as with every launch in order."""
    from gpu_node.kernels import launch

    model = _model(weights)
    logits = []
    try:
        for release in (False, True):
            launch.SMALL_KERNELS_RELEASE_NEXT = release
            engine = _engine(model, "bf16", 8)
            for rid, ids in list(PROMPTS.items())[:3]:
                engine.add_request(rid, ids, SamplingParams(max_tokens=12, ignore_eos=True))
            engine.step()  # the prompts
            steps = _record_logits(engine.runner)
            for _ in range(8):
                engine.step()
            assert engine.runner.graphs.captured == [(4, 256)]
            logits.append(torch.cat(steps))
    finally:
        launch.SMALL_KERNELS_RELEASE_NEXT = True
    assert torch.equal(logits[0], logits[1])


@needs_cuda
def test_the_captured_kernels_refuse_a_foreign_page():
    """The host check is bypassed, so only the kernels inside the graph can see that r1's
    table points at r0's page; r1 is aborted, the others finish with the eager tokens."""
    import random

    from gpu_node.faults import FaultInjector

    model = _model("int4 g32")
    expected = _generate(_engine(model, "fp8", 0))
    engine = _engine(model, "fp8", 8)
    engine.runner.find_violations = lambda chunks, tables=None: [False] * len(chunks)
    for rid, ids in PROMPTS.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=MAX_TOKENS[rid], ignore_eos=True))
    tokens = {rid: [] for rid in PROMPTS}
    finals = {}
    for step in range(1000):
        if step == 3:  # the graphs of the first bucket were captured and replayed by now
            assert len(engine.runner.graphs.captured) == 1
            FaultInjector(engine, random.Random(0)).point_at_foreign_page("r1", "r0")
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                finals[out.request_id] = out.finish_reason
    assert finals == {"r0": "length", "r1": "error", "r2": "length", "r3": "length", "r4": "length"}
    assert engine.num_integrity_violations == 1
    assert {r: t for r, t in tokens.items() if r != "r1"} == {
        r: t for r, t in expected.items() if r != "r1"
    }


@needs_cuda
def test_graphs_replayed_after_others_and_past_the_first_context_bucket():
    """A 300-token context (bucket 512) decodes alone, then beside five more (the bucket of
    6, a cap that is no power of two), then alone again: the graph of one row replays
    after another graph was captured into the shared pool, with the eager logits."""
    from gpu_node.engine.decode_graphs import DecodeGraphs

    model = _model("int4 g32")
    long_ids = [(11 * j) % 4000 + 1 for j in range(300)]
    runs = []
    for capture in (False, True):
        engine = _engine(model, "fp8", 0)
        runner = engine.runner
        runner.graphs = DecodeGraphs.for_runner(runner, 6, engine.max_model_len, capture=capture)
        steps = _record_logits(runner)
        engine.add_request("long", long_ids, SamplingParams(max_tokens=16, ignore_eos=True))
        for _ in range(3):
            engine.step()
        for i in range(5):
            ids = [(5 * i + j) % 4000 + 1 for j in range(20)]
            engine.add_request(f"s{i}", ids, SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        runs.append((torch.cat(steps), runner.graphs.captured))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[1][1] == [(1, 512), (6, 512)]


@needs_cuda
def test_float_moe_graph_steps_give_the_eager_tokens():
    """bf16 MoE experts on CUDA run kernels/moe/dense.py, which waits for nothing on the
    host, so their decode steps are recorded too and give the eager steps' tokens."""
    from gpu_node.models.llama import fuse_projections
    from gpu_node.models.weights import moe_model

    model = fuse_projections(moe_model("moe-small", device="cuda").to(torch.bfloat16))
    eager = _generate(_engine(model, "fp8", 0))
    engine = _engine(model, "fp8", 8)
    assert engine.runner.graphs is not None
    assert _generate(engine) == eager
    assert engine.runner.graphs.captured == [(1, 256), (2, 256), (4, 256), (8, 256)]
