"""Builds a model and fills its weights from a GGUF file."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpu_node.gguf_loader import GGUFModel
from gpu_node.models.config import ModelConfig
from gpu_node.models.llama import LlamaModel, RotaryEmbedding, gguf_parameter_names

Progress = Callable[[int, int], None]  # (tensors done, tensors total)


def load_llama(
    gguf: GGUFModel,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
) -> LlamaModel:
    """Dequantizes each GGUF tensor into its parameter; the model code stays plain."""
    config = gguf.config()
    with torch.device("meta"):
        model = LlamaModel(config)
    names = gguf_parameter_names(config)
    missing = [name for name in names if not gguf.has(name)]
    if missing:
        from gpu_node.errors import ModelNotFoundError

        raise ModelNotFoundError(f"{gguf.path} lacks tensors: {', '.join(missing[:5])}")
    state = {}
    for i, (src, dst) in enumerate(names.items()):
        state[dst] = gguf.tensor(src, dtype).to(device)
        if progress:
            progress(i + 1, len(names))
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model.load_state_dict(state, assign=True, strict=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # Buffers are not in the state dict: rebuild the (non-persistent) RoPE table for real.
    model.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_interleaved).to(
        device
    )
    return model.eval()


def seeded_llama(
    config: ModelConfig, seed: int = 0, device: torch.device | str = "cpu"
) -> LlamaModel:
    """A model of `config`'s shape with seeded random weights (for tests and benchmarks)."""
    generator = torch.Generator().manual_seed(seed)
    model = LlamaModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
    return model.to(device).eval()
