"""Pulling models from PyPI into a model home, and resolving names to files."""

from __future__ import annotations

import pytest

from gpu_node.errors import ModelNotFoundError
from gpu_node.models.model_store import (
    KNOWN_MODELS,
    LocalModel,
    describe,
    local_models,
    model_path,
    pull,
    resolve_model,
    sha256_of,
)


def test_gemma3_is_four_wheels_joined_in_order():
    package = KNOWN_MODELS["gemma3-270m"]
    assert package.filename == "gemma-3-270m-q4_k_m.gguf"
    assert [p.member.rsplit(".", 1)[-1] for p in package.parts] == [
        "part00", "part01", "part02", "part03",
    ]  # fmt: skip
    assert all(p.requirement.endswith("==1.0.0") for p in package.parts)


def test_an_unknown_model_is_refused_naming_the_pullable_ones(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"pullable: gemma3-270m, .*smollm2"):
        pull("gemma9", tmp_path)


def test_a_model_not_pulled_names_the_command_that_pulls_it(tmp_path):
    with pytest.raises(ModelNotFoundError, match="edgeserve model pull gemma3-270m"):
        resolve_model("gemma3-270m", tmp_path)


@pytest.mark.slow
def test_pull_joins_the_parts_and_replaces_a_damaged_file(tmp_path, gemma3_path):
    package = KNOWN_MODELS["gemma3-270m"]
    damaged = model_path(package, tmp_path)
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"GGUF, cut short")
    path = pull("gemma3-270m", tmp_path, quiet=True)
    assert path == damaged == resolve_model("gemma3-270m", tmp_path)
    assert sha256_of(path) == package.sha256
    assert path.stat().st_size == gemma3_path.stat().st_size
    assert [p.name for p in path.parent.iterdir()] == [package.filename]  # no leftovers


def test_the_shared_cache_holds_the_verified_file(gemma3_path, smollm2_path):
    assert gemma3_path == model_path(KNOWN_MODELS["gemma3-270m"])
    assert smollm2_path == model_path(KNOWN_MODELS["smollm2"])


def test_describe_reads_family_and_format_from_the_gguf_header(gemma3_path, smollm2_path):
    assert describe("gemma3-270m", gemma3_path) == LocalModel(
        "gemma3-270m", gemma3_path, 253113024, "gemma3", "GGUF Q4_K_M"
    )
    assert describe("smollm2", smollm2_path) == LocalModel(
        "smollm2", smollm2_path, smollm2_path.stat().st_size, "llama", "GGUF Q4_1"
    )


def test_an_unreadable_file_is_listed_as_such(tmp_path):
    broken = tmp_path / "models" / "broken.gguf"
    broken.parent.mkdir()
    broken.write_bytes(b"not a gguf")
    assert local_models(tmp_path) == [
        LocalModel("broken", broken, 10, "unknown", "GGUF (unreadable)")
    ]


@pytest.mark.slow
def test_a_checkpoint_package_is_a_directory_pulled_whole_and_verified(tmp_path, minilm_path):
    package = KNOWN_MODELS["minilm"]
    target = model_path(package, tmp_path)
    with pytest.raises(ModelNotFoundError, match="run `edgeserve model pull minilm`"):
        resolve_model("minilm", tmp_path)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a pull cut short: weights missing
    path = pull("minilm", tmp_path, quiet=True)
    assert path == target == resolve_model("minilm", tmp_path)
    assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in minilm_path.iterdir())
    assert (path / "1_Pooling" / "config.json").is_file()
    assert sha256_of(path / "model.safetensors") == package.sha256
    assert (path / "config.json").read_bytes() == (minilm_path / "config.json").read_bytes()
    (path / "model.safetensors").write_bytes(b"damaged")
    assert pull("minilm", tmp_path, quiet=True) == path
    assert sha256_of(path / "model.safetensors") == package.sha256
    assert [m.name for m in local_models(tmp_path)] == ["minilm"]
