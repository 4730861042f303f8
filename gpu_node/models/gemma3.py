"""The Gemma 3 family (text), written plainly beside llama and sharing its parts.

What Gemma 3 changes on llama's decoder: each sublayer's output is normalised before it
joins the residual ("sandwich" norms: four per layer), the MLP gates with tanh-GELU, the
embedding is scaled by sqrt(D), queries and keys are normalised per head, and five of
every six layers attend through a sliding window with their own RoPE base
(ModelConfig.layer_types, sliding_rope_theta). Gemma's checkpoints store norm weights as
an offset from 1 (it multiplies by 1 + w); the safetensors loader adds the 1 once, and a
GGUF holds them with the 1 added already, so RMSNorm here is llama's.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_node.models.config import ModelConfig
from gpu_node.models.deepseek_v2 import DeepseekV2Model
from gpu_node.models.llama import (
    AttentionBackend,
    LlamaAttention,
    LlamaMLP,
    LlamaModel,
    RMSNorm,
    RotaryEmbedding,
)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.pre_feedforward_layernorm = RMSNorm(d, eps)
        self.mlp: nn.Module = LlamaMLP(d, config.intermediate_size, config.hidden_act)
        self.post_feedforward_layernorm = RMSNorm(d, eps)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), positions, rope, attention)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(LlamaModel):
    @staticmethod
    def decoder_layer(config: ModelConfig, layer: int) -> nn.Module:
        return Gemma3DecoderLayer(config, layer)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, D]
        # sqrt(D) rounded to the weights' dtype first, as the checkpoints were trained
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)


def model_class(config: ModelConfig) -> type[LlamaModel]:
    """The model class of `config`'s family."""
    if config.architecture == "deepseek_v2":
        return DeepseekV2Model
    return Gemma3Model if config.architecture == "gemma3" else LlamaModel


# Gemma 3's GGUF tensor names -> our parameter names, per layer. llama.cpp stores Gemma's
# norm weights with the 1 of its (1 + w) already added: what our RMSNorm multiplies by.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
