"""What a request costs its account: tokens reserved before it runs, settled when it ends.

    Meter.admit         the job's estimated tokens reserved with admission (RPM / TPM /
                        concurrency); a refusal is the client's error, with its limit headers
    Meter.record_start  a stream's durable start record, once its client has the status
                        line and before the first token: should the gateway die mid-answer,
                        billing completes it from this and the node's
    Meter.settle        once, at the end: the trace's token counts, the admission given back
                        at the tokens used, and the usage event

`billed_usage` is the one place that decides what billing counts of an upstream: what the
node reported for a finished request; for one that ended early, the prompt tokens the node
computed and the output tokens that reached the client, at no cost when the node failed.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from billing.events import Status, UsageEvent
from common.node_api import GenerateParams
from gateway.admission import (
    AdmissionError,
    AdmissionUnavailable,
    DuplicateRequestId,
    InvalidLimits,
    InvalidRequest,
    Limiter,
)
from gateway.errors import (
    BadRequestError,
    ConflictError,
    RateLimitedError,
    TokenLimitError,
    UnavailableError,
)
from gateway.jobs import EmbeddingJob, Job
from gateway.tracing import GenAISpan
from gateway.upstream import Upstream

log = logging.getLogger(__name__)

UNAVAILABLE_RETRY_S = 1.0  # the limiter probes Redis again about this soon after a failure
# Admission's refusal reasons as a client reads them in "too many ... for this account".
_REFUSAL_REASONS = {
    "requests": "requests",
    "tokens": "tokens",
    "concurrency": "concurrent requests",
}


def estimate_tokens(payload: GenerateParams) -> int:
    """Prompt tokens guessed from characters (about 3.5 per token in English, rounded up),
    the tools offered among them, + max_tokens for each of the n answers."""
    chars = len(payload.prompt or "")
    for message in payload.messages or ():
        chars += len(message.content) + 16  # the template's role markers
        for call in message.tool_calls or ():
            chars += len(call.name) + len(call.arguments) + 32
    if payload.tools:
        chars += len(json.dumps(payload.tools)) + 256  # a template's words around them
    return chars // 3 + 8 + payload.max_tokens * payload.n


class UsageSinkLike(Protocol):
    """billing.sink.UsageSink's shape: the gateway needs only `record` (never raises)."""

    async def record(self, event: UsageEvent) -> None: ...


@dataclass(frozen=True)
class BilledUsage:
    status: Status
    input_tokens: int
    output_tokens: int
    cached_tokens: int


def billed_usage(upstream: Upstream) -> BilledUsage:
    """What billing counts of `upstream`, as it stands."""
    finished = upstream.finished
    if finished is not None:
        return BilledUsage(
            "ok",
            finished.prompt_tokens,
            finished.completion_tokens,
            min(finished.cached_tokens, finished.prompt_tokens),
        )
    status: Status = "error" if upstream.has_failed else "cancelled"
    cached = min(upstream.cached_tokens, upstream.prefilled_tokens)
    return BilledUsage(status, upstream.prefilled_tokens, upstream.num_delivered_tokens, cached)


def start_event(upstream: Upstream) -> UsageEvent:
    """The start record of a stream: written once its client has the status line, before
    the first token."""
    job = upstream.job
    return UsageEvent(
        request_id=job.request_id,
        account_id=job.account_id,
        model=job.model.name,
        node_id=upstream.node_id,
        input_tokens=upstream.prompt_tokens,
        output_tokens=0,
        cached_tokens=min(upstream.cached_tokens, upstream.prompt_tokens),
        started_at=upstream.started_at,
        ended_at=upstream.started_at,
        status="cancelled",
        kind="start",
    )


