"""What the gateway is asked to run for a client, once its request is validated: a
generation (`GenerationJob`, streamed from a node's engine) or an embedding
(`EmbeddingJob`, one answer from a node's encoder). Admission, placement, metering and
tracing take either (`Job`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.node_api import GenerateParams
from gateway.catalog import CatalogModel


@dataclass(frozen=True)
class GenerationJob:
    request_id: str
    account_id: str
    model: CatalogModel
    payload: GenerateParams  # what the node is asked to generate
    estimated_tokens: int  # prompt estimate + max_tokens: what admission and placement reserve
    reject_if_busy: bool = False  # Workers AI options.rejectIfBusy: never wait for a node
    stream: bool = False  # the client reads the answer as it comes (gen_ai.request.stream)
    max_tokens_name: str = "max_tokens"  # the field the client named it in, for its errors
    # x-session-affinity: placement's key to the node holding the session's prefix (never
    # logged: the client's own words)
    session_id: str | None = field(default=None, repr=False)

    @property
    def operation_name(self) -> str:
        """The GenAI operation: `chat` for a conversation, `text_completion` for a bare
        prompt (templated or raw)."""
        return "chat" if self.payload.messages is not None else "text_completion"


@dataclass(frozen=True)
class EmbeddingJob:
    """Texts, or token arrays, to embed: exactly one of `texts` and `token_ids`."""

    request_id: str
    account_id: str
    model: CatalogModel
    texts: list[str] | None
    token_ids: list[list[int]] | None
    estimated_tokens: int  # the inputs' tokens, guessed from characters: what is reserved
    truncate: bool = False  # cut an input past the model's positions instead of refusing it
    reject_if_busy: bool = False
    session_id: str | None = field(default=None, repr=False)  # as GenerationJob's
    operation_name = "embeddings"
    stream = False

    @property
    def num_inputs(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids or ())


Job = GenerationJob | EmbeddingJob


def estimate_input_tokens(
    texts: list[str] | None, token_ids: list[list[int]] | None, max_tokens: int
) -> int:
    """An embedding request's tokens: exact for token arrays; for texts, about 3 characters
    a token (rounded up) and the model's [CLS]/[SEP], at most `max_tokens` each."""
    if token_ids is not None:
        return sum(len(one) for one in token_ids)
    return sum(min(len(text) // 3 + 3, max_tokens) for text in texts or ())
