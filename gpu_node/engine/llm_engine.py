"""The synchronous engine: requests in, one step at a time, outputs out.

`LLMEngine.step()` asks the scheduler for a batch, runs it, samples, applies
stop conditions and returns what each request produced. It is driven by one
thread (`AsyncEngine`, the CLI, tests); nothing here is thread-safe.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.window import Window
from gpu_node.cache.kv_cache import build_kv_cache
from gpu_node.cache.kv_quant import DTYPE_NAMES
from gpu_node.config import EngineConfig
from gpu_node.engine.decode_graphs import DecodeGraphs, capturable
from gpu_node.engine.grammar import Grammar, GrammarCompiler, GrammarMasks, Matcher
from gpu_node.engine.handoff import KVHandoff, KVSpec, export_rows, import_rows
from gpu_node.engine.model_runner import ModelRunner, StepBroadcast
from gpu_node.engine.outputs import EngineEvent, EngineStats, RequestOutput, SampledLogprob
from gpu_node.engine.prefix_cache import PrefixCache
from gpu_node.engine.sampler import apply_penalties, draw
from gpu_node.engine.step_graphs import StepGraphs
from gpu_node.errors import InvalidRequestError, RequestTooLargeError
from gpu_node.models.llama import LlamaModel
from gpu_node.models.tokenizer import ChatTokenizer
from gpu_node.models.weights import Progress, activation_dtype, build_model
from scheduler.block_manager import BlockManager, pages_for, release_window, sequence_tag
from scheduler.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from scheduler.sequence import (
    SEED_RANGE,
    FinishReason,
    SamplingParams,
    Sequence,
    SequenceStatus,
)

if TYPE_CHECKING:
    from gpu_node.parallel.launch import TensorParallelGroup

log = logging.getLogger(__name__)


def _plain_greedy(params: SamplingParams) -> bool:
    """Greedy with no penalty nor logprobs: the token is its logits' argmax."""
    return (
        params.is_greedy
        and not params.logprobs
        and params.repetition_penalty == 1.0
        and not params.frequency_penalty
        and not params.presence_penalty
    )


@dataclass
class _RequestState:
    seq: Sequence
    generator: torch.Generator | None
    text_sent: int = 0  # characters of decoded text already emitted
    tokens_sent: int = 0
    text: str = ""  # the whole output decoded
    # Output decoding is incremental: `text[:settled_chars]` is the text of the first
    # `settled_tokens` tokens, ending on a whole character, so only the tokens after it
    # are decoded each step (byte-level BPE text concatenates at such boundaries).
    settled_tokens: int = 0
    settled_chars: int = 0
    stop_at: int | None = None  # where a stop string begins in `text`
    events: list[EngineEvent] = field(default_factory=list)
    prefill_only: bool = False  # hand the prompt's KV off after the first token
    handoff: KVHandoff | None = None  # a prefilled prompt's KV, imported on admission
    # Prompt tokens whose KV this request has had, computed or from the prefix cache or a
    # handoff (the most at any time: a preemption recomputes them, it does not undo them).
    num_prefilled: int = 0
    matcher: Matcher | None = None  # where the output stands in the request's grammar
    logprobs: list[SampledLogprob] = field(default_factory=list)  # one per output token
    index: int = 0  # the choice, of a request with n > 1
    parent_id: str = ""  # the request's id, of a choice past the first (n > 1)
    # Choices still to fork from this one once its prompt is computed (n > 1).
    fork: _Fork | None = None

    def record(self, name: str) -> None:
        self.events.append(EngineEvent(name, time.time_ns(), self.seq.num_held_pages))


@dataclass(frozen=True)
class _Fork:
    """What choices 1..n-1 of a request start from: its grammar and how many."""

    num_choices: int
    grammar: Grammar | None
    cache_salt: str


