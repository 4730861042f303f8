"""The architecture of a model, read once from its weights' metadata."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a llama-family decoder (dense), optionally with MoE layers.

    `rope_interleaved`: GGUF conversion permutes Q/K rows so that rotary pairs are
    adjacent dims (2i, 2i+1) rather than HF's halves (i, i + d/2); we keep the
    GGUF rows as they are and rotate adjacent pairs.
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

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
