"""The llama family (dense, grouped-query attention), written plainly.

The model knows nothing of pages or quantization: attention goes through an
`AttentionBackend` the runner passes in (which owns the KV cache), and quantized
linears are swapped in after the model is built. On a GPU, RMSNorm, RoPE and
SwiGLU's activation each run as one kernel (kernels/elementwise/kernel.py) with the
arithmetic of the torch code here.

Shape legend:
    T  tokens in the step (all sequences, flattened)
    D  hidden size          H  query heads      K  kv heads      E  head dim
    F  MLP hidden size      V  vocabulary
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gpu_node.kernels import cpu as cpu_kernels
from gpu_node.models.config import ModelConfig, RopeScaling


class AttentionBackend(Protocol):
    """Stores this step's K/V in the cache and attends over each sequence's context."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [T, H, E], k/v [T, K, E] -> [T, H, E]"""
        ...


def _fused(x: torch.Tensor) -> bool:
    """On a GPU the small operations below run as one kernel each (kernels/elementwise/kernel.py),
    with the same arithmetic as the torch code here, which CPUs run (or, for a model built
    with `cpu_kernels`, the fused C loops of kernels/cpu)."""
    if not x.is_cuda:
        return False
    from gpu_node.kernels.elementwise.kernel import use_kernels

    return use_kernels(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused(x) and x.dim() == 2:
            from gpu_node.kernels.elementwise.kernel import rms_norm

            return rms_norm(x, self.weight, self.eps)
        if cpu_kernels.use_kernels(x) and x.dim() == 2 and x.stride(1) == 1:
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the sum in x's dtype; one launch on a GPU."""
        if _fused(x) and x.dim() == 2 and residual.dtype == x.dtype:
            from gpu_node.kernels.elementwise.kernel import add_rms_norm

            return add_rms_norm(x, residual, self.weight, self.eps)
        if cpu_kernels.use_kernels(x) and x.dim() == 2 and residual.dtype == x.dtype:
            return cpu_kernels.add_rms_norm(x, residual, self.weight, self.eps)
        summed = x + residual
        return self(summed), summed


class RotaryEmbedding(nn.Module):
    """RoPE; `interleaved` rotates adjacent pairs (GGUF's row order, and DeepSeek's, which
    rotates complex pairs), else halves (HF's). YaRN scaling also multiplies cos and sin by
    its attention factor.

    Within `at(positions)` (a model's forward) every layer's call at those positions
    reuses one cos and sin instead of computing them twice a layer.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        interleaved: bool,
        scaling: RopeScaling | None = None,
    ):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if scaling is not None and scaling.kind == "yarn":
            inv_freq = yarn_frequencies(head_dim, theta, scaling)
        elif scaling is not None:
            inv_freq = scaled_frequencies(inv_freq, scaling)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.interleaved = interleaved
        self.attention_factor = 1.0 if scaling is None else rope_attention_factor(scaling)
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, E/2] of positions [T]."""
        step = self._step
        if step is not None and step[0] is positions:
            return step[1], step[2]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, E/2]
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    @contextlib.contextmanager
    def at(self, positions: torch.Tensor) -> Iterator[None]:
        """Calls at `positions` (this very tensor) inside the block share its cos and sin."""
        self._step = (positions, *self.angles(positions))
        try:
            yield
        finally:
            self._step = None

    def pair(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's queries and keys rotated alike; one launch on a GPU."""
        if _fused(q) and q.stride(2) == 1 and k.stride(2) == 1 and k.dtype == q.dtype:
            from gpu_node.kernels.elementwise.kernel import rope_qk

            cos, sin = self.angles(positions)
            return rope_qk(q, k, cos, sin, self.interleaved)
        cos, sin = self.angles(positions)
        if cpu_kernels.use_kernels(q) and 2 * cos.shape[-1] == q.shape[-1] == k.shape[-1]:
            # in place: q and k are this step's own
            return (
                cpu_kernels.rope_(q, cos, sin, self.interleaved),
                cpu_kernels.rope_(k, cos, sin, self.interleaved),
            )
        return self(q, positions), self(k, positions)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [T, N, E], positions [T]
        cos, sin = self.angles(positions)
        if _fused(x) and x.stride(2) == 1:
            from gpu_node.kernels.elementwise.kernel import rope

            return rope(x, cos, sin, self.interleaved)
        x32 = x.float()
        if self.interleaved:
            x1, x2 = x32[..., 0::2], x32[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = x32.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)


def scaled_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """RoPE's frequencies [E/2] stretched as `scaling` says (RopeScaling)."""
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    original = scaling.original_max_position_embeddings
    low_wavelen = original / scaling.low_freq_factor  # longer waves than this: divided
    high_wavelen = original / scaling.high_freq_factor  # shorter ones: kept
    wavelen = 2 * math.pi / inv_freq
    divided = inv_freq / scaling.factor
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * divided + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, divided, inv_freq)
    return torch.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), blended, out)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched by `factor` (Eq. 21 of the
    paper): 0.1 * mscale * ln(factor) + 1, and 1 where nothing is stretched."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: RopeScaling) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor, 1 for other scalings."""
    if scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return yarn_mscale(scaling.factor)


