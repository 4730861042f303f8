"""Engine options the commands share (`up`, `node`, `run`), and what `--device` means."""

from __future__ import annotations

import typer

PREFIX_CACHE_BLOCKS = typer.Option(
    0, min=0, help="prompt pages kept for reuse by later requests of an account (0: off)"
)
KV_DTYPE = typer.Option(
    "auto",
    help="auto (fp32 on the CPU, on a GPU bf16, or fp16 with --activations fp16) | fp32 | bf16 "
    "| fp16 | fp8",
)
ACTIVATIONS = typer.Option(
    "auto",
    help="auto (bf16 for int4 weights on a GPU and for bf16 weights, else fp32) | bf16 | fp16 "
    "(int4 weights on a GPU: faster kernels, fp16's narrower range)",
)
DEVICE = typer.Option(
    "auto", help="auto (a CUDA GPU where there is one, else the CPU) | cpu | cuda"
)
CUDA_GRAPH_BATCH = typer.Option(
    None, min=0,
    help="on a GPU, decode batches up to this size replay CUDA graphs (0: off; default 32)",
)  # fmt: skip
CUDA_GRAPH_TOKENS = typer.Option(
    None, min=0,
    help="on a GPU, other steps (prefill, mixed) of up to this many tokens replay CUDA graphs "
    "piecewise, attention eager between the pieces (0: off; default 2048, at most the step "
    "budget)",
)  # fmt: skip


def resolve_device(name: str) -> str:
    """--device as an engine device: auto is a CUDA GPU where one is visible, else the CPU.

    A node drives one GPU, the first visible one: CUDA_VISIBLE_DEVICES chooses it (the
    engine's kernels launch on the current device, so `cuda:N` is not offered)."""
    if name not in ("auto", "cpu", "cuda"):
        raise typer.BadParameter(
            "must be auto, cpu or cuda (CUDA_VISIBLE_DEVICES chooses the GPU)",
            param_hint="--device",
        )
    if name == "cpu":
        return name
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if name == "auto":
        return "cpu"
    raise typer.BadParameter("cuda: no CUDA GPU is visible here", param_hint="--device")


def resolve_activations(name: str, weights: str | None, device: str) -> str:
    """--activations checked against the weights (None: the engine's default) and the
    device (resolved) before anything starts, so a node that could not serve them fails at
    once with the reason rather than in its background load."""
    from gpu_node.config import ACTIVATIONS, EngineConfig
    from gpu_node.models.weights import activation_dtype

    if name not in ACTIVATIONS:
        raise typer.BadParameter(
            f"must be one of {', '.join(ACTIVATIONS)}", param_hint="--activations"
        )
    try:
        activation_dtype(weights or EngineConfig.weights, device, name)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--activations") from None
    return name


def resolve_kv_dtype(name: str, device: str, activations: str = "auto") -> str:
    """--kv-dtype for an engine on `device` (resolved): auto is fp32 on the CPU (the exact
    reference) and on a GPU the activations' dtype, bf16 or fp16 (half fp32's memory)."""
    from gpu_node.config import KV_DTYPES

    if name == "auto":
        if device == "cpu":
            return "fp32"
        return "fp16" if activations == "fp16" else "bf16"
    if name not in KV_DTYPES:
        raise typer.BadParameter(f"must be auto, {', '.join(KV_DTYPES)}", param_hint="--kv-dtype")
    return name
