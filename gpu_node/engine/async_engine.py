"""The engine behind an async API: one background thread steps the engine, many
coroutines submit requests and iterate over their outputs.

Hand-offs cross threads through a command queue (submit / abort) into the
engine thread, and `loop.call_soon_threadsafe` back to each request's
asyncio.Queue. Closing a request's async iterator early aborts it, which frees
its pages at once. An abort can overtake its own submit (the two come on different
connections): the engine remembers the last `REMEMBERED_ABORTS` ids it could not find,
and refuses such a request when it comes (RequestCancelledError), so it never runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from common.node_api import GrammarSpec
from gpu_node.config import EngineConfig
from gpu_node.engine.grammar import Grammar
from gpu_node.engine.handoff import KVHandoff
from gpu_node.engine.llm_engine import LLMEngine
from gpu_node.engine.outputs import EngineStats, RequestOutput, ends_request
from gpu_node.errors import EngineError, EngineStoppedError, RequestCancelledError
from gpu_node.models.weights import Progress
from scheduler.sequence import SamplingParams

log = logging.getLogger(__name__)

REMEMBERED_ABORTS = 4096


@dataclass(frozen=True)
class _Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str
    sink: _Sink
    prefill_only: bool = False
    handoff: KVHandoff | None = None
    grammar: Grammar | None = None
    n: int = 1


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Sink:
    """Delivers outputs from the engine thread to one request's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int = 1):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.num_choices = n
        self.num_finished = 0  # choices finished (engine thread)

    def put(self, item: RequestOutput | BaseException) -> None:
        # RuntimeError: the request's loop is closed, so nobody is listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_request_tokens = engine.max_request_tokens
        self._commands: queue.Queue[_Submit | _Abort | None] = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._aborted_early: OrderedDict[str, None] = OrderedDict()  # engine thread only
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._stats = engine.stats()

    @classmethod
    def from_config(cls, config: EngineConfig, progress: Progress | None = None) -> AsyncEngine:
        return cls(LLMEngine.from_config(config, progress))

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._thread is None or not self._thread.is_alive():
            self.engine.close()

    def stats(self) -> EngineStats:
        """A snapshot taken by the engine thread after its last step."""
        return self._stats

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def compile_grammar(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar for `spec` (cached), on the caller's thread: call it off
        the event loop (asyncio.to_thread). InvalidRequestError naming what is wrong."""
        return self.engine.grammars.compile(spec)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str = "",
        *,
        prefill_only: bool = False,
        handoff: KVHandoff | None = None,
        grammar: Grammar | None = None,
        n: int = 1,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; the last has `finished=True`.

        Raises InvalidRequestError before the first output on bad input.
        `prefill_only`, `handoff`, `grammar` (from `compile_grammar`) and `n`: as
        LLMEngine.add_request; with n > 1 the choices' outputs interleave, each finishing
        in turn, and the stream ends after the request's last (outputs.ends_request).
        """
        if self._stopped.is_set():
            raise EngineStoppedError("the engine is shutting down")
        sink = _Sink(asyncio.get_running_loop(), n)
        submit = _Submit(
            request_id, list(prompt_token_ids), params, cache_salt, sink, prefill_only,
            handoff, grammar, n,
        )  # fmt: skip
        self._commands.put(submit)
        finished = False
        num_finished = 0
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine refused it or dropped it: nothing to abort
                    raise item
                num_finished += item.finished
                if ends_request(item, num_finished, n):
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    # -- the engine thread ---------------------------------------------------------------

    def _loop(self) -> None:
        engine = self.engine
        while True:
            commands = self._drain(block=not engine.has_unfinished())
            for command in commands:
                if command is None:
                    self._fail_all(EngineStoppedError("the engine stopped"))
                    return
                self._apply(command)
            try:
                outputs = engine.step()
            except Exception as exc:  # a bug: fail what runs, keep serving new requests
                log.exception("engine step failed")
                self._fail_all(EngineError(f"engine step failed: {exc}"))
                continue
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    sink.put(out)
                    sink.num_finished += out.finished
                    if ends_request(out, sink.num_finished, sink.num_choices):
                        del self._sinks[out.request_id]
            self._stats = engine.stats()

    def _drain(self, block: bool) -> list[_Submit | _Abort | None]:
        """Every pending command; waits for one first when the engine is idle."""
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Submit | _Abort) -> None:
        if isinstance(command, _Submit):
            if command.request_id in self._aborted_early:
                del self._aborted_early[command.request_id]
                command.sink.put(
                    RequestCancelledError(f"request {command.request_id} was cancelled")
                )
                return
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.params,
                    command.cache_salt,
                    prefill_only=command.prefill_only,
                    handoff=command.handoff,
                    grammar=command.grammar,
                    n=command.n,
                )
            except EngineError as exc:
                command.sink.put(exc)
                return
            except Exception as exc:  # a bug: refuse this request, keep the engine thread
                log.exception("adding request %s failed", command.request_id)
                command.sink.put(EngineError(f"could not add the request: {exc}"))
                return
            self._sinks[command.request_id] = command.sink
        else:
            final = self.engine.abort(command.request_id)
            sink = self._sinks.pop(command.request_id, None)
            if final is None and sink is None:  # not here yet, or long gone
                self._aborted_early[command.request_id] = None
                while len(self._aborted_early) > REMEMBERED_ABORTS:
                    self._aborted_early.popitem(last=False)
            elif final is not None and sink is not None:
                sink.put(final)
        self._stats = self.engine.stats()

    def _fail_all(self, exc: EngineError) -> None:
        for request_id, sink in list(self._sinks.items()):
            self.engine.abort(request_id)
            sink.put(exc)
        self._sinks.clear()
