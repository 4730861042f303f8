"""The `edgeserve` command. Each module in `edgeserve.commands` adds its own sub-commands."""

from __future__ import annotations

import importlib
import pkgutil

import typer

from edgeserve import commands


def build_app() -> typer.Typer:
    app = typer.Typer(
        no_args_is_help=True, add_completion=False, help="edgeserve: serverless LLM inference"
    )
    for module_info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{module_info.name}")
        module.register(app)
    return app


def main() -> None:
    build_app()()
