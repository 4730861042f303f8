"""The model families we serve from Hugging Face checkpoints: a checkpoint's `config.json`
read into a `ModelConfig`, per family.

Each family names what it changes on llama; unknown architectures and settings we do not
compute (a RoPE scaling we lack, attention soft-capping, ...) are refused with a message
that says what is supported, never approximated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gpu_node.errors import ModelNotFoundError
from gpu_node.models.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    RopeScaling,
)
from gpu_node.models.moe import MoeConfig

Reader = Callable[[Mapping[str, Any]], ModelConfig]


def _need(raw: Mapping[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ModelNotFoundError(f"config.json lacks {key!r}")
    return raw[key]


def _rope(raw: Mapping[str, Any], part: str | None = None) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta` and
    `rope_scaling` (the checkpoints on the Hub); `part` picks a layer type's entry."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and part is not None and part in params:
        params = params[part]
    if isinstance(params, Mapping) and "rope_theta" in params:
        theta, scaling = float(params["rope_theta"]), dict(params)
    else:
        theta, scaling = float(raw.get("rope_theta", 10000.0)), dict(raw.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(scaling["factor"]),
            float(scaling.get("low_freq_factor", 1.0)),
            float(scaling.get("high_freq_factor", 4.0)),
            int(scaling.get("original_max_position_embeddings", 8192)),
        )
    raise ModelNotFoundError(
        f"RoPE scaling {kind!r} is not supported (default, linear and llama3 are)"
    )


def _base(raw: Mapping[str, Any], architecture: str, **changes: Any) -> ModelConfig:
    """The llama line's fields, read alike by every family."""
    hidden, heads = int(_need(raw, "hidden_size")), int(_need(raw, "num_attention_heads"))
    theta, scaling = _rope(raw)
    fields: dict[str, Any] = {
        "architecture": architecture,
        "num_layers": int(_need(raw, "num_hidden_layers")),
        "hidden_size": hidden,
        "intermediate_size": int(_need(raw, "intermediate_size")),
        "num_heads": heads,
        "num_kv_heads": int(raw.get("num_key_value_heads") or heads),
        "head_dim": int(raw.get("head_dim") or hidden // heads),
        "vocab_size": int(_need(raw, "vocab_size")),
        "max_position_embeddings": int(raw.get("max_position_embeddings") or 4096),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "rope_interleaved": False,  # HF rotates halves
    }
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ModelNotFoundError(f"activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
    fields["hidden_act"] = "gelu_tanh" if act == "gelu_pytorch_tanh" else "silu"
    if raw.get("mlp_bias"):
        raise ModelNotFoundError("MLP biases are not supported")
    fields.update(changes)
    try:
        return ModelConfig(**fields)
    except ValueError as exc:
        raise ModelNotFoundError(f"config.json: {exc}") from exc


def _sliding(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The sliding window of a llama-line config: Mistral's applies to every layer;
    Qwen2's only where `use_sliding_window` says, from `max_window_layers` on."""
    window = raw.get("sliding_window")
    if not window or raw.get("use_sliding_window") is False:
        return {}
    types = raw.get("layer_types")
    if types is None and "max_window_layers" in raw:
        first = int(raw["max_window_layers"])
        layers = int(raw["num_hidden_layers"])
        types = [FULL_ATTENTION if i < first else SLIDING_ATTENTION for i in range(layers)]
    return {"sliding_window": int(window), "layer_types": tuple(types) if types else None}


def _no_attention_bias(raw: Mapping[str, Any]) -> None:
    if raw.get("attention_bias"):
        raise ModelNotFoundError(f"{raw.get('model_type')} with attention_bias is not supported")


def llama(raw: Mapping[str, Any]) -> ModelConfig:
    _no_attention_bias(raw)
    return _base(raw, "llama", **_sliding(raw))


def qwen2(raw: Mapping[str, Any]) -> ModelConfig:
    return _base(raw, "qwen2", attention_bias=True, **_sliding(raw))


def qwen3(raw: Mapping[str, Any]) -> ModelConfig:
    _no_attention_bias(raw)
    return _base(raw, "qwen3", qk_norm=True, **_sliding(raw))


# Gemma 3's defaults where a file leaves them out (transformers' Gemma3TextConfig; llama.cpp
# fixes both for every GGUF of the family): every sixth layer attends globally, and the
# sliding layers rotate with base 10000.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_SLIDING_ROPE_THETA = 10000.0


def gemma3_layer_types(num_layers: int, pattern: int = GEMMA3_SLIDING_PATTERN) -> tuple[str, ...]:
    """Gemma 3's layers: sliding, but every `pattern`-th global."""
    return tuple(
        FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(num_layers)
    )


def gemma3_changes(
    *,
    layer_types: tuple[str, ...],
    sliding_window: int,
    sliding_rope_theta: float,
    query_pre_attn_scalar: float,
    final_logit_softcap: float | None,
) -> dict[str, Any]:
    """What Gemma 3 changes on the llama line's fields, whichever file it is read from
    (config.json here, GGUF metadata in gguf_loader.py)."""
    return {
        "qk_norm": True,
        "layer_types": layer_types,
        "sliding_window": sliding_window,
        "sliding_rope_theta": sliding_rope_theta,
        "query_scale": query_pre_attn_scalar**-0.5,
        "final_logit_softcap": final_logit_softcap,
    }


def gemma3(raw: Mapping[str, Any]) -> ModelConfig:
    raw = raw.get("text_config", raw)  # Gemma3ForConditionalGeneration: its language model
    for key in ("attn_logit_softcapping",):
        if raw.get(key) is not None:
            raise ModelNotFoundError(f"Gemma 3 with {key} is not supported")
    layers = int(_need(raw, "num_hidden_layers"))
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern"))
        types = gemma3_layer_types(layers, int(pattern or GEMMA3_SLIDING_PATTERN))
    theta, scaling = _rope(raw, FULL_ATTENTION)
    local_theta, local_scaling = _rope(raw, SLIDING_ATTENTION)
    if "rope_local_base_freq" in raw:
        local_theta, local_scaling = float(raw["rope_local_base_freq"]), None
    if local_scaling is not None:
        raise ModelNotFoundError("Gemma 3 sliding layers with RoPE scaling are not supported")
    return _base(
        raw,
        "gemma3",
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        rope_theta=theta,
        rope_scaling=scaling,
        **gemma3_changes(
            layer_types=tuple(types),
            sliding_window=int(raw.get("sliding_window") or 4096),
            sliding_rope_theta=local_theta,
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
            final_logit_softcap=raw.get("final_logit_softcapping"),
        ),
    )


def qwen3_moe(raw: Mapping[str, Any]) -> ModelConfig:
    _no_attention_bias(raw)
    layers = int(_need(raw, "num_hidden_layers"))
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or ())
    moe = MoeConfig(
        hidden_size=int(_need(raw, "hidden_size")),
        num_experts=experts,
        top_k=int(_need(raw, "num_experts_per_tok")),
        expert_hidden_size=int(_need(raw, "moe_intermediate_size")),
        renormalize=bool(raw.get("norm_topk_prob", False)),
    )
    moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return _base(raw, "qwen3_moe", qk_norm=True, moe=moe, moe_layers=moe_layers, **_sliding(raw))


def mixtral(raw: Mapping[str, Any]) -> ModelConfig:
    moe = MoeConfig(
        hidden_size=int(_need(raw, "hidden_size")),
        num_experts=int(_need(raw, "num_local_experts")),
        top_k=int(_need(raw, "num_experts_per_tok")),
        expert_hidden_size=int(_need(raw, "intermediate_size")),
    )
    return _base(raw, "mixtral", moe=moe, **_sliding(raw))


def _deepseek_rope(raw: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of a DeepSeek-V2 config: YaRN's read here as transformers reads it,
    any other kind by `_rope`."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" in params:
        theta, scaling = float(params["rope_theta"]), dict(params)
    else:
        theta, scaling = float(raw.get("rope_theta", 10000.0)), dict(raw.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", "linear", "llama3"):
        return _rope(raw)
    if kind != "yarn":
        raise ModelNotFoundError(
            f"RoPE scaling {kind!r} is not supported (default, linear, llama3 and yarn are)"
        )
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelNotFoundError("YaRN with a partial_rotary_factor is not supported")
    original = int(
        scaling.get("original_max_position_embeddings") or _need(raw, "max_position_embeddings")
    )
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else int(raw["max_position_embeddings"]) / original

    def optional(key: str) -> float | None:
        return None if scaling.get(key) is None else float(scaling[key])

    return theta, RopeScaling(
        "yarn",
        factor,
        original_max_position_embeddings=original,
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        attention_factor=optional("attention_factor"),
        truncate=bool(scaling.get("truncate", True)),
    )


DEEPSEEK_TOPK_METHODS = ("greedy", "group_limited_greedy")


def deepseek_v2(raw: Mapping[str, Any]) -> ModelConfig:
    """DeepSeek-V2 (V2-Lite, V2.5): multi-head latent attention (models/deepseek_v2.py),
    `first_k_dense_replace` dense layers, then an MoE MLP every `moe_layer_freq` layers
    (DeepSeek's rule; transformers ignores the frequency, which is 1 in every released
    checkpoint) with shared experts and softmax routing, greedy or group-limited."""
    from gpu_node.models.deepseek_v2 import MlaConfig
    from gpu_node.models.llama import yarn_mscale

    if raw.get("quantization_config") is not None:
        raise ModelNotFoundError(
            "quantized DeepSeek-V2 checkpoints are not imported; serve the bf16 checkpoint "
            "with --weights int4 to quantize it on load"
        )
    _no_attention_bias(raw)
    if raw.get("norm_topk_prob"):
        raise ModelNotFoundError(
            "DeepSeek-V2 with norm_topk_prob is not supported: DeepSeek's code renormalises "
            "the top-k weights and then drops routed_scaling_factor, transformers' does "
            "neither, so there is no one reference to match (released checkpoints set it false)"
        )
    if raw.get("scoring_func", "softmax") != "softmax":
        raise ModelNotFoundError(
            f"DeepSeek-V2 routing scoring_func {raw['scoring_func']!r} is not supported (softmax)"
        )
    method = raw.get("topk_method") or "greedy"
    if method not in DEEPSEEK_TOPK_METHODS:
        raise ModelNotFoundError(
            f"DeepSeek-V2 topk_method {method!r} is not supported "
            f"({', '.join(DEEPSEEK_TOPK_METHODS)} are)"
        )
    layers, heads = int(_need(raw, "num_hidden_layers")), int(_need(raw, "num_attention_heads"))
    try:
        mla = MlaConfig(
            kv_lora_rank=int(_need(raw, "kv_lora_rank")),
            qk_nope_head_dim=int(_need(raw, "qk_nope_head_dim")),
            qk_rope_head_dim=int(_need(raw, "qk_rope_head_dim")),
            v_head_dim=int(_need(raw, "v_head_dim")),
            q_lora_rank=None if raw.get("q_lora_rank") is None else int(raw["q_lora_rank"]),
        )
        moe, moe_layers = None, None
        if raw.get("n_routed_experts") is not None:
            grouped = method == "group_limited_greedy"
            moe = MoeConfig(
                hidden_size=int(_need(raw, "hidden_size")),
                num_experts=int(raw["n_routed_experts"]),
                top_k=int(_need(raw, "num_experts_per_tok")),
                expert_hidden_size=int(_need(raw, "moe_intermediate_size")),
                num_shared_experts=int(raw.get("n_shared_experts") or 0),
                renormalize=False,
                routed_scaling=float(raw.get("routed_scaling_factor", 1.0)),
                num_groups=int(_need(raw, "n_group")) if grouped else 1,
                topk_groups=int(_need(raw, "topk_group")) if grouped else 1,
            )
            first, step = (
                int(raw.get("first_k_dense_replace", 0)),
                int(raw.get("moe_layer_freq", 1)),
            )
            moe_layers = tuple(i for i in range(layers) if i >= first and i % step == 0)
    except ValueError as exc:
        raise ModelNotFoundError(f"config.json: {exc}") from exc
    theta, scaling = _deepseek_rope(raw)
    scale = mla.qk_head_dim**-0.5
    if scaling is not None and scaling.kind == "yarn" and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    # _base reads the llama line's fields; the RoPE it cannot read is passed in here.
    plain = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling")}
    plain["rope_theta"] = theta
    return _base(
        plain,
        "deepseek_v2",
        num_kv_heads=heads,  # kv_b_proj gives every head its own K and V
        head_dim=mla.cache_head_dim,
        rope_scaling=scaling,
        rope_interleaved=True,  # DeepSeek rotates complex pairs, adjacent dims
        query_scale=scale,
        moe=moe,
        moe_layers=moe_layers,
        mla=mla,
    )


# `architectures[0]` of config.json -> its reader.
FAMILIES: Mapping[str, Reader] = {
    "LlamaForCausalLM": llama,
    "MistralForCausalLM": llama,
    "Qwen2ForCausalLM": qwen2,
    "Qwen3ForCausalLM": qwen3,
    "Gemma3ForCausalLM": gemma3,
    "Gemma3ForConditionalGeneration": gemma3,
    "Qwen3MoeForCausalLM": qwen3_moe,
    "MixtralForCausalLM": mixtral,
    "DeepseekV2ForCausalLM": deepseek_v2,
}


def config_from_hf(raw: Mapping[str, Any]) -> ModelConfig:
    """A checkpoint's config.json as a ModelConfig; ModelNotFoundError for an architecture
    or a setting we do not serve, naming what is supported."""
    architectures = raw.get("architectures") or []
    reader = FAMILIES.get(architectures[0]) if architectures else None
    if reader is None:
        supported = ", ".join(sorted(FAMILIES))
        raise ModelNotFoundError(
            f"architecture {', '.join(architectures) or '(none named)'} is not supported; "
            f"supported: {supported}"
        )
    return reader(raw)
