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
from gpu_node.models.gguf_loader import GGUFModel

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
        special = [tokens[i] for i, t in enumerate(types) if t == CONTROL_TOKEN]

        def build() -> Tokenizer:
            bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=False)
            tok = Tokenizer(bpe)
            tok.pre_tokenizer = _pre_tokenizer(gguf.field("tokenizer.ggml.pre"))
            tok.decoder = decoders.ByteLevel()
            tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
            return tok

        self._tok = build()
        # The same vocabulary reading a control token's spelling as plain characters: what a
        # message's own text is encoded with (encode_chat), so no user can forge a turn.
        self._text_only = build()
        self._text_only.encode_special_tokens = True
        self._special_spellings = tuple(special)
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
        return self._with_bos(ids) if add_special_tokens else ids

    def _with_bos(self, ids: list[int]) -> list[int]:
        """`ids` after the model's start token, for a model whose GGUF asks for one."""
        return [self.bos_token_id, *ids] if self.add_bos and self.bos_token_id is not None else ids

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of `messages` in the chat template, a message's text being only text.

        A control token spelled out inside a message (`<|im_end|>`, `<|im_start|>system`) is
        encoded as its characters, never as the control token, so a message cannot end its
        own turn or open another. Messages without such spellings (nearly all) take the
        plain path: the rendered template encoded in one piece.
        """
        contents = [m.get("content") if isinstance(m, dict) else None for m in messages]
        if not any(
            isinstance(c, str) and any(s in c for s in self._special_spellings) for c in contents
        ):
            return self.encode(self.apply_chat_template(messages, add_generation_prompt))
        # Render with a mark in place of each message's text, then encode the template's own
        # text with control tokens and each message's text without them.
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        marked = [
            m | {"content": mark} if isinstance(m, dict) else m
            for m, mark in zip(messages, marks, strict=True)
        ]
        rest = self.apply_chat_template(marked, add_generation_prompt)
        ids: list[int] = []
        for mark, content in zip(marks, contents, strict=True):
            before, found, after = rest.partition(mark)
            if not found:  # the template left this message out
                continue
            ids += self._tok.encode(before, add_special_tokens=False).ids
            ids += self._text_only.encode(str(content), add_special_tokens=False).ids
            rest = after
        ids += self._tok.encode(rest, add_special_tokens=False).ids
        return self._with_bos(ids)

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
