"""Turns one sequence's logits into its next token.

Sampling is per sequence with the sequence's own random generator, so a seeded
request draws the same numbers whatever else shares its batch: same seed,
same output.
"""

from __future__ import annotations

import torch

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
    if params.is_greedy:
        return int(torch.argmax(logits))
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
        return int(torch.argmax(unscaled))
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
    return int(torch.multinomial(probs, 1, generator=generator))
