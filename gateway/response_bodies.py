"""The bodies the gateway answers with, as pydantic models: what `/openapi.json` declares
(gateway/openapi.py) and what tests hold the real answers against.

The handlers build their bodies as plain dicts (the hot path needs no validation); these
models say what those dicts are. Every model forbids fields it does not name, so an
answer that grows a field the document does not declare fails the schemathesis run
(tests/gateway/test_openapi.py). Streams (`text/event-stream`) are declared as text.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Errors, one shape a dialect (gateway/errors.py error_body).


class OpenAIErrorDetail(_Body):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(_Body):
    """An OpenAI-dialect error."""

    error: OpenAIErrorDetail


class WorkersAIMessage(_Body):
    code: int
    message: str


class WorkersAIError(_Body):
    """A Workers AI error envelope (also the usage, admin and operational routes')."""

    result: None
    success: Literal[False]
    errors: list[WorkersAIMessage] = Field(min_length=1)
    messages: list[Any]


class _Envelope(_Body):
    success: Literal[True]
    errors: list[WorkersAIMessage] = Field(max_length=0)
    messages: list[Any]


# The Workers AI dialect.


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class WorkersAIToolCall(_Body):
    name: str
    arguments: Any  # an object; the text as far as it went when cut short by max_tokens


class WorkersAITextResult(_Body):
    response: str
    usage: Usage
    tool_calls: list[WorkersAIToolCall] = Field(default_factory=list)  # with tools offered


class WorkersAIEmbeddingResult(_Body):
    shape: list[int] = Field(min_length=2, max_length=2)
    data: list[list[float]]


class WorkersAIBatchStatus(_Body):
    """An async batch queued or running (`?queueRequest=true`)."""

    status: Literal["queued", "running"]
    request_id: str
    model: str


class WorkersAIBatchAnswer(_Body):
    id: int
    result: WorkersAITextResult | None
    success: bool
    errors: list[WorkersAIMessage] = Field(default_factory=list)
    external_reference: Any = None


class WorkersAIBatchDone(_Body):
    """An async batch's answers, in order, and their total usage."""

    responses: list[WorkersAIBatchAnswer]
    usage: Usage


class WorkersAIRunResponse(_Envelope):
    """`ai/run`: generated text, embeddings for an embedding model, or an async batch's
    status or answers."""

    result: (
        WorkersAITextResult | WorkersAIEmbeddingResult | WorkersAIBatchStatus | WorkersAIBatchDone
    )


class SearchTask(_Body):
    id: str
    name: str


class SearchProperty(_Body):
    property_id: str
    value: str


class SearchEntry(_Body):
    id: str
    name: str
    description: str
    task: SearchTask
    properties: list[SearchProperty]


class ResultInfo(_Body):
    page: int
    per_page: int
    count: int
    total_count: int


class WorkersAIModelSearch(_Envelope):
    result: list[SearchEntry]
    result_info: ResultInfo


# The OpenAI dialect.


class PromptTokensDetails(_Body):
    cached_tokens: int


class OpenAIUsage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[TokenLogprob]
    refusal: None


class ToolCallFunction(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["assistant"]
    content: str | None
    refusal: None
    tool_calls: list[ToolCall] = Field(default_factory=list)  # when the model made calls


class ChatChoice(_Body):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: OpenAIUsage


class CompletionLogprobs(_Body):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class Completion(_Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: OpenAIUsage


class Embedding(_Body):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32


class EmbeddingUsage(_Body):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Body):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ResponseOutputText(_Body):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ResponseMessage(_Body):
    type: Literal["message"]
    id: str
    status: Literal["completed", "in_progress"]
    role: Literal["assistant"]
    content: list[ResponseOutputText]


class ResponseFunctionCall(_Body):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["completed", "in_progress"]


class ResponseUsage(_Body):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(_Body):
    """An OpenAI Responses answer (gateway/responses_api.py)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    error: None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[ResponseMessage | ResponseFunctionCall]
    parallel_tool_calls: bool
    previous_response_id: None
    store: bool
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    metadata: dict[str, str]
    usage: ResponseUsage | None


class Model(_Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    context_window: int  # prompt + max_tokens, as served now


class ModelList(_Body):
    object: Literal["list"]
    data: list[Model]


# Usage reports, admin and operations (Workers AI envelopes where enveloped).


class UsageRow(_Body):
    account_id: str | None = None  # with group_by account
    model: str | None = None  # with group_by model
    day: str | None = None  # with group_by day
    requests: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    cost: str | None  # a decimal string; None where a model has no price


class UsageTotal(_Body):
    requests: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    cost: str | None


class UsageReport(_Body):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    from_: str = Field(alias="from")
    to: str
    currency: str
    group_by: list[Literal["account", "model", "day"]]
    rows: list[UsageRow]
    total: UsageTotal
    unpriced_models: list[str]
    account_id: str  # as asked: an account, or "*" for all (admin)


class UsageResponse(_Envelope):
    result: UsageReport


class Limits(_Body):
    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int


class AccountLimits(_Body):
    account_id: str
    model: str | None
    effective: Limits
    account: Limits | None
    models: dict[str, Limits]


class LimitsResponse(_Envelope):
    result: AccountLimits


class DashboardNode(_Body):
    node_id: str
    role: str
    models: list[str]
    num_pages: int
    num_free_pages: int
    num_used_pages: int
    page_size: int
    kv_dtype: str
    num_running: int
    num_waiting: int
    load: float
    tokens_per_s: float
    age_s: float


class DashboardGateway(_Body):
    num_generations: int
    num_failed: int
    num_input_tokens: int
    num_output_tokens: int
    admission_rejections: dict[str, int]


class DashboardNumbers(_Body):
    at: float
    is_registry_away: bool
    nodes: list[DashboardNode]
    models: list[dict[str, Any]]
    num_queued: int
    gateway: DashboardGateway
    usage: dict[str, Any] | None  # today's per account; None without a ledger
    errors: list[dict[str, Any]]


class DashboardResponse(_Envelope):
    result: DashboardNumbers


class Health(_Body):
    status: Literal["ok", "degraded", "loading"]
    store: Literal["unavailable"] = "unavailable"  # while degraded


RESPONSE_MODELS: tuple[type[BaseModel], ...] = (
    OpenAIError,
    WorkersAIError,
    WorkersAIRunResponse,
    WorkersAIModelSearch,
    ChatCompletion,
    Completion,
    EmbeddingList,
    ResponseObject,
    Model,
    ModelList,
    UsageResponse,
    LimitsResponse,
    DashboardResponse,
    Health,
)
