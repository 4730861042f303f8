"""Constrained decoding: a request's grammar compiled once, matched token by token, and
applied as a mask on its row of logits.

xgrammar, picked over llguidance for its per-token mask, about 10x faster on SmolLM2's
vocabulary (docs/benchmarks.md, "Constrained decoding").

    GrammarCompiler   one per tokenizer: GrammarSpec -> Grammar, cached, thread-safe (the
                      server compiles off the engine thread, before the request is queued)
    Grammar           a compiled grammar; `matcher()` starts a request's walk through it
    Matcher           one request's state: which tokens may come next; advanced by each
                      token sampled, and only by those, so a preempted request (whose KV is
                      recomputed, not its tokens) keeps it, and a handed-off request's
                      matcher is rebuilt by replaying its tokens
    GrammarMasks      one step's masks: filled on the host for the rows that have a grammar,
                      applied to those rows of the logits on their device

xgrammar is imported when the first grammar is compiled: an engine that is never asked
for one runs without it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from common.node_api import GrammarSpec
from gpu_node.errors import EngineError, InvalidGrammarError

if TYPE_CHECKING:
    from gpu_node.models.tokenizer import ChatTokenizer

# xgrammar's C++ errors begin with a time stamp, a source location and an assertion.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")
_COMPACT = (",", ":")


def _import_xgrammar() -> Any:
    import os

    # apache-tvm-ffi (xgrammar's binding) would otherwise build a torch extension with the
    # host's compiler on first import; xgrammar never needs it.
    os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    import xgrammar

    return xgrammar


class Grammar:
    """A compiled grammar (for one tokenizer)."""

    def __init__(self, spec: GrammarSpec, compiled: Any) -> None:
        self.spec = spec
        self._compiled = compiled

    def matcher(self) -> Matcher:
        return Matcher(self._compiled)


class Matcher:
    """Where one request stands in its grammar."""

    def __init__(self, compiled: Any) -> None:
        xgr = _import_xgrammar()
        self._matcher = xgr.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into `bitmask[row]` (int32 [rows, ceil(V / 32)],
        on the host): bit t set when token t may come. Stop tokens are allowed only where
        the grammar is complete."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advances past `token`; False (the state unchanged) when the grammar refuses it."""
        return bool(self._matcher.accept_token(token))

    def replay(self, tokens: list[int]) -> bool:
        """Advances past each of `tokens`; False when the grammar refuses one."""
        return all(self.accept(t) for t in tokens)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: nothing may follow."""
        return bool(self._matcher.is_terminated())


class GrammarCompiler:
    """Compiles grammar specs for one tokenizer's vocabulary, keeping the last
    `max_cached` compiled (a spec's JSON text is its key). Thread-safe."""

    def __init__(self, tokenizer: ChatTokenizer, vocab_size: int, max_cached: int = 256) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._max_cached = max_cached
        self._compiler: Any = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.num_hits = 0

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The grammar `spec` describes; InvalidGrammarError naming the problem when it
        is not one."""
        key = spec.model_dump_json()
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return found
            compiler = self._compiler_for_vocabulary()
        # Compiled outside the lock: xgrammar's compiler is thread-safe, and a large
        # schema must not hold back a small one.
        try:
            grammar = Grammar(spec, _compile(compiler, spec))
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _LOCATION.sub("", str(exc)).strip().splitlines()[0] if str(exc) else ""
            raise InvalidGrammarError(
                f"invalid {spec.kind} grammar: {message or type(exc).__name__}"
            ) from None
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = grammar
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return grammar

    def _compiler_for_vocabulary(self) -> Any:
        """xgrammar's compiler over the tokenizer's vocabulary, built on first use (most
        of a second for a 49K vocabulary)."""
        if self._compiler is None:
            try:
                xgr = _import_xgrammar()
                from transformers import PreTrainedTokenizerFast
            except ImportError as exc:
                raise EngineError(
                    f"constrained decoding needs xgrammar, which this node cannot import: {exc}"
                ) from None

            # The tokenizers.Tokenizer the ChatTokenizer wraps (it exposes no accessor).
            backend = self._tokenizer._tok
            info = xgr.TokenizerInfo.from_huggingface(
                PreTrainedTokenizerFast(tokenizer_object=backend),
                vocab_size=self._vocab_size,
                stop_token_ids=sorted(self._tokenizer.stop_token_ids),
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def _compile(compiler: Any, spec: GrammarSpec) -> Any:
    kind = spec.kind
    if kind == "json_schema":
        try:
            json.loads(spec.value)
        except ValueError as exc:
            raise ValueError(f"the schema is not JSON: {exc}") from None
        return compiler.compile_json_schema(
            spec.value, any_whitespace=False, separators=_COMPACT, strict_mode=True
        )
    if kind == "json_object":
        return compiler.compile_json_schema(
            '{"type": "object"}', any_whitespace=False, separators=_COMPACT, strict_mode=False
        )
    if kind == "regex":
        return compiler.compile_regex(spec.value)
    if kind == "choice":
        if not spec.choices:
            raise ValueError("a choice grammar needs at least one choice")
        return compiler.compile_grammar(
            "root ::= " + " | ".join(_ebnf_string(c) for c in spec.choices)
        )
    if kind == "ebnf":
        return compiler.compile_grammar(spec.value)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(spec.value)
    raise ValueError(f"unknown grammar kind {kind!r}")


def _ebnf_string(text: str) -> str:
    """`text` as an EBNF string literal (JSON's escapes are GBNF's)."""
    if not text:
        raise ValueError("a choice must not be empty")
    return json.dumps(text, ensure_ascii=False)


class GrammarMasks:
    """One step's token masks for the rows of the logits that have a grammar."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._width = -(-vocab_size // 32)
        self._bitmask = torch.empty((0, self._width), dtype=torch.int32)

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[Matcher]) -> None:
        """Sets to -inf, in place, each token that `matchers[i]` does not allow next in
        row `rows[i]` of `logits` [N, V]; the other rows are not touched. The bitmasks are
        filled on the host and applied on the logits' device (xgrammar's kernel: C++ on
        the CPU, Triton on a GPU)."""
        if not rows:
            return
        xgr = _import_xgrammar()
        if len(self._bitmask) < len(logits):
            self._bitmask = torch.empty((len(logits), self._width), dtype=torch.int32)
        bitmask = self._bitmask[: len(logits)]  # [N, W]; rows not named are never read
        for row, matcher in zip(rows, matchers, strict=True):
            matcher.fill(bitmask, row)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device), vocab_size=logits.shape[-1], indices=rows
        )
