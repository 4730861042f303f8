"""What a model's files say around its vocabulary (`TokenizerMeta`), and the chat templates
of models whose files name none. Read by models/hf_tokenizer.py and models/gguf_tokenizer.py,
used by models/tokenizer.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Gemma's turns; a system message opens the first user turn, as Gemma's own template does.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set first = '' %}{% set turns = messages %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] ~ '\n\n' %}{% set turns = messages[1:] %}{% endif %}"
    "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ first if loop.first else '' }}"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# The names of a template's special-token variables (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip


def default_template(vocab: Mapping[str, int]) -> str:
    """The template of a model whose files name none: its vocabulary's own turn markers."""
    if "<start_of_turn>" in vocab and "<end_of_turn>" in vocab:
        return GEMMA_TEMPLATE
    return CHATML_TEMPLATE


@dataclass(frozen=True)
class TokenizerMeta:
    """What a model's files say around its vocabulary."""

    bos_token_id: int | None
    eos_token_id: int | None
    # Every token that ends a generation: the EOS and the model's other end-of-turn tokens.
    stop_token_ids: frozenset[int]
    chat_template: str
    # Template variables: bos_token, eos_token, ... -> the token's spelling (those named).
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    # encode_chat puts BOS first where the template did not (llama.cpp's reading of a GGUF's
    # add_bos_token); transformers encodes a rendered chat without adding any token.
    chat_adds_bos: bool = False
    # transformers' clean_up_tokenization_spaces, which it applies to non-BPE models only.
    clean_up_spaces: bool = False
    # The model's sampling defaults (temperature, top_p, top_k), only those its files state.
    generation_defaults: Mapping[str, float | int] = field(default_factory=dict)
