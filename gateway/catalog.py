"""The model catalog: public model names (and aliases), the node model each one runs on, and
the sampling a request gets for the values it does not name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling value out gets, in both dialects: the model's
    generation config where it ships one, else a default chosen for the model here."""

    temperature: float = 0.6  # Workers AI's, for a model that states none
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens


@dataclass(frozen=True)
class CatalogModel:
    name: str  # public, e.g. "@cf/huggingface/smollm2-135m-instruct"
    node_model: str  # what nodes publish in their capacity record, e.g. "smollm2"
    id: str  # stable id shown in the catalog
    description: str
    aliases: tuple[str, ...] = ()
    task: str = "Text Generation"
    context_window: int = 8192
    is_experimental: bool = False  # Workers AI search's hide_experimental leaves it out
    sampling: SamplingDefaults = SamplingDefaults()

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
        name="@cf/edgeserve/moe-small",
        node_model="moe-small",
        id="0b6c8f7e-2f0d-4c55-8f42-1d9e3b7a6c02",
        description="A small mixture-of-experts model with seeded weights, for benchmarks.",
        aliases=("moe-small",),
        is_experimental=True,
    ),
)


class ModelCatalog:
    def __init__(self, models: tuple[CatalogModel, ...] = DEFAULT_MODELS) -> None:
        self.models = models
        self._by_name: dict[str, CatalogModel] = {}
        for model in models:
            for name in (model.name, *model.aliases):
                self._by_name[name] = model

    def resolve(self, name: str) -> CatalogModel | None:
        return self._by_name.get(name)
