"""The llama model (llama.py). Ours against an independent implementation (transformers)
reading the same GGUF; RoPE: one cos and sin a step, shared by every layer's call at that
step's positions; fuse_projections: a layer's q/k/v and gate/up as one product each (what GPU
nodes serve) give bit for bit the logits of the separate products, in fp32 and from SmolLM2's
own Q4_1 blocks, and parts that cannot share one product are left alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from gpu_node.models.config import ModelConfig
from gpu_node.models.gguf_loader import GGUFModel
from gpu_node.models.llama import RotaryEmbedding, fuse_projections
from gpu_node.models.weights import load_llama, seeded_llama
from gpu_node.quant.linear import Int4Linear, model_bytes, quantize_model
from scheduler.sequence import SamplingParams
from tests.gpu_node.helpers import prompt_logits

TINY = ModelConfig(
    architecture="llama", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
    num_kv_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
    rope_theta=10000.0, rms_norm_eps=1e-5,
)  # fmt: skip


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    import transformers  # a test extra: its absence is an install bug, never a skip

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


def test_prompt_logits_match_transformers(make_engine, chat_ids, hf_model):
    engine = make_engine()
    ids = chat_ids("Tell me about the history of Rome.")
    ours = prompt_logits(engine, ids)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape == (len(ids), 49152)
    assert (ours - theirs).abs().max().item() < 1e-3


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_greedy_continuation_matches_transformers_for_40_tokens(
    make_engine, chat_ids, hf_model, kv_dtype
):
    ids = chat_ids("Tell me about the history of Rome.")
    engine = make_engine(kv_dtype=kv_dtype)
    ours = engine.generate({"r": ids}, SamplingParams(max_tokens=40, ignore_eos=True))["r"]
    with torch.no_grad():
        theirs = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=40, min_new_tokens=40, do_sample=False
        )[0, len(ids) :].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), 40)
    # fp32 KV is exact to the last token; bf16 KV must hold the first 30
    assert agree >= (40 if kv_dtype == "fp32" else 30)


# -- RoPE ------------------------------------------------------------------------------


def test_a_step_shares_its_angles_and_only_with_its_own_positions() -> None:
    rope = RotaryEmbedding(8, 10000.0, interleaved=True)
    positions = torch.tensor([0, 5, 9])
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    before = rope(x, positions)
    with rope.at(positions):
        cos, sin = rope.angles(positions)
        assert rope.angles(positions)[0] is cos and rope.angles(positions)[1] is sin
        assert torch.equal(rope(x, positions), before)
        # another tensor, even with equal values, gets angles of its own
        other = torch.tensor([1, 2, 3])
        assert torch.equal(rope(x, other), RotaryEmbedding(8, 10000.0, interleaved=True)(x, other))
        assert rope.angles(positions.clone())[0] is not cos
    assert rope.angles(positions)[0] is not cos  # the step is over: nothing kept
    assert torch.equal(rope(x, positions), before)


def test_angles_are_cleared_when_the_step_raises() -> None:
    rope = RotaryEmbedding(4, 10000.0, interleaved=False)
    positions = torch.tensor([3])
    try:
        with rope.at(positions):
            cos, _ = rope.angles(positions)
            raise RuntimeError("a layer failed")
    except RuntimeError:
        pass
    assert rope.angles(positions)[0] is not cos


# -- fuse_projections ------------------------------------------------------------------


@pytest.mark.parametrize("int4", [False, True])
def test_fused_projections_give_the_same_logits_bit_for_bit(
    smollm2_path, make_engine, chat_ids, int4
):
    model = load_llama(GGUFModel(smollm2_path), torch.float32, int4=int4)  # its own copy
    engine = make_engine()
    engine.model = engine.runner.model = model
    ids = chat_ids("What is the capital of France?")
    before, bytes_before = prompt_logits(engine, ids), model_bytes(model)
    assert fuse_projections(model) is model
    after = prompt_logits(engine, ids)
    assert torch.equal(after, before)
    assert model_bytes(model) == bytes_before
    kind = Int4Linear if int4 else nn.Linear
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn.qkv_proj, kind) and isinstance(mlp.gate_up_proj, kind)
        assert attn.q_proj is attn.k_proj is attn.v_proj is mlp.gate_proj is mlp.up_proj is None
    qkv, gate_up = model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.gate_up_proj
    rows = [m.out_features if int4 else m.weight.shape[0] for m in (qkv, gate_up)]
    assert rows == [576 + 2 * 192, 2 * 1536]
    assert fuse_projections(model) is model  # a second call changes nothing
    assert torch.equal(prompt_logits(engine, ids), before)


def test_parts_that_cannot_share_one_product_stay_apart():
    model = seeded_llama(TINY, seed=2)
    first, second = model.layers
    quantize_model(first.self_attn, group_size=32, skip=("q_proj",))  # q float, k and v INT4
    second.mlp.up_proj = nn.Linear(64, 128, bias=True)  # a bias
    mixed = seeded_llama(dataclasses.replace(TINY, num_layers=1), seed=3)
    attn = mixed.layers[0].self_attn
    quantize_model(attn, group_size=32, skip=("v_proj",))
    attn.v_proj = Int4Linear.from_linear(attn.v_proj, 64)  # groups of 32 and of 64
    fuse_projections(model)
    fuse_projections(mixed)
    assert first.self_attn.qkv_proj is None and isinstance(first.self_attn.q_proj, nn.Linear)
    assert isinstance(first.mlp.gate_up_proj, nn.Linear)
    assert isinstance(second.self_attn.qkv_proj, nn.Linear)
    assert second.mlp.gate_up_proj is None and second.mlp.up_proj.bias is not None
    assert attn.qkv_proj is None and isinstance(attn.q_proj, Int4Linear)
