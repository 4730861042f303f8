"""The architecture of a model, read once from its weights' metadata (a GGUF's fields or a
checkpoint's `config.json`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from gpu_node.models.deepseek_v2 import MlaConfig
    from gpu_node.models.moe import MoeConfig

# The layer kinds of `ModelConfig.layer_types` (the names of transformers' configs).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches RoPE past its training length.

    "linear" divides every frequency by `factor`; "llama3" (Llama 3.1+) keeps the high
    frequencies, divides the low ones by `factor` and blends the band between, the
    wavelengths measured against `original_max_position_embeddings`. "yarn" (YaRN, as
    transformers computes it) keeps the dims that turn more than `beta_fast` times over
    the original length, divides those turning fewer than `beta_slow` times by `factor`,
    ramps linearly between, and multiplies cos and sin by `attention_factor` (None: from
    `mscale` and `mscale_all_dim`, llama.rope_attention_factor).
    """

    kind: Literal["linear", "llama3", "yarn"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True  # yarn's ramp ends rounded out to whole dims


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder of the llama line (dense, or with MoE MLPs) and the variations its
    families make on it.

    `architecture` names the family: "llama" (also Mistral's, which is llama with a sliding
    window), "qwen2" (q/k/v bias), "qwen3" (q/k norms), "gemma3" (its own decoder layer,
    models/gemma3.py), "qwen3_moe", "mixtral", "deepseek_v2" (multi-head latent attention,
    models/deepseek_v2.py), "moe" (seeded benchmark weights).

    `rope_interleaved`: llama.cpp's conversion of llama-architecture models permutes Q/K
    rows so that rotary pairs are adjacent dims (2i, 2i+1) rather than HF's halves
    (i, i + d/2); we keep those GGUF rows as they are and rotate adjacent pairs. Gemma's
    GGUF rows are not permuted (False, as for safetensors checkpoints).
    """

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool = True
    rope_interleaved: bool = True
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False  # q, k and v projections carry a bias (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3)
    # Tokens a sliding layer's query sees, itself included; None: every layer is global.
    sliding_window: int | None = None
    # Per layer FULL_ATTENTION or SLIDING_ATTENTION; None: all sliding when
    # `sliding_window` is set, else all full.
    layer_types: tuple[str, ...] | None = None
    # RoPE base of the sliding layers where it differs from `rope_theta` (Gemma 3's local
    # layers); those layers never take `rope_scaling`.
    sliding_rope_theta: float | None = None
    hidden_act: Literal["silu", "gelu_tanh"] = "silu"
    # Queries are scaled by this before softmax; None: head_dim ** -0.5.
    query_scale: float | None = None
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    moe: MoeConfig | None = None
    # Which layers carry the MoE MLP (the rest a dense one); None: all of them when `moe`.
    moe_layers: tuple[int, ...] | None = None
    # Multi-head latent attention (DeepSeek-V2); `head_dim` is then the cache's head dim.
    mla: MlaConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types names {len(self.layer_types)} layers, the model has "
                    f"{self.num_layers}"
                )
            unknown = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
            if unknown:
                raise ValueError(f"unknown layer types {sorted(unknown)}")
            if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
                raise ValueError("sliding layers need a sliding_window")
        if self.mla is not None and (
            self.head_dim != self.mla.cache_head_dim or self.num_kv_heads != self.num_heads
        ):
            raise ValueError(
                f"MLA caches {self.num_heads} heads of {self.mla.cache_head_dim} dims, "
                f"not {self.num_kv_heads} of {self.head_dim}"
            )

    @property
    def rope_head_dim(self) -> int:
        """The dims of a head that RoPE rotates: all of them, or MLA's rope part."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def attention_scale(self) -> float:
        return self.head_dim**-0.5 if self.query_scale is None else self.query_scale

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == SLIDING_ATTENTION

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: how many tokens back a query sees, itself included (None: all)."""
        return tuple(
            self.sliding_window if self.is_sliding(i) else None for i in range(self.num_layers)
        )

    def has_moe(self, layer: int) -> bool:
        return self.moe is not None and (self.moe_layers is None or layer in self.moe_layers)
