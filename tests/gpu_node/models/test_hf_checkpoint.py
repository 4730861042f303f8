"""Every family's checkpoint, written by transformers, loads through our path and computes
what transformers computes: prompt logits within 1e-3 (fp32) and 40 greedy tokens equal.
And a real one: SmolLM2 converted from its GGUF by transformers (weights to safetensors,
tokenizer to tokenizer.json with its chat template), served from that directory, answers
exactly as from the GGUF."""

from __future__ import annotations

import json

import pytest
import torch

from gpu_node.engine.attention import attend_ref
from gpu_node.errors import ModelNotFoundError
from gpu_node.models.families import config_from_hf
from gpu_node.models.hf_checkpoint import HFCheckpoint, load_hf_model
from tests.gpu_node.models.hf_tiny import FAMILIES, PROMPT, PROMPTS, write_checkpoint


class WholeContext:
    """The attention of one prompt run in one step: causal over the step's own K/V, each
    layer with its window (the reference the paged engine is tested against elsewhere)."""

    def __init__(self, windows, scale):
        self.windows, self.scale = windows, scale

    def __call__(self, layer, q, k, v):
        return attend_ref(q, k, v, self.scale, self.windows[layer])


def our_logits(model, ids):
    config = model.config
    attention = WholeContext(config.layer_windows, config.attention_scale)
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(len(ids)), attention)


def our_greedy(model, ids, n):
    ids = list(ids)
    for _ in range(n):  # recomputes the whole context each token: the plainest reference
        ids.append(int(our_logits(model, ids)[-1].argmax()))
    return ids[len(PROMPT) :]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    # sharded in two or more files, so the index and the shard-by-shard path are exercised
    hf = write_checkpoint(request.param, directory, shard_bytes=200_000)
    return request.param, directory, hf


def test_config_json_reads_into_our_config(family_checkpoint):
    family, directory, _ = family_checkpoint
    config = HFCheckpoint(directory).config()
    assert config.num_layers == 3 and config.hidden_size == 64 and config.head_dim == 16
    assert (config.num_heads, config.num_kv_heads, config.vocab_size) == (4, 2, 320)
    assert config.rope_interleaved is False
    expected_windows = {
        "mistral": (8, 8, 8),
        "gemma3": (8, None, 8),
    }.get(family, (None, None, None))
    assert config.layer_windows == expected_windows
    assert config.qk_norm == (family in ("qwen3", "gemma3", "qwen3_moe"))
    assert config.attention_bias == (family == "qwen2")
    if family == "qwen3_moe":
        assert config.moe is not None and config.moe.renormalize
        assert [config.has_moe(i) for i in range(3)] == [True, False, True]
    if family == "gemma3":
        assert config.attention_scale == pytest.approx(24**-0.5)
        assert config.sliding_rope_theta == 10000.0 and config.rope_theta == 100000.0
        assert config.rope_scaling is not None and config.rope_scaling.kind == "linear"


def test_checkpoint_is_sharded(family_checkpoint):
    _, directory, _ = family_checkpoint
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(HFCheckpoint(directory).shards) >= 2


def test_prompt_logits_match_transformers(family_checkpoint):
    _, directory, hf = family_checkpoint
    model = load_hf_model(HFCheckpoint(directory))
    ours = our_logits(model, PROMPT)
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0].float()
    assert ours.shape == theirs.shape == (len(PROMPT), 320)
    assert (ours - theirs).abs().max().item() < 1e-3


def test_40_greedy_tokens_match_transformers(family_checkpoint):
    _, directory, hf = family_checkpoint
    model = load_hf_model(HFCheckpoint(directory))
    ours = our_greedy(model, PROMPT, 40)
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=40, min_new_tokens=40, do_sample=False
        )[0, len(PROMPT) :].tolist()
    assert ours == theirs


