"""RoPE: one cos and sin a step, shared by every layer's call at that step's positions."""

from __future__ import annotations

import torch

from gpu_node.models.llama import RotaryEmbedding


def test_a_step_shares_its_angles_and_only_with_its_own_positions() -> None:
    rope = RotaryEmbedding(8, 10000.0, interleaved=True)
    positions = torch.tensor([0, 5, 9])
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    before = rope(x, positions)
    with rope.at(positions):
        cos, sin = rope.angles(positions)
        assert rope.angles(positions)[0] is cos and rope.angles(positions)[1] is sin
        assert torch.equal(rope(x, positions), before)
        # another tensor, even with equal values, gets angles of its own
        other = torch.tensor([1, 2, 3])
        assert torch.equal(rope(x, other), RotaryEmbedding(8, 10000.0, interleaved=True)(x, other))
        assert rope.angles(positions.clone())[0] is not cos
    assert rope.angles(positions)[0] is not cos  # the step is over: nothing kept
    assert torch.equal(rope(x, positions), before)


def test_angles_are_cleared_when_the_step_raises() -> None:
    rope = RotaryEmbedding(4, 10000.0, interleaved=False)
    positions = torch.tensor([3])
    try:
        with rope.at(positions):
            cos, _ = rope.angles(positions)
            raise RuntimeError("a layer failed")
    except RuntimeError:
        pass
    assert rope.angles(positions)[0] is not cos
