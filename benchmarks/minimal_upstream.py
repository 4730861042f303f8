"""A minimal upstream that speaks the node's internal API, for measuring the gateway alone.

It answers `POST /internal/v1/generate` at once with `max_tokens` NDJSON
chunks (one word each) and the final usage line, plus health and capacity —
no model, as little CPU as possible, so that what the benchmark measures is
the gateway. Benchmarks only: tests always use the real node.

    python benchmarks/minimal_upstream.py --port 9100
"""

from __future__ import annotations

import argparse
import asyncio
import json

CAPACITY = {
    "node_id": "upstream",
    "address": "",
    "role": "mixed",
    "models": ["smollm2"],
    "num_pages": 4096,
    "num_free_pages": 4096,
    "page_size": 16,
    "kv_dtype": "fp32",
    "num_running": 0,
    "num_waiting": 0,
    "load": 0.0,
    "published_at": 0.0,
    "ttl_s": 3.0,
}


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    head = b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + content_type
    return head + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body


def _generate(body: bytes) -> bytes:
    request = json.loads(body)
    num_tokens = int(request.get("max_tokens", 16))
    lines = [b'{"text":"tok ","token_ids":[1],"prompt_tokens":8,"cached_tokens":0}\n']
    lines += [b'{"text":"tok ","token_ids":[1]}\n'] * (num_tokens - 1)
    usage = {"prompt_tokens": 8, "completion_tokens": num_tokens, "cached_tokens": 0}
    lines.append(json.dumps({"finish_reason": "length", "usage": usage}).encode() + b"\n")
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(line), line) for line in lines)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + chunks + b"0\r\n\r\n"


class UpstreamProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, Content-Length bodies only (what httpx sends)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self._buffer[:end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self._buffer) < end + 4 + length:
                return
            body = self._buffer[end + 4 : end + 4 + length]
            self._buffer = self._buffer[end + 4 + length :]
            method, path, _ = head.split(" ", 2)
            assert self._transport is not None
            self._transport.write(self._answer(method, path, body))

    def _answer(self, method: str, path: str, body: bytes) -> bytes:
        if method == "POST" and path == "/internal/v1/generate":
            return _generate(body)
        if method == "DELETE":
            return b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n"
        if path == "/internal/v1/capacity":
            return _response("200 OK", json.dumps(CAPACITY).encode())
        if path == "/internal/v1/health":
            return _response("200 OK", b'{"status":"ok"}')
        return _response("404 Not Found", b'{"error":{"code":"not_found","message":"no route"}}')


async def serve(host: str, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(
        UpstreamProtocol, host, port, backlog=1024
    )
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    args = parser.parse_args()
    import uvloop

    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
