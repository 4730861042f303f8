"""Decode steps from CUDA graphs (decode_graphs.py). What a CPU can check: the buckets,
the padding, which steps a graph takes, and, with the static step run eagerly
(`capture=False`), that the padded step gives the engine's own tokens and writes
nothing but its own tokens' slots. On a GPU, the captured graphs replayed: the same
tokens as eager steps (in bf16 and fp16), bit for bit the same logits as the same padded
step launched eagerly, and the ownership check inside the captured kernels (seeded
weights: the GGUF does not reach the GPU machine)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from gpu_node.config import EngineConfig
from gpu_node.engine.decode_graphs import (
    PAD_TAG,
    DecodeGraphs,
    DecodeInputs,
    batch_bucket,
    capturable,
    context_bucket,
)
from gpu_node.models.moe import MoeExperts
from gpu_node.models.weights import moe_model
from scheduler.sequence import SamplingParams
from tests.gpu_node.helpers import (
    SEEDED_MAX_TOKENS,
    SEEDED_PROMPTS,
    needs_cuda,
    record_logits,
    seeded_engine,
    seeded_int4_model,
    seeded_model,
)

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
PROMPTS = [
    "What is the capital of France?",
    "Name three colours.",
    "Count from one to five, then say done.",
]


def static_steps(engine, max_batch: int = 8) -> DecodeGraphs:
    """The engine's decode steps through the padded static step, run eagerly."""
    graphs = DecodeGraphs.for_runner(engine.runner, max_batch, engine.max_model_len, capture=False)
    engine.runner.graphs = graphs
    return graphs


def test_batch_buckets_are_powers_of_two_up_to_the_cap() -> None:
    assert [batch_bucket(b, 32) for b in (1, 2, 3, 4, 5, 8, 9, 17, 32)] == [
        1, 2, 4, 4, 8, 8, 16, 32, 32,
    ]  # fmt: skip
    assert batch_bucket(5, 6) == 6  # the cap itself is a bucket
    assert batch_bucket(33, 32) is None
    assert batch_bucket(0, 32) is None


def test_context_buckets_start_at_256_and_stop_at_the_window() -> None:
    assert [context_bucket(n, 8192) for n in (1, 256, 257, 1000, 1024, 1025, 8000, 8192)] == [
        256, 256, 512, 1024, 1024, 2048, 8192, 8192,
    ]  # fmt: skip
    assert context_bucket(300, 400) == 400


def test_pad_rows_write_nothing_and_read_one_token_of_page_0_under_no_owner() -> None:
    inputs = DecodeInputs.padded(
        ids=np.array([11, 12, 13]),
        positions=np.array([5, 40, 17]),
        slots=np.array([7 * 16 + 5, 9 * 16 + 8, 3 * 16 + 1]),
        tables=np.array([[7, 0, 0], [2, 4, 9], [6, 3, 0]]),
        context_lens=np.array([6, 41, 18]),
        seq_tags=np.array([65536, 131072, 196609]),
        batch=4,
        width=5,
    )
    assert inputs.ids.tolist() == [11, 12, 13, 0]
    assert inputs.positions.tolist() == [5, 40, 17, 0]
    assert inputs.slots.tolist() == [117, 152, 49, -1]
    # the step's own width: a row's columns past its context are never read
    assert inputs.tables.tolist() == [[7, 0, 0], [2, 4, 9], [6, 3, 0], [0, 0, 0]]
    assert inputs.context_lens.tolist() == [6, 41, 18, 1]
    assert inputs.seq_tags.tolist() == [65536, 131072, 196609, PAD_TAG]
    assert inputs.tables.dtype == np.int32 and inputs.context_lens.dtype == np.int32
    with pytest.raises(ValueError, match="3 rows of 6 pages do not fit a bucket of 4 x 5"):
        DecodeInputs.padded(*(np.zeros(3, dtype=np.int64),) * 3, np.zeros((3, 6)),
                            np.ones(3), np.ones(3), batch=4, width=5)  # fmt: skip


def test_only_all_decode_steps_within_the_buckets_and_tables_are_taken(make_engine) -> None:
    graphs = static_steps(make_engine(), max_batch=4)  # 128 pages of 16, window 8192: width 512
    assert graphs.width == 512
    lens = np.array([2, 3])
    assert graphs.takes([1, 1], np.array([17, 40]), lens)
    assert not graphs.takes([1, 5], np.array([17, 40]), lens)  # a prompt chunk
    assert not graphs.takes([1] * 5, np.full(5, 3), np.full(5, 1))  # past the largest bucket
    assert not graphs.takes([1, 1], np.array([17, 48]), lens)  # token 48 is past 3 pages
    assert not graphs.takes([1], np.array([3]), np.array([513]))  # wider than the window
    graphs.disabled = True
    assert not graphs.takes([1, 1], np.array([17, 40]), lens)


