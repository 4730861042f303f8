"""--weights int4|bf16|fp32 and the moe-small model through the engine."""

import pytest
import torch

import gpu_node.kernels.launch as launch
import gpu_node.models.weights as weights_module
from gpu_node.config import EngineConfig
from gpu_node.engine.llm_engine import LLMEngine
from gpu_node.models.gguf_loader import GGUFModel
from gpu_node.models.weights import activation_dtype, build_model, load_llama
from gpu_node.quant.int4 import quantize_int4
from gpu_node.quant.linear import Int4Linear, model_bytes
from scheduler.sequence import SamplingParams
from tests.gpu_node.models.test_parity import prompt_logits


@pytest.fixture(scope="module")
def int4_parts(smollm2_path):
    return build_model(str(smollm2_path), "int4")


def test_int4_model_holds_q4_1_blocks_not_floats(int4_parts):
    model, _ = int4_parts
    linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(linears) == 30 * 7  # q, k, v, o, gate, up, down in every layer
    assert not any(
        isinstance(m, torch.nn.Linear) and m is not model.lm_head for m in model.modules()
    )
    sizes = model_bytes(model)
    # 106,168,320 weights in 210 Q4_1 matrices: 4 bits each + an fp16 scale and min per 32
    assert (sizes.packed, sizes.scales, sizes.mins) == (53_084_160, 6_635_520, 6_635_520)


def test_int4_answers_paris_and_tracks_the_dequantized_model(int4_parts, smollm2_parts, chat_ids):
    model, tokenizer = int4_parts
    engine = LLMEngine(
        EngineConfig(model="smollm2", weights="int4", num_pages=64), model, tokenizer
    )
    ids = chat_ids("What is the capital of France?")
    out = engine.generate({"q": ids}, SamplingParams(max_tokens=10))
    assert tokenizer.decode(out["q"]) == "The capital of France is Paris."
    reference = LLMEngine(EngineConfig(model="smollm2", num_pages=64), smollm2_parts[0], tokenizer)
    fp32 = prompt_logits(reference, ids)
    # torch's CPU int4 kernel: bf16 activations and bf16 scale/zero. Measured on three
    # prompts: max |diff| 1.39 on logits reaching 38, and the same argmax everywhere.
    fast = prompt_logits(engine, ids)
    assert (fast - fp32).abs().max().item() < 2.0
    assert torch.equal(fast.argmax(-1), fp32.argmax(-1))
    # The reference arithmetic (dequantize, fp32 matmul) is the fp32 model exactly:
    # Q4_1 blocks import without loss.
    linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
    for linear in linears:
        linear.forward = linear.forward_ref
    try:
        exact = prompt_logits(engine, ids)
    finally:
        for linear in linears:
            del linear.forward
    assert (exact - fp32).abs().max().item() < 1e-4


def test_int4_greedy_continuation_matches_fp32_for_40_tokens(int4_parts, smollm2_parts, chat_ids):
    model, tokenizer = int4_parts
    ids = chat_ids("Tell me about the history of Rome.")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    int4 = LLMEngine(EngineConfig(model="smollm2", num_pages=64), model, tokenizer).generate(
        {"r": ids}, params
    )
    fp32 = LLMEngine(
        EngineConfig(model="smollm2", num_pages=64), smollm2_parts[0], tokenizer
    ).generate({"r": ids}, params)
    assert int4 == fp32


def check_moe_small_serves_two_requests(engine):
    """Two requests through a moe-small engine of 32 pages: the pages each takes and gives
    back, and its usage (its tokens are seeded noise)."""
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


@pytest.mark.parametrize("weights", ["int4", "bf16", "fp32"])
def test_moe_small_runs_through_the_engine(weights):
    engine = LLMEngine.from_config(EngineConfig(model="moe-small", weights=weights, num_pages=32))
    check_moe_small_serves_two_requests(engine)


def test_bf16_weights_load_in_bf16(smollm2_path):
    model = load_llama(GGUFModel(smollm2_path), torch.bfloat16)
    assert model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("weights", "device", "mma", "expected"),
    [
        ("int4", "cpu", False, torch.float32),  # torch's int4 CPU kernel from fp32 activations
        ("int4", "cuda", True, torch.bfloat16),  # the tensor-core kernels take bf16
        ("int4", "cuda:1", True, torch.bfloat16),
        ("int4", "cuda", False, torch.float32),  # before sm_80: the CUDA-core kernels, fp32
        ("bf16", "cpu", False, torch.bfloat16),
        ("fp32", "cuda", True, torch.float32),
    ],
)
def test_activation_dtype_by_weights_and_device(monkeypatch, weights, device, mma, expected):
    monkeypatch.setattr(launch, "has_mma_sync", lambda dev: mma and dev.type == "cuda")
    assert activation_dtype(weights, device) is expected


@pytest.mark.parametrize(
    ("weights", "device", "activations", "expected"),
    [
        ("int4", "cuda", "fp16", torch.float16),  # the W4A16 kernels' fp16 dequantization
        ("int4", "cuda:1", "fp16", torch.float16),
        ("int4", "cuda", "bf16", torch.bfloat16),
        ("bf16", "cpu", "bf16", torch.bfloat16),
        ("fp32", "cuda", "auto", torch.float32),
    ],
)
def test_activations_asked_for_where_the_kernels_take_them(
    monkeypatch, weights, device, activations, expected
):
    monkeypatch.setattr(launch, "has_mma_sync", lambda dev: dev.type == "cuda")
    assert activation_dtype(weights, device, activations) is expected


@pytest.mark.parametrize(
    ("weights", "device", "mma", "activations", "message"),
    [
        ("int4", "cpu", False, "fp16", "int4 weights on cpu compute in fp32"),
        ("int4", "cuda", False, "fp16", "int4 weights on cuda compute in fp32"),  # before sm_80
        ("bf16", "cuda", True, "fp16", "bf16 weights on cuda compute in bf16"),
        ("fp32", "cuda", True, "fp16", "fp32 weights on cuda compute in fp32"),
    ],
)
def test_fp16_activations_are_refused_where_no_fp16_kernel_runs(
    monkeypatch, weights, device, mma, activations, message
):
    monkeypatch.setattr(launch, "has_mma_sync", lambda dev: mma and dev.type == "cuda")
    with pytest.raises(ValueError) as info:
        activation_dtype(weights, device, activations)
    assert str(info.value) == (
        "activations fp16 takes int4 weights on a CUDA GPU of compute capability 8.0 or newer "
        f"(the tensor-core W4A16 kernels); {message}: use activations auto"
    )


def test_bf16_activations_are_refused_where_auto_computes_in_fp32(monkeypatch):
    monkeypatch.setattr(launch, "has_mma_sync", lambda dev: False)
    with pytest.raises(ValueError) as info:
        activation_dtype("int4", "cpu", "bf16")
    assert str(info.value) == (
        "activations bf16: int4 weights on cpu compute in fp32; use activations auto"
    )
    with pytest.raises(ValueError, match="activations must be one of auto, bf16, fp16, got 'fp8'"):
        activation_dtype("int4", "cpu", "fp8")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"activations": "fp8"}, "activations must be one of auto, bf16, fp16, got 'fp8'"),
        (
            {"activations": "fp16", "weights": "bf16"},
            "activations fp16 takes int4 weights (they run the fp16 W4A16 kernels); bf16 "
            "weights compute in their own dtype: use activations auto",
        ),
    ],
)
def test_engine_config_refuses_activations_it_cannot_serve(options, message):
    with pytest.raises(ValueError) as info:
        EngineConfig(**options)
    assert str(info.value) == f"invalid EngineConfig: {message}"


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
