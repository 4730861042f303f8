"""Request bodies of the public API (pydantic): validated once here, `/openapi.json` is built from them.

Each request turns into `GenerationJob` fields the same way: `node_payload()`
gives what the node is asked to generate (`common.node_api.GenerateParams`), the sampling
values the client left out taken from the model's `SamplingDefaults` (the catalog).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from common.node_api import GenerateParams, GrammarSpec
from common.tool_grammar import ToolGrammarError, tool_call_grammar
from gateway.catalog import CatalogModel, SamplingDefaults
from gateway.errors import BadRequestError, UnsupportedError

MAX_PROMPT_CHARS = 1_000_000  # past this a request is refused before any tokenizing
MAX_CHOICES = 16  # `n`: answers to one prompt
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5  # a completion's `logprobs`: OpenAI's own limit

# JSON's own types, not coerced: "stream": "yes", "max_tokens": "4" or 4.0, "temperature":
# "0.5" are 400s, as in the APIs we speak (an integer is still a number).
Int = StrictInt
Float = Annotated[float, Strict()]
PromptText = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
# A flag the OpenAI API documents as nullable: null is its default, false.
NullableFlag = Annotated[StrictBool, BeforeValidator(lambda v: False if v is None else v)]


_MODEL_DEFAULT = "left out: the model's own default (its generation config, else the catalog's)"


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64)
    arguments: str | dict[str, Any] = Field(description="a JSON object, or its text")

    def arguments_text(self) -> str:
        if isinstance(self.arguments, dict):
            return json.dumps(self.arguments, ensure_ascii=False)
        return self.arguments


class MessageToolCall(BaseModel):
    """A call an assistant turn made: OpenAI's shape ({"id", "type": "function",
    "function": {"name", "arguments"}}) or Workers AI's ({"name", "arguments"})."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction | None = None
    name: str | None = None
    arguments: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_shape(self) -> MessageToolCall:
        if self.function is None:
            if self.name is None:
                raise ValueError("a tool call needs 'function' (or 'name' and 'arguments')")
            self.function = CalledFunction(name=self.name, arguments=self.arguments or {})
        return self

    def node_call(self) -> dict[str, Any]:
        assert self.function is not None
        call = {"name": self.function.name, "arguments": self.function.arguments_text()}
        return call | ({"id": self.id} if self.id is not None else {})


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = Field(
        None,
        description="text, or OpenAI content parts of type text (null only for an assistant)",
    )
    tool_calls: list[MessageToolCall] | None = Field(None, description="an assistant's calls")
    tool_call_id: str | None = Field(None, description="the call a tool message answers")

    @model_validator(mode="after")
    def _content_given(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        if self.content is None and not self.tool_calls and "content" not in self.model_fields_set:
            raise ValueError("an assistant message needs 'content' or 'tool_calls'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries 'tool_calls'")
        return self

    def text(self) -> str:
        if self.content is None:  # an assistant turn with no text (OpenAI allows null there)
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise UnsupportedError("only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)

    def node_message(self) -> dict[str, Any]:
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.node_call() for call in self.tool_calls]
        if self.tool_call_id is not None and role == "tool":
            message["tool_call_id"] = self.tool_call_id
        return message


class JSONSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema under `schema`, with its name."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field("response", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: NullableFlag = Field(
        False, description="answers always match the schema exactly, strict or not"
    )


class _JSONFormat(BaseModel):
    """A response format: text, any JSON object, or JSON matching a schema (`json_schema`,
    in the shape of each dialect)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]

    @model_validator(mode="after")
    def _schema_given(self) -> _JSONFormat:
        if self.type == "json_schema" and getattr(self, "json_schema", None) is None:
            raise ValueError("type 'json_schema' needs 'json_schema'")
        return self

    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON Schema an answer must match; None for text."""
        if self.type == "json_object":
            return {"type": "object"}
        return self._schema() if self.type == "json_schema" else None

    def _schema(self) -> dict[str, Any]:
        raise NotImplementedError


class ResponseFormat(_JSONFormat):
    """OpenAI's `response_format`: the schema under `json_schema.schema`, with its name."""

    json_schema: JSONSchemaFormat | None = None

    def _schema(self) -> dict[str, Any]:
        assert self.json_schema is not None
        return self.json_schema.schema_


