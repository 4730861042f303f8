"""Fixtures for engine tests: the real SmolLM2 weights, loaded once per session."""

from __future__ import annotations

import pytest
import torch

# The gpu_node modules are imported inside the fixtures: pytest imports this conftest
# before pytest_configure (tests/conftest.py) sets TRITON_INTERPRET, and the engine
# imports kernel modules, which Triton decorates interpreted-or-compiled right then.


@pytest.fixture(scope="session")
def smollm2_parts(smollm2_path):
    from gpu_node.models.gguf_loader import GGUFModel
    from gpu_node.models.tokenizer import ChatTokenizer
    from gpu_node.models.weights import load_llama

    gguf = GGUFModel(smollm2_path)
    return load_llama(gguf, torch.float32), ChatTokenizer(gguf)


@pytest.fixture
def make_engine(smollm2_parts):
    """Builds an engine around the shared model with a fresh KV pool."""
    from gpu_node.config import EngineConfig
    from gpu_node.engine.llm_engine import LLMEngine

    model, tokenizer = smollm2_parts

    def make(**overrides) -> LLMEngine:
        config = EngineConfig(**{"model": "smollm2", "num_pages": 128, **overrides})
        return LLMEngine(config, model, tokenizer)

    return make


@pytest.fixture(scope="session")
def chat_ids(smollm2_parts):
    """Token ids of a user message wrapped in the chat template."""
    _, tokenizer = smollm2_parts

    def ids(text: str) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))

    return ids
