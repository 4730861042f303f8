"""What a node process loads and how it reports, shared by `up`, `node` and `up`'s node
process (edgeserve/node_process.py): the engine's and the encoder's factories, and telemetry
from the environment."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import typer

# The gateway's server-span middleware logs one INFO line per request there: the access log.
ACCESS_LOGGER = "gateway.tracing"


def _telemetry(service_name: str, *, access_log: bool = False) -> Any:
    """Telemetry from the OTel environment (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_TRACES_SAMPLER_ARG,
    EDGESERVE_RECORD_CONTENT, EDGESERVE_LOG_LEVEL, ...); logs become JSON lines on stderr.

    The access log is off unless asked for: a line per health poll buries what matters."""
    from common.telemetry import (
        TelemetrySettings,
        TelemetrySettingsError,
        configure_logging,
        setup_telemetry,
    )

    try:
        settings = TelemetrySettings.from_env(service_name)
    except TelemetrySettingsError as exc:
        raise typer.BadParameter(str(exc)) from None
    configure_logging(settings)
    is_access_logged = access_log or settings.log_level == "DEBUG"
    root_level = logging.getLogger().level
    logging.getLogger(ACCESS_LOGGER).setLevel(
        min(logging.INFO, root_level) if is_access_logged else max(logging.WARNING, root_level)
    )
    return setup_telemetry(settings)


def _engine_factory(
    model: str,
    kv_dtype: str,
    weights: str | None,
    max_model_len: int | None,
    kv_memory_mb: int | None,
    prefix_cache_blocks: int = 0,
    device: str = "cpu",
    cuda_graph_batch: int | None = None,
    activations: str = "auto",
    cuda_graph_tokens: int | None = None,
    tensor_parallel: int = 1,
) -> Any:
    def load() -> Any:
        from gpu_node.config import EngineConfig
        from gpu_node.engine.async_engine import AsyncEngine

        options: dict[str, Any] = {
            "model": model, "kv_dtype": kv_dtype, "device": device, "activations": activations
        }  # fmt: skip
        if cuda_graph_batch is not None:
            options["cuda_graph_batch"] = cuda_graph_batch
        if cuda_graph_tokens is not None:
            options["cuda_graph_tokens"] = cuda_graph_tokens
        if weights is not None:
            options["weights"] = weights
        if max_model_len is not None:
            options["max_model_len"] = max_model_len
        if kv_memory_mb is not None:
            options["kv_memory_bytes"] = kv_memory_mb * 1024 * 1024
        options["prefix_cache_blocks"] = prefix_cache_blocks
        options["tensor_parallel"] = tensor_parallel
        return AsyncEngine.from_config(EngineConfig(**options))

    return load


def _embedder_factory(model: str, device: str) -> Callable[[], Any]:
    """Loads the encoder `model` on `device`, served under the name it was given."""

    def load() -> Any:
        from gpu_node.engine.embedder import Embedder
        from gpu_node.models.model_store import resolve_model

        return Embedder.from_directory(resolve_model(model), device=device, name=model)

    return load
