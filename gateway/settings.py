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
    # A node that has sent nothing on a request's stream for node_silence_s is asked its
    # health; one that does not answer within node_probe_timeout_s (frozen, hung) fails the
    # request: before the first token it is retried elsewhere. A busy or draining node
    # answers, and is waited for, up to node_read_timeout_s.
    node_silence_s: float = 5.0
    node_probe_timeout_s: float = 5.0
    max_node_connections: int = 1000
    default_chat_max_tokens: int = 256
    default_completion_max_tokens: int = 16  # OpenAI's default for /v1/completions
    # Fleet capacity admission: how long a request waits for a node when every one is full.
    queue_deadline_s: float = 10.0
    max_queued: int = 1024
    max_queued_per_account: int = 256
    # Bearer token of the admin API (/admin/v1) and of usage reports across accounts;
    # None leaves the admin API unmounted.
    admin_token: str | None = None
    # While the fleet's Redis is away (gateway/stores.py): keys this gateway confirmed
    # within known_key_s keep working (any other key is a 503), and the last-known capacity
    # records are trusted for store_outage_grace_s from the outage's start.
    known_key_s: float = 600.0
    store_outage_grace_s: float = 60.0
    # A node reservation lapses this long after its gateway last renewed it (every third of
    # it while the request runs): the most a crashed gateway's reservations outlive it.
    reservation_ttl_s: float = 6.0
    # Workers AI's async batch (`queueRequest`, gateway/batch/): answers are kept this long
    # past a batch's last one; a batch holds at most max_batch_requests, and an account's
    # unanswered batch requests are at most max_batch_queued_per_account (429 past it).
    batch_retention_s: float = 24 * 3600.0
    max_batch_requests: int = 256
    max_batch_queued_per_account: int = 1024
    # A batch request starts only after batch_idle_s without an interactive request on this
    # gateway, on a node with nobody waiting and a load under batch_max_node_load;
    # batch_concurrency of them at a time. A claim a dead gateway stopped renewing lapses
    # after batch_claim_s, and another gateway runs the request.
    batch_idle_s: float = 0.5
    batch_max_node_load: float = 0.5
    batch_concurrency: int = 1
    batch_claim_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.internal_token:
            raise ValueError("internal_token must not be empty")
        for name in (
            "capacity_max_age_s",
            "node_connect_timeout_s",
            "node_read_timeout_s",
            "node_silence_s",
            "node_probe_timeout_s",
            "max_queued",
            "max_queued_per_account",
            "known_key_s",
            "store_outage_grace_s",
            "reservation_ttl_s",
            "batch_retention_s",
            "max_batch_requests",
            "max_batch_queued_per_account",
            "batch_max_node_load",
            "batch_concurrency",
            "batch_claim_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.batch_idle_s < 0:
            raise ValueError(f"batch_idle_s must be >= 0, got {self.batch_idle_s}")
        if self.queue_deadline_s < 0:
            raise ValueError(f"queue_deadline_s must be >= 0, got {self.queue_deadline_s}")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ValueError("admin_token must be at least 16 characters (or None: no admin API)")
