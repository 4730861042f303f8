"""Turns one sequence's logits into its next token.

Sampling is per sequence with the sequence's own random generator, so a seeded
request draws the same numbers whatever else shares its batch: same seed,
same output.

Log-probabilities (`draw` with `num_top`) are those of the distribution the token was
drawn from. The logits have by then had the grammar's mask (-inf outside it) and the
penalties applied; then:
  - greedy (temperature 0, or top_k 1): log_softmax of those logits, at temperature 1;
  - sampled: log(p / sum(p)) for p the probabilities multinomial draws from: softmax of
    the logits / temperature over the top_k tokens, less the tokens past top_p (zero,
    so -inf, and never among the alternatives); a temperature so small that the scaled
    logits overflow is the argmax alone, log-probability 0.
"""

from __future__ import annotations

import torch

from gpu_node.engine.outputs import SampledLogprob
from scheduler.sequence import SamplingParams


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """logits [V] -> penalized copy. Repetition (HF-style, over prompt + output);
    frequency and presence (OpenAI-style, over the output only)."""
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        picked = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(
            picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty
        )
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        ids, counts = torch.tensor(output_ids, dtype=torch.long).unique(return_counts=True)
        logits = logits.clone()
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [V] (already penalized) -> token id."""
    return draw(logits, params, generator)[0]


def draw(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    num_top: int | None = None,
) -> tuple[int, SampledLogprob | None]:
    """logits [V] (already masked and penalized) -> token id, and with `num_top` (0 for the
    token's alone) its log-probability and the `num_top` most likely tokens' (module
    docstring). The same token as without, from the same random numbers."""
    if params.is_greedy:
        token = int(torch.argmax(logits))
        if num_top is None:
            return token, None
        return token, _logprob(torch.log_softmax(logits.float(), dim=-1), token, num_top)
    if generator is not None and generator.device != logits.device:
        # Generators live on the host (their state moves between nodes with a KV handoff,
        # and seeds draw the same tokens on every device): sample there.
        logits = logits.to(generator.device)
    unscaled = logits
    logits = logits.float() / params.temperature
    if not bool(torch.isfinite(logits.max())):
        # A temperature (or a repetition penalty) so small that a logit overflows float32:
        # the distribution is then the limit it tends to, all its mass on the argmax (of
        # the logits before scaling, where the overflowed ones are not all tied at inf).
        token = int(torch.argmax(unscaled))
        return token, None if num_top is None else SampledLogprob(token, 0.0, ((token, 0.0),))
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
        outside = before >= params.top_p
        # The most probable token always stays: a top_p below float32's least value rounds
        # to 0 beside `before`, and would otherwise leave no token at all.
        outside[0] = False
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    token = int(torch.multinomial(probs, 1, generator=generator))
    if num_top is None:
        return token, None
    return token, _logprob(torch.log(probs / probs.sum()), token, num_top)


def _logprob(logprobs: torch.Tensor, token: int, num_top: int) -> SampledLogprob:
    """The token's entry of `logprobs` [V] and the `num_top` largest finite ones."""
    top: tuple[tuple[int, float], ...] = ()
    if num_top:
        values, ids = torch.topk(logprobs, min(num_top, logprobs.shape[-1]))
        top = tuple(
            (int(i), float(v))
            for i, v in zip(ids.tolist(), values.tolist(), strict=True)
            if v != float("-inf")
        )
    return SampledLogprob(token, float(logprobs[token]), top)
