"""The window rule's exact answers: where a request fits, how a default max_tokens is
shortened, and the words of each refusal (the gateway's, the node server's and the engine's)."""

from __future__ import annotations

from common.window import Window

CONTEXT = Window.of_context(1024)
SMALL_POOL = Window(128, 1024)  # a node whose KV pool holds fewer tokens than the context


def test_a_request_fits_up_to_the_last_token_of_the_window() -> None:
    assert CONTEXT.refusal(24, 1000) is None
    assert CONTEXT.refusal(1023) is None  # the prompt not counted yet: at least one token
    assert SMALL_POOL.refusal(28, 100) is None
    assert CONTEXT.refusal(25, 1000) == (
        "prompt (1000 tokens) + max_tokens (25) exceeds the context window of 1024 tokens"
    )


def test_a_max_tokens_that_leaves_no_room_for_any_prompt_is_refused_by_its_name() -> None:
    assert CONTEXT.refusal(1024, max_tokens_name="max_completion_tokens") == (
        "max_completion_tokens (1024) leaves no room for a prompt in the context window of "
        "1024 tokens"
    )
    assert CONTEXT.refusal(5000, is_default=True) is None  # the node counts, then shortens


def test_a_kv_pool_smaller_than_the_context_is_named_as_such() -> None:
    assert SMALL_POOL.refusal(40, 100) == (
        "prompt (100 tokens) + max_tokens (40) exceeds the 128 tokens this node's KV cache "
        "holds (context window 1024)"
    )
    assert SMALL_POOL.refusal(256, 128, is_default=True) == (
        "prompt (128 tokens) exceeds the 128 tokens this node's KV cache holds "
        "(context window 1024) with room for an answer"
    )


def test_a_default_max_tokens_is_shortened_to_what_the_window_leaves() -> None:
    assert CONTEXT.fit_max_tokens(256, 1000) == 24
    assert CONTEXT.fit_max_tokens(256, 100) == 256  # it fits as it is
    assert CONTEXT.fit_max_tokens(5000) == 1023  # the prompt not counted yet
    assert SMALL_POOL.fit_max_tokens(256, 128) == 256  # nothing left: refused, not zero
    assert SMALL_POOL.refusal(SMALL_POOL.fit_max_tokens(256, 120), 120, is_default=True) is None
