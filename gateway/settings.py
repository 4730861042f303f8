"""The gateway's one config object, validated at the entry point."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewaySettings:
    internal_token: str  # the bearer token nodes expect on their internal API
    capacity_max_age_s: float = 1.0  # read cache of the registry: one node heartbeat at most
    max_body_bytes: int = 4 * 1024 * 1024
    node_connect_timeout_s: float = 5.0
    node_read_timeout_s: float = 300.0  # between two chunks of a node's stream (queueing included)
    max_node_connections: int = 1000
    default_chat_max_tokens: int = 256
    default_completion_max_tokens: int = 16  # OpenAI's default for /v1/completions

    def __post_init__(self) -> None:
        if not self.internal_token:
            raise ValueError("internal_token must not be empty")
        for name in ("capacity_max_age_s", "node_connect_timeout_s", "node_read_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
