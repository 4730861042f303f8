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

# moe-small: 4 query and 2 KV heads, MoE blocks of 8 experts and a shared one (folded), so
# two ranks split its attention by heads and its experts by rank.
CONFIG = EngineConfig(
    model="moe-small", weights="fp32", kv_dtype="fp32", num_pages=64, max_num_seqs=4,
    max_num_batched_tokens=16,
)  # fmt: skip


def test_two_ranks_spawned_by_the_engine_answer_as_one_process(smollm2_path: Any) -> None:
    single = LLMEngine.from_config(CONFIG)
    prompts = {
        "short": [5, 17, 99, 4],
        "long": [(7 * i) % 4000 + 1 for i in range(30)],  # past the 16-token budget: chunked
    }
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = single.generate(prompts, params)
    del single

    engine = LLMEngine.from_config(dataclasses.replace(CONFIG, tensor_parallel=2))
    group = engine.parallel
    assert group is not None
    try:
        assert engine.model.config.num_heads == 2 and engine.model.config.num_kv_heads == 1
        assert [p.is_alive() for p in group.processes] == [True]
        got = engine.generate(prompts, params)
    finally:
        engine.close()
    assert got == expected
    assert [p.exitcode for p in group.processes] == [0]
    assert group.errors.empty()
    engine.close()  # a second close does nothing


def test_a_model_that_does_not_split_is_refused_naming_why(smollm2_path: Any) -> None:
    with pytest.raises(ValueError) as refused:
        LLMEngine.from_config(dataclasses.replace(CONFIG, tensor_parallel=3))
    assert str(refused.value) == (
        "moe-small cannot run on 3 ranks: 4 query heads do not divide by 3 ranks; "
        "2 KV heads do not divide by 3 ranks"
    )


def test_tensor_parallel_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor_parallel must be >= 1, got 0"):
        EngineConfig(tensor_parallel=0)
