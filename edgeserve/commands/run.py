"""`edgeserve run MODEL [PROMPT]`: an answer streamed in the terminal, or a chat without PROMPT.

Through the `edgeserve up` of this EDGESERVE_HOME when one is running and serves MODEL
(found by `edgeserve/up_file.py`, as `ollama run` finds its server), else on an engine
loaded in this process."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import typer

from edgeserve.engine_options import (
    ACTIVATIONS,
    DEVICE,
    KV_DTYPE,
    resolve_activations,
    resolve_device,
    resolve_kv_dtype,
)

if TYPE_CHECKING:
    from edgeserve.up_file import UpFile

# One turn of a chat: the messages so far in, the answer's text pieces out.
Generate = Callable[[list[dict[str, str]]], Iterator[str]]


class RunError(Exception):
    """A turn that cannot be answered: the reason, for one line on stderr."""


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run(
        model: str = typer.Argument(..., help="model name (smollm2) or a .gguf path"),
        prompt: str | None = typer.Argument(
            None, help="the user message (none: a chat, one message a line, until EOF)"
        ),
        max_tokens: int = typer.Option(256, "--max-tokens", help="most tokens to generate"),
        temperature: float | None = typer.Option(
            None, "--temperature", help="0 = greedy (default: the model's)"
        ),
        top_p: float | None = typer.Option(None, "--top-p", help="default: the model's"),
        top_k: int | None = typer.Option(None, "--top-k", help="default: the model's"),
        seed: int | None = typer.Option(None, "--seed"),
        kv_dtype: str = KV_DTYPE,
        weights: str = typer.Option("int4", "--weights", help="int4 (default), bf16 or fp32"),
        activations: str = ACTIVATIONS,
        system: str | None = typer.Option(None, "--system", help="a system message"),
        raw: bool = typer.Option(
            False, "--raw", help="send the prompt as is, without the chat template"
        ),
        device: str = DEVICE,
        local: bool = typer.Option(
            False, "--local", help="load the model here even when an `edgeserve up` serves it"
        ),
    ) -> None:
        """Generate a reply to PROMPT, streamed token by token; without PROMPT, chat."""
        from rich.console import Console

        from gateway.catalog import ModelCatalog, SamplingDefaults
        from scheduler.sequence import SamplingParams

        err = Console(stderr=True)
        if raw and prompt is None:
            raise typer.BadParameter("--raw needs a PROMPT", param_hint="--raw")
        entry = ModelCatalog().resolve(model)
        defaults = entry.sampling if entry is not None else SamplingDefaults()
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.temperature if temperature is None else temperature,
            top_p=defaults.top_p if top_p is None else top_p,
            top_k=defaults.top_k if top_k is None else top_k,
            seed=seed,
        )
        if problems := params.problems():
            err.print(f"[red]error:[/red] {'; '.join(problems)}")
            raise typer.Exit(2)
        server = None if local else _running_up(model)
        given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
        if server is not None:
            generate = _through_up(server, model, max_tokens, given, raw)
        else:
            unnamed = [k for k in ("temperature", "top_p", "top_k") if given[k] is None]
            generate = _in_process(
                model, params, unnamed, kv_dtype, weights, activations, device, raw, err
            )  # fmt: skip
        history = [{"role": "system", "content": system}] if system else []
        turns = [prompt] if prompt is not None else _lines(sys.stdin)
        for text in turns:
            history.append({"role": "user", "content": text})
            answer = []
            try:
                for piece in generate(history):
                    answer.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            except RunError as exc:
                err.print(f"[red]error:[/red] {exc}")
                raise typer.Exit(2) from None
            sys.stdout.write("\n")
            sys.stdout.flush()
            history.append({"role": "assistant", "content": "".join(answer)})


def _lines(stdin: Any) -> Iterator[str]:
    """The chat's user messages: one a line until EOF (a prompt shown at a terminal)."""
    is_terminal = stdin.isatty()
    while True:
        if is_terminal:
            sys.stderr.write(">>> ")
            sys.stderr.flush()
        line = stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def _running_up(model: str) -> UpFile | None:
    """The `up` recorded in EDGESERVE_HOME if it runs, answers /healthz and serves `model`."""
    import httpx

    from edgeserve.up_file import read_up_file
    from gateway.catalog import ModelCatalog

    found = read_up_file()
    if found is None or not found.is_alive:
        return None
    catalog = ModelCatalog()
    entry = catalog.resolve(model)
    if model != found.model and (entry is None or entry != catalog.resolve(found.model)):
        return None
    try:
        is_ready = httpx.get(f"{found.url}/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return None
    return found if is_ready else None


def _through_up(
    server: UpFile, model: str, max_tokens: int, given: dict[str, Any], raw: bool
) -> Generate:
    """Turns streamed by the running `up`'s Workers AI API (its usage billed as any other);
    sampling values left out are the model's defaults there."""
    import json

    import httpx

    url = f"{server.url}/client/v4/accounts/{server.account_id}/ai/run/{model}"
    headers = {"authorization": f"Bearer {server.api_key}"}
    options = {"max_tokens": max_tokens, "stream": True}
    options |= {name: value for name, value in given.items() if value is not None}

    def generate(messages: list[dict[str, str]]) -> Iterator[str]:
        body = options | (
            {"prompt": messages[-1]["content"], "raw": True} if raw else {"messages": messages}
        )
        try:
            with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as response:
                if response.status_code != 200:
                    response.read()
                    raise RunError(
                        f"{server.url} answered {response.status_code}: {_why(response)}"
                    )
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    if "errors" in event:
                        raise RunError("; ".join(e["message"] for e in event["errors"]))
                    yield event["response"]
        except httpx.HTTPError as exc:
            raise RunError(f"{server.url}: {exc}") from None

    return generate


def _why(response: Any) -> str:
    try:
        return "; ".join(e["message"] for e in response.json()["errors"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def _in_process(
    model: str, params: Any, unnamed: list[str], kv_dtype: str, weights: str,
    activations: str, device: str, raw: bool, err: Any,
) -> Generate:  # fmt: skip
    """Turns generated by an engine loaded here, a progress bar while it loads; the sampling
    values in `unnamed` (the user named none) become the model's own where its files state
    them."""
    from dataclasses import replace

    from rich.progress import Progress

    from gpu_node.config import EngineConfig
    from gpu_node.engine.llm_engine import LLMEngine
    from gpu_node.errors import EngineError

    try:
        engine_device = resolve_device(device)
        activations = resolve_activations(activations, weights, engine_device)
        config = EngineConfig(
            model=model, kv_dtype=resolve_kv_dtype(kv_dtype, engine_device, activations),
            weights=weights, activations=activations, device=engine_device, max_num_seqs=1,
        )  # fmt: skip
        with Progress(console=err, transient=True) as bar:
            task = bar.add_task(f"loading {model} on {engine_device}", total=None)
            engine = LLMEngine.from_config(
                config, lambda done, total: bar.update(task, completed=done, total=total)
            )
    except (EngineError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    tok = engine.tokenizer
    stated = {k: tok.generation_defaults[k] for k in unnamed if k in tok.generation_defaults}
    if "top_k" in stated:
        stated["top_k"] = int(stated["top_k"])
    params = replace(params, **stated)
    num_turns = 0

    def generate(messages: list[dict[str, str]]) -> Iterator[str]:
        nonlocal num_turns
        num_turns += 1
        ids = tok.encode(messages[-1]["content"]) if raw else tok.encode_chat(messages)
        try:
            engine.add_request(f"cli-{num_turns}", ids, params)
        except (EngineError, ValueError) as exc:
            raise RunError(str(exc)) from None
        while engine.has_unfinished():
            for out in engine.step():
                yield out.text

    return generate
