"""A GGUF's tokenizer, rebuilt with the `tokenizers` library from the file's metadata.

GGUF stores the vocabulary (`tokenizer.ggml.tokens`, `token_type`, and `merges` or
`scores`) and names the model kind:

    gpt2    byte-level BPE; the pre-tokenizer split is named by `tokenizer.ggml.pre`
    llama   SentencePiece BPE with byte fallback (`<0x00>`..`<0xFF>` pieces); no merges are
            stored, they follow from the vocabulary: a piece is the merge of two others,
            ranked by its score (by its position for Gemma, whose files rank that way)

Control tokens (type 3) become special tokens, so `<|im_start|>` in a chat template is one
token, never split; user-defined tokens (type 4: Gemma's runs of newlines, `\\t`) are
matched whole too, but are not special. The result reads as transformers' tokenizer of
the same file does (tests/gpu_node/models/test_gemma3.py, test_tokenizer.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from gpu_node.errors import ModelNotFoundError
from gpu_node.models.gguf_loader import GGUFModel
from gpu_node.models.tokenizer_meta import SPECIAL_TOKEN_NAMES, TokenizerMeta, default_template

CONTROL_TOKEN = 3
USER_DEFINED_TOKEN = 4
SPACE = "\u2581"  # SentencePiece's visible space

# Pre-tokenizer splits by `tokenizer.ggml.pre`, as the vocabularies were trained.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_DIGITS_FIRST = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
# Spellings that end a turn in the templates GGUF models ship: stop there too.
_TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")
# Sampling defaults a GGUF may carry (llama.cpp writes them from generation_config.json).
_SAMPLING_FIELDS = (
    ("general.sampling.temp", "temperature", float),
    ("general.sampling.top_p", "top_p", float),
    ("general.sampling.top_k", "top_k", int),
)


def read_gguf_tokenizer(gguf: GGUFModel) -> tuple[Tokenizer, TokenizerMeta]:
    """The tokenizer a GGUF describes; ModelNotFoundError for a kind we cannot rebuild."""
    kind = gguf.field("tokenizer.ggml.model")
    tokens: list[str] = list(gguf.field("tokenizer.ggml.tokens") or [])
    types: list[int] = [int(t) for t in gguf.field("tokenizer.ggml.token_type") or []]
    if not tokens:
        raise ModelNotFoundError(f"{gguf.path}: no tokenizer.ggml.tokens")
    if kind == "gpt2":
        tok = _byte_level(tokens, list(gguf.field("tokenizer.ggml.merges") or []), gguf)
        default_bos = False
    elif kind == "llama":
        tok = _sentencepiece(tokens, types, gguf)
        default_bos = True  # llama.cpp adds BOS to a SentencePiece vocabulary unless told not to
    else:
        raise ModelNotFoundError(
            f"{gguf.path}: tokenizer {kind!r} is not supported "
            "(gpt2: byte-level BPE, llama: SentencePiece)"
        )
    special = [tokens[i] for i, t in enumerate(types) if t == CONTROL_TOKEN]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    # Only those the vocabulary spells as the file does: Gemma's runs of spaces are pieces
    # of SPACEs there (_sentencepiece), merged as any piece, never matched whole.
    user_defined = [
        tokens[i]
        for i, t in enumerate(types)
        if t == USER_DEFINED_TOKEN and tok.token_to_id(tokens[i]) == i
    ]
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in user_defined])
    vocab = {t: i for i, t in enumerate(tokens)}

    bos = _token_id(gguf, "bos_token_id")
    eos = _token_id(gguf, "eos_token_id")
    add_bos = bool(gguf.field("tokenizer.ggml.add_bos_token", default_bos)) and bos is not None
    add_eos = bool(gguf.field("tokenizer.ggml.add_eos_token", False)) and eos is not None
    tok.post_processor = _post_processor(tokens, bos if add_bos else None, eos if add_eos else None)

    ends = {vocab[s] for s in _TURN_ENDS if s in vocab and types[vocab[s]] == CONTROL_TOKEN}
    ends |= {
        i for key in ("eot_token_id", "eom_token_id") if (i := _token_id(gguf, key)) is not None
    }
    named = {"bos_token": bos, "eos_token": eos, "unk_token": _token_id(gguf, "unknown_token_id"),
             "pad_token": _token_id(gguf, "padding_token_id")}  # fmt: skip
    meta = TokenizerMeta(
        bos_token_id=bos,
        eos_token_id=eos,
        stop_token_ids=frozenset(ends | ({eos} if eos is not None else set())),
        chat_template=gguf.field("tokenizer.chat_template") or default_template(vocab),
        special_tokens={
            name: tokens[i]
            for name, i in named.items()
            if name in SPECIAL_TOKEN_NAMES and i is not None
        },
        chat_adds_bos=add_bos,
        generation_defaults={
            name: cast(value)
            for key, name, cast in _SAMPLING_FIELDS
            if (value := gguf.field(key)) is not None
        },
    )
    return tok, meta


def _token_id(gguf: GGUFModel, key: str) -> int | None:
    value = gguf.field(f"tokenizer.ggml.{key}")
    return None if value is None else int(value)


def _post_processor(
    tokens: Sequence[str], bos: int | None, eos: int | None
) -> processors.PostProcessor:
    single = " ".join(
        [*([f"{tokens[bos]}:0"] if bos is not None else []), "$A:0",
         *([f"{tokens[eos]}:0"] if eos is not None else [])]
    )  # fmt: skip
    specials = [(tokens[i], i) for i in (bos, eos) if i is not None]
    return processors.TemplateProcessing(
        single=single, pair=f"{single} $B:1", special_tokens=specials
    )


def _byte_level(tokens: list[str], merges: list[str], gguf: GGUFModel) -> Tokenizer:
    pairs = [(left, right) for left, _, right in (m.partition(" ") for m in merges)]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    split = pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated")
    steps: list[pre_tokenizers.PreTokenizer] = [split, byte_level]
    if gguf.field("tokenizer.ggml.pre") in _DIGITS_FIRST:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(tokens: list[str], types: list[int], gguf: GGUFModel) -> Tokenizer:
    """SentencePiece BPE as `tokenizers` runs it: text with SPACE for spaces, merges in the
    vocabulary's rank order, unknown characters as their UTF-8 bytes."""
    is_gemma = str(gguf.field("general.architecture", "")).startswith("gemma")
    if is_gemma:
        # Gemma stores its pieces of two or more spaces as real spaces; its text has SPACE.
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks: Sequence[float] = [-i for i in range(len(tokens))]
    else:
        ranks = [float(s) for s in gguf.field("tokenizer.ggml.scores")]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = gguf.field("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=sentencepiece_merges(tokens, ranks),
            unk_token=tokens[int(unk_id)] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if is_gemma:
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        prefix = bool(gguf.field("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False
        )
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def sentencepiece_merges(tokens: Sequence[str], ranks: Iterable[float]) -> list[tuple[str, str]]:
    """Every (left, right) whose concatenation is a piece, best piece first (highest rank),
    a piece's splits longest left part first: the order transformers derives them in."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for piece, rank in zip(tokens, ranks, strict=True):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-rank, -len(left), -len(right), left, right))
    found.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in found]