class WorkersAIResponseFormat(_JSONFormat):
    """Workers AI's JSON mode: `{"type": "json_schema", "json_schema": <the schema>}` (or
    OpenAI's shape, the schema under `schema`), or `{"type": "json_object"}`."""

    json_schema: dict[str, Any] | None = None

    def _schema(self) -> dict[str, Any]:
        assert self.json_schema is not None
        wrapped = self.json_schema.get("schema")
        if isinstance(wrapped, dict) and "name" in self.json_schema:
            return wrapped
        return self.json_schema


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of an object")
    strict: NullableFlag = False


class ToolSpec(BaseModel):
    """A function the model may call: OpenAI's `{"type": "function", "function": {...}}`,
    or Workers AI's `{"name", "description", "parameters"}`."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionSpec | None = None
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_shape(self) -> ToolSpec:
        if self.function is None:
            if self.name is None:
                raise ValueError("a tool needs 'function' (or 'name')")
            self.function = FunctionSpec(
                name=self.name, description=self.description, parameters=self.parameters
            )
        return self

    def node_tool(self) -> dict[str, Any]:
        """OpenAI's shape, as the node renders it."""
        assert self.function is not None
        function: dict[str, Any] = {"name": self.function.name}
        if self.function.description is not None:
            function["description"] = self.function.description
        function["parameters"] = self.function.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def structured_output(
    schema: dict[str, Any] | None,
    tools: list[ToolSpec] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool,
) -> tuple[GrammarSpec | None, list[dict[str, Any]] | None]:
    """(the grammar an answer is held to, the tools offered to the model) for a JSON
    schema response format and function tools (common/tool_grammar.py)."""
    offered = [t.node_tool() for t in tools] if tools and tool_choice != "none" else None
    if offered:
        choice: str | dict[str, Any]
        if isinstance(tool_choice, NamedToolChoice):  # that function, called once
            choice, parallel_tool_calls = tool_choice.model_dump(), False
        else:
            choice = tool_choice or "auto"
        try:
            grammar = tool_call_grammar(offered, choice, parallel_tool_calls, schema)
        except ToolGrammarError as exc:
            param = "tool_choice" if "tool_choice" in str(exc) else "tools"
            raise BadRequestError(str(exc), param=param) from None
        return grammar, offered
    if schema is None:
        return None, None
    if schema == {"type": "object"}:
        return GrammarSpec(kind="json_object"), None
    return GrammarSpec(kind="json_schema", value=json.dumps(schema)), None


