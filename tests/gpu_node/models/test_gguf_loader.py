"""Our GGUF reader against the gguf package's own, on a real file."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_node.errors import ModelNotFoundError
from gpu_node.models.gguf_loader import GGUFModel, read_summary


def test_fields_and_tensors_read_as_the_gguf_package_reads_them(smollm2_path):
    import gguf

    ours, theirs = GGUFModel(smollm2_path), gguf.GGUFReader(smollm2_path)
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):  # the header's own numbers, not metadata
            assert ours.field(key) == field.contents(), key
    assert ours.tensor_names == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        raw = ours.raw(t.name)
        assert raw.ggml_type == t.tensor_type.name
        assert raw.shape == tuple(reversed(t.shape.tolist()))
        assert raw.data.dtype == t.data.dtype and np.array_equal(raw.data, t.data), t.name


def test_the_summary_names_family_and_weight_type(smollm2_path):
    summary = read_summary(smollm2_path)
    assert (summary.architecture, summary.weight_type) == ("llama", "Q4_1")


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a gguf at all"])
def test_a_file_that_is_no_gguf_is_refused_by_name(tmp_path, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelNotFoundError, match=r"broken\.gguf is not a readable GGUF file"):
        GGUFModel(path)
