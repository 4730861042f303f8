"""Texts to vectors with an encoder model (models/bert.py), batched by a token budget.

A request's texts are tokenized here, refused past the model's positions (or cut to them
when the caller asks), then run with every other text waiting, shortest first, in
batches whose padded size (texts x longest) stays within `max_batch_tokens`: as prefill is
budgeted, so one long text never pads a batch of short ones to its length. Nothing is kept
after a pass.

`EmbedQueue` is how a node serves requests: what arrives while a pass runs waits, and
every request waiting then runs together in the next pass (one `Embedder.embed`), so
concurrent single-text requests fill batches as one request of many texts does.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from gpu_node.errors import InvalidRequestError, RequestTooLargeError
from gpu_node.models.bert import BertEncoder, load_encoder


@dataclass(frozen=True)
class Embeddings:
    vectors: torch.Tensor  # [n, d] fp32, on the CPU
    num_tokens: int  # the input tokens encoded (what is billed)


class Embedder:
    def __init__(
        self,
        model: BertEncoder,
        tokenizer: Tokenizer,
        *,
        max_batch_tokens: int = 16384,
        name: str = "",
    ) -> None:
        self.model = model
        self.name = name
        self.max_batch_tokens = max_batch_tokens
        self.max_tokens = model.config.max_position_embeddings
        self.dimensions = model.config.hidden_size
        self.device = next(model.parameters()).device
        # The file's own truncation and padding (all-MiniLM's: 128) are not ours: a text
        # past the model's positions is refused or cut here, and batches pad themselves.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer = tokenizer
        self._cut = Tokenizer.from_str(tokenizer.to_str())
        self._cut.enable_truncation(self.max_tokens)
        self._lock = threading.Lock()  # one pass at a time on the model

    @classmethod
    def from_directory(
        cls,
        directory: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        name: str | None = None,
    ) -> Embedder:
        """The encoder of a checkpoint directory, served as `name` (default: the path)."""
        path = Path(directory)
        return cls(
            load_encoder(path, dtype, device),
            Tokenizer.from_file(str(path / "tokenizer.json")),
            name=str(directory) if name is None else name,
        )

    def tokenize(self, texts: list[str], *, truncate: bool = False) -> list[list[int]]:
        """Each text's ids ([CLS] ... [SEP]); RequestTooLargeError naming the first text
        past the model's positions, unless `truncate` cuts it to them."""
        if truncate:
            return [e.ids for e in self._cut.encode_batch(texts)]
        ids = [e.ids for e in self.tokenizer.encode_batch(texts)]
        for i, one in enumerate(ids):
            if len(one) > self.max_tokens:
                raise RequestTooLargeError(
                    f"input[{i}] is {len(one)} tokens; this model takes at most "
                    f"{self.max_tokens} (ask for truncation to cut it)"
                )
        return ids

    def check_ids(self, ids: list[list[int]]) -> None:
        """Token arrays a caller sent: in the vocabulary and within the model's positions."""
        vocab = self.model.config.vocab_size
        for i, one in enumerate(ids):
            if not one:
                raise InvalidRequestError(f"input[{i}] is empty")
            if len(one) > self.max_tokens:
                raise RequestTooLargeError(
                    f"input[{i}] is {len(one)} tokens; this model takes at most {self.max_tokens}"
                )
            if any(not 0 <= t < vocab for t in one):
                raise InvalidRequestError(f"input[{i}] holds a token id outside 0..{vocab - 1}")

    def embed(self, ids: list[list[int]]) -> Embeddings:
        """The vectors of `ids`, in their order, batched shortest first within the budget."""
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        vectors = torch.empty(len(ids), self.dimensions)
        start = 0
        while start < len(order):
            end = start + 1
            # Texts are sorted, so the last one taken sets the batch's padded length.
            while end < len(order) and (end - start + 1) * len(ids[order[end]]) <= max(
                self.max_batch_tokens, len(ids[order[start]])
            ):
                end += 1
            batch = [ids[i] for i in order[start:end]]
            vectors[order[start:end]] = self._run(batch)
            start = end
        return Embeddings(vectors, sum(len(one) for one in ids))

    def _run(self, batch: list[list[int]]) -> torch.Tensor:
        longest = max(len(one) for one in batch)
        input_ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, one in enumerate(batch):
            input_ids[row, : len(one)] = torch.tensor(one)
            mask[row, : len(one)] = 1
        with self._lock:
            out = self.model(input_ids.to(self.device), mask.to(self.device))
        return out.float().cpu()


@dataclass
class _Waiting:
    ids: list[list[int]]
    answer: asyncio.Future[Embeddings] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class EmbedQueue:
    """Requests' inputs for one `Embedder`, run together: each pass takes every request
    waiting when it starts (see the module docstring)."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self._waiting: list[_Waiting] = []
        self._runner: asyncio.Task[None] | None = None
        self.num_passes = 0  # passes run: fewer than requests when they were batched

    async def embed(self, ids: list[list[int]]) -> Embeddings:
        """`ids`' vectors, from the first pass that starts after they arrive."""
        waiting = _Waiting(ids)
        self._waiting.append(waiting)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        return await waiting.answer

    async def _run(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            batch = [w for w in batch if not w.answer.done()]  # a caller that left: skipped
            if not batch:
                continue
            every = [one for w in batch for one in w.ids]
            self.num_passes += 1
            try:
                result = await asyncio.to_thread(self.embedder.embed, every)
            except Exception as exc:  # every request of the pass fails with it
                for w in batch:
                    if not w.answer.done():
                        w.answer.set_exception(exc)
                continue
            start = 0
            for w in batch:
                end = start + len(w.ids)
                tokens = sum(len(one) for one in w.ids)
                if not w.answer.done():
                    w.answer.set_result(Embeddings(result.vectors[start:end], tokens))
                start = end