class WorkersAIOptions(BaseModel):
    """Workers AI request options (the body's `options` object)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, title="WorkersAIOptions")

    reject_if_busy: StrictBool = Field(
        False,
        alias="rejectIfBusy",
        description="refuse at once (429, code 3040) instead of waiting when every node is busy",
    )


class WorkersAITextRequest(BaseModel):
    """Workers AI text generation: `prompt` (wrapped in the chat template unless `raw`) or `messages`."""

    model_config = ConfigDict(extra="ignore", title="WorkersAITextGeneration")

    prompt: str | None = Field(None, min_length=1, max_length=MAX_PROMPT_CHARS)
    messages: list[Message] | None = Field(None, min_length=1)
    input: list[ResponseInputItem] | None = Field(
        None, description="Responses-style input: a string, or messages and function items"
    )
    instructions: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    max_tokens: Int = Field(256, ge=1)
    temperature: Float | None = Field(None, ge=0, le=5, description=_MODEL_DEFAULT)
    top_p: Float | None = Field(None, gt=0, le=1, description=_MODEL_DEFAULT)
    top_k: Int | None = Field(None, ge=1, le=50, description=_MODEL_DEFAULT)
    seed: Int | None = Field(None, ge=0, le=9_999_999_999)
    repetition_penalty: Float | None = Field(None, gt=0, le=2)
    frequency_penalty: Float | None = Field(None, ge=-2, le=2)
    presence_penalty: Float | None = Field(None, ge=-2, le=2)
    stream: StrictBool = False
    raw: StrictBool = False
    options: WorkersAIOptions | None = None
    tools: list[ToolSpec] | None = Field(None, description="functions the model may call")
    response_format: WorkersAIResponseFormat | None = Field(
        None, description="JSON mode: answers match the schema"
    )
    # Workers AI options these models cannot honour: refused, never silently dropped.
    lora: Any = None
    functions: Any = None

    @property
    def reject_if_busy(self) -> bool:
        return self.options is not None and self.options.reject_if_busy

    def check_supported(self) -> None:
        if self.lora is not None:
            raise UnsupportedError("'lora' is not supported: no adapters are served", param="lora")
        if self.functions:
            raise UnsupportedError("'functions' is not supported: use 'tools'", param="functions")
        if self.tools is not None and self.prompt is not None:
            raise BadRequestError("'tools' needs 'messages' or 'input'", param="tools")

    @property
    def offers_tools(self) -> bool:
        return bool(self.tools)

    _input = field_validator("input", mode="before")(
        lambda value: None if value is None else input_text_or_items(value)
    )

    @model_validator(mode="after")
    def _one_prompt(self) -> WorkersAITextRequest:
        given = [self.prompt, self.messages, self.input]
        if sum(one is not None for one in given) != 1:
            raise ValueError("give exactly one of 'prompt', 'messages' or 'input'")
        if self.instructions is not None and self.input is None:
            raise ValueError("'instructions' goes with 'input'")
        return self

    def node_payload(self, sampling: SamplingDefaults) -> GenerateParams:
        payload: dict[str, Any] = {"max_tokens": self.max_tokens} | _sampled(self, sampling)
        if "max_tokens" not in self.model_fields_set:  # the node may shorten the default
            payload["max_tokens_is_default"] = True
        if self.messages is not None:
            payload["messages"] = [m.node_message() for m in self.messages]
        elif self.input is not None:
            payload["messages"] = input_messages(self.instructions, self.input)
        else:
            payload["prompt"] = self.prompt
            payload["raw"] = self.raw
        schema = None if self.response_format is None else self.response_format.answer_schema()
        grammar, tools = structured_output(schema, self.tools, "auto", True)
        payload |= {"grammar": grammar, "tools": tools}
        return GenerateParams.model_validate(
            payload
            | _optional(
                self,
                (
                    "seed",
                    "repetition_penalty",
                    "frequency_penalty",
                    "presence_penalty",
                ),
            )
        )


class StreamOptions(BaseModel):
    include_usage: NullableFlag = False


class _OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0, le=2)
    top_p: Float | None = Field(None, gt=0, le=1)
    seed: Int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, as OpenAI's own API
    stop: str | list[str] | None = None
    stream: NullableFlag = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Float | None = Field(None, ge=-2, le=2)
    presence_penalty: Float | None = Field(None, ge=-2, le=2)
    n: Int | None = Field(None, ge=1)
    logprobs: Any = Field(None, description="chat: true or false; a completion: 0 to 5")
    user: str | None = None
    logit_bias: Any = None

    # Where a context-window refusal points: the field that holds the prompt; where a
    # grammar refusal points: the field that asks for the answer's format.
    prompt_field: ClassVar[str] = "prompt"
    format_field: ClassVar[str] = "response_format"

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if len(stops) > 4:
            raise ValueError("takes at most 4 sequences")
        if any(not s for s in stops):
            raise ValueError("sequences must not be empty")
        return stop

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_supported(self) -> None:
        if self.n is not None and self.n > MAX_CHOICES:
            raise UnsupportedError(f"'n' is at most {MAX_CHOICES}", param="n")
        if self.logit_bias:  # null and {} change nothing
            raise UnsupportedError("'logit_bias' is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedError(
                "'stream_options' requires 'stream': true", param="stream_options"
            )

    @property
    def max_tokens_name(self) -> str:
        """The field the client gave the output limit in (what its errors should name)."""
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def _sampling(self, default_max_tokens: int, sampling: SamplingDefaults) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "max_tokens": self.max_tokens or default_max_tokens,
            "stop": self.stop_strings(),
            "n": self.num_choices,
        } | _sampled(self, sampling)
        if self.max_tokens is None:  # the node may shorten it to what the context leaves
            payload["max_tokens_is_default"] = True
        return payload | _optional(self, ("seed", "frequency_penalty", "presence_penalty"))


class ChatCompletionRequest(_OpenAIBase):
    """OpenAI `POST /v1/chat/completions`."""

    model_config = ConfigDict(extra="ignore", title="ChatCompletionRequest")

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = Field(None, description="left out: true")
    functions: list[Any] | None = None  # the API's older spelling of tools
    function_call: Any = None
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    # Outputs of other kinds, or ways of making them, that these models have none of:
    # refused, as OpenAI refuses them for a model without them, never answered in text.
    modalities: list[Any] | None = None
    audio: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None

    prompt_field: ClassVar[str] = "messages"

    @property
    def max_tokens_name(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def check_supported(self) -> None:
        super().check_supported()
        if self.modalities is not None and self.modalities != ["text"]:
            raise UnsupportedError("only the 'text' modality is supported", param="modalities")
        for name in ("audio", "web_search_options", "reasoning_effort"):
            if getattr(self, name) is not None:
                raise UnsupportedError(f"'{name}' is not supported", param=name)
        if self.functions:
            raise UnsupportedError("'functions' is not supported: use 'tools'", param="functions")
        if self.function_call not in (None, "none"):
            raise UnsupportedError(
                "'function_call' is not supported: use 'tool_choice'", param="function_call"
            )
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise BadRequestError("'tool_choice' needs 'tools'", param="tool_choice")
        if self.logprobs not in (None, True, False):
            raise BadRequestError("'logprobs' is true or false", param="logprobs")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")

    @property
    def offers_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def node_payload(self, default_max_tokens: int, sampling: SamplingDefaults) -> GenerateParams:
        payload = self._sampling(default_max_tokens, sampling)
        if self.max_completion_tokens is not None:
            payload["max_tokens"] = self.max_completion_tokens
            payload.pop("max_tokens_is_default", None)
        payload["messages"] = [m.node_message() for m in self.messages]
        schema = None if self.response_format is None else self.response_format.answer_schema()
        parallel = self.parallel_tool_calls is not False
        grammar, tools = structured_output(schema, self.tools, self.tool_choice, parallel)
        payload |= {"grammar": grammar, "tools": tools}
        if self.logprobs:
            payload |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        return GenerateParams.model_validate(payload)


class ResponseInputContent(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text", "text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class ResponseInputItem(BaseModel):
    """One item of a Responses `input`: a message, a function call the model made, or a
    function call's output."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[ResponseInputContent] | None = None
    call_id: str | None = Field(None, max_length=200)
    name: str | None = None
    arguments: str | None = None
    output: str | None = Field(None, max_length=MAX_PROMPT_CHARS)

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> ResponseInputItem:
        needs = {
            "message": ("role", "content"),
            "function_call": ("call_id", "name", "arguments"),
            "function_call_output": ("call_id", "output"),
        }[self.type]
        missing = [name for name in needs if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.type} item needs {', '.join(repr(m) for m in missing)}")
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content or ())


