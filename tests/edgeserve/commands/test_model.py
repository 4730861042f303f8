"""`edgeserve model list`: what is on disk, its size, family and format; `model pull`."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from edgeserve.cli import build_app
from tests.gpu_node.models.hf_tiny import write_checkpoint


def edgeserve(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "edgeserve", *args], capture_output=True, text=True, timeout=timeout
    )


def test_model_list_shows_size_family_and_format(tmp_path, monkeypatch, gemma3_path):
    models = tmp_path / "models"
    gemma3 = models / "gemma3-270m" / gemma3_path.name
    gemma3.parent.mkdir(parents=True)
    gemma3.symlink_to(gemma3_path)
    write_checkpoint("qwen3", models / "tiny-qwen3")
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path))

    result = CliRunner().invoke(build_app(), ["model", "list"])

    assert result.exit_code == 0, result.output
    header, *rows = [line.split() for line in result.output.splitlines()]
    assert header == ["NAME", "SIZE", "FAMILY", "FORMAT", "PATH"]
    by_name = {row[0]: row for row in rows}
    assert by_name["gemma3-270m"] == [
        "gemma3-270m", "241.4", "MiB", "gemma3", "GGUF", "Q4_K_M", str(gemma3),
    ]  # fmt: skip
    _, _, unit, *rest = by_name["tiny-qwen3"]
    assert (unit, rest) == ("MiB", ["qwen3", "safetensors", "F32", str(models / "tiny-qwen3")])
    assert by_name["smollm2"] == ["smollm2", "-", "-", "not", "pulled", "edgeserve", "model",
                                  "pull", "smollm2"]  # fmt: skip
    assert by_name["moe-small"] == ["moe-small", "-", "moe", "built-in", "(seeded", "dummy",
                                    "weights)"]  # fmt: skip
    # what is on disk first, then what could be pulled, then what is built in
    assert [row[0] for row in rows][:2] == ["gemma3-270m", "tiny-qwen3"]
    assert rows[-1][0] == "moe-small"


def test_model_pull_is_idempotent(smollm2_path):
    before = smollm2_path.stat().st_mtime_ns
    result = edgeserve("model", "pull", "smollm2")
    assert result.returncode == 0 and result.stdout.strip() == f"smollm2: {smollm2_path}"
    assert smollm2_path.stat().st_mtime_ns == before
    result = edgeserve("model", "pull", "llama-9000")
    assert result.returncode == 1 and "unknown model 'llama-9000'" in result.stderr
