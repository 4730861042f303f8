"""The MoE family: router, grouping by expert, MoeMLP (float and INT4), GGUF loading, and
the moe-small model through the engine in each weight format (INT4 computing in fp16 on a
GPU too)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import gpu_node.models.weights as weights_module
from gpu_node.config import EngineConfig
from gpu_node.models.moe import (
    MOE_CONFIGS,
    Int4MoeExperts,
    MoeConfig,
    MoeExperts,
    MoeMLP,
    moe_mlp_from_gguf,
)
from gpu_node.models.moe_routing import expert_slots_ref, group_by_expert, route
from gpu_node.models.weights import build_model
from gpu_node.quant.int4 import (
    Int4ExpertsMMA,
    Int4Weight,
    dequantize_int4,
    experts_from_mma,
    experts_to_mma,
    gated_row_order,
    int4_expert,
    quantize_int4,
    to_mma,
)
from gpu_node.quant.linear import Int4Linear, ModelBytes, model_bytes, quantize_model
from tests.gpu_node.helpers import check_moe_small_serves_two_requests, needs_cuda

SMALL = MOE_CONFIGS["moe-small"]


def test_ties_go_to_the_lower_expert_id() -> None:
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0, 5.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    r = route(logits, top_k=2)
    assert r.topk_ids.tolist() == [[1, 2], [0, 1]]
    assert r.topk_weights.tolist() == [[0.5, 0.5], [0.5, 0.5]]


def test_softmax_without_renormalisation_keeps_the_probabilities() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, float(np.log(4.0))]])  # probs 1/8 x4, 1/2
    r = route(logits, top_k=2, renormalize=False)
    assert r.topk_ids.tolist() == [[4, 0]]
    torch.testing.assert_close(r.topk_weights, torch.tensor([[0.5, 0.125]]))


def test_renormalisation_makes_weights_sum_to_one_then_scales() -> None:
    logits = torch.tensor([[0.0, 3.0, -1.0, 2.0]])
    r = route(logits, top_k=2, scoring="sigmoid", renormalize=True, routed_scaling=2.5)
    s = torch.sigmoid(torch.tensor([3.0, 2.0]))
    assert r.topk_ids.tolist() == [[1, 3]]
    torch.testing.assert_close(r.topk_weights, (s / s.sum() * 2.5).view(1, 2))


def test_a_batch_of_one_token_routes_and_runs() -> None:
    mlp = MoeMLP.dummy(SMALL, seed=1, dtype=torch.float32)
    x = torch.randn(1, SMALL.hidden_size, generator=torch.Generator().manual_seed(0))
    r = mlp.router(x)
    assert r.topk_ids.shape == (1, SMALL.top_k)
    y = mlp(x)
    assert y.shape == (1, SMALL.hidden_size) and bool(torch.isfinite(y).all())


def test_route_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="top_k"):
        route(torch.zeros(2, 4), top_k=5)
    with pytest.raises(ValueError, match="scoring"):
        route(torch.zeros(2, 4), top_k=1, scoring="relu")
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        route(torch.zeros(4), top_k=1)


def test_group_by_expert_pads_each_expert_and_skips_empty_ones() -> None:
    # 3 tokens, top-2, 4 experts: expert 2 receives no tokens.
    ids = torch.tensor([[0, 3], [3, 1], [0, 3]])
    b = group_by_expert(ids, num_experts=4, block_m=2)
    pad = 6  # T * K
    # expert 0: assignments 0, 4; expert 1: 3 (+pad); expert 3: 1, 2, 5 (+pad); then unused tail.
    assert b.sorted_ids.tolist() == [0, 4, 3, pad, 1, 2, 5, pad, pad, pad]
    assert b.block_experts.tolist() == [0, 1, 3, 3, 4]  # 4 == E: nothing there
    assert b.num_assignments == 6 and b.block_m == 2


def test_expert_slots_ref_cuts_each_expert_into_slots_of_eight() -> None:
    # 10 tokens, top-2, 4 experts: expert 1 gets 10 assignments (two slots), 2 gets 7,
    # 3 gets 2, 0 gets 1; assignment a = token * 2 + k.
    ids = torch.tensor([[3, 1], [1, 0], [1, 3]] + [[1, 2]] * 7)
    s = expert_slots_ref(ids, num_experts=4)
    assert s.num_assignments == 20
    assert s.slot_experts.tolist() == [0, 1, 1, 2, 3] + [4] * 15  # 4 == E: unused
    assert s.slot_counts.tolist() == [1, 8, 2, 7, 2] + [0] * 15
    rows = s.slot_ids.tolist()
    assert rows[0] == [3] * 8  # one assignment; the other columns repeat it
    assert rows[1] == [1, 2, 4, 6, 8, 10, 12, 14]  # expert 1's first eight, in token order
    assert rows[2] == [16, 18, 16, 16, 16, 16, 16, 16]
    assert rows[3] == [7, 9, 11, 13, 15, 17, 19, 7]
    assert rows[4] == [0, 5, 0, 0, 0, 0, 0, 0]
    assert s.slot_ids.dtype == s.slot_experts.dtype == s.slot_counts.dtype == torch.int32


def test_expert_slots_ref_one_token_gives_one_slot_per_expert() -> None:
    s = expert_slots_ref(torch.tensor([[5, 2, 7]]), num_experts=8)
    assert s.slot_experts.tolist() == [2, 5, 7]
    assert s.slot_counts.tolist() == [1, 1, 1]
    assert s.slot_ids[:, 0].tolist() == [1, 0, 2]


def test_expert_stack_mma_layout_is_lossless_and_per_expert() -> None:
    gen = torch.Generator().manual_seed(7)
    weight = quantize_int4(torch.randn(3, 40, 128, generator=gen), 64)
    mma = experts_to_mma(weight)
    assert mma.tiles.shape == (3, 3, 2, 2 * 64 + 16) and mma.shape == (3, 40, 128)
    # Expert-major, then group-major within the expert, as one expert's Int4WeightMMA.
    assert mma.tiles.stride() == (2 * 3 * 144, 144, 3 * 144, 1)
    for e in range(3):
        assert torch.equal(mma.expert(e).tiles, to_mma(int4_expert(weight, e)).tiles)
    back = experts_from_mma(mma)
    assert torch.equal(back.packed, weight.packed)
    assert torch.equal(back.scales, weight.scales) and torch.equal(back.mins, weight.mins)
    # Gated: row block r holds gate rows 8r .. 8r + 7, then up rows I + 8r .. I + 8r + 7
    # (N = 32, I = 16: rows 0-7 and 16-23, then 8-15 and 24-31).
    even = quantize_int4(torch.randn(2, 32, 128, generator=gen), 64)
    order = [*range(0, 8), *range(16, 24), *range(8, 16), *range(24, 32)]
    assert gated_row_order(32).tolist() == order
    rows = Int4Weight(
        even.packed[:, order], even.scales[:, order], even.mins[:, order], even.shape, 64
    )
    gated = experts_to_mma(even, gated=True)
    assert gated.gated and not mma.gated
    assert torch.equal(gated.tiles, experts_to_mma(rows).tiles)
    back_gated = experts_from_mma(experts_to_mma(even, gated=True))
    assert torch.equal(back_gated.packed, even.packed) and torch.equal(back_gated.mins, even.mins)
    with pytest.raises(ValueError, match="multiple of 8"):
        experts_to_mma(weight, gated=True)  # N = 40: I = 20
    with pytest.raises(ValueError, match="3-D"):
        experts_to_mma(quantize_int4(torch.randn(40, 128), 64))
    with pytest.raises(ValueError, match=r"\[E, \.\.\.\] for E = 4"):
        Int4ExpertsMMA(tiles=mma.tiles, shape=(4, 40, 128), group_size=64)


def test_int4_moe_experts_in_the_mma_layout_give_the_same_output() -> None:
    config = MoeConfig(hidden_size=128, num_experts=4, top_k=2, expert_hidden_size=64)
    experts = MoeMLP.dummy(config, seed=4, dtype=torch.float32).experts
    assert isinstance(experts, MoeExperts)
    int4 = experts.to_int4(group_size=64)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    routing = route(torch.randn(5, 4, generator=torch.Generator().manual_seed(2)), 2)
    before = int4(x, routing)
    w13, w2 = int4.weights()
    assert int4.layout == "int4"
    int4.use_mma_layout()
    assert int4.layout == "mma" and int4.w13_packed.dtype == torch.int32
    assert int4.w13_scales.numel() == 0  # the scales and mins live in the tiles
    after_w13, after_w2 = int4.weights()
    assert torch.equal(after_w13.packed, w13.packed) and torch.equal(after_w2.mins, w2.mins)
    assert torch.equal(int4(x, routing), before)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="top_k"):
        MoeConfig(hidden_size=8, num_experts=2, top_k=3, expert_hidden_size=8)
    with pytest.raises(ValueError, match="hidden_size"):
        MoeConfig(hidden_size=0, num_experts=2, top_k=1, expert_hidden_size=8)
    with pytest.raises(ValueError, match="scoring"):
        MoeConfig(hidden_size=8, num_experts=2, top_k=1, expert_hidden_size=8, scoring="tanh")  # type: ignore[arg-type]


def test_dummy_weights_are_seeded() -> None:
    a = MoeMLP.dummy(SMALL, seed=5, dtype=torch.float32)
    b = MoeMLP.dummy(SMALL, seed=5, dtype=torch.float32)
    c = MoeMLP.dummy(SMALL, seed=6, dtype=torch.float32)
    assert torch.equal(a.experts.w13, b.experts.w13) and torch.equal(
        a.router.weight, b.router.weight
    )
    assert not torch.equal(a.experts.w13, c.experts.w13)
    assert a.experts.w13.shape == (8, 128, 128) and a.experts.w2.shape == (8, 128, 64)


def test_int4_moe_equals_the_float_moe_of_its_dequantized_weights() -> None:
    x = torch.randn(9, SMALL.hidden_size, generator=torch.Generator().manual_seed(2))
    original = MoeMLP.dummy(SMALL, seed=3, dtype=torch.float32)
    y_float = original(x)
    quantized = quantize_model(MoeMLP.dummy(SMALL, seed=3, dtype=torch.float32), group_size=32)
    assert isinstance(quantized.experts, Int4MoeExperts)
    w13, w2 = quantized.experts.weights()
    reference = MoeMLP.dummy(SMALL, seed=3, dtype=torch.float32)
    reference.experts = MoeExperts(dequantize_int4(w13), dequantize_int4(w2))
    shared = quantized.shared
    assert shared is not None and reference.shared is not None
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(reference.shared, name).weight.data = dequantize_int4(
            getattr(shared, name).weight_int4
        )
    for module in quantized.modules():  # the reference arithmetic, not torch's bf16 CPU kernel
        if isinstance(module, Int4Linear):
            module.forward = module.forward_ref
    y_int4 = quantized(x)
    torch.testing.assert_close(y_int4, reference(x), rtol=1e-5, atol=1e-5)
    # Against the unquantized model: measured 0.13 relative error (group 32, seed 3).
    rel = float((y_int4 - y_float).norm() / y_float.norm())
    assert 0.01 < rel < 0.2


@pytest.mark.parametrize("num_shared", [1, 2])
def test_folding_the_shared_experts_keeps_the_float_output(num_shared: int) -> None:
    config = dataclasses.replace(SMALL, num_shared_experts=num_shared)
    mlp = MoeMLP.dummy(config, seed=8, dtype=torch.float32)
    x = torch.randn(6, config.hidden_size, generator=torch.Generator().manual_seed(8))
    before = mlp(x)
    assert mlp.fold_shared_experts()
    assert mlp.shared is None and mlp.num_always_on == num_shared
    assert isinstance(mlp.experts, MoeExperts)
    assert mlp.experts.w13.shape == (8 + num_shared, 128, 128)
    assert mlp.experts.w2.shape == (8 + num_shared, 128, 64)
    torch.testing.assert_close(mlp(x), before, rtol=1e-5, atol=1e-5)
    assert not mlp.fold_shared_experts()  # nothing left to fold


@pytest.mark.parametrize("num_shared", [1, 2])
def test_folding_int4_shared_experts_moves_their_codes_exactly(num_shared: int) -> None:
    config = dataclasses.replace(SMALL, num_shared_experts=num_shared)
    mlp = quantize_model(MoeMLP.dummy(config, seed=9, dtype=torch.float32), group_size=32)
    assert mlp.shared is not None
    gate, up, down = (
        getattr(mlp.shared, n).weight_int4 for n in ("gate_proj", "up_proj", "down_proj")
    )
    for module in mlp.modules():  # the reference arithmetic, as the folded experts use
        if isinstance(module, Int4Linear):
            module.forward = module.forward_ref
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(9))
    before, bytes_before = mlp(x), model_bytes(mlp)
    assert mlp.fold_shared_experts()
    assert isinstance(mlp.experts, Int4MoeExperts) and mlp.shared is None
    w13, w2 = mlp.experts.weights()
    assert w13.shape == (8 + num_shared, 128, 128) and w2.shape == (8 + num_shared, 128, 64)
    dense13, dense2 = dequantize_int4(w13), dequantize_int4(w2)
    for s in range(num_shared):  # expert 8 + s: rows s*64 .. s*64 + 63 of the shared MLP
        rows = slice(64 * s, 64 * s + 64)
        assert torch.equal(dense13[8 + s, :64], dequantize_int4(gate)[rows])
        assert torch.equal(dense13[8 + s, 64:], dequantize_int4(up)[rows])
        assert torch.equal(dense2[8 + s], dequantize_int4(down)[:, rows])
    assert model_bytes(mlp) == bytes_before
    torch.testing.assert_close(mlp(x), before, rtol=1e-5, atol=1e-5)


def test_fold_refuses_a_float_shared_mlp_beside_int4_experts() -> None:
    mlp = quantize_model(
        MoeMLP.dummy(SMALL, seed=1, dtype=torch.float32), group_size=32, skip=("shared",)
    )
    assert isinstance(mlp.experts, Int4MoeExperts) and mlp.shared is not None
    assert not mlp.fold_shared_experts()
    assert mlp.shared is not None and mlp.num_always_on == 0


def test_moe_small_bytes_by_kind() -> None:
    mlp = quantize_model(MoeMLP.dummy(SMALL, seed=0, dtype=torch.bfloat16), group_size=32)
    # routed: 8 * (128*128 + 128*64) values; shared: 3 * 128*64; router 8*128 bf16 stays.
    values = 8 * (128 * 128 + 128 * 64) + 3 * 128 * 64
    assert model_bytes(mlp) == ModelBytes(
        packed=values // 2, scales=2 * values // 32, mins=2 * values // 32, unquantized=2 * 8 * 128
    )


def _write_moe_gguf(path: Path, config: MoeConfig, quantize: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(9)
    h, e, i = config.hidden_size, config.num_experts, config.expert_hidden_size
    arrays = {
        "blk.0.ffn_gate_inp.weight": rng.standard_normal((e, h), dtype=np.float32),
        "blk.0.ffn_gate_exps.weight": rng.standard_normal((e, i, h), dtype=np.float32) / 8,
        "blk.0.ffn_up_exps.weight": rng.standard_normal((e, i, h), dtype=np.float32) / 8,
        "blk.0.ffn_down_exps.weight": rng.standard_normal((e, h, i), dtype=np.float32) / 8,
        "blk.0.ffn_gate_shexp.weight": rng.standard_normal((i, h), dtype=np.float32) / 8,
        "blk.0.ffn_up_shexp.weight": rng.standard_normal((i, h), dtype=np.float32) / 8,
        "blk.0.ffn_down_shexp.weight": rng.standard_normal((h, i), dtype=np.float32) / 8,
    }
    writer = gguf.GGUFWriter(path, arch="llama")
    stored = {}
    for name, array in arrays.items():
        if quantize and "_exps" in name:
            q4 = gguf.GGMLQuantizationType.Q4_1
            blocks = gguf.quants.quantize(array, q4)
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=q4)
            stored[name] = gguf.quants.dequantize(blocks, q4).reshape(array.shape)
        else:
            writer.add_tensor(name, array)
            stored[name] = array
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@pytest.mark.parametrize("quantize", [False, True])
def test_load_from_gguf_matches_the_stored_tensors(tmp_path: Path, quantize: bool) -> None:
    config = dataclasses.replace(SMALL, num_experts=4)
    stored = _write_moe_gguf(tmp_path / "moe.gguf", config, quantize)
    mlp = moe_mlp_from_gguf(tmp_path / "moe.gguf", layer=0, config=config, dtype=torch.float32)
    assert isinstance(mlp.experts, Int4MoeExperts if quantize else MoeExperts)
    if quantize:
        w13, w2 = mlp.experts.weights()
        w13_dense, w2_dense = dequantize_int4(w13).numpy(), dequantize_int4(w2).numpy()
    else:
        w13_dense, w2_dense = mlp.experts.w13.numpy(), mlp.experts.w2.numpy()
    gate_up = np.concatenate(
        [stored["blk.0.ffn_gate_exps.weight"], stored["blk.0.ffn_up_exps.weight"]], axis=1
    )
    assert np.array_equal(w13_dense, gate_up)
    assert np.array_equal(w2_dense, stored["blk.0.ffn_down_exps.weight"])
    assert np.array_equal(mlp.router.weight.numpy(), stored["blk.0.ffn_gate_inp.weight"])
    assert mlp.shared is not None
    assert np.array_equal(
        mlp.shared.down_proj.weight.numpy(), stored["blk.0.ffn_down_shexp.weight"]
    )
    y = mlp(torch.randn(3, config.hidden_size))
    assert y.shape == (3, config.hidden_size)


def test_load_from_gguf_names_a_missing_tensor(tmp_path: Path) -> None:
    _write_moe_gguf(tmp_path / "moe.gguf", SMALL, quantize=False)
    with pytest.raises(KeyError, match=r"blk\.1\.ffn_gate_inp\.weight"):
        moe_mlp_from_gguf(tmp_path / "moe.gguf", layer=1, config=SMALL)


def test_casting_int4_experts_keeps_their_scales() -> None:
    mlp = quantize_model(MoeMLP.dummy(SMALL, seed=4, dtype=torch.float32), group_size=32)
    before = mlp.experts.weights()
    mlp.to(torch.bfloat16)
    after = mlp.experts.weights()
    assert mlp.router.weight.dtype == torch.bfloat16
    for b, a in zip(before, after, strict=True):
        assert a.scales.dtype == torch.float16 and torch.equal(a.scales, b.scales)
        assert torch.equal(a.mins, b.mins) and torch.equal(a.packed, b.packed)


def test_int4_experts_keep_their_tile_strides_through_a_memory_format_move() -> None:
    mlp = quantize_model(MoeMLP.dummy(SMALL, seed=5, dtype=torch.float32), group_size=32)
    mlp.experts.use_mma_layout()  # 4-D tiles, stored group-major (not contiguous)
    strides = mlp.experts.w13_packed.stride()
    mlp.to(memory_format=torch.channels_last)
    assert mlp.experts.w13_packed.stride() == strides
    w13, _ = mlp.experts.weights_mma()  # would refuse tiles without a unit last stride
    assert w13.group_size == 32


@pytest.mark.parametrize("weights", ["int4", "bf16", "fp32"])
def test_moe_small_runs_through_the_engine(weights):
    from gpu_node.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig(model="moe-small", weights=weights, num_pages=32))
    check_moe_small_serves_two_requests(engine)


def test_moe_small_in_bf16_serves_the_codes_of_the_fp32_build(monkeypatch):
    # As a GPU node builds it (bf16 activations), here on CPU: norms and embeddings in
    # bf16, the INT4 codes, scales and mins exactly those quantized from the fp32 weights
    # (checked on layer 0 against its own fp32 weights, quantized here).
    monkeypatch.setattr(weights_module, "activation_dtype", lambda *args: torch.bfloat16)
    model, _ = build_model("moe-small", "int4")
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    fp32 = weights_module.moe_model("moe-small").layers[0]  # the same seeds, unquantized
    q_proj = model.layers[0].self_attn.q_proj.weight_int4
    expected = quantize_int4(fp32.self_attn.q_proj.weight, 32)
    assert q_proj.scales.dtype == torch.float16
    assert torch.equal(q_proj.packed, expected.packed)
    assert torch.equal(q_proj.scales, expected.scales) and torch.equal(q_proj.mins, expected.mins)
    w13, w2 = model.layers[0].mlp.experts.weights()
    assert torch.equal(w13.packed, quantize_int4(fp32.mlp.experts.w13, 32).packed)
    assert torch.equal(w2.scales, quantize_int4(fp32.mlp.experts.w2, 32).scales)
    x = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
    assert model.layers[0].mlp(x).dtype == torch.bfloat16


@needs_cuda
def test_moe_small_serves_int4_in_fp16_through_the_engine():
    from gpu_node.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model="moe-small", weights="int4", activations="fp16", device="cuda", kv_dtype="fp16",
        num_pages=32,
    )  # fmt: skip
    engine = LLMEngine.from_config(config)
    assert engine.model.embed_tokens.weight.dtype == torch.float16
    check_moe_small_serves_two_requests(engine)
