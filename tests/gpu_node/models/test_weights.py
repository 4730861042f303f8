"""Loading weights (weights.py): SmolLM2's Q4_1 blocks as INT4 modules that answer as the
dequantized model does, bf16 weights in bf16, and the dtype a model computes in
(activation_dtype) by weights, device and what is asked for."""

import pytest
import torch

import gpu_node.kernels.launch as launch
from gpu_node.config import EngineConfig
from gpu_node.engine.llm_engine import LLMEngine
from gpu_node.models.gguf_loader import GGUFModel
from gpu_node.models.weights import activation_dtype, build_model, load_llama
from gpu_node.quant.linear import Int4Linear, model_bytes
from gpu_node.quant.q8 import Q8Linear
from scheduler.sequence import SamplingParams
from tests.gpu_node.helpers import prompt_logits


@pytest.fixture(scope="module")
def int4_parts(smollm2_path):
    return build_model(str(smollm2_path), "int4")


def test_int4_model_holds_q4_1_blocks_not_floats(int4_parts):
    model, _ = int4_parts
    linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
    # readied for the CPU kernels: q|k|v, o, gate|up and down in every layer
    assert len(linears) == 30 * 4 and model.cpu_kernels
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    # the output head: the file's Q8_0 blocks of the tied embedding, 34 bytes a 32 weights
    assert isinstance(model.lm_head, Q8Linear)
    assert model.lm_head.codes.numel() + 2 * model.lm_head.scales.numel() == 30_081_024
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
    # A prompt's projections run torch's CPU int4 kernel (bf16 activations and bf16
    # scale/zero), the head the C GEMV. Measured on three prompts: max |diff| 1.39 on
    # logits reaching 38, and the same argmax everywhere.
    fast = prompt_logits(engine, ids)
    assert (fast - fp32).abs().max().item() < 2.0
    assert torch.equal(fast.argmax(-1), fp32.argmax(-1))
    # The reference arithmetic (dequantize, fp32 matmul; the head's Q8_0 blocks likewise
    # outside the C kernels) is the fp32 model exactly: Q4_1 blocks import without loss.
    linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
    model.cpu_kernels = False
    for linear in linears:
        linear.forward = linear.forward_ref
    try:
        exact = prompt_logits(engine, ids)
    finally:
        model.cpu_kernels = True
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
