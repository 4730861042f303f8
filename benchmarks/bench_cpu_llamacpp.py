"""CPU against llama.cpp: SmolLM2's GGUF on this machine's CPU, our engine and `edgeserve up`
beside llama-cpp-python and its OpenAI server, the same token ids, `--threads` each.

    .venv/bin/python benchmarks/bench_cpu_llamacpp.py [--rounds 3] [--llama-venv DIR]
    .venv/bin/python benchmarks/bench_cpu_llamacpp.py --build-llama [SDIST]   # build it first
    .venv/bin/python benchmarks/bench_cpu_llamacpp.py --smoke     # tiny counts, seconds (CI)

Rows, each the median of `--rounds` rounds, ours and llama.cpp alternated (who goes first
swaps every round):

  decode, batch 1, engine alone    tokens/s after the first token of a short chat prompt
  prefill, 500-token prompt        prompt tokens / time to the first token
  8 requests x 64 tokens           ours all at once, llama.cpp one after another: tokens/s
  one streamed chat over HTTP      `edgeserve up`'s /v1/chat/completions against
                                   `python -m llama_cpp.server`: tokens/s after the first
                                   token and the time to it
  8 and 16 concurrent streams      through `up`: tokens/s in total and the median time to
                                   the first token, beside llama.cpp's one stream

llama-cpp-python is not a dependency of ours: it runs from its own virtual environment
(`--llama-venv`), built from source with native instructions (`GGML_NATIVE=ON`) by
`--build-llama` (from the sdist named, else llama-cpp-python==LLAMA_VERSION from the
package index). Without it the llama.cpp columns are skipped, saying how to build it.
Our engine runs in this process with torch's threads set to `--threads`; `up` runs with
its own thread layout (`edgeserve/threads.py`), as a user starts it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA_VERSION = "0.3.36"
CHAT = "Write a long story about a lighthouse keeper and a storm at sea. Use many details."
PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors and say why.",
    "Write a haiku about the sea.",
    "Explain what a Python list comprehension is.",
    "What is 17 times 3? Show your steps.",
    "Give me five synonyms for 'happy'.",
    "What does HTTP stand for, and what is it for?",
    "Translate 'good morning, how are you' into Spanish and French.",
)
LONG_TEXT = (
    "The history of computing is the story of people who wanted to count, to remember and "
    "to reason faster than their hands allowed. Tally sticks and the abacus came first; "
    "then gears, punched cards, relays, valves, transistors and chips, each smaller, "
    "cheaper and faster than the one before it. "
)
API_KEY = "es-bench-cpu-llamacpp"
REQUEST_NUMBERS = itertools.count()


def default_llama_venv() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("edgeserve")) / "bench" / "llama-cpp-venv"


def build_llama(venv: Path, source: str | None) -> None:
    """llama-cpp-python (with its server) into `venv`, compiled for this CPU."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    what = f"{source}[server]" if source else f"llama-cpp-python[server]=={LLAMA_VERSION}"
    env = os.environ | {"CMAKE_ARGS": "-DGGML_NATIVE=ON", "FORCE_CMAKE": "1"}
    print(f"building {what} into {venv} (minutes) ...", flush=True)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-cache-dir", what],
        check=True, env=env,
    )  # fmt: skip


def llama_python(venv: Path) -> Path | None:
    """The venv's python where llama_cpp and its server import, else None."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    probe = subprocess.run(
        [str(python), "-c", "import llama_cpp, llama_cpp.server.app; print(llama_cpp.__version__)"],
        capture_output=True, text=True,
    )  # fmt: skip
    return python if probe.returncode == 0 else None


# -- engine alone: ours in this process, llama.cpp in a worker process --------------------

# The worker's script: one JSON command a line on stdin, one JSON answer a line on stdout.
LLAMA_WORKER = textwrap.dedent("""
    import json, sys, time
    from llama_cpp import Llama

    path, threads = sys.argv[1], int(sys.argv[2])
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048,
                n_batch=512, verbose=False)

    def run(ids, n):
        # greedy; generate() never stops at EOS itself: exactly n tokens. reset() first, so
        # that no prompt reuses the KV of the one before.
        llm.reset()
        start = time.perf_counter()
        tokens = llm.generate(ids, top_k=1, temp=0.0, reset=True)
        next(tokens)
        first = time.perf_counter()
        for _ in range(n - 1):
            next(tokens)
        return first - start, time.perf_counter() - first

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "decode":
            _, seconds = run(cmd["ids"], cmd["n"] + 1)
            answer = cmd["n"] / seconds
        elif cmd["op"] == "prefill":
            seconds, _ = run(cmd["ids"], 1)
            answer = len(cmd["ids"]) / seconds
        else:  # one request after another
            start = time.perf_counter()
            for ids in cmd["prompts"]:
                run(ids, cmd["n"])
            answer = len(cmd["prompts"]) * cmd["n"] / (time.perf_counter() - start)
        print(json.dumps(answer), flush=True)
