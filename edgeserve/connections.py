"""Connection limits of the gateway and node servers: what a client may hold open, and for how long.

    a connection:  open ─ head ≤ header_timeout_s, ≤ max_header_bytes
                   ─ body (idle ≤ body_timeout_s, in all ≤ body_deadline_s from the head's end)
                   ─ response (unbounded: SSE) ─ keep-alive idle ≤ keep_alive_timeout_s ─ next head ...

    past a limit        the client reads                                  and then
    head too slow       408 Request Timeout (nothing if no byte came)     linger, close
    head too large      431 Request Header Fields Too Large, at once      linger, close
    body stalled        408 Request Timeout (a response begun is cut)     linger, close
    body past deadline  408 Request Timeout (a response begun is cut)     linger, close
    answer before body  the app's response; the rest of the body unread   linger, close
    connections full    503 Service Unavailable, at accept                linger, close
    max requests        its last response carries Connection: close       close

To linger is to end the answer (FIN) and read and drop input for LINGER_S before closing:
closing with unread input sends a TCP reset, which can destroy the answer before the client
reads it. Silence and a cut response close at once. A refusal at the connection cap lingers
outside the cap, at most MAX_LINGERING_REFUSALS at once a server; past them it closes at once.

The servers stay uvicorn's with httptools (the gateway's SSE streaming, the shared event
loop of `up`'s two servers, and the tests' in-process servers all keep working), with
`LimitedHttpToolsProtocol` in place of its protocol. uvicorn has the keep-alive timeout
but no header deadline, no header cap with httptools (whose parser concatenates a header
value as it arrives, so memory and time grow with it), no body deadline and no
connection cap that answers before the request. hypercorn has a header cap (h11) but no
connection cap and one read timeout for everything; granian bounds heads and connections
in Rust but runs the app in workers of its own, not beside `up`'s node on one loop.

The subclass reads uvicorn's HttpToolsProtocol internals (its parser callbacks, `cycle`,
`flow`, `connections`), so pyproject.toml pins uvicorn to the minor versions tested.
"""

from __future__ import annotations

import asyncio
import resource
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

# A refused client may still be sending (the rest of a huge head, a body): its bytes are read
# and dropped for this long after the answer, so that closing with unread input (a TCP reset)
# does not destroy the answer before the client reads it.
LINGER_S = 2.0
# Refusals at the connection cap that linger at once, per server: each holds a descriptor for
# LINGER_S outside the cap, so a flood of them is bounded here, not by the cap.
MAX_LINGERING_REFUSALS = 32
# Descriptors kept out of the connection cap's share: logs, Redis, the ledger, listening sockets.
RESERVED_FDS = 256
DEFAULT_MAX_CONNECTIONS = 10_000


@dataclass(frozen=True)
class ConnectionLimits:
    """Bounds on each server's connections (one server a process, two in `up`)."""

    # From connection open, or the end of the previous response, to the end of the head.
    header_timeout_s: float = 10.0
    # Request line and headers, the blank line included.
    max_header_bytes: int = 64 * 1024
    # Longest wait for the next byte of a request body while the app reads it.
    body_timeout_s: float = 10.0
    # From the end of the head to the end of the body, while the server reads: a body sent a
    # byte at a time, never idle for body_timeout_s, still ends here.
    body_deadline_s: float = 60.0
    # Idle time between a response and the next request's first byte.
    keep_alive_timeout_s: float = 5.0
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_requests_per_connection: int = 1000

    def __post_init__(self) -> None:
        for name in (
            "header_timeout_s",
            "body_timeout_s",
            "body_deadline_s",
            "keep_alive_timeout_s",
        ):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        for name, least in (
            ("max_header_bytes", 1024),
            ("max_connections", 1),
            ("max_requests_per_connection", 1),
        ):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be at least {least}, got {getattr(self, name)}")
        if self.keep_alive_timeout_s > self.header_timeout_s:
            # The next request's head is due header_timeout_s after the previous response.
            raise ValueError(
                f"keep_alive_timeout_s must be at most header_timeout_s ({self.header_timeout_s}), "
                f"got {self.keep_alive_timeout_s}"
            )
        if self.body_deadline_s < self.body_timeout_s:
            raise ValueError(
                f"body_deadline_s must be at least body_timeout_s ({self.body_timeout_s}), "
                f"got {self.body_deadline_s}"
            )


def raise_open_file_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # a container may forbid it: the cap follows the soft limit as it is
    return int(soft)