def input_text_or_items(value: Any) -> Any:
    """Responses' `input` before validation: a string is one user message; anything else
    must be a list of items."""
    if value == "" or value == []:
        raise ValueError("must not be empty")
    if isinstance(value, str):
        if len(value) > MAX_PROMPT_CHARS:
            raise ValueError(f"is longer than {MAX_PROMPT_CHARS} characters")
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of input items")
    return value


def input_messages(
    instructions: str | None, items: list[ResponseInputItem]
) -> list[dict[str, Any]]:
    """Responses' instructions and input as chat turns: instructions first, function calls
    on the assistant turn that made them, their outputs as tool turns."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if item.type == "message":
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text()})
        elif item.type == "function_call":
            call = {"id": item.call_id, "name": item.name, "arguments": item.arguments}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
    return messages


class ResponseFormatText(BaseModel):
    """Responses' `text.format`: text, JSON, or JSON matching a schema (flat, with its name)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: NullableFlag = False

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormatText:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("type 'json_schema' needs 'schema'")
        return self

    def answer_schema(self) -> dict[str, Any] | None:
        if self.type == "json_object":
            return {"type": "object"}
        return self.schema_ if self.type == "json_schema" else None


class ResponseTextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: ResponseFormatText = Field(
        default_factory=lambda: ResponseFormatText.model_validate({})
    )


