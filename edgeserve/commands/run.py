"""`edgeserve run MODEL PROMPT`: stream an answer in the terminal, no server."""

from __future__ import annotations

import sys

import typer

from edgeserve.engine_options import (
    ACTIVATIONS,
    DEVICE,
    KV_DTYPE,
    resolve_activations,
    resolve_device,
    resolve_kv_dtype,
)


def register(app: typer.Typer) -> None:
    @app.command("run")
    def run(
        model: str = typer.Argument(..., help="model name (smollm2) or a .gguf path"),
        prompt: str = typer.Argument(..., help="the user message"),
        max_tokens: int = typer.Option(256, "--max-tokens", help="most tokens to generate"),
        temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy"),
        top_p: float = typer.Option(1.0, "--top-p"),
        top_k: int = typer.Option(0, "--top-k"),
        seed: int | None = typer.Option(None, "--seed"),
        kv_dtype: str = KV_DTYPE,
        weights: str = typer.Option("int4", "--weights", help="int4 (default), bf16 or fp32"),
        activations: str = ACTIVATIONS,
        system: str | None = typer.Option(None, "--system", help="a system message"),
        raw: bool = typer.Option(
            False, "--raw", help="send the prompt as is, without the chat template"
        ),
        device: str = DEVICE,
    ) -> None:
        """Generate a reply to PROMPT, streamed token by token."""
        from rich.console import Console
        from rich.progress import Progress

        from gpu_node.config import EngineConfig
        from gpu_node.engine.llm_engine import LLMEngine
        from gpu_node.errors import EngineError
        from scheduler.sequence import SamplingParams

        err = Console(stderr=True)
        try:
            engine_device = resolve_device(device)
            activations = resolve_activations(activations, weights, engine_device)
            config = EngineConfig(
                model=model, kv_dtype=resolve_kv_dtype(kv_dtype, engine_device, activations),
                weights=weights, activations=activations, device=engine_device, max_num_seqs=1,
            )  # fmt: skip
            with Progress(console=err, transient=True) as bar:
                task = bar.add_task(f"loading {model}", total=None)
                engine = LLMEngine.from_config(
                    config, lambda done, total: bar.update(task, completed=done, total=total)
                )
            tok = engine.tokenizer
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
            ids = tok.encode(prompt) if raw else tok.encode_chat(messages)
            params = SamplingParams(
                max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
            )
            engine.add_request("cli", ids, params)
        except (EngineError, ValueError) as exc:
            err.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2) from exc
        while engine.has_unfinished():
            for out in engine.step():
                sys.stdout.write(out.text)
                sys.stdout.flush()
        sys.stdout.write("\n")
