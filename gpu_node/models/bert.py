"""BERT-family text encoders (all-MiniLM, bge-small/base, e5): a checkpoint directory in,
one vector per text out.

    ids [B, T], mask [B, T] -> embeddings (word + absolute position + token type), LayerNorm
        -> N x (bidirectional attention -> add & LayerNorm -> GELU MLP -> add & LayerNorm)
        -> pooling (mean over the real tokens, or the first token), normalized if asked

What the checkpoint's sentence-transformers files say decides the pooling
(`1_Pooling/config.json`) and the normalization (a `Normalize` module in `modules.json`);
a plain BERT checkpoint without them pools by mean and does not normalize. Padded positions
are masked out of attention and pooling, so a text's vector does not depend on the batch
it ran in. No KV is kept: an encoder pass is one prefill.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from gpu_node.errors import ModelNotFoundError
from gpu_node.models.hf_tokenizer import read_json_object

Pooling = Literal["mean", "cls"]
ENCODER_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForPreTraining")


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pooling: Pooling = "mean"
    normalize: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def is_encoder_directory(directory: Path) -> bool:
    """Whether `directory` holds a BERT-family encoder checkpoint (by its config.json)."""
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return raw.get("model_type") == "bert" or any(
        a in ENCODER_ARCHITECTURES for a in raw.get("architectures") or []
    )


def encoder_config(directory: Path) -> EncoderConfig:
    """The encoder's shape from config.json, its pooling and normalization from the
    sentence-transformers files; ModelNotFoundError for what we do not serve."""
    raw = read_json_object(directory / "config.json", required=True)
    if raw.get("model_type") != "bert":
        raise ModelNotFoundError(
            f"{directory}: model_type {raw.get('model_type')!r} is not an encoder we serve "
            "(bert: all-MiniLM, bge, e5)"
        )
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise ModelNotFoundError(f"{directory}: only absolute position embeddings are served")
    if raw.get("hidden_act", "gelu") != "gelu":
        raise ModelNotFoundError(f"{directory}: hidden_act {raw['hidden_act']!r} is not served")
    return EncoderConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=int(raw["num_attention_heads"]),
        intermediate_size=int(raw["intermediate_size"]),
        max_position_embeddings=int(raw["max_position_embeddings"]),
        type_vocab_size=int(raw.get("type_vocab_size", 2)),
        layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
        pooling=_pooling(directory),
        normalize=_normalizes(directory),
    )


def _modules(directory: Path) -> list[dict[str, Any]]:
    path = directory / "modules.json"
    if not path.is_file():
        return []
    value = json.loads(path.read_text())
    return [m for m in value if isinstance(m, dict)] if isinstance(value, list) else []


def _pooling(directory: Path) -> Pooling:
    pooling = next((m for m in _modules(directory) if m.get("type", "").endswith("Pooling")), None)
    if pooling is None:
        return "mean"
    config = read_json_object(
        directory / str(pooling.get("path", "1_Pooling")) / "config.json", required=True
    )
    modes = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
    if modes == ["pooling_mode_mean_tokens"]:
        return "mean"
    if modes == ["pooling_mode_cls_token"]:
        return "cls"
    raise ModelNotFoundError(f"{directory}: pooling {modes} is not served (mean or cls)")


def _normalizes(directory: Path) -> bool:
    return any(m.get("type", "").endswith("Normalize") for m in _modules(directory))


class EncoderLayer(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps)
        self.up_proj = nn.Linear(hidden, config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, hidden)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x [B, T, H]; bias [B, 1, 1, T]: 0 at real tokens, -inf at padding."""
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        x = self.attention_norm(x + self.o_proj(attended.transpose(1, 2).reshape(b, t, -1)))
        return self.mlp_norm(x + self.down_proj(F.gelu(self.up_proj(x))))


class BertEncoder(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, hidden)
        self.embedding_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The pooled (and, as configured, normalized) vectors [B, H] of `input_ids` [B, T],
        `attention_mask` [B, T] being 1 at real tokens and 0 at padding. fp32 out."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
        x = self.embedding_norm(x + self.token_type_embeddings.weight[0])
        real = attention_mask.bool()
        bias = torch.zeros(real.shape, dtype=x.dtype, device=x.device)
        bias = bias.masked_fill(~real, float("-inf"))[:, None, None, :]
        for layer in self.layers:
            x = layer(x, bias)
        return pool(x.float(), real, self.config.pooling, self.config.normalize)


def pool(hidden: torch.Tensor, real: torch.Tensor, mode: Pooling, normalize: bool) -> torch.Tensor:
    """hidden [B, T, H] -> [B, H]: the mean over real tokens, or the first token."""
    if mode == "cls":
        vectors = hidden[:, 0]
    else:
        weights = real.to(hidden.dtype)[..., None]
        vectors = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return F.normalize(vectors, p=2.0, dim=-1) if normalize else vectors


# Checkpoint names (with or without the `bert.` prefix) -> ours; the pooler and the
# masked-LM head are not used by sentence embeddings.
_RENAMES = (
    (r"embeddings\.LayerNorm\.", "embedding_norm."),
    (r"embeddings\.", ""),
    (r"encoder\.layer\.(\d+)\.attention\.self\.query\.", r"layers.\1.q_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.self\.key\.", r"layers.\1.k_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.self\.value\.", r"layers.\1.v_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.o_proj."),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attention_norm."),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.up_proj."),
    (r"encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.down_proj."),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.mlp_norm."),
)
_UNUSED = re.compile(r"^(pooler\.|cls\.)|position_ids$")


def our_encoder_name(name: str) -> str | None:
    """Our parameter's name for a checkpoint tensor; None for one we do not load."""
    name = name.removeprefix("bert.")
    if _UNUSED.search(name):
        return None
    for pattern, replacement in _RENAMES:
        renamed, found = re.subn(f"^{pattern}", replacement, name)
        if found:
            # LayerNorm's old names (gamma/beta) in some checkpoints
            return renamed.replace(".gamma", ".weight").replace(".beta", ".bias")
    raise ModelNotFoundError(f"unexpected tensor {name!r} in a BERT checkpoint")


def load_encoder(
    directory: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> BertEncoder:
    """The encoder of a checkpoint directory, its tensors read lazily onto `device`."""
    from safetensors import safe_open

    from gpu_node.models.hf_checkpoint import HFCheckpoint

    checkpoint = HFCheckpoint(directory)
    config = encoder_config(checkpoint.path)
    with torch.device("meta"):
        model = BertEncoder(config)
    state: dict[str, torch.Tensor] = {}
    for file, names in checkpoint.shards.items():
        with safe_open(file, framework="pt", device=str(torch.device(device))) as f:
            for name in names:
                if (ours := our_encoder_name(name)) is not None:
                    state[ours] = f.get_tensor(name).to(dtype)
    expected = set(model.state_dict())
    if missing := sorted(expected - set(state)):
        raise ModelNotFoundError(f"{checkpoint.path}: weights missing for {', '.join(missing[:5])}")
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()
