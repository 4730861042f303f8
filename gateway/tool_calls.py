"""Tool calls read out of an answer as its text arrives, for both dialects' answers.

A call is written as the tool-call grammar holds it (common/tool_grammar.py):

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

`ToolCallReader.feed(text)` turns the answer's text, chunk by chunk, into `Content` (text
outside calls), `CallStart` (a call's function, once its name is whole) and
`CallArguments` (its arguments' JSON text, piece by piece, as the model writes it), so a
stream can send OpenAI's `tool_calls` deltas as they come. Text that may be the start of
a call's opening or closing mark is held back until the next chunk says which it is;
blanks around calls (the newline between parallel calls) are not content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from common.tool_grammar import CALL_BEGIN, CALL_END

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_CLOSE = "}" + CALL_END  # the call object's brace, then the closing mark


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # of the call in the answer, from 0
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


Piece = Content | CallStart | CallArguments


def _held(text: str, mark: str) -> int:
    """How many characters at the end of `text` could begin `mark`."""
    for size in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ToolCallReader:
    _buffer: str = ""
    _state: str = "text"  # text | head (after <tool_call>) | arguments
    _blank: str = ""  # blanks held back: content only if more text follows
    _after_call: bool = False  # no text since the last call ended
    num_calls: int = 0
    arguments: list[str] = field(default_factory=list)  # each call's whole arguments text
    names: list[str] = field(default_factory=list)

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        out: list[Piece] = []
        while True:
            if self._state == "text":
                at = self._buffer.find(CALL_BEGIN)
                end = len(self._buffer) - _held(self._buffer, CALL_BEGIN) if at < 0 else at
                self._content(self._buffer[:end], out)
                self._buffer = self._buffer[end:]
                if at < 0:
                    return out
                self._buffer = self._buffer[len(CALL_BEGIN) :]
                self._blank = ""
                self._state = "head"
            elif self._state == "head":
                match = _HEAD.match(self._buffer)
                if match is None or match.end() == len(self._buffer):
                    return out  # the name is not whole yet (or its JSON may go on)
                name = json.loads(match.group(1))
                self.names.append(name)
                self.arguments.append("")
                out.append(CallStart(self.num_calls, name))
                self._buffer = self._buffer[match.end() :]
                self._state = "arguments"
            else:
                at = self._buffer.find(_CLOSE)
                end = len(self._buffer) - _held(self._buffer, _CLOSE) if at < 0 else at
                if end:
                    self.arguments[-1] += self._buffer[:end]
                    out.append(CallArguments(self.num_calls, self._buffer[:end]))
                self._buffer = self._buffer[end:]
                if at < 0:
                    return out
                self._buffer = self._buffer[len(_CLOSE) :]
                self.num_calls += 1
                self._after_call = True
                self._state = "text"

    def finish(self) -> list[Piece]:
        """What is left once the answer has ended: held-back text, or a call the answer
        ended inside (cut at max_tokens), as far as it went."""
        out: list[Piece] = []
        if self._state == "text":
            self._content(self._buffer, out)
            if not self.num_calls and self._blank:
                out.append(Content(self._blank))
        elif self._state == "head":
            self._content(CALL_BEGIN + self._buffer, out)
        elif self._buffer:
            self.arguments[-1] += self._buffer
            out.append(CallArguments(self.num_calls, self._buffer))
        self._buffer, self._blank = "", ""
        return out

    def _content(self, text: str, out: list[Piece]) -> None:
        """Text outside calls: sent, except blanks that may turn out to lie between calls
        (held until text follows them; dropped after a call and before one)."""
        text, self._blank = self._blank + text, ""
        if self._after_call:
            text = text.lstrip()
        body = text.rstrip()
        self._blank = text[len(body) :]
        if body:
            out.append(Content(body))
            self._after_call = False
