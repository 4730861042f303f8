"""SamplingParams.problems: every unusable value named, NaN and infinity included."""

from __future__ import annotations

import math

import pytest

from scheduler.sequence import SamplingParams


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        # NaN had passed `temperature < 0` and sampled greedily (`edgeserve run --temperature nan`)
        ("temperature", math.nan, "temperature must be >= 0 and finite, got nan"),
        ("temperature", math.inf, "temperature must be >= 0 and finite, got inf"),
        ("temperature", -0.5, "temperature must be >= 0 and finite, got -0.5"),
        ("top_p", math.nan, "top_p must be in (0, 1], got nan"),
        ("repetition_penalty", math.nan, "repetition_penalty must be > 0 and finite, got nan"),
        ("repetition_penalty", math.inf, "repetition_penalty must be > 0 and finite, got inf"),
        ("frequency_penalty", math.nan, "frequency_penalty must be finite, got nan"),
        ("presence_penalty", -math.inf, "presence_penalty must be finite, got -inf"),
    ],
)
def test_a_value_that_is_not_a_usable_number_is_a_problem(field, value, problem) -> None:
    assert SamplingParams(**{field: value}).problems() == [problem]


def test_the_defaults_and_the_bounds_are_fine() -> None:
    assert SamplingParams().problems() == []
    edges = {"temperature": 0.0, "top_p": 1.0, "repetition_penalty": 2.0, "presence_penalty": -2.0}
    assert SamplingParams(**edges).problems() == []
