"""The tokenizer and chat template, built from a GGUF's own metadata.

GGUF stores a byte-level BPE vocabulary (`tokenizer.ggml.tokens`, `merges`,
`token_type`) and names its pre-tokenizer (`tokenizer.ggml.pre`); we rebuild
it with the `tokenizers` library. Control tokens (type 3) become special tokens,
so `<|im_start|>` in a chat template is one token, never split into bytes.
"""

from __future__ import annotations

from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from gpu_node.errors import InvalidRequestError, ModelNotFoundError
from gpu_node.gguf_loader import GGUFModel

CONTROL_TOKEN = 3

# Pre-tokenizer splits by `tokenizer.ggml.pre`, as the vocabularies were trained.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_DIGITS_FIRST = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    split = pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated")
    steps: list[pre_tokenizers.PreTokenizer] = [split, byte_level]
    if pre in _DIGITS_FIRST:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    return pre_tokenizers.Sequence(steps)


class ChatTokenizer:
    """Encodes, decodes, and renders chat messages with the model's template."""

    def __init__(self, gguf: GGUFModel):
        if gguf.field("tokenizer.ggml.model") != "gpt2":
            raise ModelNotFoundError(
                f"{gguf.path}: tokenizer {gguf.field('tokenizer.ggml.model')!r} is not supported (byte-level BPE only)"
            )
        tokens: list[str] = list(gguf.field("tokenizer.ggml.tokens"))
        merges = [tuple(m.split(" ", 1)) for m in gguf.field("tokenizer.ggml.merges")]
        types = list(gguf.field("tokenizer.ggml.token_type") or [])
        vocab = {tok: i for i, tok in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=False)
        self._tok = Tokenizer(bpe)
        self._tok.pre_tokenizer = _pre_tokenizer(gguf.field("tokenizer.ggml.pre"))
        self._tok.decoder = decoders.ByteLevel()
        special = [tokens[i] for i, t in enumerate(types) if t == CONTROL_TOKEN]
        self._tok.add_special_tokens(
            [AddedToken(s, special=True, normalized=False) for s in special]
        )
        self.vocab_size = len(tokens)
        self.bos_token_id: int | None = gguf.field("tokenizer.ggml.bos_token_id")
        self.eos_token_id: int = int(gguf.field("tokenizer.ggml.eos_token_id"))
        self.add_bos = bool(gguf.field("tokenizer.ggml.add_bos_token", False))
        # ChatML ends an assistant turn with <|im_end|>: stop there too.
        self.stop_token_ids = frozenset(
            {self.eos_token_id} | {vocab[s] for s in ("<|im_end|>", "<|eot_id|>") if s in vocab}
        )
        self._template_source = gguf.field("tokenizer.chat_template") or CHATML_TEMPLATE
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        self._template = env.from_string(self._template_source)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Renders messages ({"role", "content"}) as the model expects them."""
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise InvalidRequestError(f"messages[{i}] needs 'role' and 'content'")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._tok.id_to_token(self.bos_token_id)
            if self.bos_token_id is not None
            else "",
            eos_token=self._tok.id_to_token(self.eos_token_id),
        )


def _raise_template_error(message: str) -> None:
    raise InvalidRequestError(f"chat template: {message}")
