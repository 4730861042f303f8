"""The node's internal API as both sides read and write it: one set of models, no dicts.

    POST /internal/v1/generate   GenerateRequest in; NDJSON out, one NodeEvent a line:
                                 TokenChunk ... then Finish, or ErrorEvent on a failure
                                 after the first line; with n > 1, the n choices'
                                 TokenChunks interleave, each event tagged with its
                                 `index`, and the stream ends after n Finish lines
    any refusal before the stream  ErrorEvent as the body, with the code's status
                                 (an invalid grammar: invalid_request, naming the problem)

The gateway builds `GenerateParams` from a client's request, completes it into a
`GenerateRequest` for the node it places on, and reads the node's answer with
`read_event`; the node validates the request once, at its edge, and writes each event
with `event_line`. Lines end at the `\\n` byte alone (`event_line` never writes one
inside an event); any other character, U+2028 included, is text.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

NodeErrorCode = Literal[
    "unauthorized",
    "invalid_request",
    "invalid_grammar",  # a response format or tools no grammar can be built from
    "request_too_large",
    "model_not_found",
    "over_capacity",
    "cancelled",
    "internal",
]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FunctionCall(_Wire):
    """A tool call an assistant turn made: the function's name and its arguments' JSON."""

    name: str
    arguments: str  # JSON text of an object, as the model wrote it
    id: str | None = None  # what a tool turn's tool_call_id names


class ChatMessage(_Wire):
    """One turn. An assistant turn may carry the tool calls it made; a `tool` turn is the
    result of one (`tool_call_id` names the call)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[FunctionCall] | None = None
    tool_call_id: str | None = None


GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "ebnf", "structural_tag"]


class GrammarSpec(_Wire):
    """What the answer must match, enforced token by token (constrained decoding).

    kind            value
    json_schema     the JSON Schema, as JSON text; strict: properties the schema does not
                    name are refused unless it says `additionalProperties`
    json_object     unused: any JSON object
    regex           the pattern the whole answer matches
    choice          unused: `choices` lists the answers allowed, verbatim
    ebnf            a GBNF grammar (llama.cpp's EBNF dialect), its start rule `root`
    structural_tag  xgrammar's structural tag, as JSON text ({"type": "structural_tag",
                    "format": ...}): free text with triggered, constrained sections, as
                    common/tool_grammar.py builds for tool calls

    JSON is written compactly unless the schema's own text asks otherwise: no whitespace
    between tokens (`{"a":1}`), which keeps a small model from looping on blanks.
    """

    kind: GrammarKind
    value: str = ""
    choices: list[str] = Field(default_factory=list)


class GenerateParams(_Wire):
    """What to generate: the prompt (exactly one of the three forms) and how to sample.

    `grammar`: the answer is constrained to it; it ends (finish_reason "stop") when the
    grammar is complete. `logprobs`: every TokenChunk carries `logprobs`, one entry per
    token, with the `top_logprobs` most likely alternatives. `n`: that many answers to the
    one prompt (its prefill shared), their events tagged with `index` (0..n-1); a seed
    gives choice i the seed `seed + i`.
    """

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
    grammar: GrammarSpec | None = None
    # OpenAI function tools offered to the model ({"type": "function", "function": {...}}),
    # rendered into the prompt: by the chat template where it knows tools, else as
    # gpu_node/models/chat_tools.py writes them
    tools: list[dict[str, Any]] | None = None
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    n: int = Field(default=1, ge=1, le=16)


class GenerateRequest(GenerateParams):
    """One generation, as the gateway sends it to the node it placed it on."""

    request_id: str = Field(min_length=1, max_length=200)
    account_id: str = ""
    model: str
    # Disaggregation: the base URL of the prefill node that runs the prompt; the node
    # fetches the prompt's KV from it and decodes (gpu_node/engine/handoff.py).
    prefill_from: str | None = Field(default=None, pattern=r"^https?://[^\s]+$", max_length=300)


class EmbedRequest(_Wire):
    """Texts, or token arrays, to embed: what the gateway sends a node serving an encoder.
    Exactly one of `texts` and `token_ids`."""

    request_id: str = Field(min_length=1, max_length=200)
    account_id: str = ""
    model: str
    texts: list[str] | None = Field(default=None, min_length=1, max_length=2048)
    token_ids: list[list[int]] | None = Field(default=None, min_length=1, max_length=2048)
    truncate: bool = False  # cut a text past the model's positions instead of refusing it


class EmbedResponse(_Wire):
    vectors: list[list[float]]  # one a text, in their order
    prompt_tokens: int  # the tokens encoded: what is billed


class TopLogprob(_Wire):
    token_id: int
    token: str  # the token's text alone (U+FFFD for a part of a UTF-8 character)
    logprob: float


class TokenLogprob(_Wire):
    """One generated token's log-probability under the distribution it was sampled from
    (gpu_node/engine/sampler.py says which), and the most likely tokens of that
    distribution, most likely first (`top_logprobs` of them, fewer where fewer were
    possible)."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)


class TokenChunk(_Wire):
    """Text and the tokens it decodes from. The first chunk also carries what billing
    counts should the stream end early: the prompt's tokens, those served from the prefix
    cache, and those computed by then (fewer than the prompt's only when a cancel stops
    the prompt midway). With n > 1, the first chunk of each choice carries them, the
    prompt's counts alike in each (bill the prompt once). `logprobs`: when asked for, one
    entry per token of `token_ids`, in order. `index`: the choice (n > 1)."""

    text: str
    token_ids: list[int]
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    prefilled_tokens: int | None = None
    logprobs: list[TokenLogprob] | None = None
    index: int = 0


class Usage(_Wire):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Finish(_Wire):
    """The end of one choice: `usage` counts the prompt (alike in every choice) and this
    choice's completion tokens. finish_reason: stop (EOS, a stop string or the grammar
    complete), length, cancelled."""

    finish_reason: str
    usage: Usage
    index: int = 0


class NodeError(_Wire):
    code: str  # a NodeErrorCode from our nodes; read as "internal" when unknown
    message: str


class ErrorEvent(_Wire):
    error: NodeError


NodeEvent = TokenChunk | Finish | ErrorEvent
_EVENT: TypeAdapter[NodeEvent] = TypeAdapter(NodeEvent)


def event_line(event: NodeEvent) -> bytes:
    """One NDJSON line of the node's stream (JSON escapes every `\\n` inside it); fields at
    their defaults are left out, so a reader that predates one still reads the line."""
    return event.model_dump_json(exclude_defaults=True).encode() + b"\n"


def read_event(line: str | bytes) -> NodeEvent:
    """The event on one line of the node's stream; pydantic's ValidationError (a
    ValueError) for a line that is none."""
    return _EVENT.validate_json(line)