class ResponsesNamedTool(BaseModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    """OpenAI `POST /v1/responses`, stateless: the conversation comes whole in `input`."""

    model_config = ConfigDict(extra="ignore", title="ResponsesRequest")

    model: str = Field(min_length=1)
    input: list[ResponseInputItem] = Field(
        description="a string (one user message), or messages, function calls and outputs"
    )
    instructions: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0, le=2)
    top_p: Float | None = Field(None, gt=0, le=1)
    stream: NullableFlag = False
    text: ResponseTextConfig | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: StrictBool | None = None
    store: StrictBool | None = Field(None, description="accepted; no response is kept")
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    reasoning: Any = None
    background: Any = None

    _input = field_validator("input", mode="before")(input_text_or_items)

    prompt_field: ClassVar[str] = "input"
    max_tokens_name: ClassVar[str] = "max_output_tokens"
    format_field: ClassVar[str] = "text"

    def check_supported(self) -> None:
        if self.previous_response_id is not None:
            raise UnsupportedError(
                "'previous_response_id' is not supported: no response is kept here; send the "
                "whole conversation in 'input'",
                param="previous_response_id",
            )
        if self.reasoning is not None:
            raise UnsupportedError("'reasoning' is not supported", param="reasoning")
        if self.background:
            raise UnsupportedError("'background' is not supported", param="background")

    @property
    def offers_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def node_messages(self) -> list[dict[str, Any]]:
        return input_messages(self.instructions, self.input)

    def node_payload(self, default_max_tokens: int, sampling: SamplingDefaults) -> GenerateParams:
        payload: dict[str, Any] = {
            "max_tokens": self.max_output_tokens or default_max_tokens,
            "messages": self.node_messages(),
        } | _sampled(self, sampling)
        if self.max_output_tokens is None:
            payload["max_tokens_is_default"] = True
        schema = None if self.text is None else self.text.format.answer_schema()
        tool_choice: ToolChoice | None
        if isinstance(self.tool_choice, ResponsesNamedTool):
            tool_choice = NamedToolChoice(
                type="function", function=NamedFunction(name=self.tool_choice.name)
            )
        else:
            tool_choice = self.tool_choice
        parallel = self.parallel_tool_calls is not False
        grammar, tools = structured_output(schema, self.tools, tool_choice, parallel)
        payload |= {"grammar": grammar, "tools": tools}
        return GenerateParams.model_validate(payload)


class CompletionRequest(_OpenAIBase):
    """OpenAI `POST /v1/completions` (the prompt goes to the model as is)."""

    model_config = ConfigDict(extra="ignore", title="CompletionRequest")

    prompt: PromptText | list[PromptText]  # the cap on each string, a list's one too
    echo: NullableFlag = False
    suffix: str | None = None
    best_of: Int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise UnsupportedError(
                "'prompt' must be one string (batches are not supported)", param="prompt"
            )
        if not self.prompt_text():
            # nothing to continue: the model adds no start token of its own
            raise BadRequestError("the prompt is empty", param="prompt")
        if self.echo:
            raise UnsupportedError("'echo' is not supported", param="echo")
        if self.suffix:
            raise UnsupportedError("'suffix' is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise UnsupportedError("'best_of' is not supported", param="best_of")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS
        ):
            raise BadRequestError(
                f"'logprobs' is an integer from 0 to {MAX_COMPLETION_LOGPROBS}", param="logprobs"
            )

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def node_payload(self, default_max_tokens: int, sampling: SamplingDefaults) -> GenerateParams:
        payload = self._sampling(default_max_tokens, sampling)
        payload["prompt"] = self.prompt_text()
        payload["raw"] = True
        if self.logprobs is not None:  # the sampled tokens' own, and this many alternatives
            payload |= {"logprobs": True, "top_logprobs": self.logprobs}
        return GenerateParams.model_validate(payload)


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's own limit on one request's inputs
TokenIds = list[Annotated[StrictInt, Field(ge=0)]]
EmbeddingText = Annotated[StrictStr, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]