def test_unknown_architecture_is_refused_naming_the_supported():
    with pytest.raises(ModelNotFoundError) as info:
        config_from_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    message = str(info.value)
    assert "GPT2LMHeadModel is not supported" in message
    for name in ("LlamaForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert name in message


def test_unsupported_rope_scaling_is_refused(tmp_path):
    write_checkpoint("llama", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelNotFoundError, match="RoPE scaling 'yarn' is not supported"):
        HFCheckpoint(tmp_path).config()


def test_a_directory_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelNotFoundError, match=r"holds no \.safetensors weights"):
        HFCheckpoint(tmp_path)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_int4_on_load_is_within_the_rounding_bound_of_each_product(tmp_path, family):
    """Quantized on load, every projection's output on the model's own activations lies
    within what round-to-nearest allows: each weight moves by at most half its group's
    scale (scale rounded up, min down in fp16: the whole group stays representable), so
    |x W'^T - x W^T| <= sum_k |x_k| * scale_g(k) / 2, plus fp32 summation error."""
    from gpu_node.quant.int4 import dequantize_int4
    from gpu_node.quant.linear import Int4Linear

    torch.set_grad_enabled(False)
    write_checkpoint(family, tmp_path)
    checkpoint = HFCheckpoint(tmp_path)
    exact = load_hf_model(checkpoint)
    quantized = load_hf_model(checkpoint, int4=True)
    int4_modules = {n: m for n, m in quantized.named_modules() if isinstance(m, Int4Linear)}
    assert len(int4_modules) == {"qwen2": 21, "qwen3_moe": 15}[family]  # 7 a dense layer
    inputs: dict[str, torch.Tensor] = {}

    def keep_input(name):
        def hook(_module, args, _out):
            inputs.setdefault(name, args[0].clone())

        return hook

    hooks = [exact.get_submodule(n).register_forward_hook(keep_input(n)) for n in int4_modules]
    our_logits(exact, PROMPT)
    for hook in hooks:
        hook.remove()
    for name, module in int4_modules.items():
        x = inputs[name].clone()  # [T, K]
        w = exact.get_submodule(name).weight.detach().float()  # [N, K]
        q = module.weight_int4
        assert q.group_size == (64 if w.shape[1] == 64 else 32)
        half_scale = (q.scales.float() / 2).repeat_interleave(q.group_size, dim=1)  # [N, K]
        assert ((dequantize_int4(q) - w).abs() <= half_scale * (1 + 1e-3)).all(), name
        bound = x.abs() @ half_scale.T + 1e-4
        error = (x @ dequantize_int4(q).T - x @ w.T).abs()
        assert (error <= bound).all(), name
        bias = 0 if module.bias is None else module.bias
        assert (module.forward_ref(x) - bias - x @ dequantize_int4(q).T).abs().max() < 1e-4
        # The CPU kernel takes x, the scale and the zero (min + 8 scale) in bf16: each value
        # off by at most 2^-9 of itself, so a product by at most 2^-9 sum_k |x_k| (|w_k| +
        # 8 scale + |zero|) more, twice over for the two roundings it compounds.
        zero = (q.mins.float() + 8 * q.scales.float()).repeat_interleave(q.group_size, dim=1)
        per_weight = dequantize_int4(q).abs() + 16 * half_scale + zero.abs()
        kernel_bound = (x.abs() @ per_weight.T) * 2**-8 + 1e-4
        assert ((module(x) - module.forward_ref(x)).abs() <= kernel_bound).all(), name


def engine_greedy(directory, hf_expected, *, device="cpu", weights="fp32", kv_dtype="fp32"):
    """40 greedy tokens of three prompts at once through the engine: paged KV in pages of
    8 tokens (16 on a GPU), prompts prefilled in chunks of at most 16 tokens a step beside the others'
    decodes, every sequence's window cut from the pages."""
    from gpu_node.config import EngineConfig
    from gpu_node.engine.llm_engine import LLMEngine
    from gpu_node.models.llama import fuse_projections
    from gpu_node.models.tokenizer import ChatTokenizer
    from gpu_node.models.weights import activation_dtype
    from scheduler.sequence import SamplingParams

    dtype = activation_dtype(weights, device)
    model = load_hf_model(HFCheckpoint(directory), dtype, device, int4=weights == "int4")
    if device == "cuda":
        model = fuse_projections(model)
    page_size = 16 if device == "cuda" else 8  # the GPU's kernels take pages of 16 tokens
    config = EngineConfig(
        model=str(directory), weights=weights, device=device, kv_dtype=kv_dtype,
        page_size=page_size, num_pages=64, max_num_batched_tokens=16, long_prefill_tokens=0,
    )  # fmt: skip
    engine = LLMEngine(config, model, ChatTokenizer.from_directory(directory))
    prompts = {name: ids for name, ids in hf_expected}
    outputs = engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    return outputs


def transformers_greedy(hf, prompts):
    with torch.no_grad():
        return {
            name: hf.generate(
                torch.tensor([ids]), max_new_tokens=40, min_new_tokens=40, do_sample=False
            )[0, len(ids) :].tolist()
            for name, ids in prompts
        }


