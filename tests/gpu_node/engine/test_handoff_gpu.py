"""Prefill/decode handoff between two engines, and prefix caching, on a GPU: pools read
and written by the Triton kernels (seeded weights: the GGUF does not reach the GPU machine)."""

from __future__ import annotations

import os

import pytest
import torch

from gpu_node.engine.handoff import KVHandoff
from scheduler.sequence import SamplingParams

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU with compiled kernels",
)


class _Tokens:
    """The engine needs a tokenizer only to detokenize and stop."""

    stop_token_ids = frozenset()
    eos_token_id = -1

    def decode(self, ids, skip_special_tokens=True):
        return ""


def _engine(model, kv_dtype, prefix_cache_blocks=0):
    from gpu_node.config import EngineConfig
    from gpu_node.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model="seeded", device="cuda", kv_dtype=kv_dtype, num_pages=64,
        prefix_cache_blocks=prefix_cache_blocks,
    )  # fmt: skip
    return LLMEngine(config, model, _Tokens())


def _model():
    from gpu_node.models.config import ModelConfig
    from gpu_node.models.weights import seeded_llama

    shape = ModelConfig(
        architecture="llama", num_layers=4, hidden_size=256, intermediate_size=512,
        num_heads=8, num_kv_heads=2, head_dim=64, vocab_size=4096,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
    )  # fmt: skip
    return seeded_llama(shape, seed=1, device="cuda").to(torch.bfloat16)


def _run(engine, request_id, ids, params, **kwargs):
    engine.add_request(request_id, ids, params, **kwargs)
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prefilled_on_one_gpu_engine_decoded_on_another_equals_one_engine(kv_dtype, temperature):
    model = _model()
    ids = [(7 * j) % 4000 + 1 for j in range(45)]  # three pages of 16 and a part
    params = SamplingParams(max_tokens=20, temperature=temperature, seed=3, ignore_eos=True)
    alone = [t for o in _run(_engine(model, kv_dtype), "r", ids, params) for t in o.token_ids]
    (handed,) = _run(_engine(model, kv_dtype), "r", ids, params, prefill_only=True)
    assert handed.finish_reason == "handoff" and handed.handoff is not None
    handoff = KVHandoff.from_bytes(handed.handoff.to_bytes())
    assert handoff.k.device.type == "cpu" and handoff.k.shape == (4, 45, 2, 64)
    decoder = _engine(model, kv_dtype)
    tokens = [t for o in _run(decoder, "r", ids, params, handoff=handoff) for t in o.token_ids]
    assert tokens == alone and len(tokens) == 20
    assert decoder.stats().num_free_pages == decoder.stats().num_pages


@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_a_cached_prefix_on_the_gpu_gives_the_cold_tokens(kv_dtype):
    model = _model()
    shared = [(5 * j) % 4000 + 1 for j in range(40)]
    first, second = [*shared, 7, 8, 9], [*shared, 11, 12, 13, 14, 15]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    cold = [t for o in _run(_engine(model, kv_dtype), "c", second, params) for t in o.token_ids]
    warm = _engine(model, kv_dtype, prefix_cache_blocks=8)
    _run(warm, "a", first, params)
    outs = _run(warm, "b", second, params)
    assert [t for o in outs for t in o.token_ids] == cold
    assert outs[-1].num_cached_tokens == 32  # two full pages of the shared 40 tokens
