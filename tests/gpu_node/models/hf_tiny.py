"""Tiny Hugging Face checkpoints of every family we serve, written by transformers' own
config and model classes with seeded random weights, for the loader and parity tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320
SLIDING = "sliding_attention"
FULL = "full_attention"

# prompts of token ids the parity tests run through our engine and through transformers
PROMPT = [5, 77, 301, 12, 9, 250, 64, 3, 18, 140, 33, 7, 99, 210, 41, 2, 160, 88, 19, 270]
PROMPTS = [("a", PROMPT), ("b", PROMPT[5:] + PROMPT[:3]), ("c", PROMPT[::-1] + PROMPT[:11])]

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip

# family -> (config class, model class, the settings that family is about)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        rope_theta=500000.0,
    )),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=8, layer_types=[SLIDING, FULL, SLIDING], query_pre_attn_scalar=24,
        rope_parameters={FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         SLIDING: {"rope_type": "default", "rope_theta": 10000.0}},
    )),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1],
    )),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
    )),
}  # fmt: skip


def hf_model(family: str, seed: int = 0):
    """The family's tiny transformers model, fp32, with weights drawn so that logits
    are far from uniform: matrices N(0, 1/fan-in), norms and biases near their identity."""
    import transformers

    config_name, model_name, settings = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**_COMMON, **settings})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    generator = torch.Generator().manual_seed(seed)
    offset = family == "gemma3"  # Gemma's norms multiply by 1 + w
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_((0.0 if offset else 1.0) + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(noise * param.shape[-1] ** -0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def write_tokenizer(directory: Path) -> None:
    """A byte-level BPE of VOCAB tokens trained here, with a ChatML template, saved as a
    checkpoint's tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    corpus = ["The capital of France is Paris.", "Tell me about the history of Rome."] * 50
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(directory)


def write_checkpoint(family: str, directory: Path, *, shard_bytes: int | None = None, seed=0):
    """The family's tiny checkpoint in `directory` (sharded when `shard_bytes`); returns
    the transformers model it holds."""
    model = hf_model(family, seed)
    kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(directory, **kwargs)
    write_tokenizer(directory)
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[family][1]]
    return model
