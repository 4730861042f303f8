"""Sub-commands of `edgeserve`: each module defines `register(app: typer.Typer)`.

Modules import their heavy dependencies (torch, servers) inside the command
functions, so `edgeserve --help` stays fast.
"""
