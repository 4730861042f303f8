"""The body of the node's generate call (pydantic: validated once, at the edge)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler.sequence import SamplingParams


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class GenerateRequest(BaseModel):
    """One generation, as the gateway sends it. Exactly one of the three prompt forms."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=200)
    account_id: str = ""
    model: str
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    raw: bool = False  # prompt as is; otherwise wrapped in the chat template as a user turn
    max_tokens: int = 256
    # max_tokens is the gateway's default, not the client's: shortened to what the context
    # leaves after the prompt rather than refused (OpenAI's rule when max_tokens is left out)
    max_tokens_is_default: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Disaggregation: the base URL of the prefill node that runs the prompt; this node
    # fetches the prompt's KV from it and decodes (gpu_node/handoff.py).
    prefill_from: str | None = Field(default=None, pattern=r"^https?://[^\s]+$", max_length=300)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(self.stop),
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
        )
