"""Builds a model and fills its weights from a GGUF file."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from gpu_node.cache.kv_quant import DTYPE_NAMES, KV_DTYPES
from gpu_node.config import ACTIVATIONS
from gpu_node.errors import ModelNotFoundError
from gpu_node.kernels import launch
from gpu_node.kernels.cpu import available as kernels_built
from gpu_node.models.config import ModelConfig
from gpu_node.models.gemma3 import GGUF_LAYER_NAMES as GEMMA3_GGUF_LAYER_NAMES
from gpu_node.models.gemma3 import model_class
from gpu_node.models.gguf_loader import GGUFModel
from gpu_node.models.llama import LlamaModel, fuse_projections, gguf_parameter_names
from gpu_node.models.tokenizer import ChatTokenizer
from gpu_node.quant.linear import Int4Linear

Progress = Callable[[int, int], None]  # (tensors done, tensors total)


def load_llama(
    gguf: GGUFModel,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
    int4: bool = False,
) -> LlamaModel:
    """Fills a plain model of the GGUF's family (llama or Gemma 3) from it; the model code
    stays plain.

    With `int4`, every linear stored as Q4_1 becomes an `Int4Linear` straight from
    its blocks (never held in full precision); other 2-D weights are quantized
    from their dequantized values; embeddings and norms stay in `dtype`.
    """
    config = gguf.config()
    with torch.device("meta"):
        model = model_class(config)(config)
    if config.architecture == "gemma3":
        names = gguf_parameter_names(config, GEMMA3_GGUF_LAYER_NAMES)
    else:
        names = gguf_parameter_names(config)
    missing = [name for name in names if not gguf.has(name)]
    if missing:
        raise ModelNotFoundError(f"{gguf.path} lacks tensors: {', '.join(missing[:5])}")
    state = {}
    for i, (src, dst) in enumerate(names.items()):
        module_name = dst.removesuffix(".weight")
        if int4 and _is_projection(module_name):
            raw = gguf.raw(src)
            if raw.ggml_type == "Q4_1":
                rows, cols = raw.shape
                linear = Int4Linear.from_q4_1(raw.data, (rows, cols))
            else:
                dense = nn.Linear(raw.shape[1], raw.shape[0], bias=False)
                dense.weight.data = gguf.tensor(src)
                linear = Int4Linear.from_linear(dense, group_size=32)
            model.set_submodule(module_name, linear.to(device))
        else:
            state[dst] = gguf.tensor(src, dtype).to(device)
        if progress:
            progress(i + 1, len(names))
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=False)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # Buffers are not in the state dict: rebuild the (non-persistent) RoPE table for real.
    model.reset_rotary_tables(device)
    _assert_materialized(model)
    return model.eval()


def _is_projection(module_name: str) -> bool:
    return module_name.rsplit(".", 1)[-1].endswith("_proj")


def _assert_materialized(model: nn.Module) -> None:
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelNotFoundError(f"weights missing for {', '.join(left[:5])}")


# The small MoE model served with dummy weights: llama attention, MoE MLPs.
MOE_SMALL = ModelConfig(
    architecture="moe", num_layers=4, hidden_size=128, intermediate_size=256, num_heads=4,
    num_kv_heads=2, head_dim=32, vocab_size=49152, max_position_embeddings=4096,
    rope_theta=10000.0, rms_norm_eps=1e-5,
)  # fmt: skip


def moe_model(name: str, seed: int = 0, device: torch.device | str = "cpu") -> LlamaModel:
    """A llama whose MLPs are seeded dummy MoE blocks of `MOE_CONFIGS[name]`, their shared
    experts folded into the expert stack (MoeMLP.fold_shared_experts)."""
    from gpu_node.models.moe import MOE_CONFIGS, MoeMLP

    moe = MOE_CONFIGS[name]
    config = dataclasses.replace(MOE_SMALL, hidden_size=moe.hidden_size)
    model = seeded_llama(config, seed, device)
    for i, layer in enumerate(model.layers):
        mlp = MoeMLP.dummy(moe, seed=seed * 1000 + i, dtype=torch.float32, device=device)
        mlp.fold_shared_experts()
        layer.mlp = mlp
    return model


def activation_dtype(
    weights: str, device: torch.device | str, activations: str = "auto"
) -> torch.dtype:
    """What a node computes in: bf16 with bf16 weights, and with INT4 weights on a GPU
    of compute capability 8.0 or newer (the tensor-core W4A16 and MoE kernels take bf16
    activations; older GPUs keep the CUDA-core kernels, in fp32); fp32 otherwise (INT4
    on CPU runs torch's int4 kernel from fp32 activations, and fp32 is the reference).

    `activations` "fp16" asks for fp16 instead, which only INT4 weights on such a GPU take:
    the kernels then dequantize a word in 5 instructions instead of bf16's 7
    (w4a16/mma_asm.py), 1-8% faster a GEMV at 11 of 12 layer shapes on the H200
    (docs/benchmarks.md), for
    fp16's range (65504 at most) in place of bf16's. "bf16" is auto's GPU choice, refused
    where auto would not give it; raises ValueError naming what is missing.
    """
    tensor_cores = weights == "int4" and launch.has_mma_sync(torch.device(device))
    auto = torch.bfloat16 if weights == "bf16" or tensor_cores else torch.float32
    if activations == "auto":
        return auto
    if activations not in ACTIVATIONS:
        raise ValueError(
            f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}"
        )
    wanted = KV_DTYPES[activations]
    if wanted == torch.float16 and not tensor_cores:
        raise ValueError(
            f"activations fp16 takes int4 weights on a CUDA GPU of compute capability 8.0 "
            f"or newer (the tensor-core W4A16 kernels); {weights} weights on {device} compute "
            f"in {DTYPE_NAMES[auto]}: use activations auto"
        )
    if wanted == torch.bfloat16 and auto != torch.bfloat16:
        raise ValueError(
            f"activations bf16: {weights} weights on {device} compute in {DTYPE_NAMES[auto]}; "
            f"use activations auto"
        )
    return wanted


def build_model(
    model: str,
    weights: str,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
    activations: str = "auto",
    cpu_kernels: bool = True,
) -> tuple[LlamaModel, ChatTokenizer]:
    """The model and tokenizer a node serves, in the weight format asked for, computing in
    activation_dtype(weights, device, activations). `cpu_kernels`: an INT4 model on the
    CPU readied for the C decode kernels where they are built (use_cpu_kernels); off for a
    model to be sharded, whose fused modules they would not know.

    `moe-small` borrows SmolLM2's tokenizer (its own weights are dummies).
    """
    from gpu_node.models.model_store import SYNTHETIC_MODELS, resolve_model
    from gpu_node.quant.linear import quantize_model

    dtype = activation_dtype(weights, device, activations)
    # On a GPU a layer's q/k/v and gate/up run as one product each (fuse_projections: the
    # same dot products, fewer launches); a CPU keeps the modules as loaded.
    on_gpu = torch.device(device).type == "cuda"
    if model in SYNTHETIC_MODELS:
        tokenizer = ChatTokenizer(GGUFModel(resolve_model("smollm2")))
        built = moe_model(model, device=device)
        if weights == "int4":  # from the fp32 weights, so every device serves the same codes
            quantize_model(built, group_size=32, skip=("lm_head", "embed_tokens", "router"))
        built = built.to(dtype)  # the INT4 buffers are moved, never cast
        return (fuse_projections(built) if on_gpu else built), tokenizer
    path = resolve_model(model)
    gguf = None
    if path.is_dir():  # a Hugging Face checkpoint
        from gpu_node.models.hf_checkpoint import HFCheckpoint, load_hf_model

        loaded = load_hf_model(HFCheckpoint(path), dtype, device, progress, weights == "int4")
        tokenizer = ChatTokenizer.from_directory(path)
    else:
        gguf = GGUFModel(path)
        loaded = load_llama(gguf, dtype, device, progress, int4=weights == "int4")
        tokenizer = ChatTokenizer(gguf)
    if on_gpu:
        return fuse_projections(loaded), tokenizer
    if cpu_kernels and weights == "int4" and dtype == torch.float32 and kernels_built():
        use_cpu_kernels(loaded, gguf)
    return loaded, tokenizer


def use_cpu_kernels(model: LlamaModel, gguf: GGUFModel | None = None) -> LlamaModel:
    """Readies an fp32 model with INT4 projections for the CPU's C decode kernels
    (kernels/cpu), in place: q/k/v and gate/up fused (one GEMV each), the output head
    as Q8_0 (the GGUF's own blocks where it stores the head so, else quantized as GGUF
    does), and `model.cpu_kernels` set, so its forward calls the kernels. Returns `model`."""
    from gpu_node.quant.q8 import Q8Linear

    fuse_projections(model)
    if isinstance(model.lm_head, nn.Linear):
        name = "token_embd.weight" if model.config.tie_word_embeddings else "output.weight"
        raw = gguf.raw(name) if gguf is not None and gguf.has(name) else None
        if raw is not None and raw.ggml_type == "Q8_0":
            model.lm_head = Q8Linear.from_gguf(raw.data, (raw.shape[0], raw.shape[1]))
        elif model.lm_head.in_features % 32 == 0:
            model.lm_head = Q8Linear.from_weight(model.lm_head.weight)
    model.cpu_kernels = True
    return model


def seeded_llama(
    config: ModelConfig,
    seed: int = 0,
    device: torch.device | str = "cpu",
    draw_on_device: bool = False,
) -> LlamaModel:
    """A model of `config`'s shape with seeded random weights (for tests and benchmarks):
    norms 1, every other weight N(0, 1) / sqrt(fan-in).

    The weights are drawn on the host, so a seed gives the same model on any device.
    `draw_on_device`: build and draw them on `device` instead (an 8B model's fp32 build on
    the host takes minutes); the values then depend on the device's generator."""
    where = torch.device(device) if draw_on_device else torch.device("cpu")
    with where:
        model = LlamaModel(config)
    generator = torch.Generator(device=where).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(
                    torch.randn(param.shape, generator=generator, device=where)
                    * param.shape[-1] ** -0.5
                )
    return model.to(device).eval()