def yarn_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's frequencies [E/2] (RopeScaling): each dim's frequency blends the interpolated
    (divided by `factor`) and the original one by a linear ramp over the dims between
    those that turn `beta_fast` and `beta_slow` times in the original context."""
    original = scaling.original_max_position_embeddings

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width would divide by zero
    extrapolated = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    interpolated = extrapolated / scaling.factor
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return interpolated * ramp + extrapolated * (1 - ramp)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    return F.silu(x)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        d, e, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(d, config.num_heads * e, bias=bias)
        self.k_proj = nn.Linear(d, config.num_kv_heads * e, bias=bias)
        self.v_proj = nn.Linear(d, config.num_kv_heads * e, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * e, d, bias=False)
        # Qwen3 and Gemma 3 normalise each head's query and key before RoPE.
        self.q_norm = RMSNorm(e, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(e, config.rms_norm_eps) if config.qk_norm else None
        # q, k and v as one product (`fuse_projections`, on GPU nodes); None: three
        self.qkv_proj: nn.Module | None = None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        t, h, kv, e = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:  # views of one [T, (H + 2K) E] product
            q, k, v = self.qkv_proj(x).split((h * e, kv * e, kv * e), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None and self.k_norm is not None:  # over each head's E values
            q = self.q_norm(q.reshape(t * h, e))
            k = self.k_norm(k.reshape(t * kv, e))
        q, k = rope.pair(q.view(t, h, e), k.view(t, kv, e), positions)  # [T, H, E], [T, K, E]
        v = v.view(t, kv, e)  # [T, K, E]
        out = attention(self.layer, q, k, v)  # [T, H, E]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with gelu_tanh."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu"):
        super().__init__()
        self.act = act
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up as one product, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, F] views
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)  # [T, F]
        if self.act == "silu" and _fused(gate) and gate.dtype == up.dtype:
            from gpu_node.kernels.elementwise.kernel import silu_mul

            return self.down_proj(silu_mul(gate, up))
        if self.act == "silu" and cpu_kernels.use_kernels(gate) and gate.dim() == 2:
            return self.down_proj(cpu_kernels.silu_mul(gate, up))
        return self.down_proj(activation(self.act, gate) * up)  # [T, D]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Any module mapping [T, D] -> [T, D] may replace this (the MoE family does).
        self.mlp: nn.Module = LlamaMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act
        )

    def forward(self, x, positions, rope, attention):
        attended = self.self_attn(self.input_layernorm(x), positions, rope, attention)
        normed, x = self.post_attention_layernorm.add_norm(x, attended)  # x + attended
        return x + self.mlp(normed)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope, self.sliding_rope = rotary_embeddings(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Forward runs inside cpu_kernels.active(): fp32 steps on the CPU call the C kernels
        # (set by `use_cpu_kernels`).
        self.cpu_kernels = False
        self._c_plan: cpu_kernels.LlamaDecodePlan | Literal[False] | None = None  # on first use

    @staticmethod
    def decoder_layer(config: ModelConfig, layer: int) -> nn.Module:
        return LlamaDecoderLayer(config, layer)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # [T, D]

    def reset_rotary_tables(self, device: torch.device | str) -> None:
        """Rebuilds the RoPE tables (buffers outside the state dict) on `device`."""
        rope, sliding = rotary_embeddings(self.config)
        self.rope = rope.to(device)
        self.sliding_rope = sliding.to(device) if sliding is not None else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> logits [N, V] for the rows in `logits_indices` (all if None)."""
        with cpu_kernels.active(self.cpu_kernels):
            return self.logits(self.hidden_states(input_ids, positions, attention), logits_indices)

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        """input_ids, positions [T] -> the last layer's output [T, D], before the final norm."""
        x = self.embed(input_ids)  # [T, D]
        if self.cpu_kernels and self._decode_in_c(x, positions, attention):
            return x
        sliding_rope = self.sliding_rope or self.rope
        with self.rope.at(positions), sliding_rope.at(positions):
            for i, layer in enumerate(self.layers):
                rope = sliding_rope if self.config.is_sliding(i) else self.rope
                x = layer(x, positions, rope, attention)
        return x

    def _decode_in_c(
        self, x: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend
    ) -> bool:
        """A decode step's layers as one C call (kernels/cpu LlamaDecodePlan) where the plan
        covers this model and the attention backend takes it; x updated in place."""
        if self._c_plan is None:
            self._c_plan = c_decode_plan(self) or False
        decode_in_c = getattr(attention, "decode_in_c", None)
        if not self._c_plan or decode_in_c is None or not cpu_kernels.use_kernels(x):
            return False
        cos, sin = self.rope.angles(positions)
        return decode_in_c(self._c_plan, x, cos, sin)

    def logits(
        self, hidden: torch.Tensor, logits_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The last layer's output [T, D] -> logits [N, V] (fp32) of the rows in
        `logits_indices` (all if None)."""
        if logits_indices is not None:
            # only the tokens we sample from: the lm_head is the widest matmul
            hidden = hidden[logits_indices]
        logits = self.lm_head(self.norm(hidden)).float()  # [N, V]
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def c_decode_plan(model: LlamaModel) -> cpu_kernels.LlamaDecodePlan | None:
    """The C decode step of `model` (kernels/cpu LlamaDecodePlan) where it covers every
    layer: llama's own decoder layers (no q/k norms, a silu MLP) whose q/k/v and gate/up
    are each one INT4 linear without bias (fuse_projections), groups a multiple of 32,
    fp32 norms, RoPE over whole heads without an attention factor; else None."""
    from gpu_node.quant.linear import Int4Linear

    config = model.config
    if config.rope_head_dim != config.head_dim or model.rope.attention_factor != 1.0:
        return None
    layers = []
    for layer in model.layers:
        if type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not LlamaMLP:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        if attn.q_norm is not None or mlp.act != "silu":
            return None
        parts = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        for part in parts:
            if not (
                type(part) is Int4Linear
                and part.bias is None
                and part.layout == "int4"
                and part.group_size % cpu_kernels.BLOCK == 0
            ):
                return None
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
            return None
        layers.append((*(w.detach() for w in norms), *parts))
    dims = {
        "D": config.hidden_size, "H": config.num_heads, "KH": config.num_kv_heads,
        "E": config.head_dim, "F": config.intermediate_size, "eps": config.rms_norm_eps,
        "interleaved": int(config.rope_interleaved),
    }  # fmt: skip
    return cpu_kernels.LlamaDecodePlan(layers, dims)


def rotary_embeddings(config: ModelConfig) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
    """The global layers' RoPE, and the sliding layers' where theirs differs (Gemma 3)."""
    rope = RotaryEmbedding(
        config.rope_head_dim, config.rope_theta, config.rope_interleaved, config.rope_scaling
    )
    sliding = None
    if config.sliding_rope_theta is not None:
        sliding = RotaryEmbedding(
            config.head_dim, config.sliding_rope_theta, config.rope_interleaved
        )
    return rope, sliding


def fuse_projections(model: LlamaModel) -> LlamaModel:
    """Each layer's q, k and v projections as one product, and its MLP's gate and up as one,
    in place (fewer, wider products: at decode a small product costs its launch, not its
    bytes). Parts are fused only when all are plain linears without bias or all INT4 of
    one group size; the rows of the fused weight are the parts' rows, in order, so every
    output is the same dot product as before (bit for bit on CPU, tested; on a GPU the
    wider product's kernel may sum in another order). Returns `model`."""
    for layer in model.layers:
        attn = layer.self_attn
        if (
            isinstance(attn, LlamaAttention)
            and attn.qkv_proj is None
            and (fused := _fused_linear(attn.q_proj, attn.k_proj, attn.v_proj))
        ):
            attn.qkv_proj, attn.q_proj, attn.k_proj, attn.v_proj = fused, None, None, None
        mlp = layer.mlp
        if (
            isinstance(mlp, LlamaMLP)
            and mlp.gate_up_proj is None
            and (fused := _fused_linear(mlp.gate_proj, mlp.up_proj))
        ):
            mlp.gate_up_proj, mlp.gate_proj, mlp.up_proj = fused, None, None
    return model


def _fused_linear(*parts: nn.Module) -> nn.Module | None:
    from gpu_node.quant.int4 import Int4Weight
    from gpu_node.quant.linear import Int4Linear

    if all(isinstance(p, nn.Linear) and p.bias is None for p in parts):
        weights = [p.weight for p in parts if isinstance(p, nn.Linear)]
        rows = sum(w.shape[0] for w in weights)
        fused = nn.Linear(weights[0].shape[1], rows, bias=False, device="meta")
        fused.weight = nn.Parameter(torch.cat([w.detach() for w in weights]), requires_grad=False)
        return fused
    if all(isinstance(p, Int4Linear) and p.bias is None for p in parts):
        ws = [p.weight_int4 for p in parts if isinstance(p, Int4Linear)]
        if len({(w.group_size, w.shape[1]) for w in ws}) != 1:
            return None
        return Int4Linear(
            Int4Weight(
                packed=torch.cat([w.packed for w in ws]),
                scales=torch.cat([w.scales for w in ws]),
                mins=torch.cat([w.mins for w in ws]),
                shape=(sum(w.shape[0] for w in ws), ws[0].shape[1]),
                group_size=ws[0].group_size,
            )
        )
    return None


# GGUF tensor names -> our parameter names, per layer.
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_parameter_names(
    config: ModelConfig, layer_names: Mapping[str, str] = _GGUF_LAYER_NAMES
) -> dict[str, str]:
    """Maps each GGUF tensor name to the parameter it fills; `layer_names`: a layer's
    tensors, GGUF's name -> ours (llama's by default; gemma3.GGUF_LAYER_NAMES)."""
    names = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight"}
    if not config.tie_word_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(config.num_layers):
        for src, dst in layer_names.items():
            names[f"blk.{i}.{src}.weight"] = f"layers.{i}.{dst}.weight"
    return names
