"""What several gpu_node test modules share: a request run to its end (its logprobs and
the logits the sampler saw, too), the prompt's logits through the pages, the moe-small
two-request check, and the seeded engines the GPU tests build (the GGUF does not reach the
GPU machine). The gpu_node modules are imported inside the functions, so this module
imports no kernel module and needs no fixture of the conftests."""

from __future__ import annotations

import os

import pytest
import torch

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU with compiled kernels",
)

# max_tokens differ, so the batch shrinks 5 -> 4 -> 3 -> 2 -> 1: buckets 8, 4, 2 and 1 run
SEEDED_PROMPTS = {
    f"r{i}": [(13 * i + 7 * j) % 4000 + 1 for j in range(9 + 23 * i)] for i in range(5)
}
SEEDED_MAX_TOKENS = {"r0": 6, "r1": 30, "r2": 14, "r3": 38, "r4": 22}


class StubTokenizer:
    """The engine needs a tokenizer only to detokenize and stop."""

    stop_token_ids = frozenset()
    eos_token_id = -1

    def decode(self, ids, skip_special_tokens=True):
        return ""


def seeded_model(weights, fuse=True):
    """A 4-layer seeded llama on CUDA in bf16, `weights` "bf16" or "int4 g<group size>";
    its projections fused as a GPU node serves it, unless `fuse` is False."""
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
    return fuse_projections(model) if fuse else model


def seeded_int4_model(dtype, group_size=128):
    """A 4-layer seeded llama, INT4 from its fp32 weights (every dtype the same codes),
    computing in `dtype` as a GPU node serves it."""
    from gpu_node.models.config import ModelConfig
    from gpu_node.models.llama import fuse_projections
    from gpu_node.models.weights import seeded_llama
    from gpu_node.quant.linear import quantize_model

    shape = ModelConfig(
        architecture="llama", num_layers=4, hidden_size=512, intermediate_size=1024,
        num_heads=8, num_kv_heads=2, head_dim=64, vocab_size=4096,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
    )  # fmt: skip
    model = seeded_llama(shape, seed=3, device="cuda")
    quantize_model(model, group_size=group_size, skip=("lm_head", "embed_tokens"))
    return fuse_projections(model.to(dtype))


def seeded_engine(model, kv_dtype, cuda_graph_batch=0, activations="auto"):
    """An engine of 64 pages on CUDA around `model`, decode graphs alone."""
    from gpu_node.config import EngineConfig
    from gpu_node.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model="seeded", device="cuda", kv_dtype=kv_dtype, activations=activations,
        num_pages=64, cuda_graph_batch=cuda_graph_batch, cuda_graph_tokens=0,  # decode graphs alone
    )  # fmt: skip
    return LLMEngine(config, model, StubTokenizer())


def default_seeded_engine(model, kv_dtype, prefix_cache_blocks=0):
    """An engine of 64 pages on CUDA around `model`, CUDA graphs as configured by default."""
    from gpu_node.config import EngineConfig
    from gpu_node.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model="seeded", device="cuda", kv_dtype=kv_dtype, num_pages=64,
        prefix_cache_blocks=prefix_cache_blocks,
    )  # fmt: skip
    return LLMEngine(config, model, StubTokenizer())


def run_to_end(engine, request_id, ids, params, **add):
    """One request through a sync LLMEngine (`add` goes to add_request): every token it
    produced and its final output."""
    engine.add_request(request_id, ids, params, **add)
    tokens: list[int] = []
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.token_ids)
            final = out if out.finished else final
    return tokens, final


def run_capturing_logits(engine, ids, params, grammar=None):
    """Runs one request; its outputs' logprobs, tokens and the logits row of each step
    (as the sampler saw them: after the grammar's mask)."""
    seen: list[torch.Tensor] = []
    mask = engine._mask

    def capture(chunks, logits):
        mask(chunks, logits)
        seen.append(logits[0].clone())

    engine._mask = capture
    engine.add_request("r", ids, params, grammar=grammar)
    logprobs, tokens = [], []
    while engine.has_unfinished():
        for out in engine.step():
            logprobs += list(out.logprobs or ())
            tokens += list(out.token_ids)
    return logprobs, tokens, seen


def record_logits(runner):
    """The logits of each step the runner runs from now on."""
    steps, run = [], runner.run

    def record(chunks, tables=None):
        result = run(chunks, tables)
        steps.append(result.logits.clone())
        return result

    runner.run = record
    return steps


def prompt_logits(engine, ids):
    """The logits [T, V] of every position of `ids`, the prompt in one step through the
    engine's pages."""
    from gpu_node.engine.attention import PagedAttention
    from scheduler.scheduler import ScheduledChunk
    from scheduler.sequence import SamplingParams, Sequence

    seq = Sequence(seq_id=1, request_id="p", prompt_token_ids=ids, params=SamplingParams())
    engine.block_manager.allocate(seq, len(ids))
    chunk = ScheduledChunk(seq, len(ids))
    input_ids, positions, metadata = engine.runner.prepare([chunk])
    with torch.inference_mode():
        logits = engine.model(
            input_ids, positions, PagedAttention(engine.kv_cache, metadata, engine.runner.scale)
        )
    engine.block_manager.free(seq)
    return logits  # [T, V]


def check_moe_small_serves_two_requests(engine):
    """Two requests through a moe-small engine of 32 pages: the pages each takes and gives
    back, and its usage (its tokens are seeded noise)."""
    from scheduler.sequence import SamplingParams

    engine.add_request("a", list(range(100, 140)), SamplingParams(max_tokens=9, ignore_eos=True))
    engine.add_request("b", list(range(200, 205)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert engine.stats().num_free_pages == 32 - 3 - 1  # 40 tokens -> 3 pages, 5 tokens -> 1
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert (finals["a"].num_prompt_tokens, finals["a"].num_completion_tokens) == (40, 9)
    assert (finals["b"].num_prompt_tokens, finals["b"].num_completion_tokens) == (5, 3)
    assert engine.stats().num_free_pages == 32