def default_max_connections(open_file_limit: int) -> int:
    """A third of the descriptors left after RESERVED_FDS, at most DEFAULT_MAX_CONNECTIONS: a
    gateway connection may hold a second to its node, and in `up` the node's end is a third."""
    return max(1, min(DEFAULT_MAX_CONNECTIONS, (open_file_limit - RESERVED_FDS) // 3))


def protocol_class(limits: ConnectionLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class to pass as uvicorn.Config(http=...) for a server bounded by `limits`.
    One class a server: its lingering refusals are counted per server."""
    return type(
        "BoundedHttpToolsProtocol",
        (LimitedHttpToolsProtocol,),
        {"limits": limits, "lingering_refusals": set()},
    )


def _response(status: int, reason: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    body = reason.encode("ascii")
    lines = [STATUS_LINE[status]]
    lines += [name + b": " + value + b"\r\n" for name, value in default_headers]
    lines += [
        b"content-type: text/plain; charset=utf-8\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n\r\n",
        body,
    ]
    return b"".join(lines)


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol under ConnectionLimits (see the module docstring).

    While a head is incomplete, bytes reach the parser only in whole lines (what is after
    the last line feed waits here), so the parser never joins a header from many pieces,
    and every byte read counts against max_header_bytes before any is kept."""

    limits: ClassVar[ConnectionLimits]
    # Refused at the cap and lingering: uvicorn's `connections` leaves them out.
    lingering_refusals: ClassVar[set[LimitedHttpToolsProtocol]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head = bytearray()  # the partial last line of a head, held back from the parser
        self._num_head_bytes = 0  # of the head in progress, fed to the parser
        self._is_reading_head = True
        self._is_lingering = False  # input is read and dropped until the close
        self._num_requests = 0
        self._last_body_at = 0.0
        self._body_checked_at = 0.0
        self._body_due_at = 0.0  # the head's end + body_deadline_s + time the server did not read
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None

    # -- connection ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            # Answered before any byte is read: the excess costs neither a parse nor a wait.
            self.transport = transport
            self._is_lingering = True
            transport.write(
                _response(503, "too many connections", self.server_state.default_headers)
            )
            if len(self.lingering_refusals) < MAX_LINGERING_REFUSALS:
                self.lingering_refusals.add(self)
                self._linger_and_close()
            else:
                transport.close()
            return
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()  # a pending timer would hold this protocol until it fired
        self._head_timer = self._body_timer = self._linger_timer = None
        self._head.clear()
        self.lingering_refusals.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._is_lingering or self.transport.is_closing():
            return
        if not self._is_reading_head:
            super().data_received(data)
            return
        searched = len(self._head)  # what is held back has no line feed
        self._head += data
        while self._is_reading_head and self._head and not self.transport.is_closing():
            room = self.limits.max_header_bytes - self._num_head_bytes
            end = self._head.rfind(b"\n", searched, room) + 1
            if not end:
                if len(self._head) >= room:  # the head cannot end within the cap
                    self._refuse(
                        431, f"request line and headers exceed {self.limits.max_header_bytes} bytes"
                    )
                return
            lines = bytes(self._head[:end])
            del self._head[:end]
            searched = 0
            self._num_head_bytes += end
            super().data_received(lines)
        if self._head and not self.transport.is_closing():
            rest = bytes(self._head)  # the head ended in the lines fed: this is its body
            self._head.clear()
            super().data_received(rest)

    # -- parser callbacks ----------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self._is_reading_head = False
        self._cancel_head_timer()
        super().on_headers_complete()
        self._num_requests += 1
        if self._num_requests >= self.limits.max_requests_per_connection and self.cycle:
            self.cycle.keep_alive = False  # its response says Connection: close
        self._last_body_at = self._body_checked_at = self.loop.time()
        self._body_due_at = self._last_body_at + self.limits.body_deadline_s
        if self._body_timer is not None:
            self._body_timer.cancel()
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._on_body_timeout)

    def on_body(self, body: bytes) -> None:
        self._last_body_at = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._is_reading_head = True
        # Bytes of a pipelined head fed with this message's end are not counted: at most one read.
        self._num_head_bytes = 0
        if self.cycle.response_complete:
            self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing() or not self.cycle.response_complete:
            return  # closed, or a pipelined request is next
        if self._is_reading_head:
            self._arm_head_timer()
        else:
            # Answered before its body was read (a 401 for a body on its way): reading the rest
            # for keep-alive would let a client hold the connection with a byte now and then.
            self._linger_and_close()

    # -- deadlines -----------------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        if self.transport.is_closing():
            return
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._num_head_bytes == 0 and not self._head:
            # Nothing of a request came: an idle connection, closed the way keep-alive closes
            # one (a client that reuses it retries on the closed socket, not on a 408).
            self.transport.close()
            return
        self._refuse(408, f"request headers not received within {self.limits.header_timeout_s:g} s")

    def _on_body_timeout(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None:
            return
        now = self.loop.time()
        if self.flow.read_paused or cycle.waiting_for_100_continue:
            # The server is not reading, or the client awaits its 100 Continue: the time since
            # the last check is the server's, and counts against neither bound.
            self._body_due_at += now - self._body_checked_at
            self._last_body_at = now
        self._body_checked_at = now
        if now >= self._body_due_at:
            reason = f"request body not received within {self.limits.body_deadline_s:g} s"
        elif now - self._last_body_at >= self.limits.body_timeout_s:
            reason = f"no byte of the request body for {self.limits.body_timeout_s:g} s"
        else:
            due_at = min(self._last_body_at + self.limits.body_timeout_s, self._body_due_at)
            self._body_timer = self.loop.call_later(due_at - now, self._on_body_timeout)
            return
        if cycle.response_started:
            self.transport.close()  # the app reads a disconnect; its answer has gone out
            return
        self._refuse(408, reason)

    def _refuse(self, status: int, reason: str) -> None:
        """Answer `status` and close: the app, if running, reads a disconnect and writes nothing."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.write(_response(status, reason, self.server_state.default_headers))
        self._linger_and_close()

    def _linger_and_close(self) -> None:
        """End the answer written, read and drop input for LINGER_S, and close."""
        self._is_lingering = True
        self._head.clear()
        self._cancel_head_timer()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._unset_keepalive_if_required()
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        if self.flow is not None:  # none for a refusal at the cap, which never paused
            self.flow.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)