def test_the_engine_decodes_what_transformers_does(family_checkpoint):
    _, directory, hf = family_checkpoint
    assert engine_greedy(directory, PROMPTS) == transformers_greedy(hf, PROMPTS)


def reference_model(directory, weights):
    """Our model on the CPU in fp32 (transformers' logits to 1e-4, tested above), holding the
    weights a GPU engine of `weights` computes with: bf16's rounded, INT4's dequantized
    (run by the modules' fp32 reference; the caller turns the CPU INT4 kernel off)."""
    model = load_hf_model(HFCheckpoint(directory), int4=weights == "int4")
    if weights == "bf16":
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.copy_(parameter.bfloat16().float())
    return model


def reference_shortfalls(model, prompts, ours) -> list[float]:
    """How far below the reference's best logit each token we chose lies, the reference
    reading our own answers (teacher forcing): 0 where it is its greedy choice; worst first."""
    shortfalls: list[float] = []
    for name, ids in prompts:
        logits = our_logits(model, ids + ours[name])[len(ids) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(ours[name])[:, None])[:, 0]
        shortfalls += (logits.max(-1).values - chosen).tolist()
    return sorted(shortfalls, reverse=True)


# A GPU engine computes in TF32 (fp32 weights) or bf16 (bf16 and INT4 weights) inside its
# kernels, so a near-tie between two tokens may fall the other way: each token it chooses
# must be the reference's greedy choice (the same weights, fp32 arithmetic) to within these
# logits (the tiny models' logits span ~1-5).
GPU_SHORTFALL = {"fp32": 1e-2, "bf16": 0.15, "int4": 0.15}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("weights", ["fp32", "bf16", "int4"])
def test_the_engine_on_a_gpu_chooses_transformers_tokens(family_checkpoint, weights, monkeypatch):
    """The GPU's paths (decode kernels and graphs, fused projections, q/k norm and MoE
    kernels, sliding layers past their window, INT4 kernels) against transformers' arithmetic
    on the same weights (reference_model): 40 tokens of three prompts, each its greedy
    choice up to a near-tie of GPU_SHORTFALL."""
    from gpu_node.quant import linear

    family, directory, _ = family_checkpoint
    kv_dtype = "fp32" if weights == "fp32" else "bf16"
    ours = engine_greedy(directory, PROMPTS, device="cuda", weights=weights, kv_dtype=kv_dtype)
    assert {name: len(ids) for name, ids in ours.items()} == {"a": 40, "b": 40, "c": 40}
    monkeypatch.setattr(linear, "_HAS_CPU_INT4", False)
    shortfalls = reference_shortfalls(reference_model(directory, weights), PROMPTS, ours)
    print(f"{family} {weights}: worst shortfalls {[round(x, 4) for x in shortfalls[:4]]}")
    assert shortfalls[0] <= GPU_SHORTFALL[weights]


# Already-quantized checkpoints (quant/checkpoint_formats.py), written by each format's spec.
QUANTIZED = [
    ("gptq", "llama"),
    ("gptq_v2_asym", "qwen2"),
    ("awq", "llama"),
    ("ct_sym", "qwen2"),
    ("ct_asym", "llama"),
]


@pytest.fixture(scope="module", params=QUANTIZED, ids=["-".join(p) for p in QUANTIZED])
def quantized_checkpoint(request, tmp_path_factory):
    from tests.gpu_node.quant.test_checkpoint_formats import write_quantized_checkpoint

    kind, family = request.param
    directory = tmp_path_factory.mktemp(f"{kind}-{family}")
    values, hf = write_quantized_checkpoint(kind, family, directory)
    return directory, values, hf


