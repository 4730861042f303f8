"""The embedder: texts tokenized as the model's tokenizer does, refused or cut past its
positions, batched by a token budget without changing any vector, token arrays checked."""

from __future__ import annotations

import pytest
import torch

from gpu_node.engine.embedder import Embedder
from gpu_node.errors import InvalidRequestError, RequestTooLargeError

pytestmark = pytest.mark.slow

TEXTS = ["short", "a somewhat longer sentence about Paris and Rome", "mid length text here", "x"]


@pytest.fixture(scope="module")
def embedder(minilm_path):
    return Embedder.from_directory(minilm_path)


def test_texts_tokenize_as_the_models_tokenizer(embedder, minilm_path):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(minilm_path)
    long = "word " * 300  # past the file's own truncation at 128: ours does not cut
    ids = embedder.tokenize([*TEXTS, long])
    assert ids == [reference(t)["input_ids"] for t in [*TEXTS, long]]
    assert len(ids[-1]) == 302


def test_budgeted_batches_give_the_vectors_of_one_batch(embedder):
    ids = embedder.tokenize(TEXTS * 4)
    whole = Embedder(embedder.model, embedder.tokenizer, max_batch_tokens=10_000).embed(ids)
    small = Embedder(embedder.model, embedder.tokenizer, max_batch_tokens=16).embed(ids)
    assert whole.num_tokens == small.num_tokens == sum(len(i) for i in ids)
    assert (whole.vectors - small.vectors).abs().max() < 1e-5
    alone = torch.stack([embedder.embed([one]).vectors[0] for one in ids])
    assert (alone - whole.vectors).abs().max() < 1e-5
    assert whole.vectors.shape == (16, 384)
    assert torch.allclose(whole.vectors.norm(dim=-1), torch.ones(16), atol=1e-5)


def test_a_text_past_the_positions_is_refused_or_cut(embedder):
    long = "word " * 600
    with pytest.raises(RequestTooLargeError, match=r"^input\[1\] is 602 tokens; this model "
                       r"takes at most 512 \(ask for truncation to cut it\)$"):  # fmt: skip
        embedder.tokenize(["fine", long])
    cut = embedder.tokenize(["fine", long], truncate=True)
    assert len(cut[1]) == 512 and cut[1][-1] == cut[0][-1]  # [SEP] kept at the end
    assert embedder.embed(cut).vectors.shape == (2, 384)


def test_token_arrays_are_checked(embedder):
    embedder.check_ids([[101, 7592, 102]])
    with pytest.raises(InvalidRequestError, match=r"input\[1\] is empty"):
        embedder.check_ids([[101], []])
    with pytest.raises(InvalidRequestError, match=r"input\[0\] holds a token id outside 0..30521"):
        embedder.check_ids([[101, 30522]])
    with pytest.raises(RequestTooLargeError, match=r"input\[0\] is 513 tokens"):
        embedder.check_ids([[1] * 513])


def test_requests_waiting_together_run_in_one_pass_each_getting_its_own_vectors(embedder):
    import asyncio

    from gpu_node.engine.embedder import EmbedQueue

    requests = [embedder.tokenize([text]) for text in TEXTS] + [embedder.tokenize(TEXTS[:2])]

    async def concurrently() -> tuple[list, int]:
        queue = EmbedQueue(embedder)
        # The first request starts a pass at once; the rest arrive while it runs.
        first = asyncio.ensure_future(queue.embed(requests[0]))
        await asyncio.sleep(0)
        rest = [asyncio.ensure_future(queue.embed(ids)) for ids in requests[1:]]
        return list(await asyncio.gather(first, *rest)), queue.num_passes

    answers, num_passes = asyncio.run(concurrently())
    assert num_passes == 2
    for ids, answer in zip(requests, answers, strict=True):
        alone = embedder.embed(ids)
        assert answer.num_tokens == alone.num_tokens == sum(len(one) for one in ids)
        assert answer.vectors.shape == (len(ids), 384)
        assert (answer.vectors - alone.vectors).abs().max() < 1e-5


def test_a_failed_pass_fails_its_requests_and_the_queue_goes_on(embedder):
    import asyncio

    from gpu_node.engine.embedder import EmbedQueue

    async def run() -> tuple[BaseException | None, int]:
        queue = EmbedQueue(embedder)
        failing = queue.embed([[101, 10**9, 102]])  # past the vocabulary: the model raises
        try:
            await failing
            error = None
        except (IndexError, RuntimeError) as exc:
            error = exc
        after = await queue.embed(embedder.tokenize(["fine"]))
        return error, after.vectors.shape[0]

    error, num_after = asyncio.run(run())
    assert error is not None and num_after == 1
