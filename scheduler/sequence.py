"""A request as the scheduler sees it: its tokens, its pages and where it stands.

A sequence moves WAITING -> RUNNING -> FINISHED; preemption sends it back to
WAITING with its pages freed (its KV is recomputed when it runs again).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

# What a seed may be: the range torch.Generator.manual_seed takes (int64's least value to
# uint64's largest); the OpenAI schema takes int64, the Workers AI schema its own cap.
SEED_RANGE = (-(2**63), 2**64 - 1)
MAX_TOP_LOGPROBS = 20


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context window
    CANCELLED = "cancelled"
    ERROR = "error"
    HANDOFF = "handoff"  # prefilled for a decode node, which carries the request on


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated by `validate()` at submit."""

    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    logprobs: bool = False  # report each sampled token's log-probability
    top_logprobs: int = 0  # and this many of the most likely tokens beside it

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    def problems(self) -> list[str]:
        """Every reason these parameters are unusable (empty when they are fine)."""
        found = []
        if self.max_tokens <= 0:
            found.append(f"max_tokens must be positive, got {self.max_tokens}")
        # Written so that NaN fails each check (every comparison with NaN is false): NaN
        # had passed `temperature < 0` and sampled greedily.
        if not 0 <= self.temperature < math.inf:
            found.append(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            found.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            found.append(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.repetition_penalty < math.inf:
            found.append(
                f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                found.append(f"{name} must be finite, got {getattr(self, name)}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            found.append(f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            found.append(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
            )
        if self.top_logprobs and not self.logprobs:
            found.append("top_logprobs needs logprobs")
        if any(not s for s in self.stop):
            found.append("stop strings must not be empty")
        return found


@dataclass(eq=False)
class Sequence:
    """One request inside the engine. Mutated only by the engine loop."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str = ""  # the account: prefix-cache pages are never shared across salts
    arrival: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # Leading block-table columns whose pages went back to the pool, out of every later
    # step's window (BlockManager.release_passed); their entries are never read.
    num_released_pages: int = 0
    # A prefill for a decode node hands its prompt's KV off whole: none of its pages is
    # released, and it is admitted with all of them.
    keeps_pages: bool = False
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_held_pages(self) -> int:
        """Pages this sequence holds now: its block table less the released columns."""
        return len(self.block_table) - self.num_released_pages
