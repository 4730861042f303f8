"""The moe-small model through the engine, in each weight format, and an engine refusing a
model not in the activations asked for."""

import pytest
import torch

import gpu_node.models.weights as weights_module
from gpu_node.config import EngineConfig
from gpu_node.engine.llm_engine import LLMEngine
from gpu_node.models.weights import build_model
from gpu_node.quant.int4 import quantize_int4
from tests.gpu_node.helpers import check_moe_small_serves_two_requests


@pytest.mark.parametrize("weights", ["int4", "bf16", "fp32"])
def test_moe_small_runs_through_the_engine(weights):
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


def test_an_engine_refuses_a_model_not_in_the_activations_asked_for(smollm2_parts):
    model, tokenizer = smollm2_parts  # fp32
    config = EngineConfig(model="smollm2", weights="bf16", activations="bf16", num_pages=8)
    with pytest.raises(ValueError) as info:
        LLMEngine(config, model, tokenizer)
    assert str(info.value) == (
        "activations bf16 asked for, but the model computes in fp32 (build it with "
        "build_model(..., activations='bf16'))"
    )
