"""Request bodies as JSON: every way a body can fail to decode ends in one ValueError."""

from __future__ import annotations

import json
from typing import Any


def load_json(raw: bytes) -> Any:
    """The JSON value of a request body.

    Raises ValueError with the reason for a body that is not UTF-8, not JSON, nested past the
    decoder's recursion limit (RecursionError otherwise) or holding an integer longer than
    Python converts (its own ValueError), so callers answer every one as the client's 400."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None
