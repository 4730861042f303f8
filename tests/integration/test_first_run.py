"""A newcomer's first run, as processes on loopback: `edgeserve up` says ready and logs no
line per request, the README's first request answers as printed, `edgeserve run` (a prompt,
then a chat on stdin) goes through the running `up`, the billing report reads the ledger
that `up` wrote, and `up` keeps every file in EDGESERVE_HOME."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpu_node.kernels import cpu as cpu_kernels
from tests.conftest import free_port

README = Path(__file__).resolve().parents[2] / "README.md"
EDGESERVE = [sys.executable, "-c", "from edgeserve.cli import main; main()"]
ACCESS_LINE = '"message": "request finished"'


class Up:
    """`edgeserve up` as a child process, its console (stdout and stderr) read as it runs."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [*EDGESERVE, "up", "--port", str(self.port), "--max-model-len", "1024",
             "--kv-memory-mb", "32", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready := [line for line in self.lines if line.startswith("ready")]:
                return ready[0]
            assert self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.05)
        raise AssertionError(f"no ready line in {timeout_s} s:\n{''.join(self.lines)}")

    def banner(self, field: str) -> str:
        return next(line for line in self.lines if line.startswith(f"  {field}:")).split()[-1]

    def stop(self) -> str:
        """SIGTERM, as Ctrl-C would; the console. It must exit 0 (`returncode`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        return "".join(self.lines)


def _env(home: Path, outside: Path) -> dict[str, str]:
    """EDGESERVE_HOME in `home` (the pulled models linked in), every per-user directory
    (HOME, XDG_*) in `outside`, where nothing must appear."""
    from gpu_node.models.model_store import edgeserve_home

    home.mkdir()
    (home / "models").symlink_to(edgeserve_home() / "models")
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "EDGESERVE_API_KEY",
                                                               "EDGESERVE_LOG_LEVEL")}  # fmt: skip
    return env | {
        "EDGESERVE_HOME": str(home), "HOME": str(outside),
        "XDG_DATA_HOME": str(outside / "data"), "XDG_CACHE_HOME": str(outside / "cache"),
        "XDG_CONFIG_HOME": str(outside / "config"), "XDG_STATE_HOME": str(outside / "state"),
        "PYTHONUNBUFFERED": "1", "NO_COLOR": "1",
    }  # fmt: skip


def _readme_first_request() -> tuple[str, str]:
    """The README's first request as printed: its URL and its body."""
    text = README.read_text()
    command = re.search(r"^curl (http://127\.0\.0\.1:8080\S+) \\\n(.*?)$", text, re.M)
    assert command is not None, "the README has no first request"
    words = shlex.split(command.group(2))
    return command.group(1), words[words.index("-d") + 1]


def _edgeserve(env: dict[str, str], *args: str, stdin: str | None = None) -> Any:
    return subprocess.run(
        [*EDGESERVE, *args], env=env, input=stdin, capture_output=True, text=True, timeout=180
    )


def _billed(env: dict[str, str], *ledger: str, num_requests: int) -> dict[str, Any]:
    """The plain `billing report` (as JSON) once it counts `num_requests` requests: the
    ledger is written just after each answer."""
    deadline = time.monotonic() + 20
    while True:
        result = _edgeserve(env, "billing", "report", "--format", "json", *ledger)
        report = json.loads(result.stdout) if result.returncode == 0 else None
        if report is not None and report["total"]["requests"] == num_requests:
            return report
        assert time.monotonic() < deadline, (result.stdout, result.stderr)
        time.sleep(0.2)


