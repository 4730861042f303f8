"""Request bodies: what each shape of input means, and the one error a bad one gets."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.catalog import DEFAULT_MODELS
from gateway.errors import BadRequestError, UnsupportedError
from gateway.http import validation_error
from gateway.schemas import (
    EmbeddingsRequest,
    WorkersAIEmbeddingRequest,
    check_embedding_model,
    check_generation_model,
)

SMOLLM2, _, MINILM, _ = DEFAULT_MODELS


@pytest.mark.parametrize(
    ("given", "texts", "ids"),
    [
        ("a", ["a"], None),
        (["a", "b"], ["a", "b"], None),
        ([7, 8], None, [[7, 8]]),
        ([[7], [8, 9]], None, [[7], [8, 9]]),
    ],
)
def test_embedding_inputs_are_texts_or_token_arrays(given, texts, ids) -> None:
    assert EmbeddingsRequest(model="m", input=given).inputs() == (texts, ids)


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ("", "must not be empty"),
        ([], "must not be empty"),
        ([""], "holds an empty string"),
        (["a", 1], "mixes strings with other values"),
        ([[1], []], "holds an empty token array"),
        ([1, -2], "token arrays hold token ids: integers of 0 or more"),
        ([1.5], "token arrays hold token ids: integers of 0 or more"),
        (True, "must be a string, a list of strings, a token array or a list of token arrays"),
        (["a"] * 2049, "takes at most 2048 inputs, got 2049"),
    ],
)
def test_a_bad_embedding_input_gets_one_error_saying_what_is_wrong(given, problem) -> None:
    with pytest.raises(ValidationError) as caught:
        EmbeddingsRequest(model="m", input=given)
    error = validation_error(caught.value)
    assert (str(error), error.param) == (f"invalid request: input: {problem}", "input")


def test_workers_ai_embeddings_take_strings_only() -> None:
    assert WorkersAIEmbeddingRequest(text="a").texts() == ["a"]
    assert WorkersAIEmbeddingRequest(text=["a", "b"]).texts() == ["a", "b"]
    for bad in ([1], {"a": 1}, 3):
        with pytest.raises(ValidationError) as caught:
            WorkersAIEmbeddingRequest(text=bad)
        assert str(validation_error(caught.value)) == (
            "invalid request: text: must be a string or a list of strings"
        )
    with pytest.raises(UnsupportedError, match="'pooling' is not supported"):
        WorkersAIEmbeddingRequest(text="a", pooling="cls").check_supported()


def test_dimensions_only_at_the_models_own_size() -> None:
    EmbeddingsRequest(model="m", input="a", dimensions=384).check_for(MINILM)
    with pytest.raises(UnsupportedError) as caught:
        EmbeddingsRequest(model="m", input="a", dimensions=128).check_for(MINILM)
    assert (str(caught.value), caught.value.param) == (
        f"{MINILM.name} does not shorten its vectors: 'dimensions' may only be its own size, 384",
        "dimensions",
    )


def test_each_task_takes_its_own_models() -> None:
    check_embedding_model(MINILM)
    check_generation_model(SMOLLM2)
    with pytest.raises(BadRequestError, match="generates text; embeddings take an embedding"):
        check_embedding_model(SMOLLM2)
    with pytest.raises(BadRequestError, match="is an embedding model: it does not generate"):
        check_generation_model(MINILM)
