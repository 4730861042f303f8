"""The model runner (model_runner.py). Page-ownership integrity: injected faults are caught,
the faulty request ends in an error before any token of its step is sent, and every other
request is untouched; the host check follows its rules. FP8 KV through the runner on the
real weights: answers and perplexity."""

import random

import pytest
import torch

from gpu_node.config import EngineConfig
from gpu_node.engine.llm_engine import LLMEngine
from gpu_node.faults import FaultInjector
from gpu_node.models.config import ModelConfig
from gpu_node.models.weights import seeded_llama
from scheduler.sequence import SamplingParams
from tests.gpu_node.helpers import prompt_logits

TINY = ModelConfig(
    architecture="llama", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
    num_kv_heads=2, head_dim=16, vocab_size=49152, max_position_embeddings=512,
    rope_theta=10000.0, rms_norm_eps=1e-5,
)  # fmt: skip
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
PROMPTS = {f"r{i}": [(37 * i + 11 * j) % 4000 + 50 for j in range(5 + 7 * i)] for i in range(5)}
TRIALS = 100


@pytest.fixture(scope="module")
def tiny_parts(smollm2_parts):
    _, tokenizer = smollm2_parts
    return seeded_llama(TINY, seed=1), tokenizer


def new_engine(parts, kv_dtype="fp32"):
    model, tokenizer = parts
    return LLMEngine(
        EngineConfig(model="tiny", kv_dtype=kv_dtype, page_size=8, num_pages=64), model, tokenizer
    )


def run(engine, inject=None, inject_at=-1):
    """Requests join one per step; `inject(engine)` runs before step `inject_at`."""
    tokens = {rid: [] for rid in PROMPTS}
    finals = {}
    pending = list(PROMPTS.items())
    step = 0
    while pending or engine.has_unfinished():
        if pending:
            rid, ids = pending.pop(0)
            engine.add_request(rid, ids, PARAMS)
        if step == inject_at:
            inject(engine)
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                finals[out.request_id] = out
        step += 1
    return tokens, finals


@pytest.fixture(scope="module")
def baseline(tiny_parts):
    tokens, finals = run(new_engine(tiny_parts))
    assert all(f.finish_reason == "length" for f in finals.values())
    return tokens


def running_with_pages(engine):
    return [s.request_id for s in engine.scheduler.running if s.block_table]