class Meter:
    """Admission and billing for the dispatcher's requests; either may be absent (no limits,
    no usage records)."""

    def __init__(self, limiter: Limiter | None, usage_sink: UsageSinkLike | None) -> None:
        self._limiter = limiter
        self._usage_sink = usage_sink

    async def admit(self, job: Job, trace: GenAISpan) -> dict[str, str]:
        """Reserves `job`'s estimated tokens; admission's headers for the client. Raises the
        client's error when refused (RateLimitedError, TokenLimitError, ...)."""
        if self._limiter is None:
            return {}  # no admission step: a span that decided nothing would only mislead
        with trace.step("admission"):
            return await self._admit(self._limiter, job, trace)

    async def _admit(self, limiter: Limiter, job: Job, trace: GenAISpan) -> dict[str, str]:
        try:
            admission = await limiter.acquire(
                job.account_id, job.model.node_model, job.request_id, job.estimated_tokens
            )
        except TokenLimitError:
            trace.rejected("too_large")
            raise
        except (InvalidRequest, InvalidLimits) as exc:
            raise BadRequestError(f"cannot admit this request: {exc}") from None
        except DuplicateRequestId as exc:
            # Request ids are minted by the gateway, so this is our bug, never the client's;
            # 409 (not 500) because the first holder of the id keeps its admission.
            raise ConflictError(str(exc)) from None
        except AdmissionUnavailable as exc:
            # Fail-closed: without the shared counters nobody is admitted.
            trace.rejected("unavailable")
            raise UnavailableError(str(exc), retry_after_s=UNAVAILABLE_RETRY_S) from None
        except AdmissionError as exc:
            trace.rejected("unavailable")
            raise UnavailableError(
                f"admission failed: {exc}", retry_after_s=UNAVAILABLE_RETRY_S
            ) from None
        if not admission.admitted:
            trace.rejected(admission.reason or "unknown")
            what = _REFUSAL_REASONS.get(admission.reason or "", admission.reason)
            raise RateLimitedError(
                f"rate limited: too many {what} for this account",
                retry_after_s=admission.retry_after_s,
                headers=dict(admission.headers),
            )
        return dict(admission.headers)

    async def release(self, job: Job, num_tokens: int) -> None:
        """Gives `job`'s admission back, counting `num_tokens` against its account."""
        if self._limiter is None:
            return
        try:
            await self._limiter.release(
                job.account_id, job.model.node_model, job.request_id, num_tokens
            )
        except AdmissionError:
            # The limit store is away: its own expiry frees the slot; the answer to the client stands.
            log.warning("could not release admission for %s", job.request_id, exc_info=True)

    async def record_start(self, upstream: Upstream) -> None:
        """The durable start record of a stream (see the module docstring)."""
        if self._usage_sink is not None:
            await self._usage_sink.record(start_event(upstream))

    async def settle(self, upstream: Upstream) -> None:
        """Ends `upstream`'s trace with what it used, gives its admission back at that count
        and appends its usage event. Runs once, whatever happened to the request."""
        job = upstream.job
        usage = billed_usage(upstream)
        upstream.trace.finish(
            finish_reason=upstream.finish_reason,
            num_input_tokens=usage.input_tokens,
            num_output_tokens=usage.output_tokens,
            num_cached_tokens=usage.cached_tokens,
            error_type={"ok": None, "error": "UpstreamError"}.get(usage.status, usage.status),
        )
        await self._record(job, upstream.node_id, upstream.started_at, usage)

    async def settle_embedding(
        self, job: EmbeddingJob, node_id: str, started_at: float, num_tokens: int, trace: GenAISpan
    ) -> None:
        """Ends an embedding's trace, gives its admission back at the `num_tokens` its node
        encoded and appends its usage event (input tokens only)."""
        trace.finish(
            finish_reason=None,
            num_input_tokens=num_tokens,
            num_output_tokens=0,
            num_cached_tokens=0,
            error_type=None,
        )
        await self._record(job, node_id, started_at, BilledUsage("ok", num_tokens, 0, 0))

    async def _record(self, job: Job, node_id: str, started_at: float, usage: BilledUsage) -> None:
        await self.release(job, usage.input_tokens + usage.output_tokens)
        if self._usage_sink is None:
            return
        await self._usage_sink.record(
            UsageEvent(
                request_id=job.request_id,
                account_id=job.account_id,
                model=job.model.name,
                node_id=node_id,
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
                cached_tokens=usage.cached_tokens,
                started_at=started_at,
                ended_at=max(time.time(), started_at),
                status=usage.status,
            )
        )
