"""expert_slots (one or two launches) equals expert_slots_ref exactly (interpreter on CPU,
native on CUDA)."""

from __future__ import annotations

import pytest
import torch

import gpu_node.kernels.moe.slots as slots_module
from gpu_node.models.moe_routing import expert_slots_ref

expert_slots = slots_module.expert_slots

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k"),
    [
        (1, 8, 2),  # one token: one slot per chosen expert
        (10, 4, 2),  # experts past 8 assignments take two slots
        (16, 64, 8),  # 128 assignments: the most one program takes
        (17, 64, 8),  # 136: two passes, a tail block
        (64, 64, 8),  # 512 assignments: several programs of each pass
        (300, 16, 3),  # 900: a tail block in both passes, up to 8 slots an expert
        (3, 1, 1),  # one expert takes everything
    ],
)
def test_expert_slots_equal_the_reference(tokens: int, num_experts: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids = ids.to(DEVICE)
    ours, ref = expert_slots(ids, num_experts), expert_slots_ref(ids, num_experts)
    assert ours.num_assignments == ref.num_assignments == tokens * top_k
    assert torch.equal(ours.slot_experts, ref.slot_experts)
    assert torch.equal(ours.slot_counts, ref.slot_counts)
    assert torch.equal(ours.slot_ids, ref.slot_ids)


def test_expert_slots_of_a_known_routing() -> None:
    ids = torch.tensor([[3, 1], [1, 0], [1, 3]] + [[1, 2]] * 7, device=DEVICE)
    s = expert_slots(ids, num_experts=4)
    assert s.slot_experts.tolist() == [0, 1, 1, 2, 3] + [4] * 15
    assert s.slot_counts.tolist() == [1, 8, 2, 7, 2] + [0] * 15
    assert s.slot_ids[:5].tolist() == [
        [3] * 8,
        [1, 2, 4, 6, 8, 10, 12, 14],
        [16, 18, 16, 16, 16, 16, 16, 16],
        [7, 9, 11, 13, 15, 17, 19, 7],
        [0, 5, 0, 0, 0, 0, 0, 0],
    ]
    assert s.slot_ids[5:].eq(0).all()
