"""The model catalog: public model names (and aliases), the node model each one runs on, and
the sampling a request gets for the values it does not name.

The catalog lists what the fleet serves (`ModelCatalog.served`): its own entries that some
live node serves, and an entry for each other model a node serves (a checkpoint directory
or a GGUF path, `local_entry`). A served model's sampling defaults are its own where its
files state them (the node publishes its generation config), else the entry's.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import PurePath
from typing import Any

TEXT_GENERATION = "Text Generation"
TEXT_EMBEDDINGS = "Text Embeddings"


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling value out gets, in both dialects: the model's
    generation config where it ships one, else a default chosen for the model here."""

    temperature: float = 0.6  # Workers AI's, for a model that states none
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens

    def overlaid(self, stated: Mapping[str, float]) -> SamplingDefaults:
        """These defaults with the values a model's generation config states in their place."""
        return SamplingDefaults(
            temperature=float(stated.get("temperature", self.temperature)),
            top_p=float(stated.get("top_p", self.top_p)),
            top_k=int(stated.get("top_k", self.top_k)),
        )


@dataclass(frozen=True)
class CatalogModel:
    name: str  # public, e.g. "@cf/huggingface/smollm2-135m-instruct"
    node_model: str  # what nodes publish in their capacity record, e.g. "smollm2"
    id: str  # stable id shown in the catalog
    description: str
    aliases: tuple[str, ...] = ()
    task: str = TEXT_GENERATION  # Workers AI's task name
    context_window: int = 8192  # of an embedding model: the tokens it takes per input
    dimensions: int = 0  # an embedding model's vector size (0: not stated)
    is_experimental: bool = False  # Workers AI search's hide_experimental leaves it out
    sampling: SamplingDefaults = SamplingDefaults()

    @property
    def is_embedding(self) -> bool:
        return self.task == TEXT_EMBEDDINGS

    @property
    def author(self) -> str:
        """Who published the weights: the name's second part ("@cf/meta/..." -> "meta")."""
        parts = self.name.split("/")
        return parts[1] if len(parts) > 2 else ""

    def search_entry(self, context_window: int) -> dict[str, Any]:
        """One item of Workers AI's models/search result, with the context window served
        now (Dispatcher.context_window)."""
        return {
            "id": self.id,
            "name": self.name,
            "description": self.description,
            "task": {"id": "c329a1f9-323d-4e91-b2aa-582dd4188d34", "name": self.task},
            "properties": [
                {"property_id": "context_window", "value": str(context_window)},
                {"property_id": "aliases", "value": ",".join(self.aliases)},
            ],
        }


DEFAULT_MODELS = (
    CatalogModel(
        name="@cf/huggingface/smollm2-135m-instruct",
        node_model="smollm2",
        id="7d3d4c59-3a35-4b4e-9d1b-6f1a4a5e2b01",
        description="SmolLM2-135M-Instruct: a small instruction-tuned Llama-architecture model.",
        aliases=("smollm2",),
        # Its generation config names no sampling values. At INT4, 135M parameters answer
        # on topic only greedily: any temperature drifts, often into French.
        sampling=SamplingDefaults(temperature=0.0),
    ),
    CatalogModel(
        name="@cf/google/gemma-3-270m",
        node_model="gemma3-270m",
        id="5e2f7a1c-9b3d-4f60-8c21-7a4d0e6b9f03",
        description="Gemma 3 270M: a small base model with interleaved sliding-window layers.",
        aliases=("gemma3-270m",),
        context_window=32768,
    ),
    CatalogModel(
        name="@cf/sentence-transformers/all-minilm-l6-v2",
        node_model="minilm",
        id="3f1c9e52-7a0b-4d8e-b6a4-2c5d8f0e1a74",
        description="all-MiniLM-L6-v2: 384-dimensional sentence embeddings, mean-pooled and "
        "normalized.",
        aliases=("minilm", "all-minilm-l6-v2"),
        task=TEXT_EMBEDDINGS,
        context_window=512,
        dimensions=384,
    ),
    CatalogModel(
        name="@cf/edgeserve/moe-small",
        node_model="moe-small",
        id="0b6c8f7e-2f0d-4c55-8f42-1d9e3b7a6c02",
        description="A small mixture-of-experts model with seeded weights, for benchmarks.",
        aliases=("moe-small",),
        is_experimental=True,
    ),
)


def local_entry(
    node_model: str, context_window: int = 8192, task: str = TEXT_GENERATION
) -> CatalogModel:
    """The entry of a model the catalog does not know, served from a path: named
    `@cf/local/<file or directory name>`, with that short name and the path as aliases, the
    window its nodes take and its task."""
    short = re.sub(r"[^a-z0-9._-]+", "-", PurePath(node_model).name.lower()).strip("-.")
    short = short.removesuffix(".gguf") or "model"
    return CatalogModel(
        name=f"@cf/local/{short}",
        node_model=node_model,
        id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"edgeserve:{node_model}")),
        description=f"Served from {PurePath(node_model).name}.",
        aliases=tuple(dict.fromkeys((short, node_model))),
        task=task,
        context_window=context_window,
    )


@dataclass(frozen=True)
class ServedModel:
    """What a live node publishes about the model it serves (scheduler.CapacityRecord)."""

    node_model: str
    generation_defaults: Mapping[str, float]
    max_request_tokens: int = 0  # the largest a node serving it takes; 0: none says
    embedding_tokens: int = 0  # an encoder's tokens per input; 0: the model generates text


def _local_entry(served: ServedModel) -> CatalogModel:
    if served.embedding_tokens:
        return local_entry(served.node_model, served.embedding_tokens, TEXT_EMBEDDINGS)
    return local_entry(served.node_model, served.max_request_tokens or 8192)


class ModelCatalog:
    def __init__(self, models: tuple[CatalogModel, ...] = DEFAULT_MODELS) -> None:
        self.models = models
        self._by_name: dict[str, CatalogModel] = {}
        for model in models:
            for name in (model.name, *model.aliases):
                self._by_name[name] = model

    def resolve(self, name: str, served: Sequence[ServedModel] = ()) -> CatalogModel | None:
        """The entry `name` (a public name, an alias, or a served model's path) means, with
        the served model's own sampling defaults; None for a name nothing here means."""
        entry = self._by_name.get(name)
        if entry is None:
            entry = next((e for e in self.served(served) if name in (e.name, *e.aliases)), None)
        if entry is None:
            return None
        return self._with_defaults(entry, served)

    def served(self, served: Sequence[ServedModel]) -> list[CatalogModel]:
        """The entries of the models live nodes serve: the catalog's in its order, then one
        `local_entry` for each model it does not know."""
        node_models = {s.node_model for s in served}
        known = [m for m in self.models if m.node_model in node_models]
        known_node_models = {m.node_model for m in self.models}
        local = node_models - known_node_models
        unknown = sorted((s for s in served if s.node_model in local), key=lambda s: s.node_model)
        entries = [*known, *(_local_entry(s) for s in unknown)]
        return [self._with_defaults(e, served) for e in entries]

    @staticmethod
    def _with_defaults(entry: CatalogModel, served: Sequence[ServedModel]) -> CatalogModel:
        stated = next(
            (s.generation_defaults for s in served if s.node_model == entry.node_model), {}
        )
        return replace(entry, sampling=entry.sampling.overlaid(stated)) if stated else entry
