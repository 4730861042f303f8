"""A checkpoint's tokenizer files read as transformers reads them: the same ids for text and
for a rendered chat, the same text back, the stop tokens and sampling defaults its
generation config states, and clear refusals of files we cannot read."""

from __future__ import annotations

import json

import pytest

from gpu_node.errors import InvalidRequestError, ModelNotFoundError
from gpu_node.models.tokenizer import ChatTokenizer
from tests.gpu_node.models.hf_tiny import write_tokenizer

TEXTS = (
    "The capital of France is Paris.",
    "  two  spaces, tabs\tand\nnewlines\n\n",
    "Ünïcödé — 東京 🚀 1234567",
    "<|im_start|>spelled inside text",
)
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Tell me about the history of Rome."},
    {"role": "assistant", "content": "It was founded in 753 BC."},
    {"role": "user", "content": "And Paris?"},
]


def sentencepiece_directory(directory):
    """A SentencePiece-style BPE (visible-space pieces, byte fallback, BOS added by the
    post-processor) as transformers saves a Llama-like tokenizer."""
    from tokenizers import SentencePieceBPETokenizer, processors
    from transformers import PreTrainedTokenizerFast

    sp = SentencePieceBPETokenizer()
    corpus = [t for t in TEXTS for _ in range(20)] + [m["content"] for m in CHAT] * 20
    sp.train_from_iterator(corpus, vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok = sp._tokenizer
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}"
        "{{ eos_token if m['role'] == 'assistant' else '' }}\n{% endfor %}"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
    )
    fast.save_pretrained(directory)
    return directory


def bpe_directory(directory):
    write_tokenizer(directory)
    return directory


@pytest.fixture(params=["byte-level-bpe", "sentencepiece-bpe"])
def tokenizer_directory(request, tmp_path):
    make = bpe_directory if request.param == "byte-level-bpe" else sentencepiece_directory
    return make(tmp_path)


def transformers_tokenizer(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def test_text_encodes_and_decodes_as_transformers(tokenizer_directory):
    ours, theirs = (
        ChatTokenizer.from_directory(tokenizer_directory),
        transformers_tokenizer(tokenizer_directory),
    )
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        )
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)


def test_a_chat_renders_and_encodes_as_transformers(tokenizer_directory):
    ours, theirs = (
        ChatTokenizer.from_directory(tokenizer_directory),
        transformers_tokenizer(tokenizer_directory),
    )
    text = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT) == text
    ids = theirs.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ours.encode_chat(CHAT) == list(ids)


def test_special_tokens_stop_tokens_and_sampling_defaults(tmp_path):
    directory = sentencepiece_directory(tmp_path)
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.9, "do_sample": True})
    )
    tok = ChatTokenizer.from_directory(directory)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.stop_token_ids == frozenset({2, 7})
    assert tok.generation_defaults == {"temperature": 0.6, "top_p": 0.9}
    assert tok.meta.special_tokens == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
    }


def test_a_checkpoint_without_sampling_defaults_states_none(tmp_path):
    tok = ChatTokenizer.from_directory(bpe_directory(tmp_path))
    assert tok.generation_defaults == {}
    assert tok.stop_token_ids == frozenset({tok.encode("<|im_end|>")[0]})


def test_the_chat_template_file_and_named_templates(tmp_path):
    directory = bpe_directory(tmp_path)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{% for m in messages %}{{ m['content'] }}|{% endfor %}"},
    ]
    config_path.write_text(json.dumps(config))
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    assert ChatTokenizer.from_directory(directory).apply_chat_template(CHAT[:2]) == (
        "You answer briefly.|Tell me about the history of Rome.|"
    )
    (directory / "chat_template.jinja").write_text("{{ messages | length }} messages")
    assert ChatTokenizer.from_directory(directory).apply_chat_template(CHAT) == "4 messages"


def test_a_template_that_fails_is_the_callers_error(tmp_path):
    directory = bpe_directory(tmp_path)
    (directory / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}{{ messages[0]['content'] }}"
    )
    tok = ChatTokenizer.from_directory(directory)
    with pytest.raises(InvalidRequestError, match="chat template: first must be user"):
        tok.encode_chat(CHAT)
    assert tok.apply_chat_template(CHAT[1:]) == CHAT[1]["content"]


def test_unreadable_tokenizer_files_are_refused_by_name(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"no tokenizer\.json"):
        ChatTokenizer.from_directory(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(ModelNotFoundError, match="save it with transformers"):
        ChatTokenizer.from_directory(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelNotFoundError, match="unreadable tokenizer"):
        ChatTokenizer.from_directory(tmp_path)
    bpe_directory(tmp_path)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ModelNotFoundError, match=r"generation_config\.json: not a JSON object"):
        ChatTokenizer.from_directory(tmp_path)
