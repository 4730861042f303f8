"""What the engine hands back: one `RequestOutput` per step per request, and its stats."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_node.engine.handoff import KVHandoff


@dataclass(frozen=True)
class EngineEvent:
    """Something that happened to a request inside the engine (for the node's trace span)."""

    name: str  # queued | admitted | preempted | first_token | finished
    time_ns: int  # wall clock, time.time_ns()
    num_pages: int  # KV pages the request held right after the event


@dataclass(frozen=True)
class SampledLogprob:
    """A sampled token's log-probability and the most likely tokens beside it (most likely
    first), under the distribution it was drawn from (sampler.py says which)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """The new tokens one request produced in one engine step.

    `text` is the detokenized delta (it may hold back bytes of an unfinished
    UTF-8 character or a possible stop-string prefix until they resolve).
    Counts are cumulative. The last output of a request has `finished=True`.
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    error: str | None = None
    events: tuple[EngineEvent, ...] = ()  # the request's whole history, on the final output only
    handoff: KVHandoff | None = None  # finish_reason "handoff": the prompt's KV for a decode node
    # Prompt tokens whose KV the request had by now (all of them once it has a token; fewer
    # for one cancelled while its prompt ran, none for one that never left the queue).
    num_prefilled_tokens: int = 0
    logprobs: tuple[SampledLogprob, ...] | None = None  # one per token of `token_ids`, if asked
    # The choice, for a request with n > 1: every choice's outputs carry the request's id.
    # The request is over when all n have finished, or when choice 0 finished cancelled (a
    # cancel ends every choice) or with no token (no other choice began).
    index: int = 0


def ends_request(out: RequestOutput, num_finished: int, n: int) -> bool:
    """Whether `out`, with `num_finished` of the request's `n` choices finished by now (it
    included), is the request's last output."""
    if not out.finished:
        return False
    if num_finished >= n:
        return True
    return out.index == 0 and (out.finish_reason == "cancelled" or not out.num_completion_tokens)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the node's KV pool and queues (the capacity record's source)."""

    model: str
    kv_dtype: str
    page_size: int
    num_pages: int
    num_free_pages: int
    num_running: int
    num_waiting: int
    max_model_len: int
    activations: str  # what the model computes in: fp32, bf16 or fp16
    num_preemptions: int = 0
    num_integrity_violations: int = 0
    num_computed_tokens: int = 0  # tokens the model ran since the engine started

    @property
    def num_free_tokens(self) -> int:
        return self.num_free_pages * self.page_size