class EmbeddingsRequest(BaseModel):
    """OpenAI `POST /v1/embeddings`: a string, a list of strings, a token array or a list
    of token arrays."""

    model_config = ConfigDict(extra="ignore", title="EmbeddingsRequest")

    model: str = Field(min_length=1)
    input: (
        EmbeddingText
        | Annotated[list[EmbeddingText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | Annotated[TokenIds, Field(min_length=1)]
        | Annotated[
            list[Annotated[TokenIds, Field(min_length=1)]],
            Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS),
        ]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(None, ge=1, description="the model's own size only")
    user: str | None = None

    @field_validator("input", mode="wrap")
    @classmethod
    def _one_problem(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """One error that says what is wrong, not one per shape the input could take."""
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(embedding_input_problem(value)) from None

    def inputs(self) -> tuple[list[str] | None, list[list[int]] | None]:
        """(texts, token arrays): exactly one of them."""
        given = self.input
        if isinstance(given, str):
            return [given], None
        texts = [one for one in given if isinstance(one, str)]
        if texts:
            return texts, None
        ids = [one for one in given if isinstance(one, int)]
        if ids:
            return None, [ids]
        return None, [list(one) for one in given if isinstance(one, list)]

    def check_for(self, model: CatalogModel) -> None:
        check_embedding_model(model)
        if self.dimensions is not None and self.dimensions != model.dimensions:
            raise UnsupportedError(
                f"{model.name} does not shorten its vectors: 'dimensions' may only be its own "
                f"size" + (f", {model.dimensions}" if model.dimensions else ""),
                param="dimensions",
            )


def embedding_input_problem(value: Any) -> str:
    """What is wrong with an embedding input that matches none of its shapes."""
    if value == "" or value == []:
        return "must not be empty"
    if not isinstance(value, (str, list)):
        return "must be a string, a list of strings, a token array or a list of token arrays"
    if isinstance(value, list) and len(value) > MAX_EMBEDDING_INPUTS:
        return f"takes at most {MAX_EMBEDDING_INPUTS} inputs, got {len(value)}"
    if isinstance(value, str) or any(isinstance(one, str) for one in value):
        if not all(isinstance(one, str) for one in value):
            return "mixes strings with other values"
        if any(not one for one in value):
            return "holds an empty string"
        return f"holds a string longer than {MAX_PROMPT_CHARS} characters"
    rows = value if all(isinstance(one, list) for one in value) else [value]
    if any(not row for row in rows):
        return "holds an empty token array"
    return "token arrays hold token ids: integers of 0 or more"


class WorkersAIEmbeddingRequest(BaseModel):
    """Workers AI text embeddings: `text`, one string or a list of them."""

    model_config = ConfigDict(extra="ignore", title="WorkersAIEmbeddings")

    text: (
        EmbeddingText
        | Annotated[list[EmbeddingText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    )

    @field_validator("text", mode="wrap")
    @classmethod
    def _one_problem(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            if not isinstance(value, (str, list)) or any(not isinstance(one, str) for one in value):
                raise ValueError("must be a string or a list of strings") from None
            raise ValueError(embedding_input_problem(value)) from None

    truncate_inputs: StrictBool = Field(
        False, description="cut an input past the model's positions instead of refusing it"
    )
    pooling: Any = Field(None, description="not accepted: the model's checkpoint sets it")
    options: WorkersAIOptions | None = None

    def texts(self) -> list[str]:
        return [self.text] if isinstance(self.text, str) else list(self.text)

    def check_supported(self) -> None:
        if self.pooling is not None:
            raise UnsupportedError(
                "'pooling' is not supported: the model pools as its checkpoint says",
                param="pooling",
            )

    @property
    def reject_if_busy(self) -> bool:
        return self.options is not None and self.options.reject_if_busy


def check_embedding_model(model: CatalogModel) -> None:
    if not model.is_embedding:
        raise BadRequestError(
            f"{model.name} generates text; embeddings take an embedding model", param="model"
        )


def check_generation_model(model: CatalogModel) -> None:
    if model.is_embedding:
        raise BadRequestError(
            f"{model.name} is an embedding model: it does not generate text", param="model"
        )


# top_p and top_k at these values sample from every token: a default equal to them says
# nothing the node does not do already, and is left out of the request (and its trace).
_SAMPLES_ALL = {"top_p": 1.0, "top_k": 0}


def _sampled(body: BaseModel, sampling: SamplingDefaults) -> dict[str, Any]:
    """temperature, top_p and top_k: as the body names them, else the model's defaults."""
    values = {}
    for name, default in (
        ("temperature", sampling.temperature),
        ("top_p", sampling.top_p),
        ("top_k", sampling.top_k),
    ):
        given = getattr(body, name, None)
        if given is not None:
            values[name] = given
        elif name not in _SAMPLES_ALL or default != _SAMPLES_ALL[name]:
            values[name] = default
    return values


def _optional(model: BaseModel, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(model, name) for name in names if getattr(model, name) is not None}


class WorkersAIBatchRequest(BaseModel):
    """Workers AI's async batch (`?queueRequest=true`): `requests` to queue, or the
    `request_id` of a batch to poll. Each request is a text generation body, validated when
    it runs: one that is wrong is that request's error in the answers, not the batch's."""

    model_config = ConfigDict(extra="ignore", title="WorkersAIBatchRequest")

    requests: list[Any] | None = Field(
        None, min_length=1, description="text generation bodies to run at low priority"
    )
    request_id: StrictStr | None = Field(None, description="a queued batch's id, to poll it")

    @model_validator(mode="after")
    def _one_intent(self) -> WorkersAIBatchRequest:
        if (self.requests is None) == (self.request_id is None):
            raise ValueError("give exactly one of 'requests' (to queue) or 'request_id' (to poll)")
        return self
