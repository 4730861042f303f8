"""Encodes, decodes and renders chats with a model's own tokenizer and chat template.

One `ChatTokenizer` whatever the model came in: a `tokenizers.Tokenizer` plus what the
files say around it (`TokenizerMeta`: start and stop tokens, chat template, sampling
defaults). `ChatTokenizer.from_directory` reads a Hugging Face checkpoint's tokenizer
files (models/hf_tokenizer.py); `ChatTokenizer(gguf)` rebuilds a GGUF's vocabulary
(models/gguf_tokenizer.py). Templates render in a sandboxed jinja2 environment with the
names transformers gives them, so a checkpoint's template renders here as it does there.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gpu_node.errors import InvalidRequestError
from gpu_node.models.chat_tools import for_template
from gpu_node.models.tokenizer_meta import TokenizerMeta

if TYPE_CHECKING:
    from gpu_node.models.gguf_loader import GGUFModel


class ChatTokenizer:
    """Encodes, decodes, and renders chat messages with the model's template.

    `ChatTokenizer(gguf)` reads a GGUF's tokenizer; `ChatTokenizer(tokenizer, meta)` takes
    one already built; `ChatTokenizer.from_directory(path)` reads a checkpoint's files.
    """

    def __init__(self, source: Tokenizer | GGUFModel, meta: TokenizerMeta | None = None):
        if not isinstance(source, Tokenizer):
            from gpu_node.models.gguf_tokenizer import read_gguf_tokenizer

            source, meta = read_gguf_tokenizer(source)
        if meta is None:
            raise TypeError("ChatTokenizer(tokenizer, meta) needs the meta")
        self._tok = source
        # The same tokenizer reading a special token's spelling as plain characters: what a
        # message's own text is encoded with (encode_chat), so no user can forge a turn.
        self._text_only = Tokenizer.from_str(source.to_str())
        self._text_only.encode_special_tokens = True
        self._special_spellings = tuple(
            t.content for t in source.get_added_tokens_decoder().values() if t.special
        )
        self.meta = meta
        self.vocab_size = source.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = meta.bos_token_id
        self.eos_token_id = meta.eos_token_id
        self.stop_token_ids = meta.stop_token_ids
        self.generation_defaults: dict[str, float | int] = dict(meta.generation_defaults)
        self.chat_template = meta.chat_template
        self._template = _environment().from_string(meta.chat_template)

    @classmethod
    def from_directory(cls, path: str | Path) -> ChatTokenizer:
        """A Hugging Face checkpoint's tokenizer: tokenizer.json, tokenizer_config.json (special
        tokens, chat template), chat_template.jinja, generation_config.json (stop tokens,
        sampling defaults). ModelNotFoundError when tokenizer.json is missing or unreadable."""
        from gpu_node.models.hf_tokenizer import read_directory

        return cls(*read_directory(Path(path)))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """`text`'s ids; with `add_special_tokens`, the model's own (BOS for most) around them."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of `messages` (and the `tools` offered, models/chat_tools.py) in the
        chat template, a message's text being only text.

        A special token spelled out inside a message (`<|im_end|>`, `<|im_start|>system`) is
        encoded as its characters, never as the special token, so a message cannot end its
        own turn or open another; tools and calls a template renders itself may spell none.
        Messages without such spellings (nearly all) take the plain path: the rendered
        template encoded in one piece.
        """
        messages, extra = for_template(messages, tools, self.chat_template)
        structured = json.dumps([extra, [m.get("tool_calls") for m in messages]])
        if any(s in structured for s in self._special_spellings):
            raise InvalidRequestError("a tool or tool call spells a special token of the model")
        contents = [m.get("content") if isinstance(m, dict) else None for m in messages]
        if not any(
            isinstance(c, str) and any(s in c for s in self._special_spellings) for c in contents
        ):
            rendered = self.apply_chat_template(messages, add_generation_prompt, **extra)
            return self._with_bos(self._pieces(rendered))
        # Render with a mark in place of each message's text, then encode the template's own
        # text with special tokens and each message's text without them.
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        marked = [
            m | {"content": mark} if isinstance(m, dict) else m
            for m, mark in zip(messages, marks, strict=True)
        ]
        rest = self.apply_chat_template(marked, add_generation_prompt, **extra)
        ids: list[int] = []
        for mark, content in zip(marks, contents, strict=True):
            before, found, after = rest.partition(mark)
            if not found:  # the template left this message out
                continue
            ids += self._pieces(before)
            ids += self._text_only.encode(str(content), add_special_tokens=False).ids
            rest = after
        ids += self._pieces(rest)
        return self._with_bos(ids)

    def _pieces(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids) if text else []

    def _with_bos(self, ids: list[int]) -> list[int]:
        bos = self.bos_token_id
        if self.meta.chat_adds_bos and bos is not None and ids[:1] != [bos]:
            return [bos, *ids]
        return ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.meta.clean_up_spaces else text

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Renders messages ({"role", "content"}) as the model expects them; `extra` are
        further names the template reads (`tools`)."""
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise InvalidRequestError(f"messages[{i}] needs 'role' and 'content'")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self.meta.special_tokens,
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template: {exc}") from exc


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandbox a chat template renders in, with the filters and globals transformers
    gives templates (its own `tojson`, `raise_exception`, `strftime_now`, loop controls)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes <, > and & for HTML, which a prompt must not see.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_template_error(message: str) -> None:
    raise InvalidRequestError(f"chat template: {message}")


def clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: spaces before punctuation and contractions go."""
    for spaced, joined in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                           (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                           (" 're", "'re")):  # fmt: skip
        text = text.replace(spaced, joined)
    return text
