"""The catalog lists what the fleet serves, names models served from a path, and gives a
served model its own sampling defaults."""

from __future__ import annotations

from gateway.catalog import ModelCatalog, SamplingDefaults, ServedModel, local_entry

SMOLLM2 = "@cf/huggingface/smollm2-135m-instruct"


def test_only_served_models_are_listed_in_catalog_order_then_local_ones():
    catalog = ModelCatalog()
    assert catalog.served([]) == []
    served = [
        ServedModel("/models/b/Qwen3-0.6B", {}, 40960),
        ServedModel("moe-small", {}),
        ServedModel("/models/a/gemma.Q4_K_M.gguf", {}, 0),
        ServedModel("smollm2", {}),
    ]
    names = [m.name for m in catalog.served(served)]
    assert names == [
        SMOLLM2,
        "@cf/edgeserve/moe-small",
        "@cf/local/gemma.q4_k_m",
        "@cf/local/qwen3-0.6b",
    ]
    windows = {m.name: m.context_window for m in catalog.served(served)}
    assert windows["@cf/local/qwen3-0.6b"] == 40960
    assert windows["@cf/local/gemma.q4_k_m"] == 8192  # a node that states none


def test_gemma3_is_listed_under_its_workers_ai_name_when_served():
    catalog = ModelCatalog()
    served = [ServedModel("gemma3-270m", {}), ServedModel("smollm2", {})]
    assert [m.name for m in catalog.served(served)] == [SMOLLM2, "@cf/google/gemma-3-270m"]
    gemma = catalog.resolve("gemma3-270m", served)
    assert (gemma.author, gemma.context_window) == ("google", 32768)


def test_a_local_entry_is_stable_and_answers_to_its_short_name_and_path():
    entry = local_entry("/srv/My Models/Llama-3.1-8B-Instruct/", 131072)
    assert entry.name == "@cf/local/llama-3.1-8b-instruct"
    assert entry.aliases == ("llama-3.1-8b-instruct", "/srv/My Models/Llama-3.1-8B-Instruct/")
    assert entry.id == local_entry("/srv/My Models/Llama-3.1-8B-Instruct/").id
    assert entry.id != local_entry("/srv/other/Llama-3.1-8B-Instruct").id
    assert entry.author == "local" and entry.context_window == 131072
    catalog = ModelCatalog()
    served = [ServedModel(entry.node_model, {})]
    for name in (entry.name, "llama-3.1-8b-instruct", entry.node_model):
        found = catalog.resolve(name, served)
        assert found is not None and found.node_model == entry.node_model
    assert catalog.resolve("llama-3.1-8b-instruct") is None  # no node serves it


def test_a_models_generation_config_overrides_the_catalogs_defaults():
    catalog = ModelCatalog()
    assert catalog.resolve("smollm2").sampling == SamplingDefaults(temperature=0.0)
    stated = [ServedModel("smollm2", {"temperature": 0.7, "top_k": 20.0})]
    resolved = catalog.resolve("smollm2", stated)
    assert resolved.sampling == SamplingDefaults(temperature=0.7, top_p=1.0, top_k=20)
    assert catalog.served(stated)[0].sampling == resolved.sampling
    local = catalog.resolve("/m/Qwen3", [ServedModel("/m/Qwen3", {"top_p": 0.95})])
    assert local.sampling == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=0)
