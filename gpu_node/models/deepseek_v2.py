"""The DeepSeek-V2 family (DeepSeek-V2, V2-Lite, V2.5): multi-head latent attention (MLA)
on the llama decoder, whose MLPs are dense in the first layers and MoE after
(ModelConfig.moe_layers; shared experts and group-limited routing in moe.py).

MLA compresses a token's keys and values into one latent of `kv_lora_rank` dims plus one
rotated key part of `qk_rope_head_dim` dims shared by every head:

    q            = q_proj(x), or q_b_proj(norm(q_a_proj(x)))       [T, H, N + R]
    latent, k_pe = kv_a_proj_with_mqa(x)                           [T, C], [T, R]
    k_nope, v    = kv_b_proj(norm(latent))                         [T, H, N], [T, H, V]
    k            = k_nope ++ rope(k_pe), the same k_pe for all heads      [T, H, N + R]

Here the latent is expanded into per-head K and V when the step's tokens are written, so
the paged cache, its kernels and the engine see ordinary attention with H kv heads of
E = max(N + R, V) dims (V and, where it is the longer, K zero-padded to E; the padded dims
add nothing to a score and the output's are sliced off). That costs KV memory: a token
takes 2 * H * E values a layer where the latent takes C + R (DeepSeek-V2-Lite: 2 * 16 *
192 = 6144 against 512 + 64 = 576, 10.7x; V2's 128 heads, 85x). Storing the latent and
absorbing kv_b_proj into the query and the output (attention over C + R dims, one kv
head) is what would take the cache down to the latent's size; it needs kernels that read
K and V from one latent row.

DeepSeek rotates complex pairs, adjacent dims (2i, 2i+1): `rope_interleaved` here, with
the checkpoint's rows as they are. Under YaRN, the softmax scale carries mscale_all_dim's
factor squared (families.deepseek_v2) and cos and sin YaRN's attention factor
(RotaryEmbedding).

Shape legend:
    T  tokens      D  hidden size      H  heads      C  kv_lora_rank      Q  q_lora_rank
    N  qk_nope_head_dim      R  qk_rope_head_dim      V  v_head_dim      E  cache head dim
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gpu_node.models.config import ModelConfig
from gpu_node.models.llama import (
    AttentionBackend,
    LlamaMLP,
    LlamaModel,
    RMSNorm,
    RotaryEmbedding,
)

# The eps of MLA's two latent norms: transformers' and DeepSeek's code leave it at the
# RMSNorm default, not the model's rms_norm_eps.
MLA_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MlaConfig:
    """The dims of multi-head latent attention; `q_lora_rank` None: q is one projection."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MlaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"MlaConfig.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}"
            )
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"MlaConfig.q_lora_rank must be positive, got {self.q_lora_rank}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_head_dim(self) -> int:
        """E: the head dim of the cached K and V, the longer of the two."""
        return max(self.qk_head_dim, self.v_head_dim)


class MlaAttention(nn.Module):
    """Multi-head latent attention, its K and V expanded per head before the cache."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        mla = config.mla
        assert mla is not None
        self.layer, self.mla = layer, mla
        self.num_heads = config.num_heads
        d, h = config.hidden_size, config.num_heads
        self.q_proj: nn.Module | None = None
        self.q_a_proj: nn.Module | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Module | None = None
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, MLA_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, h * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, MLA_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, h * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(h * mla.v_head_dim, d, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        mla, t, h = self.mla, x.shape[0], self.num_heads
        n, r, v_dim, e = (
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim,
            mla.cache_head_dim,
        )
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj and self.q_a_layernorm and self.q_b_proj
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, h, n + r)  # [T, H, N + R]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split((mla.kv_lora_rank, r), dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(t, h, n + v_dim)  # [T, H, N + V]
        k_nope, v = kv.split((n, v_dim), dim=-1)  # [T, H, N], [T, H, V]
        q_pe, k_pe = rope.pair(q[..., n:], k_pe.reshape(t, 1, r), positions)  # [T, H|1, R]
        q = torch.cat((q[..., :n], q_pe), dim=-1)  # [T, H, N + R]
        k = torch.cat((k_nope, k_pe.expand(t, h, r)), dim=-1)  # [T, H, N + R]
        if e > n + r:
            q, k = F.pad(q, (0, e - n - r)), F.pad(k, (0, e - n - r))
        if e > v_dim:
            v = F.pad(v, (0, e - v_dim))
        out = attention(self.layer, q, k, v.contiguous())[..., :v_dim]  # [T, H, V]
        return self.o_proj(out.reshape(t, h * v_dim))


class DeepseekV2DecoderLayer(nn.Module):
    """llama's pre-norm residual layer around MLA; the MLP dense here, an MoeMLP where the
    loader puts one (ModelConfig.moe_layers)."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MlaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = LlamaMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act
        )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), positions, rope, attention)
        normed, x = self.post_attention_layernorm.add_norm(x, attended)  # x + attended
        return x + self.mlp(normed)


class DeepseekV2Model(LlamaModel):
    @staticmethod
    def decoder_layer(config: ModelConfig, layer: int) -> nn.Module:
        return DeepseekV2DecoderLayer(config, layer)
