"""`tensor_parallel` in the engine's config, as `edgeserve node --tensor-parallel N` sets it:
rank 0 loads its shard, spawns the other ranks itself, and answers as one process does."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gpu_node.config import EngineConfig
from gpu_node.engine.llm_engine import LLMEngine
from scheduler.sequence import SamplingParams

pytestmark = pytest.mark.slow

CONFIG = EngineConfig(
    model="smollm2", weights="fp32", kv_dtype="fp32", kv_memory_bytes=8 * 1024 * 1024,
    max_num_seqs=4, max_num_batched_tokens=64,
)  # fmt: skip


def test_three_ranks_spawned_by_the_engine_answer_as_one_process(smollm2_path: Any) -> None:
    single = LLMEngine.from_config(CONFIG)
    encode = single.tokenizer.encode
    prompts = {
        "count": encode("1, 2, 3, 4,"),
        "story": encode("Once upon a time, in a village by the sea, there lived"),
        "code": encode("def fibonacci(n):\n    "),  # 31 tokens past the 64-token budget: chunked
    }
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = single.generate(prompts, params)
    del single

    engine = LLMEngine.from_config(dataclasses.replace(CONFIG, tensor_parallel=3))
    group = engine.parallel
    assert group is not None
    try:
        assert engine.model.config.num_heads == 3 and engine.model.config.num_kv_heads == 1
        assert [p.is_alive() for p in group.processes] == [True, True]
        got = engine.generate(prompts, params)
    finally:
        engine.close()
    assert got == expected
    assert [p.exitcode for p in group.processes] == [0, 0]
    assert group.errors.empty()
    engine.close()  # a second close does nothing


def test_a_model_that_does_not_split_is_refused_naming_why(smollm2_path: Any) -> None:
    with pytest.raises(ValueError) as refused:
        LLMEngine.from_config(dataclasses.replace(CONFIG, tensor_parallel=2))
    assert str(refused.value) == (
        "smollm2 cannot run on 2 ranks: 9 query heads do not divide by 2 ranks; "
        "3 KV heads do not divide by 2 ranks"
    )


def test_tensor_parallel_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor_parallel must be >= 1, got 0"):
        EngineConfig(tensor_parallel=0)
