"""A Hugging Face checkpoint's tokenizer, read from the files transformers writes beside the
weights.

    tokenizer.json            the vocabulary, normalizer, pre-tokenizer and post-processor,
                              loaded whole by `tokenizers` (byte-level BPE, SentencePiece-
                              derived BPE or Unigram, WordPiece alike)
    tokenizer_config.json     the special tokens' spellings, the chat template (a string,
                              or a list of named templates of which "default" is used), and
                              `clean_up_tokenization_spaces`
    chat_template.jinja       the chat template, where transformers saved it on its own
    generation_config.json    the tokens that end a generation (`eos_token_id`, one or a
                              list) and the model's sampling defaults
    config.json               `bos_token_id` / `eos_token_id` where the files above are silent

Encoding follows transformers: `encode` lets the post-processor add what the checkpoint asks
(BOS for Llama and Gemma), and a rendered chat is encoded without adding any token, its
template having written BOS itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from gpu_node.errors import ModelNotFoundError
from gpu_node.models.tokenizer_meta import SPECIAL_TOKEN_NAMES, TokenizerMeta, default_template

# generation_config.json's sampling keys we honour, and the type each takes.
SAMPLING_KEYS = (("temperature", float), ("top_p", float), ("top_k", int))


def read_directory(directory: Path) -> tuple[Tokenizer, TokenizerMeta]:
    """The tokenizer and its meta from a checkpoint directory; ModelNotFoundError when the
    directory has no readable tokenizer.json."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        hint = (
            " (a SentencePiece tokenizer.model only: save it with transformers first)"
            if (directory / "tokenizer.model").is_file()
            else ""
        )
        raise ModelNotFoundError(f"{directory}: no tokenizer.json{hint}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ModelNotFoundError(f"{path}: unreadable tokenizer ({exc})") from exc
    config = read_json_object(directory / "tokenizer_config.json")
    generation = read_json_object(directory / "generation_config.json")
    model_config = read_json_object(directory / "config.json")

    special = {
        name: spelling
        for name in SPECIAL_TOKEN_NAMES
        if (spelling := _spelling(config.get(name))) is not None
    }
    bos = _token_id(tok, special.get("bos_token"), generation, model_config, "bos_token_id")
    eos = _token_id(tok, special.get("eos_token"), generation, model_config, "eos_token_id")
    stops = {eos} if eos is not None else set()
    for source in (generation, model_config):
        stops |= set(_ids(source.get("eos_token_id")))

    vocab = tok.get_vocab(with_added_tokens=True)
    meta = TokenizerMeta(
        bos_token_id=bos,
        eos_token_id=eos,
        stop_token_ids=frozenset(stops),
        chat_template=_chat_template(directory, config) or default_template(vocab),
        special_tokens=special,
        chat_adds_bos=False,
        clean_up_spaces=bool(config.get("clean_up_tokenization_spaces", False))
        and type(tok.model).__name__ != "BPE",
        generation_defaults={
            key: cast(generation[key])
            for key, cast in SAMPLING_KEYS
            if isinstance(generation.get(key), int | float)
        },
    )
    return tok, meta


def read_json_object(path: Path, *, required: bool = False) -> dict[str, Any]:
    """A checkpoint's JSON file as a dict; {} for a missing one unless `required`.
    ModelNotFoundError for a file that is missing and required, unreadable, or no object."""
    if not path.is_file():
        if required:
            raise ModelNotFoundError(f"{path}: missing")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ModelNotFoundError(f"{path}: not a JSON object")
    return value


def _spelling(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or a serialized
    AddedToken (`{"content": ..., ...}`)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _token_id(
    tok: Tokenizer,
    spelling: str | None,
    generation: dict[str, Any],
    model_config: dict[str, Any],
    key: str,
) -> int | None:
    """The token the tokenizer's config names, else the first id generation_config.json or
    config.json gives."""
    if spelling is not None and (found := tok.token_to_id(spelling)) is not None:
        return int(found)
    for source in (generation, model_config):
        if ids := _ids(source.get(key)):
            return ids[0]
    return None


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