""")


class LlamaWorker:
    def __init__(self, python: Path, gguf: Path, threads: int) -> None:
        self.proc = subprocess.Popen(
            [str(python), "-c", LLAMA_WORKER, str(gguf), str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def __call__(self, **command: Any) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the llama.cpp worker died")
        return float(json.loads(line))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


class Ours:
    """Our engine, stepped in this process: the same measurements as the worker's."""

    def __init__(self, gguf: Path) -> None:
        from gpu_node.config import EngineConfig
        from gpu_node.engine.llm_engine import LLMEngine

        self.engine = LLMEngine.from_config(EngineConfig(model=str(gguf)))
        self._count = 0

    def _add(self, ids: list[int], n: int) -> None:
        from scheduler.sequence import SamplingParams

        self._count += 1
        params = SamplingParams(max_tokens=n, ignore_eos=True)  # greedy
        self.engine.add_request(f"r{self._count}", ids, params)

    def __call__(self, op: str, **command: Any) -> float:
        engine = self.engine
        if op == "decode":
            self._add(command["ids"], command["n"] + 1)
            engine.step()  # the prompt and the first token
            start = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            return command["n"] / (time.perf_counter() - start)
        if op == "prefill":
            self._add(command["ids"], 1)
            start = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            return len(command["ids"]) / (time.perf_counter() - start)
        start = time.perf_counter()  # every request at once
        for ids in command["prompts"]:
            self._add(ids, command["n"])
        while engine.has_unfinished():
            engine.step()
        return len(command["prompts"]) * command["n"] / (time.perf_counter() - start)


# -- through HTTP: `edgeserve up` and llama_cpp.server ------------------------------------


@dataclass(frozen=True)
class Stream:
    """One streamed chat as the client saw it."""

    ttft_s: float
    num_tokens: int  # content chunks: one token each from either server
    after_first_s: float  # from the first content chunk to the last


