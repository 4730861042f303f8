"""Prefill and mixed steps replayed from CUDA graphs, in pieces split at attention.

An eager step that prefills is bound by the host as a decode step is: on an H200, a
512-token step of a 1B-parameter model took 49 ms, of which its kernels ran 6; the rest was
Python launching them one by one (docs/benchmarks.md). Attention cannot be recorded once
for every such step: a chunk's attention reads a context whose length, and so the shape of
its work, changes every step. Everything else in a layer treats the step's tokens row by
row, so:

- the step's tokens are padded to a token bucket (`token_bucket`: 1, 2, 4, 8, 16, 24, 32,
  48, 64, 96, ... up to `max_tokens`); pad rows hold whatever token and position the buffers last held
  (each a valid id and position), and their rows of every product are their own;
- a bucket's step is recorded as L + 1 graphs, split at each layer's attention: graph 0
  runs the embedding and layer 0 up to its rotated q, k and v, which it copies into static
  buffers; graph i the rest of layer i - 1 (it reads attention's output from a static
  buffer) and layer i up to its q, k and v; graph L the rest of the last layer;
- between two graphs, attention runs eagerly over the step's real rows only
  (`PagedAttention`, page-ownership checks and all): it writes their K/V, attends and puts
  its output in the buffer the next graph reads. Pad rows write no K/V and are never
  attended over;
- the final norm and the lm_head run eagerly on the rows sampled from.

A bucket's first step runs its pieces eagerly (which compiles every kernel at the bucket's
shapes and gives that step's answer), then records them. Recording runs nothing, so it
changes no K/V. The graphs of all buckets share one memory pool: a step replays one
bucket's pieces in order, and what crosses from one piece to the next (the residual stream,
RoPE's angles) is written by one piece and read by the next with only eager attention,
which never allocates from the pool, in between.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch

from gpu_node.engine.attention import PagedAttention
from gpu_node.engine.decode_graphs import GraphCaptureError
from gpu_node.models.llama import LlamaModel

if TYPE_CHECKING:
    from gpu_node.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

# Up to this many rows, the INT4 products run the tensor-core GEMV (w4a16/mma.py), past it
# a dequantized copy through cuBLAS: small steps are padded to powers of two within it, so
# that padding never changes which kernel a product takes.
GEMV_ROWS = 8


def token_bucket(tokens: int, max_tokens: int) -> int | None:
    """The token count a step of `tokens` tokens is padded to: up to 8 tokens the next power
    of two (1, 2, 4, 8), then the smallest of 16, 24, 32, 48, 64, 96, ... (powers of two and
    three quarters of each, so that a step gets at most a third more rows) that holds it,
    capped at `max_tokens`; None past `max_tokens`."""
    if tokens < 1 or tokens > max_tokens:
        return None
    power = 1 << (tokens - 1).bit_length()  # the smallest power of two >= tokens
    if power > 2 * GEMV_ROWS and tokens <= power * 3 // 4:
        power = power * 3 // 4
    return min(power, max_tokens)


class _Pieces:
    """One bucket's recorded step: L + 1 graphs and the last one's output [b, D]."""

    def __init__(self, graphs: list[torch.cuda.CUDAGraph], hidden: torch.Tensor):
        self.graphs = graphs
        self.hidden = hidden


class StepGraphs:
    """Runs steps of up to `max_tokens` tokens from piecewise CUDA graphs: those that
    prefill, and decode batches larger than the decode graphs take.

    `capture=False` runs the same padded, static-buffer pieces eagerly every step (any
    device): the tests use it on CPU to check the padding and the pieces' hand-offs against
    the engine's own step.
    """

    def __init__(
        self, model: LlamaModel, device: torch.device, max_tokens: int, capture: bool = True
    ):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.model = model
        self.max_tokens = max_tokens
        self.capture = capture
        config = model.config
        dtype = model.embed_tokens.weight.dtype
        h, kv, e = config.num_heads, config.num_kv_heads, config.head_dim
        self._ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self._positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self._q = torch.zeros(max_tokens, h, e, dtype=dtype, device=device)
        self._k = torch.zeros(max_tokens, kv, e, dtype=dtype, device=device)
        self._v = torch.zeros(max_tokens, kv, e, dtype=dtype, device=device)
        self._out = torch.zeros(max_tokens, h, e, dtype=dtype, device=device)  # attention's
        self._pieces: dict[int, _Pieces] = {}
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        self.disabled = False  # set when a capture failed: these steps run eagerly then

    @classmethod
    def for_runner(cls, runner: ModelRunner, max_tokens: int, capture: bool = True) -> StepGraphs:
        return cls(runner.model, runner.device, max_tokens, capture)

    @property
    def captured(self) -> list[int]:
        """The token buckets recorded so far, sorted."""
        return sorted(self._pieces)

    def takes(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens runs here."""
        return not self.disabled and token_bucket(num_tokens, self.max_tokens) is not None

    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        attention: PagedAttention,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The step's logits [N, V] (fp32) of the rows at `logits_indices`; ids, positions [T]
        on the device, `attention` the step's own backend over its T real rows."""
        t = ids.shape[0]
        b = token_bucket(t, self.max_tokens)
        assert b is not None  # takes() checked it
        self._ids[:t].copy_(ids)
        self._positions[:t].copy_(positions)
        pieces = self._pieces.get(b) if self.capture else None
        if pieces is None:
            hidden = self._forward(b, t, attention)
            if self.capture:
                # A failed capture is logged; this step's answer stands, later ones run eagerly.
                with contextlib.suppress(GraphCaptureError):
                    self._pieces[b] = self._record(b)
            return self.model.logits(hidden[:t], logits_indices)
        for layer, graph in enumerate(pieces.graphs[:-1]):
            graph.replay()
            self._attend(attention, layer, t)
        pieces.graphs[-1].replay()
        return self.model.logits(pieces.hidden[:t], logits_indices)

    def _attend(self, attention: PagedAttention, layer: int, t: int) -> None:
        """Layer `layer`'s attention over the real rows' static q, k and v, into `_out`."""
        attention(layer, self._q[:t], self._k[:t], self._v[:t], out=self._out[:t])

    def _forward(self, b: int, t: int, attention: PagedAttention) -> torch.Tensor:
        """The pieces of a `b`-row step run eagerly, attention over the first `t` rows."""

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self._stage(q, k, v)
            self._attend(attention, layer, t)
            return self._out[: q.shape[0]]

        return self.model.hidden_states(self._ids[:b], self._positions[:b], attend)

    def _stage(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        b = q.shape[0]
        self._q[:b].copy_(q)
        self._k[:b].copy_(k)
        self._v[:b].copy_(v)

    def _record(self, b: int) -> _Pieces:
        """Records the `b`-row step as L + 1 graphs, split where each layer attends."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self._ids.device)
        assert self._stream is not None
        graphs: list[torch.cuda.CUDAGraph] = []

        def begin() -> None:
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=self._pool)

        def split(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self._stage(q, k, v)
            graphs[-1].capture_end()
            begin()
            return self._out[:b]

        torch.cuda.synchronize(self._ids.device)
        self._stream.wait_stream(torch.cuda.current_stream())
        capturing = False
        try:
            with torch.cuda.stream(self._stream):
                begin()
                capturing = True
                hidden = self.model.hidden_states(self._ids[:b], self._positions[:b], split)
                graphs[-1].capture_end()
                capturing = False
        except RuntimeError as exc:  # the step did something a graph cannot record
            if capturing:  # end it, unless it was already invalidated
                with contextlib.suppress(RuntimeError):
                    graphs[-1].capture_end()
            self.disabled = True
            log.exception("step graph capture failed; steps that prefill run eagerly from now on")
            raise GraphCaptureError(str(exc)) from exc
        finally:
            torch.cuda.current_stream().wait_stream(self._stream)
        log.info("captured the step graphs for %d tokens (%d pieces)", b, len(graphs))
        return _Pieces(graphs, hidden)