def test_a_quantized_checkpoint_imports_each_projection_exactly(quantized_checkpoint):
    from gpu_node.quant.int4 import dequantize_int4
    from gpu_node.quant.linear import Int4Linear

    directory, values, _ = quantized_checkpoint
    model = load_hf_model(HFCheckpoint(directory), int4=True)
    imported = {n: m for n, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert sorted(imported) == sorted(values) and len(values) == 14  # 7 a layer
    for name, module in imported.items():
        assert module.group_size == 128
        assert torch.equal(dequantize_int4(module.weight_int4), values[name]), name
    assert (
        isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype == torch.float32
    )


def test_a_quantized_checkpoint_computes_the_logits_of_its_spec_weights(
    quantized_checkpoint, monkeypatch
):
    """Against transformers holding the spec's dequantized weights, at fp32. The CPU's int4
    kernel takes x, the scale and the zero in bf16, so the modules run their fp32
    reference here (the kernel is checked against it in the int4-on-load test above)."""
    from gpu_node.quant import linear

    monkeypatch.setattr(linear, "_HAS_CPU_INT4", False)
    directory, _, hf = quantized_checkpoint
    model = load_hf_model(HFCheckpoint(directory), int4=True)
    ours = our_logits(model, PROMPT)
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0].float()
    assert ours.shape == theirs.shape == (len(PROMPT), 320)
    assert (ours - theirs).abs().max().item() < 1e-4


def test_a_quantized_moe_checkpoint_imports_its_experts_exactly(tmp_path, monkeypatch):
    """Each expert's imported projections stack into the MoE layer's INT4 experts with the
    spec's values; the prompt logits are the spec weights' (fp32, as above)."""
    from gpu_node.models.moe import Int4MoeExperts
    from gpu_node.quant import linear
    from gpu_node.quant.int4 import dequantize_int4
    from tests.gpu_node.quant.test_checkpoint_formats import write_quantized_checkpoint

    monkeypatch.setattr(linear, "_HAS_CPU_INT4", False)
    values, hf = write_quantized_checkpoint("gptq", "qwen3_moe", tmp_path)
    model = load_hf_model(HFCheckpoint(tmp_path), int4=True)
    experts = model.layers[0].mlp.experts
    assert isinstance(experts, Int4MoeExperts) and experts.group_size == 128
    w13, w2 = (dequantize_int4(w) for w in experts.weights())
    for e in range(4):
        name = f"layers.0.mlp.experts.{e}"
        gate_up = torch.cat([values[f"{name}.gate_proj"], values[f"{name}.up_proj"]])
        assert torch.equal(w13[e], gate_up) and torch.equal(w2[e], values[f"{name}.down_proj"])
    ours = our_logits(model, PROMPT)
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0].float()
    assert (ours - theirs).abs().max().item() < 1e-4


def test_a_quantized_output_head_is_imported(tmp_path, monkeypatch):
    from gpu_node.quant import linear
    from gpu_node.quant.int4 import dequantize_int4
    from tests.gpu_node.quant.test_checkpoint_formats import write_quantized_checkpoint

    monkeypatch.setattr(linear, "_HAS_CPU_INT4", False)
    values, hf = write_quantized_checkpoint("gptq", "llama", tmp_path, lm_head=True)
    model = load_hf_model(HFCheckpoint(tmp_path), int4=True)
    assert isinstance(model.lm_head, linear.Int4Linear)
    assert torch.equal(dequantize_int4(model.lm_head.weight_int4), values["lm_head"])
    ours = our_logits(model, PROMPT)
    with torch.no_grad():
        theirs = hf(torch.tensor([PROMPT])).logits[0].float()
    assert (ours - theirs).abs().max().item() < 1e-4


def test_the_engine_serves_a_quantized_checkpoint(tmp_path):
    from tests.gpu_node.quant.test_checkpoint_formats import write_quantized_checkpoint

    _, hf = write_quantized_checkpoint("gptq", "qwen2", tmp_path)
    ours = engine_greedy(tmp_path, PROMPTS, weights="int4")
    theirs = transformers_greedy(hf, PROMPTS)
    assert {name: len(ids) for name, ids in ours.items()} == {"a": 40, "b": 40, "c": 40}
    assert sum(ours[n][0] == theirs[n][0] for n in ours) >= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_quantized_checkpoint_runs_the_tensor_core_kernels(quantized_checkpoint):
    """In bf16 on a GPU: every projection runs the tensor-core kernels, their layout still
    holds the spec's values, and the prompt logits stay within bf16's rounding of the spec
    weights' fp32 logits (0.04 at most on an H100, of logits up to 4.6)."""
    from gpu_node.quant.int4 import dequantize_int4

    directory, values, hf = quantized_checkpoint
    model = load_hf_model(HFCheckpoint(directory), torch.bfloat16, "cuda", int4=True)
    config = model.config
    attention = WholeContext(config.layer_windows, config.attention_scale)
    with torch.inference_mode():
        ids, positions = torch.tensor(PROMPT), torch.arange(len(PROMPT))
        ours = model(ids.cuda(), positions.cuda(), attention).float().cpu()
        theirs = hf(torch.tensor([PROMPT])).logits[0].float()
    for name, value in values.items():
        module = model.get_submodule(name)
        assert module.layout == "mma", name
        assert torch.equal(dequantize_int4(module.weight_int4).cpu(), value), name
    assert (ours - theirs).abs().max().item() < 0.1


