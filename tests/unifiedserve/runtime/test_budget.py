"""The budget search: the largest budget whose measured iteration fits the SLO."""

import pytest

from unifiedserve.runtime.budget import largest_within


@pytest.mark.parametrize("per_token_s,limit_s", [(1e-4, 0.05), (2e-5, 0.05), (1e-3, 0.5), (3e-6, 0.02)])
def test_finds_the_largest_fitting_budget_to_within_one_step_of_the_bisection(per_token_s, limit_s):
    calls = []

    def measure(n):
        calls.append(n)
        return 0.001 + n * per_token_s

    n = largest_within(measure, limit_s, 16, 16384, step=16, probes=8)
    exact = min(16384, int((limit_s - 0.001) / per_token_s))
    assert n % 16 == 0 and measure(n) <= limit_s
    assert exact - n <= max(16, exact // 64)  # doubling + 8 bisections
    assert len(calls) < 25  # a short profile


def test_nothing_fits_gives_the_minimum():
    assert largest_within(lambda n: 1.0, 0.01, 64, 4096, step=64) == 64


def test_everything_fits_gives_the_maximum():
    assert largest_within(lambda n: 0.0, 0.01, 16, 1024, step=16) == 1024
