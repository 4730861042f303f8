"""moe-small, INT4 computing in fp16 on a GPU (EngineConfig.activations "fp16"), through
the engine."""

from __future__ import annotations

import torch

from tests.gpu_node.helpers import check_moe_small_serves_two_requests, needs_cuda


@needs_cuda
def test_moe_small_serves_int4_in_fp16_through_the_engine():
    from gpu_node.config import EngineConfig
    from gpu_node.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model="moe-small", weights="int4", activations="fp16", device="cuda", kv_dtype="fp16",
        num_pages=32,
    )  # fmt: skip
    engine = LLMEngine.from_config(config)
    assert engine.model.embed_tokens.weight.dtype == torch.float16
    check_moe_small_serves_two_requests(engine)
