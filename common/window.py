"""The window rule: a request's prompt and its output fit in the tokens one request may hold.

Where a request runs, it may hold `Window.num_tokens` tokens, prompt and output together:
the model's context window, or fewer where a node's KV pool holds fewer. A max_tokens the
client named is refused when it does not fit; the gateway's default (`max_tokens_is_default`
on the node wire) is shortened to what the window leaves instead, OpenAI's rule when
max_tokens is left out.

The gateway asks before it knows the prompt's length (a max_tokens that leaves no room for
any prompt), the node server once it has tokenized the prompt, and the engine for every
request it queues; each raises its own room's error with the words `refusal` returns.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    num_tokens: int  # the most tokens (prompt + output) one request may hold here
    context_window: int  # the model's; more than num_tokens where a KV pool holds fewer

    @classmethod
    def of_context(cls, context_window: int) -> Window:
        """A window that the model's context alone bounds."""
        return cls(context_window, context_window)

    def fit_max_tokens(self, max_tokens: int, num_prompt_tokens: int | None = None) -> int:
        """A default max_tokens shortened to what the window leaves after the prompt (at
        least one token of it, where its length is not known yet); unchanged where it fits
        or where nothing is left, which `refusal` then names."""
        room = self.num_tokens - (1 if num_prompt_tokens is None else num_prompt_tokens)
        return room if 0 < room < max_tokens else max_tokens

    def refusal(
        self,
        max_tokens: int,
        num_prompt_tokens: int | None = None,
        *,
        is_default: bool = False,
        max_tokens_name: str = "max_tokens",
    ) -> str | None:
        """Why a request of `num_prompt_tokens` (None: not counted yet, so at least one) and
        `max_tokens` does not fit, in the words every room answers with; None when it fits.
        `is_default`: the client named no max_tokens, so a prompt not counted yet is never
        refused here (the node counts it and shortens the default)."""
        num_prompt = 1 if num_prompt_tokens is None else num_prompt_tokens
        if num_prompt + max_tokens <= self.num_tokens:
            return None
        if self.num_tokens == self.context_window:
            where = f"the context window of {self.num_tokens} tokens"
        else:
            where = (
                f"the {self.num_tokens} tokens this node's KV cache holds "
                f"(context window {self.context_window})"
            )
        if num_prompt_tokens is None:
            if is_default:
                return None
            return f"{max_tokens_name} ({max_tokens}) leaves no room for a prompt in {where}"
        if is_default:  # the prompt alone leaves no room: no max_tokens of the client's to name
            return f"prompt ({num_prompt_tokens} tokens) exceeds {where} with room for an answer"
        asked = f"prompt ({num_prompt_tokens} tokens) + {max_tokens_name} ({max_tokens})"
        return f"{asked} exceeds {where}"