FAULTS = {
    "foreign_page": lambda inj, a, b: inj.point_at_foreign_page(a, b),
    "freed_under": lambda inj, a, b: inj.free_page_under(a),
    "double_handout": lambda inj, a, b: inj.hand_page_twice(a, b),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_detected_in_every_randomized_trial(tiny_parts, baseline, fault):
    detected = 0
    for trial in range(TRIALS):
        rng = random.Random(f"{fault}-{trial}")
        engine = new_engine(tiny_parts)
        chosen = {}

        def inject(engine, rng=rng, chosen=chosen):
            faulty, other = rng.sample(running_with_pages(engine), 2)
            chosen["faulty"] = faulty
            FAULTS[fault](FaultInjector(engine, rng), faulty, other)
            chosen["sent"] = len(engine._requests[faulty].seq.output_token_ids)

        tokens, finals = run(engine, inject, inject_at=rng.randrange(4, 12))
        faulty = chosen["faulty"]
        assert finals[faulty].finish_reason == "error"
        assert "KV page ownership violation" in finals[faulty].error
        assert finals[faulty].token_ids == ()  # nothing of the faulty step was sent
        assert len(tokens[faulty]) == chosen["sent"]
        assert tokens[faulty] == baseline[faulty][: chosen["sent"]]
        for rid in PROMPTS:
            if rid != faulty:
                assert tokens[rid] == baseline[rid], (fault, trial, rid)
        stats = engine.stats()
        assert stats.num_integrity_violations == 1
        assert stats.num_free_pages == stats.num_pages
        detected += 1
    assert detected == TRIALS


def test_fault_free_run_reports_no_violation(tiny_parts, baseline):
    engine = new_engine(tiny_parts)
    tokens, _ = run(engine)
    assert tokens == baseline and engine.stats().num_integrity_violations == 0


def test_a_page_named_twice_in_one_table_is_a_violation(tiny_parts):
    engine = new_engine(tiny_parts)
    engine.add_request("a", PROMPTS["r3"], PARAMS)  # 26 tokens: 4 pages of 8
    engine.step()
    seq = engine._requests["a"].seq
    from scheduler.scheduler import ScheduledChunk

    assert engine.runner.find_violations([ScheduledChunk(seq, 1)]) == [False]
    seq.block_table[2] = seq.block_table[0]  # its own page, twice
    assert engine.runner.find_violations([ScheduledChunk(seq, 1)]) == [True]


def _violations_by_rule(tables, table_lens, context_lens, page_size, owner, column, seq_tags):
    """The rules of `find_violations_host`, one entry at a time."""
    bad = []
    for row, tag, length, table_len in zip(tables, seq_tags, context_lens, table_lens, strict=True):
        needed = -(-int(length) // page_size)
        wrong = [
            not 0 <= p < len(owner) or owner[p] != tag or column[p] != c
            for c, p in enumerate(int(p) for p in row[:needed])
        ]
        bad.append(any(wrong) or needed > table_len)
    return bad


def test_host_check_follows_its_rules_under_random_faults():
    import numpy as np

    from gpu_node.engine.model_runner import find_violations_host

    rng = np.random.default_rng(11)
    flagged = 0
    for _ in range(2000):
        batch, width, page_size = int(rng.integers(1, 6)), int(rng.integers(1, 8)), 16
        num_pages = batch * width + 4
        tables = rng.permutation(num_pages)[: batch * width].reshape(batch, width)
        tags = (np.arange(batch, dtype=np.int64) + 1) << 16
        owner = np.zeros(num_pages, dtype=np.int64)
        owner[tables] = np.repeat(tags, width).reshape(batch, width)
        column = np.zeros(num_pages, dtype=np.int64)
        column[tables] = np.arange(width)
        lens = rng.integers(0, width * page_size + 1, batch)
        table_lens = np.full(batch, width)
        # foreign id, freed page, a page twice, two entries swapped, a short table
        for _ in range(int(rng.integers(0, 3))):
            b, c, kind = int(rng.integers(batch)), int(rng.integers(width)), int(rng.integers(5))
            other = int(rng.integers(width))
            if kind == 0:
                tables[b, c] = rng.integers(-2, num_pages + 2)
            elif kind == 1:
                owner[tables[b, c] % num_pages] = 0
            elif kind == 2:
                tables[b, c] = tables[b, other]
            elif kind == 3:
                tables[b, [c, other]] = tables[b, [other, c]]
            else:
                table_lens[b] = rng.integers(0, width + 1)
        args = (tables, table_lens, lens, page_size, owner, column, tags)
        got = find_violations_host(*args).tolist()
        assert got == _violations_by_rule(*args)
        flagged += sum(got)
    assert flagged > 500  # the faults did land


def test_released_columns_are_not_checked_and_the_live_ones_are(tiny_parts):
    """Where every layer slides (window 8, pages of 8), a sequence's passed pages go back to
    the pool: their columns are no longer its own and never read, so a foreign page there
    breaks no rule; one in a live column still does."""
    import dataclasses

    from scheduler.block_manager import RELEASED_PAGE
    from scheduler.scheduler import ScheduledChunk

    _, tokenizer = tiny_parts
    model = seeded_llama(dataclasses.replace(TINY, sliding_window=8), seed=1)
    config = EngineConfig(model="tiny", page_size=8, num_pages=64, max_num_batched_tokens=16)
    engine = LLMEngine(config, model, tokenizer)
    engine.add_request("a", PROMPTS["r3"], PARAMS)  # 26 tokens
    engine.step()  # 16 of them: the query at 16 sees 9 .. 16, so page 0 goes back
    seq = engine._requests["a"].seq
    assert (seq.block_table, seq.num_released_pages) == ([RELEASED_PAGE, 1], 1)
    engine.add_request("b", PROMPTS["r1"], PARAMS)  # 12 tokens
    engine.step()  # a's last 10 (pages 2 and 3; pages 0, 1 are passed), b's first 6
    other = engine._requests["b"].seq
    assert (seq.block_table, seq.num_released_pages) == ([RELEASED_PAGE] * 2 + [2, 3], 2)
    assert other.block_table == [4]
    chunk = ScheduledChunk(seq, 1)
    assert engine.runner.find_violations([chunk]) == [False]
    seq.block_table[1] = other.block_table[0]  # b's page in a released column
    assert engine.runner.find_violations([chunk]) == [False]
    seq.block_table[2] = other.block_table[0]  # and in a live one
    assert engine.runner.find_violations([chunk]) == [True]


def test_host_check_skips_the_columns_before_each_tables_first():
    import numpy as np

    from gpu_node.engine.model_runner import find_violations_host

    owner = np.array([2 << 16, 1 << 16, 1 << 16, 0], dtype=np.int64)  # page 0 is another's
    column = np.array([0, 1, 2, 0], dtype=np.int64)
    tables = np.array([[0, 1, 2]], dtype=np.int64)
    args = (tables, np.array([3]), np.array([20]), 8, owner, column, np.array([1 << 16]))
    assert find_violations_host(*args).tolist() == [True]
    assert find_violations_host(*args, np.array([0])).tolist() == [True]
    assert find_violations_host(*args, np.array([1])).tolist() == [False]
    tables[0, 0] = 9  # outside the pool, but released
    assert find_violations_host(*args, np.array([1])).tolist() == [False]
    tables[0, 2] = 3  # a free page in a live column
    assert find_violations_host(*args, np.array([1])).tolist() == [True]


# -- FP8 KV on the real weights --------------------------------------------------------


def test_fp8_kv_still_answers_paris(make_engine, chat_ids):
    engine = make_engine(kv_dtype="fp8")
    out = engine.generate(
        {"q": chat_ids("What is the capital of France?")}, SamplingParams(max_tokens=20)
    )
    assert "Paris" in engine.tokenizer.decode(out["q"])
    assert (
        engine.kv_cache.k_cache[0].dtype.is_floating_point
        and engine.kv_cache.k_scale[0] is not None
    )


def perplexity(engine, ids):
    """Every position attends to K/V as the cache stores them: one prefill through the pages."""
    logits = prompt_logits(engine, ids)  # [T, V]
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return float(torch.exp(nll))


def test_fp8_kv_perplexity_increase_stays_under_the_measured_bound(make_engine, smollm2_parts):
    from pydoc_data.topics import topics

    _, tokenizer = smollm2_parts
    text = "\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer.encode(text)[:1024]
    fp32 = perplexity(make_engine(kv_dtype="fp32"), ids)
    fp8 = perplexity(make_engine(kv_dtype="fp8"), ids)
    # Measured on these 1024 tokens: 12.721 (fp32 KV) -> 12.692 (fp8 KV), -0.23%;
    # benchmarks/kv_accuracy.py has the figures. The bound is the target, 0.3% either way.
    assert abs(fp8 / fp32 - 1) < 0.003, (fp32, fp8)