@pytest.mark.usefixtures("smollm2_path", "minilm_path")
def test_up_says_ready_answers_the_readme_and_run_and_keeps_to_its_home(tmp_path: Path) -> None:
    env = _env(tmp_path / "home", tmp_path / "outside")
    up = Up(env)
    try:
        ready = up.wait_ready()
        url = f"http://127.0.0.1:{up.port}"
        assert ready.strip().endswith(f"smollm2 (int4 weights) on cpu, KV cache fp32, at {url}")
        for _ in range(5):  # what a load balancer's health checks do all day
            assert httpx.get(f"{url}/healthz").status_code == 200

        readme_url, readme_body = _readme_first_request()
        readme_url = readme_url.replace("$ACCOUNT", up.banner("account id"))
        response = httpx.post(
            readme_url.replace("http://127.0.0.1:8080", url),
            content=readme_body,
            headers={"authorization": f"Bearer {up.banner('API key')}"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        assert "Paris" in response.json()["result"]["response"]
        # The OpenAI dialect, no temperature named: the model's default there too.
        chat_completion = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
            headers={"authorization": f"Bearer {up.banner('API key')}"},
            timeout=60,
        )  # fmt: skip
        assert "Paris" in chat_completion.json()["choices"][0]["message"]["content"]

        # `run` finds the up by EDGESERVE_HOME, and its requests are billed there.
        answer = _edgeserve(env, "run", "smollm2", "What is the capital of France?")
        assert answer.returncode == 0, answer.stderr
        assert "Paris" in answer.stdout
        assert "loading" not in answer.stderr  # no engine loaded in the run's own process
        report = _billed(env, num_requests=3)
        assert [(row["account_id"], row["requests"]) for row in report["rows"]] == [("local", 3)]

        chat = _edgeserve(
            env, "run", "smollm2", stdin="What is the capital of France?\nAnd of Germany?\n"
        )
        assert chat.returncode == 0, chat.stderr
        first, second = chat.stdout.splitlines()
        assert "Paris" in first and "Berlin" in second  # the second needs the first turn
        before = _billed(env, num_requests=5)["total"]

        # The embedding model is served beside the chat model, where the banner says.
        embeddings_url = up.banner("embeddings")
        assert embeddings_url == f"{url}/v1/embeddings"
        assert "  embeddings: minilm at " in "".join(up.lines)
        embedded = httpx.post(
            embeddings_url,
            json={"model": "minilm", "input": ["Paris", "Berlin"]},
            headers={"authorization": f"Bearer {up.banner('API key')}"},
            timeout=60,
        )
        assert embedded.status_code == 200, embedded.text
        assert [len(d["embedding"]) for d in embedded.json()["data"]] == [384, 384]
        after = _billed(env, num_requests=6)["total"]
        billed = (after["input_tokens"] - before["input_tokens"], after["output_tokens"])
        assert billed == (embedded.json()["usage"]["prompt_tokens"], before["output_tokens"])
        assert (tmp_path / "home" / "up.json").stat().st_mode & 0o777 == 0o600
    finally:
        console = up.stop()
    assert up.proc.returncode == 0, console
    assert ACCESS_LINE not in console
    # the CPU kernels are built in the home where a compiler is (none under `outside`)
    built = ["cpu-kernels"] if cpu_kernels.compiler() else []
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == [
        *built,
        "ledger.sqlite3",
        "models",
    ]
    assert [p for p in (tmp_path / "outside").rglob("*")] == []


@pytest.mark.usefixtures("smollm2_path")
def test_up_logs_access_lines_when_asked_and_report_reads_its_ledger(tmp_path: Path) -> None:
    env = _env(tmp_path / "home", tmp_path / "outside")
    ledger = tmp_path / "elsewhere" / "billing.sqlite3"
    up = Up(env | {"EDGESERVE_API_KEY": "es-first-run"}, "--access-log", "--ledger", str(ledger))
    try:
        up.wait_ready()
        assert up.banner("ledger") == str(ledger)
        response = httpx.post(
            f"http://127.0.0.1:{up.port}/client/v4/accounts/local/ai/run/smollm2",
            json={"prompt": "Hi", "max_tokens": 2},
            headers={"authorization": "Bearer es-first-run"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        report = _billed(env, "--ledger", str(ledger), num_requests=1)
        assert report["total"]["output_tokens"] == 2
        # The plain report reads EDGESERVE_HOME's ledger, which this up did not write.
        assert _edgeserve(env, "billing", "report").returncode == 2
    finally:
        console = up.stop()
    assert up.proc.returncode == 0, console
    access = [json.loads(line) for line in console.splitlines() if ACCESS_LINE in line]
    assert {(line["route"], line["status"]) for line in access} >= {
        ("/client/v4/accounts/{account_id}/ai/run/{model_name:path}", 200)
    }