def test_the_padded_static_step_gives_the_engines_own_tokens(make_engine, chat_ids) -> None:
    prompts = {f"r{i}": chat_ids(text) for i, text in enumerate(PROMPTS)}
    plain = make_engine().generate(prompts, GREEDY)
    engine = make_engine()
    graphs = static_steps(engine)
    calls = []
    run = graphs.run
    graphs.run = lambda inputs, n: calls.append((len(inputs.ids), n)) or run(inputs, n)
    assert engine.generate(prompts, GREEDY) == plain
    # three sequences decode in a bucket of 4 (one pad row) until they finish together
    assert calls and set(calls) == {(4, 3)}
    assert len(calls) == GREEDY.max_tokens - 1
    assert all(len(tokens) == GREEDY.max_tokens for tokens in plain.values())


def test_one_token_prompt_chunks_that_complete_nothing_take_the_static_step(
    make_engine, chat_ids
) -> None:
    """With two tokens a step, the second prompt is computed a token a step beside the
    first one's decode token: steps whose rows complete and do not complete sequences
    go through the static step, and only the completing rows' logits are sampled."""
    prompts = {f"r{i}": chat_ids(text) for i, text in enumerate(PROMPTS[:2])}
    plain = make_engine(max_num_batched_tokens=2).generate(prompts, GREEDY)
    engine = make_engine(max_num_batched_tokens=2)
    static_steps(engine)
    completing = []
    run = engine.runner._run_decode_graph

    def record(graphs, chunks, *rest):
        completing.append([c.completes_sequence for c in chunks])
        return run(graphs, chunks, *rest)

    engine.runner._run_decode_graph = record
    assert engine.generate(prompts, GREEDY) == plain
    # r0's last prompt token, then its nine decode tokens, each beside one of r1's prompt
    # tokens; then r1 alone: the rest of its prompt in 2-token chunks (eager), and its
    # nine decode tokens
    assert completing == [[True, False]] * 10 + [[True]] * 9


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
def test_a_padded_step_writes_only_its_own_tokens_slots(make_engine, chat_ids, kv_dtype) -> None:
    engine = make_engine(kv_dtype=kv_dtype)
    static_steps(engine)
    for i, text in enumerate(PROMPTS):
        engine.add_request(f"r{i}", chat_ids(text), GREEDY)
    engine.step()  # the three prompts, eagerly
    seqs = list(engine.scheduler.running)
    slots = [
        s.block_table[s.num_computed_tokens // 16] * 16 + s.num_computed_tokens % 16 for s in seqs
    ]
    kv = engine.kv_cache
    before = [t.clone() for t in kv.k_cache + kv.v_cache]
    engine.step()  # one decode step, three rows and a pad row
    changed = set()
    for old, new in zip(before, kv.k_cache + kv.v_cache, strict=True):
        # bytes, not values: an fp8 page's K bytes are int8 codes, some of them NaN as e4m3
        differ = old.view(torch.uint8) != new.view(torch.uint8)
        rows = differ.reshape(kv.num_pages * 16, -1).any(dim=1)  # [slots]
        changed |= set(torch.nonzero(rows).flatten().tolist())
    assert changed == set(slots)
    assert all(s.num_computed_tokens == s.num_prompt_tokens + 1 for s in seqs)


def test_a_foreign_page_is_refused_with_the_static_step_as_without(make_engine, chat_ids) -> None:
    from gpu_node.faults import FaultInjector

    finals = []
    for use_static in (False, True):
        engine = make_engine()
        if use_static:
            static_steps(engine)
        for i, text in enumerate(PROMPTS):
            engine.add_request(f"r{i}", chat_ids(text), GREEDY)
        engine.step()
        engine.step()
        FaultInjector(engine, random.Random(0)).point_at_foreign_page("r1", "r0")
        outcome, tokens = {}, {f"r{i}": 0 for i in range(len(PROMPTS))}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += len(out.token_ids)
                if out.finished:
                    outcome[out.request_id] = (out.finish_reason, tokens[out.request_id])
        finals.append(outcome)
    assert finals[0] == finals[1]
    assert finals[1]["r1"][0] == "error"
    # the two steps before the fault gave each request its first two tokens
    assert finals[1]["r0"] == finals[1]["r2"] == ("length", GREEDY.max_tokens - 2)


def test_graphs_are_only_made_on_a_gpu_and_can_be_turned_off(make_engine) -> None:
    assert make_engine().runner.graphs is None  # CPU
    assert EngineConfig().cuda_graph_batch == 32
    with pytest.raises(ValueError, match="cuda_graph_batch must be >= 0, got -1"):
        EngineConfig(cuda_graph_batch=-1)


def test_float_moe_experts_off_cuda_cannot_be_captured_and_int4_ones_can() -> None:
    """Off CUDA float experts run the reference loop, which asks the host which experts got
    tokens (on CUDA they run kernels/moe/dense.py, which does not)."""
    from gpu_node.quant.linear import quantize_model

    model = moe_model("moe-small", device="cpu")
    assert any(isinstance(m, MoeExperts) for m in model.modules())
    assert not capturable(model)
    quantize_model(model, group_size=32, skip=("lm_head", "embed_tokens", "router"))
    assert capturable(model)


# -- captured graphs on a GPU ----------------------------------------------------------


def _generate(engine):
    for rid, ids in SEEDED_PROMPTS.items():
        engine.add_request(
            rid, ids, SamplingParams(max_tokens=SEEDED_MAX_TOKENS[rid], ignore_eos=True)
        )
    tokens = {rid: [] for rid in SEEDED_PROMPTS}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    return tokens


@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("weights", ["bf16", "int4 g32", "int4 g128"])
def test_graph_steps_give_the_eager_tokens(weights, kv_dtype):
    model = seeded_model(weights)
    eager = _generate(seeded_engine(model, kv_dtype, 0))
    engine = seeded_engine(model, kv_dtype, 8)
    assert engine.runner.graphs is not None
    assert _generate(engine) == eager
    assert [len(eager[r]) for r in SEEDED_PROMPTS] == list(SEEDED_MAX_TOKENS.values())
    # buckets 8, 4, 2 and 1, all within the first context bucket (256 tokens)
    assert engine.runner.graphs.captured == [(1, 256), (2, 256), (4, 256), (8, 256)]


@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_a_replay_equals_the_same_padded_step_launched_eagerly(kv_dtype):
    from gpu_node.engine.decode_graphs import DecodeGraphs

    model = seeded_model("int4 g32")
    logits = []
    for capture in (False, True):
        engine = seeded_engine(model, kv_dtype, 0)
        runner = engine.runner
        runner.graphs = DecodeGraphs.for_runner(runner, 8, engine.max_model_len, capture=capture)
        for rid, ids in list(SEEDED_PROMPTS.items())[:3]:
            engine.add_request(rid, ids, SamplingParams(max_tokens=8, ignore_eos=True))
        engine.step()  # the prompts
        steps = record_logits(runner)
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

    model = seeded_model(weights)
    logits = []
    try:
        for release in (False, True):
            launch.SMALL_KERNELS_RELEASE_NEXT = release
            engine = seeded_engine(model, "bf16", 8)
            for rid, ids in list(SEEDED_PROMPTS.items())[:3]:
                engine.add_request(rid, ids, SamplingParams(max_tokens=12, ignore_eos=True))
            engine.step()  # the prompts
            steps = record_logits(engine.runner)
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

    model = seeded_model("int4 g32")
    expected = _generate(seeded_engine(model, "fp8", 0))
    engine = seeded_engine(model, "fp8", 8)
    engine.runner.find_violations = lambda chunks, tables=None: [False] * len(chunks)
    for rid, ids in SEEDED_PROMPTS.items():
        engine.add_request(
            rid, ids, SamplingParams(max_tokens=SEEDED_MAX_TOKENS[rid], ignore_eos=True)
        )
    tokens = {rid: [] for rid in SEEDED_PROMPTS}
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

    model = seeded_model("int4 g32")
    long_ids = [(11 * j) % 4000 + 1 for j in range(300)]
    runs = []
    for capture in (False, True):
        engine = seeded_engine(model, "fp8", 0)
        runner = engine.runner
        runner.graphs = DecodeGraphs.for_runner(runner, 6, engine.max_model_len, capture=capture)
        steps = record_logits(runner)
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
    eager = _generate(seeded_engine(model, "fp8", 0))
    engine = seeded_engine(model, "fp8", 8)
    assert engine.runner.graphs is not None
    assert _generate(engine) == eager
    assert engine.runner.graphs.captured == [(1, 256), (2, 256), (4, 256), (8, 256)]


@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8"])
def test_fp16_graph_steps_give_the_eager_tokens(kv_dtype):
    model = seeded_int4_model(torch.float16)
    tokens = []
    for graphs in (0, 8):
        engine = seeded_engine(model, kv_dtype, graphs, activations="fp16")
        for rid, ids in SEEDED_PROMPTS.items():
            engine.add_request(
                rid, ids, SamplingParams(max_tokens=SEEDED_MAX_TOKENS[rid], ignore_eos=True)
            )
        out = {rid: [] for rid in SEEDED_PROMPTS}
        while engine.has_unfinished():
            for step in engine.step():
                out[step.request_id].extend(step.token_ids)
        tokens.append(out)
        assert (engine.runner.graphs is not None) == bool(graphs)
    assert tokens[0] == tokens[1]
    assert [len(tokens[0][r]) for r in SEEDED_PROMPTS] == list(SEEDED_MAX_TOKENS.values())
