"""infra/Dockerfile: it passes hadolint, copies every package the project installs, and its
gateway image carries no engine: it installs the service's own dependencies only, and a
gateway process with every engine module blocked serves."""

from __future__ import annotations

import subprocess
import sys
import time
import tomllib
import uuid

import httpx

from tests.conftest import INTERNAL_TOKEN, REDIS_URL, free_port
from tests.infra.files import BIN, DOCKERFILE, ROOT, run_tool

# What only the engine imports: a gateway that needed any of them would fail without it.
ENGINE_MODULES = ("torch", "triton", "numpy", "gguf", "tokenizers", "jinja2", "transformers")


def test_the_dockerfile_passes_hadolint() -> None:
    checked = run_tool(str(BIN / "hadolint"), str(DOCKERFILE))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_gateway_image_installs_no_engine() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].split("[")[0].split(";")[0].strip()
             for dep in project["dependencies"]}  # fmt: skip
    assert names.isdisjoint(ENGINE_MODULES)
    dockerfile = DOCKERFILE.read_text()
    gateway_stage = dockerfile.split("FROM source AS gateway", 1)[1].split("FROM ", 1)[0]
    assert "RUN pip install --no-cache-dir .\n" in gateway_stage
    assert "torch" not in gateway_stage and "[engine" not in gateway_stage


def test_a_gateway_process_serves_with_every_engine_module_blocked() -> None:
    port = free_port()
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in ENGINE_MODULES)
    program = f"import sys; {blocked}; from edgeserve.cli import main; main()"
    gateway = subprocess.Popen(
        [sys.executable, "-c", program, "gateway", "--port", str(port), "--redis-url",
         REDIS_URL, "--prefix", f"test:torchless-{uuid.uuid4().hex[:8]}:",
         "--internal-token", INTERNAL_TOKEN],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert gateway.poll() is None, gateway.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the gateway never answered"
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        assert health.status_code == 200
        described = httpx.get(f"http://127.0.0.1:{port}/openapi.json", timeout=5)
        assert described.status_code == 200
        # No node serves this Redis prefix: a request is refused in its dialect, not a 500.
        asked = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "@cf/huggingface/smollm2-135m-instruct", "messages": []},
            timeout=5,
        )
        assert asked.status_code == 401  # no key: refused before anything else
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)


def test_the_image_copies_every_package_the_project_installs() -> None:
    """A package left out of the image installs nothing and fails at import."""
    import tomllib

    dockerfile = DOCKERFILE.read_text()
    copied = {line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ")}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {name.rstrip("*") for name in packages} <= copied
