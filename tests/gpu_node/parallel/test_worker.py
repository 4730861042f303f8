"""Tensor parallelism end to end on gloo: this test process is rank 0 (the engine with its
scheduler, as in a node), the other ranks real processes on loopback running the worker
loop; greedy tokens and logits are held to the single-process engine's."""

from __future__ import annotations

import copy
import functools
import multiprocessing
import traceback

import pytest
import torch

from tests.gpu_node.helpers import StubTokenizer, record_logits

PROMPTS = {f"r{i}": [(37 * i + 11 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(4)}


def _run_rank(rank, world_size, port, phases, errors):
    """Rank `rank`'s process: for each (build, config) of `phases` in turn, a worker loop on
    its shard of the model `build()` returns."""
    from gpu_node.parallel.group import ParallelConfig, destroy_parallel, init_parallel
    from gpu_node.parallel.sharding import shard_llama
    from gpu_node.parallel.worker import run_worker

    torch.set_num_threads(1)
    try:
        shards = [
            (int4_by_reference(shard_llama(build(), rank, world_size)), config)
            for build, config in phases
        ]
        group = init_parallel(ParallelConfig(rank, world_size, master_port=port, timeout_s=60))
        for shard, config in shards:
            run_worker(shard, config, group)
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        destroy_parallel()


def shard_of(model, rank, world_size):
    """Rank `rank`'s shard of `model`, which stays whole: the shard's module tree is a copy,
    the tensors it keeps unsliced (norms) are shared."""
    from gpu_node.parallel.sharding import shard_llama

    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return int4_by_reference(shard_llama(copy.deepcopy(model, tensors), rank, world_size))


def int4_by_reference(model):
    """`model` with its INT4 linears computing by their fp32 reference (forward_ref), not
    torch's CPU int4 kernel, whose bf16 activations would blur the comparison."""
    from gpu_node.quant.linear import Int4Linear

    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.forward = module.forward_ref
    return model


def single_process(model, config, tokenizer, prompts, params):
    """Each request's tokens and each step's logits, in one process."""
    from gpu_node.engine.llm_engine import LLMEngine

    engine = LLMEngine(config, model, tokenizer)
    steps = record_logits(engine.runner)
    return engine.generate(prompts, params), steps


def tensor_parallel(world_size, phases, tokenizer, prompts, params, meanwhile):
    """For each (model, build, config) of `phases`: each request's tokens and each step's
    logits with this process as rank 0 on its shard of `model` and a process for each other
    rank on its shard of what `build()` returns there (the same model); and what
    `meanwhile()` returns, called while those processes start."""
    from gpu_node.engine.llm_engine import LLMEngine
    from gpu_node.errors import InvalidRequestError
    from gpu_node.parallel.group import ParallelConfig, destroy_parallel, init_parallel
    from gpu_node.parallel.step import StepSender
    from tests.conftest import free_port

    port = free_port()
    # Forked from one server that has imported the worker's modules once (a fresh
    # interpreter each would import torch and the kernels again).
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, "gpu_node.parallel.worker"])
    errors = context.Queue()
    builds = [(build, config) for _, build, config in phases]
    ranks = [
        context.Process(target=_run_rank, args=(r, world_size, port, builds, errors), daemon=True)
        for r in range(1, world_size)
    ]
    for p in ranks:
        p.start()
    results = []
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks share the cores
    try:
        before = meanwhile()
        shards = [shard_of(model, 0, world_size) for model, _, _ in phases]
        group = init_parallel(ParallelConfig(0, world_size, master_port=port, timeout_s=60))
        sender = StepSender(group)
        for shard, (_, _, config) in zip(shards, phases, strict=True):
            engine = LLMEngine(config, shard, tokenizer, step_broadcast=sender)
            # what would move KV within rank 0's pool alone is refused, changing nothing
            with pytest.raises(InvalidRequestError, match="not served under tensor parallelism"):
                engine.add_request("n", next(iter(prompts.values())), params, n=2)
            steps = record_logits(engine.runner)
            results.append((engine.generate(prompts, params), steps))
            sender.stop()
    finally:
        torch.set_num_threads(num_threads)
        destroy_parallel()
        for p in ranks:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "\n".join(failures)
    assert [p.exitcode for p in ranks] == [0] * len(ranks)
    return results, before