async def stream_chat(port: int, model: str, max_tokens: int) -> Stream:
    """POST a streamed chat completion and time its content chunks (a raw HTTP/1.1 client:
    the load generator shares the cores, so it does as little as it can)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    # A prompt of its own: llama_cpp.server would reuse the KV of the previous one.
    content = f"({next(REQUEST_NUMBERS)}) {CHAT}"
    body = json.dumps({
        "model": model, "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True,
    }).encode()  # fmt: skip
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        f"authorization: Bearer {API_KEY}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    start = time.perf_counter()
    writer.write(head + body)
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"port {port}: {status!r} {await reader.read(2000)!r}")
    times: list[float] = []
    buffer = b""
    while data := await reader.read(65536):
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if not line.startswith(b"data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if (choices[0].get("delta") or {}).get("content"):
                times.append(time.perf_counter())
    writer.close()
    if not times:
        raise RuntimeError(f"port {port}: a stream without content")
    return Stream(times[0] - start, len(times), times[-1] - times[0])


def streams(port: int, model: str, count: int, max_tokens: int) -> dict[str, float]:
    """`count` concurrent streams: tokens/s in total, per stream after the first, TTFT."""

    async def run() -> tuple[float, list[Stream]]:
        start = time.perf_counter()
        done = await asyncio.gather(*(stream_chat(port, model, max_tokens) for _ in range(count)))
        return time.perf_counter() - start, list(done)

    seconds, done = asyncio.run(run())
    return {
        "total_tok_s": sum(s.num_tokens for s in done) / seconds,
        "tok_s_after_first": statistics.median(
            (s.num_tokens - 1) / s.after_first_s for s in done if s.num_tokens > 1
        ) if any(s.num_tokens > 1 for s in done) else 0.0,
        "ttft_ms": statistics.median(s.ttft_s for s in done) * 1e3,
        "tokens": statistics.mean(s.num_tokens for s in done),
    }  # fmt: skip


class Server:
    """A server process of its own session (a signal reaches its children too)."""

    def __init__(self, command: list[str], env: dict[str, str], name: str) -> None:
        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (as long as the server)
        self.proc = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True,
            start_new_session=True, cwd=ROOT,
        )  # fmt: skip

    def wait_for(self, is_ready: Callable[[str], bool], timeout_s: float) -> list[str]:
        """The lines of stdout up to the one `is_ready` accepts."""
        assert self.proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + timeout_s
        for line in self.proc.stdout:
            lines.append(line)
            if is_ready(line):
                return lines
            if time.monotonic() > deadline:
                break
        self.fail("did not start")
        raise AssertionError

    def fail(self, why: str) -> None:
        self.log.seek(0)
        self.stop()
        raise RuntimeError(f"{self.name} {why}:\n{self.log.read()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_up(gguf: Path, home: Path) -> tuple[Server, int]:
    env = os.environ | {"EDGESERVE_HOME": str(home), "EDGESERVE_API_KEY": API_KEY,
                        "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}  # fmt: skip
    server = Server(
        [sys.executable, "-m", "edgeserve", "up", "--port", "0", "--model", str(gguf),
         "--embedding-model", "none"],
        env, "edgeserve up",
    )  # fmt: skip
    lines = server.wait_for(lambda line: line.startswith("ready in"), 300)
    url = next(line for line in lines if line.startswith("edgeserve is starting at"))
    return server, int(url.split()[4].rsplit(":", 1)[1])


def start_llama_server(python: Path, gguf: Path, threads: int, model: str) -> tuple[Server, int]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    server = Server(
        [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", model,
         "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048",
         "--host", "127.0.0.1", "--port", str(port), "--api_key", API_KEY],
        dict(os.environ), "llama_cpp.server",
    )  # fmt: skip
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            server.fail("exited")
        try:
            headers = {"authorization": f"Bearer {API_KEY}"}
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", headers=headers).status_code == 200:
                return server, port
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    server.fail("did not start")
    raise AssertionError


# -- the run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    rounds: int
    decode_tokens: int
    prefill_tokens: int
    num_requests: int
    request_tokens: int
    chat_tokens: int
    stream_tokens: int
    concurrency: tuple[int, ...]


FULL = Sizes(3, 128, 500, 8, 64, 128, 64, (8, 16))
SMOKE = Sizes(1, 4, 32, 2, 4, 4, 4, (2,))


def alternated(
    rounds: int, ours: Callable[[], Any], peer: Callable[[], Any] | None
) -> tuple[list[Any], list[Any]]:
    """Each side `rounds` times, alternated; who goes first swaps every round."""
    mine: list[Any] = []
    theirs: list[Any] = []
    for r in range(rounds):
        order = [(ours, mine), (peer, theirs)]
        for fn, into in order if r % 2 == 0 else order[::-1]:
            if fn is not None:
                into.append(fn())
    return mine, theirs


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def row(
    name: str, ours: float | None, peer: float | None, unit: str, lower_is_better: bool = False
) -> str:
    def show(v: float | None) -> str:
        return "—" if v is None else f"{v:.1f} {unit}"

    if ours is None or peer is None:
        ratio = "—"
    else:
        ratio = f"{(peer / ours if lower_is_better else ours / peer):.2f}x"
    return f"| {name} | {show(ours)} | {show(peer)} | {ratio} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=FULL.rounds)
    parser.add_argument("--threads", type=int, default=2, help="each side's compute threads")
    parser.add_argument("--llama-venv", type=Path, default=None,
                        help="where llama-cpp-python is installed (default: the user's cache)")  # fmt: skip
    parser.add_argument("--build-llama", nargs="?", const="", default=None, metavar="SDIST",
                        help="build llama-cpp-python into --llama-venv first (from SDIST, else "
                        f"llama-cpp-python=={LLAMA_VERSION} from the package index)")  # fmt: skip
    parser.add_argument("--skip-http", action="store_true", help="the engine rows only")
    parser.add_argument("--smoke", action="store_true", help="tiny counts, seconds (CI)")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    rounds = sizes.rounds if args.smoke else args.rounds
    venv = args.llama_venv or default_llama_venv()
    if args.build_llama is not None:
        build_llama(venv, args.build_llama or None)
    python = llama_python(venv)
    if python is None:
        print(f"llama.cpp skipped: llama-cpp-python is not installed in {venv}; build it with "
              f"`{Path(sys.argv[0]).name} --build-llama [SDIST] --llama-venv {venv}` (a C++ "
              "compiler and CMake, minutes)", flush=True)  # fmt: skip

    import torch

    from gpu_node.models.model_store import resolve_model

    torch.set_num_threads(args.threads)
    gguf = resolve_model("smollm2")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {args.threads} threads each, median of {rounds} "
          f"alternated rounds, load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    rows = ["| | edgeserve | llama.cpp | ratio |", "|---|---:|---:|---:|"]
    rows += engine_rows(python, gguf, args.threads, sizes, rounds)
    if not args.skip_http:
        rows += http_rows(python, gguf, args.threads, sizes, rounds)
    print("\n".join(rows))


def engine_rows(
    python: Path | None, gguf: Path, threads: int, sizes: Sizes, rounds: int
) -> list[str]:
    """The engine alone: ours in this process, llama.cpp in its worker, alternated."""
    ours = Ours(gguf)
    tokenizer = ours.engine.tokenizer
    chat_ids = tokenizer.encode_chat([{"role": "user", "content": CHAT}])
    long_ids = tokenizer.encode(LONG_TEXT * (sizes.prefill_tokens // 40 + 1))[
        : sizes.prefill_tokens
    ]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}])
               for p in PROMPTS[: sizes.num_requests]]  # fmt: skip
    peer = LlamaWorker(python, gguf, threads) if python is not None else None
    commands = {
        f"batch-1 decode, engine alone ({sizes.decode_tokens} tokens)":
            {"op": "decode", "ids": chat_ids, "n": sizes.decode_tokens},
        f"prefill, {len(long_ids)}-token prompt":
            {"op": "prefill", "ids": long_ids, "n": 1},
        f"{sizes.num_requests} requests × {sizes.request_tokens} tokens (llama.cpp one after another)":
            {"op": "sequential", "prompts": prompts, "n": sizes.request_tokens},
    }  # fmt: skip
    rows = []
    try:
        for command in commands.values():  # warm-up: both sides' first calls are slower
            ours(**{**command, "n": 2})
            if peer is not None:
                peer(**{**command, "n": 2})
        for name, command in commands.items():
            mine, theirs = alternated(
                rounds, lambda c=command: ours(**c),
                None if peer is None else lambda c=command: peer(**c),
            )  # fmt: skip
            rows.append(row(name, median(mine), median(theirs), "tok/s"))
            print(rows[-1], flush=True)
    finally:
        if peer is not None:
            peer.close()
    return rows


def http_rows(
    python: Path | None, gguf: Path, threads: int, sizes: Sizes, rounds: int
) -> list[str]:
    home = Path(tempfile.mkdtemp(prefix="bench-cpu-llamacpp-"))
    model = str(gguf)  # `up` serves a GGUF path under that name
    up = llama = None
    rows: list[str] = []
    try:
        up, up_port = start_up(gguf, home)
        if python is not None:
            llama, llama_port = start_llama_server(python, gguf, threads, model)
        streams(up_port, model, 1, 4)  # warm-up
        if llama is not None:
            streams(llama_port, model, 1, 4)
        mine, theirs = alternated(
            rounds, lambda: streams(up_port, model, 1, sizes.chat_tokens),
            None if llama is None else lambda: streams(llama_port, model, 1, sizes.chat_tokens),
        )  # fmt: skip
        one_up = median([m["tok_s_after_first"] for m in mine])
        one_peer = median([t["tok_s_after_first"] for t in theirs])
        rows.append(row("one streamed chat over HTTP, tokens/s after the first (`up` / "
                        "`llama_cpp.server`)", one_up, one_peer, "tok/s"))  # fmt: skip
        rows.append(row("same, time to first token", median([m["ttft_ms"] for m in mine]),
                        median([t["ttft_ms"] for t in theirs]), "ms", lower_is_better=True))  # fmt: skip
        for count in sizes.concurrency:
            runs = [streams(up_port, model, count, sizes.stream_tokens) for _ in range(rounds)]
            total = median([r["total_tok_s"] for r in runs])
            ttft = median([r["ttft_ms"] for r in runs])
            rows.append(row(f"{count} concurrent streams through `up`, tokens/s in total (beside "
                            "llama.cpp's one stream)", total, one_peer, "tok/s"))  # fmt: skip
            rows.append(row("same, median time to first token (beside llama.cpp's one stream)",
                            ttft, median([t["ttft_ms"] for t in theirs]), "ms",
                            lower_is_better=True))  # fmt: skip
        for line in rows:
            print(line, flush=True)
    finally:
        for server in (up, llama):
            if server is not None:
                server.stop()
        shutil.rmtree(home, ignore_errors=True)
    return rows


if __name__ == "__main__":
    main()
