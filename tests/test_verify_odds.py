"""The detection odds of `distconf.client.verify_odds` against a Monte-Carlo simulation of the policy.

Each trial draws, per step, whether the liar lies (probability ``r``) and whether the step is
checked (the first always, then probability ``f``); the liar is caught when some check covers
a lie (covering policy: a lie at or before a check since the previous one; naive policy: a lie
at the checked step itself). 20,000 seeded trials per point; the estimate must lie within 5
binomial standard errors (plus a little for p near 0 or 1) of the formula.
"""

from __future__ import annotations

import math

import pytest
import torch

from distconf.client.verify_odds import caught_probability, expected_detection_delay, naive_caught_probability

TRIALS = 20_000
FRACTIONS = (0.05, 0.1, 0.25, 0.5, 1.0)
RATES = (1 / 2, 1 / 8, 1 / 32)
STEPS = (1, 8, 64)


def simulate(f: float, r: float, n: int, seed: int) -> tuple[float, float, float]:
    """(covering caught share, naive caught share, caught share with a final check) over `TRIALS` runs."""
    g = torch.Generator().manual_seed(seed)
    lies = torch.rand(TRIALS, n, generator=g) < r
    checks = torch.rand(TRIALS, n, generator=g) < f
    checks[:, 0] = True
    # covering: caught iff some lie happened at or before the last check
    steps = torch.arange(n).expand(TRIALS, n)
    last_check = torch.where(checks, steps, torch.full_like(steps, -1)).amax(dim=1)
    first_lie = torch.where(lies, steps, torch.full_like(steps, n)).amin(dim=1)
    covering = (first_lie <= last_check).float().mean().item()
    naive_checks = torch.rand(TRIALS, n, generator=g) < f  # the naive policy's own draws, no forced first check
    naive = (lies & naive_checks).any(dim=1).float().mean().item()
    final = lies.any(dim=1).float().mean().item()
    return covering, naive, final


def within(estimate: float, p: float) -> bool:
    return abs(estimate - p) <= 5 * math.sqrt(p * (1 - p) / TRIALS) + 5 / TRIALS


@pytest.mark.parametrize("n", STEPS)
def test_formulas_match_the_simulation(n: int) -> None:
    for i, f in enumerate(FRACTIONS):
        for j, r in enumerate(RATES):
            covering, naive, final = simulate(f, r, n, seed=1000 * n + 10 * i + j)
            p = caught_probability(f, r, n)
            assert within(covering, p), (f, r, n, covering, p)
            assert within(naive, naive_caught_probability(f, r, n)), (f, r, n, naive)
            assert within(final, caught_probability(f, r, n, final_check=True)), (f, r, n, final)


def test_closed_form_equals_the_sum_over_the_last_check() -> None:
    for f in (0.0, 0.1, 0.125, 0.5, 1.0):
        for r in (0.0, 1 / 8, 0.3, 1.0):
            for n in (1, 2, 5, 40):
                q, g = 1 - r, 1 - f
                missed = q * g ** (n - 1) + sum(f * g ** (n - c) * q**c for c in range(2, n + 1))
                assert caught_probability(f, r, n) == pytest.approx(1 - missed, abs=1e-12)


def test_edges() -> None:
    assert caught_probability(0.1, 0.5, 0) == 0.0
    assert caught_probability(0.0, 0.5, 10) == 0.5  # only the first step is checked
    assert caught_probability(1.0, 1 / 8, 10) == pytest.approx(1 - (7 / 8) ** 10)
    assert caught_probability(0.1, 1 / 8, 64) > naive_caught_probability(0.1, 1 / 8, 64)
    assert expected_detection_delay(1.0) == 0.0
    assert expected_detection_delay(0.1) == pytest.approx(9.0)
    with pytest.raises(ValueError):
        caught_probability(1.5, 0.1, 3)


def test_delay_matches_the_simulation() -> None:
    g = torch.Generator().manual_seed(7)
    f = 0.25
    checks = torch.rand(TRIALS, 200, generator=g) < f  # steps after a lie at step t >= 2, its own first
    delay = checks.float().argmax(dim=1).float().mean().item()
    assert abs(delay - expected_detection_delay(f)) < 0.1