def choice_id(request_id: str, index: int) -> str:
    """The engine's id of choice `index` of a request with n > 1 (choice 0: its own)."""
    return request_id if index == 0 else f"{request_id}#{index}"


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel,
        tokenizer: ChatTokenizer,
        step_broadcast: StepBroadcast | None = None,
    ):
        """`step_broadcast`: under tensor parallelism (rank 0 of a group, `model` its shard),
        what sends each step's inputs to the other ranks (gpu_node/parallel/step.py); the
        steps then run eagerly, without the prefix cache, KV handoffs nor n > 1, which
        would move KV within rank 0's pool alone."""
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        mc = model.config
        self.model_name = config.model
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.kv_cache = build_kv_cache(config, mc)
        num_pages = self.kv_cache.num_pages
        computes_in = model.embed_tokens.weight.dtype
        if config.activations != "auto":
            wanted = activation_dtype(config.weights, config.device, config.activations)
            if computes_in != wanted:
                raise ValueError(
                    f"activations {config.activations} asked for, but the model computes in "
                    f"{DTYPE_NAMES[computes_in]} (build it with build_model(..., "
                    f"activations={config.activations!r}))"
                )
        self.kv_spec = KVSpec.of(self.kv_cache, computes_in)
        # Where every layer slides, pages past the window go back to the pool as a sequence
        # grows; a model with any global layer keeps them all, since that layer reads them.
        window = release_window(mc.layer_windows)
        self.block_manager = BlockManager(num_pages, config.page_size, config.device, window)
        self.prefix_cache = (
            PrefixCache(self.kv_cache, config.prefix_cache_blocks)
            if config.prefix_cache_blocks and window is None and step_broadcast is None
            else None
        )
        if config.prefix_cache_blocks and window is not None:
            # A prompt's leading pages are released as it prefills: none is left to keep at
            # its end, and admission takes no pages for a cached prefix to be copied into.
            log.info("prefix caching is off: this model's pages past its window are released")
        elif config.prefix_cache_blocks and step_broadcast is not None:
            log.info("prefix caching is off under tensor parallelism")
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.reserve_pages,
                config.long_prefill_tokens,
            ),
            self.block_manager,
        )
        self.runner = ModelRunner(
            model,
            self.kv_cache,
            self.block_manager.page_owner,
            self.block_manager.page_owner_host,
            self.block_manager.page_column_host,
            config.check_integrity,
        )
        self.runner.broadcast = step_broadcast
        records = self._records_graphs() and step_broadcast is None
        self.runner.graphs = self._decode_graphs(config) if records else None
        self.runner.step_graphs = self._step_graphs(config) if records else None
        self.num_integrity_violations = 0
        self.num_computed_tokens = 0  # tokens the model ran: prompt chunks and decode steps
        self._requests: dict[str, _RequestState] = {}
        self._seq_ids = itertools.count(1)
        self._rng = torch.Generator().manual_seed(config.seed)
        self.grammars = GrammarCompiler(tokenizer, mc.vocab_size)
        self._masks = GrammarMasks(mc.vocab_size)
        self._choices: dict[str, list[str]] = {}  # a request's choice ids (n > 1)
        self._parent_of: dict[str, str] = {}  # a choice's request
        # The group from_config started, under tensor parallelism (gpu_node/parallel/launch.py)
        self.parallel: TensorParallelGroup | None = None

    def _records_graphs(self) -> bool:
        """Whether CUDA graphs may record this engine's steps: on a GPU, for a model whose
        forward waits for nothing on the host (decode_graphs.capturable)."""
        if self.kv_cache.device.type != "cuda":
            return False
        if not capturable(self.model):
            log.info("this model's steps cannot be captured; they run eagerly")
            return False
        return True

    def _decode_graphs(self, config: EngineConfig) -> DecodeGraphs | None:
        """CUDA graphs for the runner's decode steps (decode_graphs.py), where asked for."""
        if not config.cuda_graph_batch:
            return None
        max_batch = min(config.cuda_graph_batch, config.max_num_seqs)
        return DecodeGraphs.for_runner(self.runner, max_batch, self.max_model_len)

    def _step_graphs(self, config: EngineConfig) -> StepGraphs | None:
        """Piecewise CUDA graphs for the runner's other steps (step_graphs.py), where asked for."""
        if not config.cuda_graph_tokens:
            return None
        max_tokens = min(config.cuda_graph_tokens, config.max_num_batched_tokens)
        return StepGraphs.for_runner(self.runner, max_tokens)

    @classmethod
    def from_config(cls, config: EngineConfig, progress: Progress | None = None) -> LLMEngine:
        """Loads the model named by `config.model` (raises ModelNotFoundError); with
        `config.tensor_parallel` > 1, this process's shard, the other ranks spawned."""
        if config.tensor_parallel > 1:
            from gpu_node.parallel.launch import start_tensor_parallel

            model, tokenizer, group = start_tensor_parallel(config)
            try:
                engine = cls(config, model, tokenizer, step_broadcast=group.sender)
            except BaseException:
                group.stop()
                raise
            engine.parallel = group
            return engine
        model, tokenizer = build_model(
            config.model, config.weights, config.device, progress, config.activations
        )
        return cls(config, model, tokenizer)

    def close(self) -> None:
        """Stops what the engine started beside it (a tensor-parallel group's other ranks);
        call it once its steps are over. Idempotent."""
        if self.parallel is not None:
            self.parallel.stop()

    # -- requests --------------------------------------------------------------------------

    def add_request(
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
    ) -> None:
        """Queues a request. Raises InvalidRequestError, changing nothing, on bad input.

        `prefill_only`: the request ends after its first token with finish reason
        "handoff", its output carrying the prompt's KV (`RequestOutput.handoff`) for a
        decode node. `handoff`: such a prefilled prompt; the request starts from its
        first token, its KV imported into this pool when the request is admitted.
        `grammar` (compiled by `self.grammars`, off this thread): the output is held to
        it, and ends when it is complete. `n`: that many choices of the one prompt,
        computed once: once choice 0 has its first token, choices 1..n-1 (ids
        `choice_id(request_id, i)`, outputs with `index` i) draw theirs from the same
        logits and start from a copy of its prompt's KV.
        """
        self.validate(request_id, prompt_token_ids, params)
        if self.runner.broadcast is not None and (prefill_only or handoff is not None or n > 1):
            raise InvalidRequestError(
                "KV handoffs and n > 1 are not served under tensor parallelism"
            )
        if n > 1:
            taken = [choice_id(request_id, i) for i in range(1, n)]
            if any(c in self._requests for c in taken):
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            if prefill_only or handoff is not None:
                raise InvalidRequestError("n > 1 cannot be combined with a KV handoff")
        if handoff is not None:
            self._validate_handoff(handoff, prompt_token_ids, params, prefill_only)
        self._refuse_whole_prompt_kv(
            len(prompt_token_ids), prefill_only or handoff is not None or n > 1
        )
        matcher = grammar.matcher() if grammar is not None else None
        if (
            matcher is not None
            and handoff is not None
            and not matcher.replay([handoff.first_token])
        ):
            raise InvalidRequestError("KV handoff refused: its first token breaks the grammar")
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            cache_salt=cache_salt,
            arrival=time.monotonic(),
            # A prompt handed off, or forked into n choices, is read whole from its pages.
            keeps_pages=prefill_only or n > 1,
        )
        seed = (
            params.seed
            if params.seed is not None
            else int(torch.randint(0, 2**62, (1,), generator=self._rng))
        )
        generator = None if params.is_greedy else torch.Generator().manual_seed(seed)
        if handoff is not None:
            # The prompt's KV arrives with the request: it starts from the first token.
            seq.output_token_ids.append(handoff.first_token)
            seq.num_computed_tokens = seq.num_prompt_tokens
            if generator is not None and handoff.generator_state is not None:
                state_bytes = bytearray(handoff.generator_state)
                generator.set_state(torch.frombuffer(state_bytes, dtype=torch.uint8).clone())
        state = _RequestState(
            seq, generator, prefill_only=prefill_only, handoff=handoff, matcher=matcher
        )
        if handoff is not None:
            state.num_prefilled = seq.num_prompt_tokens
            if handoff.first_logprob is not None and params.logprobs:
                state.logprobs.append(handoff.first_logprob)
        if n > 1:
            state.fork = _Fork(n, grammar, cache_salt)
            self._choices[request_id] = [choice_id(request_id, i) for i in range(n)]
            self._parent_of.update((c, request_id) for c in self._choices[request_id])
        state.record("queued")
        self._requests[request_id] = state
        self.scheduler.add(seq)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt and output together) one request can have here: the context
        window, or the whole KV pool where that holds fewer. Where pages past a window are
        released, the context window once the pool holds the pages a sequence needs to
        compute one token (`BlockManager.max_held_pages(1)`)."""
        bm = self.block_manager
        window_pages = bm.max_held_pages(1)
        if window_pages is not None and window_pages <= bm.num_pages:
            return self.max_model_len
        return min(self.max_model_len, bm.num_pages * bm.page_size)

    def _refuse_whole_prompt_kv(self, num_prompt_tokens: int, is_handed_off: bool) -> None:
        """A prompt handed off (exported or imported) moves its KV whole, so its pages must
        all fit the pool at once, even where pages past a window are released."""
        bm = self.block_manager
        if is_handed_off and pages_for(num_prompt_tokens + 1, bm.page_size) > bm.num_pages:
            raise RequestTooLargeError(
                f"prompt ({num_prompt_tokens} tokens) exceeds the "
                f"{bm.num_pages * bm.page_size - 1} tokens this node's KV cache holds for a "
                f"prompt handed off whole"
            )

    def validate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        problems = params.problems()
        if problems:
            raise InvalidRequestError("; ".join(problems))
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        window = Window(self.max_request_tokens, self.max_model_len)
        if refusal := window.refusal(params.max_tokens, n):
            raise RequestTooLargeError(refusal)

    def _validate_handoff(
        self,
        handoff: KVHandoff,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_only: bool,
    ) -> None:
        problems = handoff.problems(self.kv_spec, prompt_token_ids)
        if prefill_only:
            problems.append("a request cannot both be prefilled here and arrive prefilled")
        if params.logprobs and handoff.first_logprob is None:
            problems.append("a request asking for logprobs needs its first token's")
        if not 0 <= handoff.first_token < self.model.config.vocab_size:
            problems.append(f"the first token must be in [0, {self.model.config.vocab_size})")
        if not params.is_greedy:
            if handoff.generator_state is None:
                problems.append("a sampled request's handoff carries its generator's state")
            else:
                try:
                    torch.Generator().set_state(
                        torch.frombuffer(bytearray(handoff.generator_state), dtype=torch.uint8)
                    )
                except RuntimeError:
                    problems.append("its generator state is not one this node can load")
        if problems:
            raise InvalidRequestError("KV handoff refused: " + "; ".join(problems))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancels a request (all its choices) at once, freeing its pages; returns its
        final output (choice 0's)."""
        for other in self._choices.get(request_id, [])[1:]:
            self._abort_one(other)
        return self._abort_one(request_id)

    def _abort_one(self, request_id: str) -> RequestOutput | None:
        state = self._requests.pop(request_id, None)
        self._forget_choice(request_id)
        if state is None:
            return None
        state.seq.finish_reason = FinishReason.CANCELLED
        state.record("finished")
        self._remember_prompt(state.seq)
        self.scheduler.finish(state.seq)
        return self._output(state, (), "", finished=True)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- stepping --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        for seq in batch.preempted:
            self._requests[seq.request_id].record("preempted")
        outputs: list[RequestOutput] = []
        warm: set[Sequence] = set()  # admitted with part of the prompt from the prefix cache
        for seq in batch.admitted:
            state = self._requests[seq.request_id]
            state.record("admitted")
            if state.handoff is not None:
                outputs.append(self._import_handoff(state))
            elif self._load_cached_prefix(seq):
                warm.add(seq)
        # A request that arrived prefilled may have ended at its first token; one that found
        # its prefix cached computes from past it (as many tokens as scheduled, at most).
        chunks = [
            ScheduledChunk(
                c.seq, min(c.num_new_tokens, c.seq.num_tokens - c.seq.num_computed_tokens)
            )
            if c.seq in warm
            else c
            for c in batch.chunks
            if c.seq.status is not SequenceStatus.FINISHED
        ]
        if not chunks:
            return outputs
        # Integrity: a sequence whose block table reaches a page it does not own is
        # aborted before the step runs, so none of this step's tokens is sent.
        tables = self.runner.host_tables(chunks)
        bad = self.runner.find_violations(chunks, tables) if self.config.check_integrity else []
        if any(bad):
            outputs.extend(
                self._fail_integrity(c.seq) for c, is_bad in zip(chunks, bad, strict=True) if is_bad
            )
            keep = [not is_bad for is_bad in bad]
            chunks = [c for c, is_kept in zip(chunks, keep, strict=True) if is_kept]
            tables = tables.select(keep)
            if not chunks:
                return outputs
        result = self.runner.run(chunks, tables)
        self.num_computed_tokens += sum(c.num_new_tokens for c in chunks)
        self._mask(chunks, result.logits)
        greedy = (
            self._greedy_tokens(result.logits)
            if any(_plain_greedy(c.seq.params) for c in chunks)
            else []
        )
        row = 0
        for chunk, flagged in zip(chunks, result.violations, strict=True):
            seq = chunk.seq
            completes = chunk.completes_sequence
            if flagged:  # the kernels refused a write or saw a foreign page
                outputs.append(self._fail_integrity(seq))
                row += completes
                continue
            seq.num_computed_tokens += chunk.num_new_tokens
            state = self._requests[seq.request_id]
            self.block_manager.release_passed(seq)
            state.num_prefilled = max(
                state.num_prefilled, min(seq.num_computed_tokens, seq.num_prompt_tokens)
            )
            if not completes:
                continue
            try:
                token = (
                    greedy[row]
                    if _plain_greedy(seq.params)
                    else self._sample(state, result.logits[row])
                )
                if state.matcher is not None and not state.matcher.accept(token):
                    raise AssertionError(f"token {token} is outside the grammar's mask")
                forks = self._fork(state, result.logits[row]) if state.fork is not None else []
            except Exception as exc:  # a bug in one request's sampling: it fails alone
                log.exception("sampling failed for request %s", seq.request_id)
                outputs.append(self._fail(seq, f"sampling failed: {type(exc).__name__}"))
                row += 1
                continue
            row += 1
            seq.output_token_ids.append(token)
            if seq.num_output_tokens == 1:
                state.record("first_token")
            for fork in forks:
                self._requests[fork.seq.request_id] = fork
                self.scheduler.add(fork.seq)
            if state.prefill_only:
                outputs.append(self._hand_off(state))
                continue
            outputs.append(self._advance(state, token))
        return outputs

    def _mask(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> None:
        """Holds the rows of requests with a grammar to it (-inf outside), in place; a
        step without one pays nothing."""
        rows: list[int] = []
        matchers: list[Matcher] = []
        row = 0
        for chunk in chunks:
            if not chunk.completes_sequence:
                continue
            matcher = self._requests[chunk.seq.request_id].matcher
            if matcher is not None:
                rows.append(row)
                matchers.append(matcher)
            row += 1
        if rows:
            self._masks.apply(logits, rows, matchers)

    def _fork(self, state: _RequestState, logits: torch.Tensor) -> list[_RequestState]:
        """Choices 1..n-1 of `state`'s request, now that its prompt is computed and
        `logits` [V] (masked) are its last position's: each draws its first token from
        them with its own generator and takes a copy of the prompt's KV, imported into
        its own pages when it is admitted, as a handed-off request's is."""
        seq, fork = state.seq, state.fork
        assert fork is not None
        state.fork = None
        k, v, k_scale, v_scale = export_rows(self.kv_cache, seq.block_table, seq.num_prompt_tokens)
        seq.keeps_pages = False  # read: its pages past a window may go from here on
        forks = []
        for index in range(1, fork.num_choices):
            params = seq.params
            if params.seed is not None:
                seed = params.seed + index
                params = dataclasses.replace(
                    params, seed=seed if seed <= SEED_RANGE[1] else seed - 2**64
                )
            child = Sequence(
                seq_id=next(self._seq_ids),
                request_id=choice_id(seq.request_id, index),
                prompt_token_ids=list(seq.prompt_token_ids),
                params=params,
                cache_salt=fork.cache_salt,
                arrival=time.monotonic(),
            )
            generator = (
                None
                if params.is_greedy
                else torch.Generator().manual_seed(
                    params.seed
                    if params.seed is not None
                    else int(torch.randint(0, 2**62, (1,), generator=self._rng))
                )
            )
            matcher = fork.grammar.matcher() if fork.grammar is not None else None
            forked = _RequestState(
                child, generator, matcher=matcher, index=index, parent_id=seq.request_id
            )
            token = self._sample(forked, logits)
            if matcher is not None and not matcher.accept(token):
                raise AssertionError(f"token {token} is outside the grammar's mask")
            child.output_token_ids.append(token)
            child.num_computed_tokens = child.num_prompt_tokens
            forked.handoff = KVHandoff(
                self.kv_spec, tuple(child.prompt_token_ids), token, None, k, v, k_scale, v_scale
            )
            forked.num_prefilled = child.num_prompt_tokens
            forked.record("queued")
            forks.append(forked)
        return forks

    def _forget_choice(self, request_id: str) -> None:
        """Forgets a request's choices once none of them is here any more."""
        parent = self._parent_of.get(request_id)
        if parent is None:
            return
        choices = self._choices[parent]
        if not any(c in self._requests for c in choices):
            del self._choices[parent]
            for c in choices:
                del self._parent_of[c]

    def _load_cached_prefix(self, seq: Sequence) -> bool:
        """Copies the cached blocks of `seq`'s prompt into its first pages (at least one
        prompt token left to compute); whether any were found."""
        if self.prefix_cache is None or seq.num_computed_tokens:
            return False
        size = self.block_manager.page_size
        usable = min(seq.num_prompt_tokens, seq.num_tokens - 1) // size
        digests = self.prefix_cache.digests(seq.prompt_token_ids[: usable * size], seq.cache_salt)
        found = self.prefix_cache.load(digests, seq.block_table)
        seq.num_computed_tokens = seq.num_cached_tokens = found * size
        return found > 0

    def _remember_prompt(self, seq: Sequence) -> None:
        """Keeps the full pages of `seq`'s computed prompt in the prefix cache (before its
        pages are freed; never for a request the integrity checks stopped, nor from a
        block table that breaks an ownership rule)."""
        if self.prefix_cache is None or seq.finish_reason is FinishReason.ERROR:
            return
        if self._first_bad_entry(seq, sequence_tag(seq))[0] != -1:
            return  # a table that names a page not its own: never keep another's rows
        size = self.block_manager.page_size
        blocks = min(seq.num_computed_tokens, seq.num_prompt_tokens) // size
        if blocks:
            digests = self.prefix_cache.digests(
                seq.prompt_token_ids[: blocks * size], seq.cache_salt
            )
            self.prefix_cache.store(digests, seq.block_table[:blocks])

    def _hand_off(self, state: _RequestState) -> RequestOutput:
        """Ends a prefill-only request at its first token, exporting its prompt's KV."""
        seq = state.seq
        k, v, k_scale, v_scale = export_rows(self.kv_cache, seq.block_table, seq.num_prompt_tokens)
        generator_state = (
            None if state.generator is None else state.generator.get_state().numpy().tobytes()
        )
        handoff = KVHandoff(
            self.kv_spec, tuple(seq.prompt_token_ids), seq.output_token_ids[0], generator_state,
            k, v, k_scale, v_scale, state.logprobs[0] if state.logprobs else None,
        )  # fmt: skip
        seq.finish_reason = FinishReason.HANDOFF
        state.record("finished")
        self._remember_prompt(seq)
        self.scheduler.finish(seq)
        del self._requests[seq.request_id]
        out = self._output(state, tuple(seq.output_token_ids), "", finished=True)
        out = dataclasses.replace(out, logprobs=tuple(state.logprobs) or None)
        return dataclasses.replace(out, handoff=handoff)

    def _import_handoff(self, state: _RequestState) -> RequestOutput:
        """Writes an arriving request's prompt KV into the pages it was just given, then
        emits its first token (stop conditions applied, as for any token)."""
        seq, handoff = state.seq, state.handoff
        assert handoff is not None
        page, reason = self._first_bad_entry(seq, sequence_tag(seq))
        assert page == -1, f"fresh pages that are not its own: page {page}, {reason}"
        import_rows(self.kv_cache, seq.block_table, handoff)
        self.block_manager.release_passed(seq)  # those its window has passed
        state.handoff = None  # a preemption from here on recomputes, as for any request
        state.record("first_token")
        return self._advance(state, handoff.first_token)

    def _fail_integrity(self, seq: Sequence) -> RequestOutput:
        tag = sequence_tag(seq)
        page, reason = self._first_bad_entry(seq, tag)
        self.num_integrity_violations += 1
        log.error(
            "kv integrity violation: request %s (tag %#x) touched page %d (%s); aborting it",
            seq.request_id, tag, page, reason,
        )  # fmt: skip
        return self._fail(
            seq, f"KV page ownership violation on page {page}: the request was aborted"
        )

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        """Ends `seq` with `error`, its pages freed; the others in its step carry on."""
        seq.error = error
        seq.finish_reason = FinishReason.ERROR
        state = self._requests.pop(seq.request_id)
        self._forget_choice(seq.request_id)
        state.record("finished")
        self.scheduler.finish(seq)
        return self._output(state, (), "", finished=True)

    def _first_bad_entry(self, seq: Sequence, tag: int) -> tuple[int, str]:
        """The first block-table entry that breaks an ownership rule, and which rule (the
        released columns are no longer the sequence's, and never read)."""
        owners = self.block_manager.page_owner_host
        columns = self.block_manager.page_column_host
        for column, page in enumerate(seq.block_table):
            if column < seq.num_released_pages:
                continue
            if not 0 <= page < len(owners):
                return page, "outside the pool"
            if int(owners[page]) != tag:
                return page, f"owned by tag {int(owners[page]):#x}"
            if int(columns[page]) != column:
                return (
                    page,
                    f"its own, named at column {column}, handed out for {int(columns[page])}",
                )
        return -1, "flagged by the kernels"  # e.g. a write the device copy refused

    @staticmethod
    def _greedy_tokens(logits: torch.Tensor) -> list[int]:
        """The argmax of every row in one operation and one read back (a GPU step would
        otherwise wait for the device once per sequence); used by the greedy rows."""
        return logits.argmax(dim=-1).tolist() if len(logits) else []

    def _sample(self, state: _RequestState, logits: torch.Tensor) -> int:
        seq, params = state.seq, state.seq.params
        logits = apply_penalties(logits, params, seq.prompt_token_ids, seq.output_token_ids)
        token, logprob = draw(
            logits, params, state.generator, params.top_logprobs if params.logprobs else None
        )
        if logprob is not None:
            state.logprobs.append(logprob)
        return token

    def _advance(self, state: _RequestState, token: int) -> RequestOutput:
        """Applies stop conditions after `token`; returns this step's output for the request."""
        seq, params = state.seq, state.seq.params
        reason: FinishReason | None = None
        is_eos = token in self.tokenizer.stop_token_ids and not params.ignore_eos
        if is_eos or (state.matcher is not None and state.matcher.is_terminated):
            reason = FinishReason.STOP
        tail = self.tokenizer.decode(seq.output_token_ids[state.settled_tokens :])
        state.text = state.text[: state.settled_chars] + tail
        if not tail.endswith("\ufffd"):
            state.settled_tokens, state.settled_chars = seq.num_output_tokens, len(state.text)
        if params.stop and reason is None:
            hits = [
                i
                for s in params.stop
                if (i := state.text.find(s, max(0, state.text_sent - len(s)))) >= 0
            ]
            if hits:
                state.stop_at = min(hits)
                reason = FinishReason.STOP
        if reason is None and (
            seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        finished = reason is not None
        end = state.stop_at if state.stop_at is not None else len(state.text)
        # Hold back an unfinished UTF-8 character; an answer that ends inside one (at
        # max_tokens) never sends its placeholder, only the whole characters before it.
        if state.text.endswith("\ufffd"):
            end = min(end, len(state.text.rstrip("\ufffd")))
        if not finished and params.stop:
            # Hold back anything that may begin a stop string too (counted back from the last
            # whole character, not from the placeholders of a half-decoded one, or a
            # multi-byte stop string's first character leaks out).
            longest = max(len(s) for s in params.stop)
            end = min(end, max(state.text_sent, end - (longest - 1)))
        delta = state.text[state.text_sent : max(end, state.text_sent)]
        state.text_sent = max(end, state.text_sent)
        new_tokens = tuple(seq.output_token_ids[state.tokens_sent :])
        logprobs = tuple(state.logprobs[state.tokens_sent :]) if params.logprobs else None
        state.tokens_sent = seq.num_output_tokens
        if finished:
            seq.finish_reason = reason
            state.record("finished")
            self._remember_prompt(seq)
            self.scheduler.finish(seq)
            del self._requests[seq.request_id]
            self._forget_choice(seq.request_id)
        return dataclasses.replace(
            self._output(state, new_tokens, delta, finished), logprobs=logprobs
        )

    def _output(
        self, state: _RequestState, tokens: tuple[int, ...], text: str, finished: bool
    ) -> RequestOutput:
        seq = state.seq
        return RequestOutput(
            request_id=state.parent_id or seq.request_id,
            token_ids=tokens,
            text=text,
            finished=finished,
            finish_reason=str(seq.finish_reason) if finished and seq.finish_reason else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_completion_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_prefilled_tokens=state.num_prefilled,
            error=seq.error,
            events=tuple(state.events) if finished else (),
            index=state.index,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            model=self.model_name,
            kv_dtype=self.config.kv_dtype,
            page_size=self.block_manager.page_size,
            num_pages=self.block_manager.num_pages,
            num_free_pages=self.block_manager.num_free_pages,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            max_model_len=self.max_model_len,
            num_preemptions=self.scheduler.num_preemptions,
            num_integrity_violations=self.num_integrity_violations,
            num_computed_tokens=self.num_computed_tokens,
            activations=self.kv_spec.activations,
        )

    # -- convenience -----------------------------------------------------------------------

    def generate(
        self, prompts: dict[str, list[int]], params: SamplingParams
    ) -> dict[str, list[int]]:
        """Runs requests to completion; returns each one's output token ids."""
        for request_id, ids in prompts.items():
            self.add_request(request_id, ids, params)
        results: dict[str, list[int]] = {rid: [] for rid in prompts}
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id].extend(out.token_ids)
        return results