def tiny_llama(num_heads, num_kv_heads, head_dim, weights, fuse):
    """A 4-layer seeded llama in fp32, its projections INT4 (group 32) or plain."""
    from gpu_node.models.config import ModelConfig
    from gpu_node.models.llama import fuse_projections
    from gpu_node.models.weights import seeded_llama
    from gpu_node.quant.linear import quantize_model

    shape = ModelConfig(
        architecture="llama", num_layers=4, hidden_size=num_heads * head_dim,
        intermediate_size=256, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, vocab_size=1000, max_position_embeddings=512,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    model = seeded_llama(shape, seed=5)
    if weights == "int4":
        quantize_model(model, group_size=32, skip=("lm_head", "embed_tokens"))
    return int4_by_reference(fuse_projections(model) if fuse else model)


def fp32_gguf(path):
    from gpu_node.models.gguf_loader import GGUFModel
    from gpu_node.models.weights import load_llama

    return load_llama(GGUFModel(path), torch.float32)


def engine_config(**overrides):
    from gpu_node.config import EngineConfig

    # Chunked prefill beside decode rows: steps of every kind cross the broadcast.
    return EngineConfig(
        **{"model": "seeded", "weights": "fp32", "page_size": 8, "num_pages": 64,
           "max_num_batched_tokens": 16, **overrides}
    )  # fmt: skip


def assert_matches(parallel, single, atol):
    (tokens, steps), (tokens_ref, steps_ref) = parallel, single
    assert tokens == tokens_ref
    assert len(steps) == len(steps_ref)
    for logits, logits_ref in zip(steps, steps_ref, strict=True):
        torch.testing.assert_close(logits, logits_ref, rtol=0, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "num_heads", "num_kv_heads", "head_dim"), [(2, 4, 2, 32), (4, 4, 4, 32)]
)
def test_seeded_llama_under_tensor_parallelism_matches_one_process(
    world_size, num_heads, num_kv_heads, head_dim
):
    """Plain weights as loaded, and INT4 weights with q/k/v and gate/up fused."""
    from scheduler.sequence import SamplingParams

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    config = engine_config()
    tokenizer = StubTokenizer()
    shape = (num_heads, num_kv_heads, head_dim)
    build_plain = functools.partial(tiny_llama, *shape, "fp32", fuse=False)
    build_int4 = functools.partial(tiny_llama, *shape, "int4", fuse=True)
    plain, int4 = build_plain(), build_int4()
    parallel, single = tensor_parallel(
        world_size, [(plain, build_plain, config), (int4, build_int4, config)],
        tokenizer, PROMPTS, params,
        lambda: [single_process(m, config, tokenizer, PROMPTS, params) for m in (plain, int4)],
    )  # fmt: skip
    for result, ref in zip(parallel, single, strict=True):
        assert_matches(result, ref, 1e-4)


@pytest.mark.slow
def test_smollm2_under_tensor_parallelism_3_matches_one_process(
    smollm2_path, smollm2_parts, chat_ids
):
    """SmolLM2's 9 query and 3 KV heads across 3 ranks, fp32 weights."""
    from scheduler.sequence import SamplingParams

    model, tokenizer = smollm2_parts
    prompts = {
        "a": chat_ids("What is the capital of France?"),
        "b": chat_ids("Name three colours."),
    }
    params = SamplingParams(max_tokens=8)
    config = engine_config(model="smollm2", max_num_batched_tokens=64)
    [parallel], single = tensor_parallel(
        3, [(model, functools.partial(fp32_gguf, smollm2_path), config)],
        tokenizer, prompts, params,
        lambda: single_process(model, config, tokenizer, prompts, params),
    )  # fmt: skip
    assert_matches(parallel, single, 1e-3)


def tiny_moe(fold: bool):
    """moe-small (8 experts, top-2, one shared expert) on 4 layers, seeded: its shared expert
    folded into the expert stack (as moe_model builds it), or kept as its own MLP."""
    from gpu_node.models.moe import MOE_CONFIGS, MoeMLP
    from gpu_node.models.weights import moe_model

    model = moe_model("moe-small", seed=3)
    if not fold:
        for i, layer in enumerate(model.layers):
            layer.mlp = MoeMLP.dummy(MOE_CONFIGS["moe-small"], seed=3000 + i, dtype=torch.float32)
    return model


@pytest.mark.slow
def test_a_tiny_moe_under_expert_parallelism_matches_one_process():
    """Attention split by heads, the experts by rank (the folded stack of 9 as 5 + 4; the
    unfolded 8 as 4 + 4 with the shared expert column- then row-parallel), on 2 ranks."""
    from gpu_node.parallel.layers import ExpertParallelMoe
    from scheduler.sequence import SamplingParams

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    config = engine_config(model="moe-small")
    tokenizer = StubTokenizer()
    builds = [functools.partial(tiny_moe, fold=True), functools.partial(tiny_moe, fold=False)]
    models = [build() for build in builds]
    shard = shard_of(models[0], 0, 2)
    assert isinstance(shard.layers[0].mlp, ExpertParallelMoe)
    assert (shard.layers[0].mlp.start, shard.layers[0].mlp.end) == (0, 5)
    parallel, single = tensor_parallel(
        2, [(m, b, config) for m, b in zip(models, builds, strict=True)],
        tokenizer, PROMPTS, params,
        lambda: [single_process(m, config, tokenizer, PROMPTS, params) for m in models],
    )  # fmt: skip
    for result, ref in zip(parallel, single, strict=True):
        assert_matches(result, ref, 1e-4)


def test_a_moe_whose_experts_leave_a_rank_none_is_refused():
    import dataclasses

    from gpu_node.models.moe import MOE_CONFIGS, MoeMLP
    from gpu_node.models.weights import MOE_SMALL, seeded_llama
    from gpu_node.parallel.sharding import shard_problems

    model = seeded_llama(dataclasses.replace(MOE_SMALL, num_layers=1, num_kv_heads=4))
    model.layers[0].mlp = MoeMLP.dummy(MOE_CONFIGS["moe-small"], seed=1, dtype=torch.float32)
    model.layers[0].mlp.fold_shared_experts()  # 9 experts: 3 a rank, the fourth none
    assert shard_problems(model, 4) == ["layer 0's 9 experts leave rank 3 none"]
