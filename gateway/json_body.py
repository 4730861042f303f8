"""Request bodies as JSON: every way a body can fail to decode ends in one ValueError."""

from __future__ import annotations

import json
from typing import Any


def load_json(raw: bytes) -> Any:
    """The JSON value of a request body.

    Raises ValueError with the reason for a body that is not UTF-8, not JSON, nested past the
    decoder's recursion limit (RecursionError otherwise), holding an integer longer than
    Python converts (its own ValueError) or a string with an unpaired surrogate escape, so
    callers answer every one as the client's 400."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if b"\\u" in raw:
        # An escape may spell half of a UTF-16 pair (\ud800): valid JSON, but no text, and
        # it would fail only later, re-encoded for a node, with an error about the node's body.
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ValueError("a string holds an unpaired UTF-16 surrogate") from None
    return value
