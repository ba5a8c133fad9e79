"""The odds that spot checks catch a lying server, in closed form.

The client's policy (`ClientConfig.verify_fraction` ``f``): a server's first step is always
checked, and each later step is checked with probability ``f``, independently; a check
compares every position since the previous check, so it covers every step since then. A
liar lies on each step with probability ``r`` (``r = 1/K`` for one step in ``K``),
independently. A lie at step ``t`` is caught at the first check at a step ``>= t``.

Not caught by step ``n`` means: no lie in steps ``1..C``, with ``C`` the last check at or
before ``n``. With ``q = 1 - r`` and ``g = 1 - f``, ``P(C = 1) = g^(n-1)`` and
``P(C = c) = f g^(n-c)`` for ``2 <= c <= n``, so

    P(missed by n) = sum_c P(C = c) q^c = q g^(n-1) + f q^2 (q^(n-1) - g^(n-1)) / (q - g)

(the fraction is ``(n-1) q^(n-2)`` when ``q = g``, i.e. ``f = r``). For comparison, a naive
policy whose check covers its own step only misses with ``(1 - f r)^n``. A final check
(text streams check once more at the end before giving out their last tokens) covers every
step: only ``q^n``, "never lied", is missed then.

The wait from a lie to its detection: the lying step is checked with probability ``f``,
else each next step is, so the check comes ``(1 - f) / f`` steps after the lie on average:
the lie's results stand for ``1 / f`` steps counting its own (in a session long enough
to reach that check).
"""

from __future__ import annotations

__all__ = ["caught_probability", "naive_caught_probability", "expected_detection_delay"]


def _check(f: float, r: float, n: int) -> None:
    if not 0.0 <= f <= 1.0 or not 0.0 <= r <= 1.0:
        raise ValueError(f"verify_fraction {f} and lie rate {r} must be in [0, 1]")
    if n < 0:
        raise ValueError(f"steps {n} must be >= 0")


def caught_probability(f: float, r: float, n: int, *, final_check: bool = False) -> float:
    """The probability that a liar is caught within ``n`` steps under the client's policy.

    :param f: the share of steps checked (``verify_fraction``); the first step is always checked.
    :param r: the liar's lie rate (it lies on each step with probability ``r``).
    :param n: the number of steps.
    :param final_check: the last step is checked too (a check covers every step since the
        previous one, so every lie is then caught: ``1 - (1 - r)^n``).
    """
    _check(f, r, n)
    if n == 0:
        return 0.0
    q, g = 1.0 - r, 1.0 - f
    if final_check:
        return 1.0 - q**n
    if abs(q - g) < 1e-6:  # (q^(n-1) - g^(n-1)) / (q - g) as its sum, without the cancellation
        rest = f * q**2 * sum(q ** (n - 2 - j) * g**j for j in range(n - 1))
    else:
        rest = f * q**2 * (q ** (n - 1) - g ** (n - 1)) / (q - g)
    return min(1.0, max(0.0, 1.0 - q * g ** (n - 1) - rest))


def naive_caught_probability(f: float, r: float, n: int) -> float:
    """The probability of catching the liar within ``n`` steps when a check covers only its own step.

    Each step is checked with probability ``f`` and lies with probability ``r``: ``1 - (1 - f r)^n``.
    """
    _check(f, r, n)
    return 1.0 - (1.0 - f * r) ** n


def expected_detection_delay(f: float) -> float:
    """The mean number of steps after a lie until the check that catches it, ``(1 - f) / f``.

    Counting the lie's own step, its results stand for ``1 / f`` steps on average (in a
    session that lasts that long; the first step, always checked, has no delay).
    """
    if not 0.0 < f <= 1.0:
        raise ValueError(f"verify_fraction {f} must be in (0, 1]")
    return (1.0 - f) / f
