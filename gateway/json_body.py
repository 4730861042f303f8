"""JSON on the gateway's wire. Request bodies: read within a size limit
(BodyTooLargeError past it), then decoded, where every way a body can fail to decode
ends in one ValueError. Answers: encoded so that no line splitter can cut them."""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from starlette.requests import Request

# A \u escape of a UTF-16 surrogate (D800-DFFF): only a body holding one can decode to a
# string that is not text, so only such a body pays for the check.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_TOO_MANY_DIGITS = re.compile(r"^Exceeds the limit \(\d+ digits\) for integer string conversion")


# Characters JSON leaves raw in a string that some readers still take for line ends
# (str.splitlines, JavaScript before ES2019): escaped in what the gateway writes.
_LINE_BREAKS = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def json_bytes(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON whose only line ends are the ones JSON escapes."""
    return (
        json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        .translate(_LINE_BREAKS)
        .encode()
    )


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")


def load_json(raw: bytes) -> Any:
    """The JSON value of a request body.

    Raises ValueError with the reason for a body that is not UTF-8, not JSON, nested past the
    decoder's recursion limit (RecursionError otherwise), holding NaN or Infinity (which
    Python's decoder takes, and JSON has not), an integer longer than
    Python converts (its own ValueError) or a string with an unpaired surrogate escape, so
    callers answer every one as the client's 400."""
    # JSON between systems is UTF-8 (RFC 8259): json.loads would also guess UTF-16 or -32
    # from bytes and skip a UTF-8 byte order mark.
    text = raw.decode("utf-8")  # UnicodeDecodeError is a ValueError
    try:
        value = json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as exc:
        if _TOO_MANY_DIGITS.search(str(exc)):
            # Python's own words name a function of its own, not the client's fault.
            limit = sys.get_int_max_str_digits()
            raise ValueError(f"an integer has more than {limit} digits") from None
        raise
    if _SURROGATE_ESCAPE.search(raw):
        # The escapes may spell half of a UTF-16 pair (\ud800): valid JSON, but no text, and
        # it would fail only later, re-encoded for a node, with an error about the node's body.
        try:
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ValueError("a string holds an unpaired UTF-16 surrogate") from None
    return value


class BodyTooLargeError(Exception):
    """A request body past its limit (raised before the rest of it is read)."""


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused as soon as it is known to pass `limit` bytes: from its
    Content-Length before anything is read, else while it streams in, so a huge body is
    never held in memory."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError(f"request body is {int(declared)} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError(f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
