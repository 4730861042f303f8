"""all-MiniLM-L6-v2 through our encoder: the vectors transformers' BertModel and the
checkpoint's own pooling give, alone and batched; other BERT checkpoints' shapes and
pooling read from their files; what we do not serve refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F

from gpu_node.errors import ModelNotFoundError
from gpu_node.models.bert import encoder_config, is_encoder_directory, load_encoder

pytestmark = pytest.mark.slow

SENTENCES = [
    "The capital of France is Paris.",
    "A man is eating food.",
    "Dogs bark at night and sleep through the day, mostly in the sun.",
    "héllo wörld — 東京タワー 🚀",
    "A B C",
]


def reference(directory, texts, *, pooling="mean", normalize=True):
    """transformers' BertModel over the padded batch, pooled as sentence-transformers does."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModel.from_pretrained(directory, dtype=torch.float32).eval()
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    if pooling == "cls":
        vectors = hidden[:, 0]
    else:
        mask = batch["attention_mask"][..., None].float()
        vectors = (hidden * mask).sum(1) / mask.sum(1)
    return (F.normalize(vectors, dim=-1) if normalize else vectors), batch


def ours(directory, batch):
    model = load_encoder(directory)
    return model(batch["input_ids"], batch["attention_mask"])


def test_minilm_reads_as_its_files_say(minilm_path):
    config = encoder_config(minilm_path)
    assert (config.hidden_size, config.num_layers, config.num_heads) == (384, 6, 12)
    assert (config.max_position_embeddings, config.pooling, config.normalize) == (512, "mean", True)
    assert is_encoder_directory(minilm_path)


def test_minilm_vectors_match_transformers_batched_and_alone(minilm_path):
    expected, batch = reference(minilm_path, SENTENCES)
    batched = ours(minilm_path, batch)
    assert F.cosine_similarity(batched, expected).min() >= 0.99999
    assert (batched - expected).abs().max() < 1e-5
    for i, text in enumerate(SENTENCES):
        alone_expected, alone_batch = reference(minilm_path, [text])
        alone = ours(minilm_path, alone_batch)
        assert (alone - alone_expected).abs().max() < 1e-5
        assert (alone[0] - batched[i]).abs().max() < 1e-5  # padding changes nothing


def test_cls_pooling_without_normalization_from_the_files(minilm_path, tmp_path):
    directory = tmp_path / "cls"
    shutil.copytree(minilm_path, directory)
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    )
    modules = json.loads((directory / "modules.json").read_text())
    (directory / "modules.json").write_text(json.dumps(modules[:2]))
    config = encoder_config(directory)
    assert (config.pooling, config.normalize) == ("cls", False)
    expected, batch = reference(directory, SENTENCES, pooling="cls", normalize=False)
    assert (ours(directory, batch) - expected).abs().max() < 1e-4


def test_a_bert_checkpoint_written_by_transformers_loads(tmp_path):
    """A bge-style checkpoint (BertModel saved with save_pretrained, `bert.`-less names,
    no sentence-transformers files): mean pooling, no normalization."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=40)  # fmt: skip
    torch.manual_seed(0)
    BertModel(config).eval().save_pretrained(tmp_path)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab))
    BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    texts = ["a b c", "hello world", "z"]
    expected, batch = reference(tmp_path, texts, normalize=False)
    assert encoder_config(tmp_path).normalize is False
    assert (ours(tmp_path, batch) - expected).abs().max() < 1e-5


def test_what_we_do_not_serve_is_refused_by_name(minilm_path, tmp_path):
    directory = tmp_path / "other"
    shutil.copytree(minilm_path, directory)
    raw = json.loads((directory / "config.json").read_text())
    for change, message in [
        ({"model_type": "roberta"}, "model_type 'roberta' is not an encoder we serve"),
        ({"position_embedding_type": "relative_key"}, "only absolute position embeddings"),
        ({"hidden_act": "relu"}, "hidden_act 'relu' is not served"),
    ]:
        (directory / "config.json").write_text(json.dumps(raw | change))
        with pytest.raises(ModelNotFoundError, match=message):
            encoder_config(directory)
    (directory / "config.json").write_text(json.dumps(raw))
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_max_tokens": True})
    )
    with pytest.raises(ModelNotFoundError, match=r"pooling \['pooling_mode_max_tokens'\]"):
        encoder_config(directory)