def test_a_quantized_checkpoint_is_served_as_int4_only(tmp_path):
    from tests.gpu_node.quant.test_checkpoint_formats import write_quantized_checkpoint

    write_quantized_checkpoint("awq", "llama", tmp_path)
    with pytest.raises(ModelNotFoundError) as info:
        load_hf_model(HFCheckpoint(tmp_path), torch.bfloat16)
    assert str(info.value) == (
        f"{tmp_path} is quantized (awq INT4): serve it with --weights int4; a full-precision "
        f"copy would only be its INT4 values dequantized"
    )


def test_a_permuted_g_idx_is_refused_on_load(tmp_path):
    from safetensors.torch import load_file, save_file

    from tests.gpu_node.quant.test_checkpoint_formats import write_quantized_checkpoint

    write_quantized_checkpoint("gptq", "llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.g_idx"
    order = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    tensors[name] = tensors[name][order].contiguous()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelNotFoundError) as info:
        load_hf_model(HFCheckpoint(tmp_path), int4=True)
    assert str(info.value) == (
        "layers.1.mlp.down_proj: g_idx scatters each group's inputs across the row (desc_act / "
        "act-order); our INT4 groups are runs of consecutive inputs, so these groups do not map"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bits": 8}, "GPTQ checkpoint not imported: bits 8; only 4-bit weights map onto our INT4"),
        (
            {"group_size": 48},
            "GPTQ checkpoint not imported: group_size 48; our INT4 groups are 32, 64, 128 "
            "inputs, so a checkpoint's group must be a multiple of 32 (or -1, one a row)",
        ),
        (
            {"quant_method": "hqq"},
            "checkpoints quantized with 'hqq' are not imported (we import 4-bit 'gptq', 'awq' "
            "and 'compressed-tensors'); serve the original (bf16/fp16) checkpoint with "
            "--weights int4 to quantize it on load",
        ),
    ],
)
def test_a_quantization_config_that_does_not_map_is_refused_before_loading(
    tmp_path, change, message
):
    from tests.gpu_node.quant.test_checkpoint_formats import write_quantized_checkpoint

    write_quantized_checkpoint("gptq", "llama", tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelNotFoundError) as info:
        HFCheckpoint(tmp_path).config()
    assert str(info.value) == message


# -- SmolLM2 converted to Hugging Face's format ----------------------------------------

QUESTIONS = ("What is the capital of France?", "Tell me about the history of Rome.")


@pytest.fixture(scope="module")
def smollm2_directory(smollm2_path, tmp_path_factory):
    import transformers

    directory = tmp_path_factory.mktemp("smollm2-hf")
    kwargs = {"gguf_file": smollm2_path.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, dtype=torch.float32, **kwargs
    )
    # transformers will not save a model it read from a GGUF: write what save_pretrained would.
    from safetensors.torch import save_file

    state = model.state_dict()
    if model.config.tie_word_embeddings:  # stored once, as the embedding
        del state["lm_head.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    model.config.__dict__.pop("quantization_config", None)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, **kwargs).save_pretrained(
        directory
    )
    return directory


def answers(model_name: str) -> dict[str, list[int]]:
    from gpu_node.config import EngineConfig
    from gpu_node.engine.llm_engine import LLMEngine
    from gpu_node.models.weights import build_model
    from scheduler.sequence import SamplingParams

    model, tokenizer = build_model(model_name, "fp32")
    engine = LLMEngine(EngineConfig(model=model_name, weights="fp32", num_pages=128), model,
                       tokenizer)  # fmt: skip
    prompts = {q: tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS}
    return engine.generate(prompts, SamplingParams(max_tokens=24)) | {
        f"prompt: {q}": ids for q, ids in prompts.items()
    }


@pytest.mark.slow
def test_the_converted_checkpoint_answers_as_the_gguf(smollm2_path, smollm2_directory):
    from_gguf = answers(str(smollm2_path))
    from_directory = answers(str(smollm2_directory))
    assert from_directory == from_gguf
    first = from_gguf[QUESTIONS[0]]
    assert len(first) > 3  # a real answer, compared token for token above
