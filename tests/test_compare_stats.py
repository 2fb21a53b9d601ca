"""The statistics behind `lowprec compare`, on synthetic inputs with known answers (no training)."""

from __future__ import annotations

import math
import random

import pytest

from lowprec.train.stats import (
    INCONCLUSIVE,
    OUTSIDE,
    WITHIN,
    first_departure,
    interval,
    relative_gaps,
    seeds_needed,
    t_quantile,
    tail_gaps,
    verdict,
)


@pytest.mark.parametrize(
    "df,expected", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (29, 2.0452), (120, 1.9799)]
)
def test_t_quantile_matches_the_table(df, expected):
    # two-sided 95% critical values from any statistics table (4 decimals)
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-4)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=1e-4)
    assert t_quantile(0.5, df) == pytest.approx(0.0, abs=1e-9)


def test_t_quantile_tends_to_the_normal_and_rejects_bad_input():
    assert t_quantile(0.975, 1e6) == pytest.approx(1.959964, abs=1e-4)
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError):
        t_quantile(0.9, 0)


def _exact(mean: float, sd: float, n: int) -> list[float]:
    """n values whose sample mean and sample sd are exactly ``mean`` and ``sd``."""
    z = [i - (n - 1) / 2 for i in range(n)]
    s = math.sqrt(sum(v * v for v in z) / (n - 1))
    return [mean + sd * v / s for v in z]


def test_interval_of_known_values():
    iv = interval([1.0, 2.0, 3.0, 4.0])
    assert (iv.n, iv.mean) == (4, 2.5)
    assert iv.sd == pytest.approx(math.sqrt(5 / 3))
    assert iv.half_width == pytest.approx(3.182446 * math.sqrt(5 / 3) / 2, rel=1e-5)
    one = interval([2.0])
    assert (one.mean, one.sd, one.low, one.high) == (2.0, None, None, None)
    xs = _exact(0.3, 0.7, 6)
    assert interval(xs).mean == pytest.approx(0.3) and interval(xs).sd == pytest.approx(0.7)


def test_interval_covers_the_true_mean_95_percent_of_the_time():
    rng = random.Random(1234)
    for n, mu, sigma in ((3, 2.5, 0.4), (5, -1.0, 2.0)):
        trials = 2000
        hits = 0
        for _ in range(trials):
            iv = interval([rng.gauss(mu, sigma) for _ in range(n)])
            hits += iv.low <= mu <= iv.high
        # binomial sd of the coverage at 2000 trials: 0.005; the band is 4 of them
        assert 0.93 <= hits / trials <= 0.97, (n, hits / trials)


def test_relative_gaps_are_paired_and_signed():
    assert relative_gaps([2.2, 1.9], [2.0, 2.0]) == pytest.approx([0.1, -0.05])
    with pytest.raises(ValueError, match="one value per seed"):
        relative_gaps([1.0], [1.0, 2.0])


def test_verdict_three_outcomes():
    thr = 0.005
    within = verdict(_exact(0.0, 0.002, 5), thr)  # half-width 2.776 * 0.002 / sqrt(5) = 0.0025
    assert within.outcome == WITHIN and within.gap.high < thr
    outside = verdict(_exact(0.02, 0.002, 5), thr)
    assert outside.outcome == OUTSIDE and outside.gap.low > thr
    better = verdict(_exact(-0.05, 0.01, 5), thr)  # much better than the baseline never fails
    assert better.outcome == WITHIN
    unsure = verdict(_exact(0.002, 0.004, 3), thr)
    assert unsure.outcome == INCONCLUSIVE and unsure.gap.low < thr < unsure.gap.high
    assert unsure.seeds_needed is not None and str(unsure.seeds_needed) in unsure.reason
    one = verdict([0.001], thr)
    assert one.outcome == INCONCLUSIVE and one.seeds_needed is None and "--seeds 3" in one.reason


def test_seeds_needed_resolves_at_the_measured_spread():
    thr, mean, sd = 0.005, 0.002, 0.004
    n = seeds_needed(mean, sd, thr)
    # the definition: the first n whose half-width is below the distance to the threshold
    assert t_quantile(0.975, n - 1) * sd / math.sqrt(n) < thr - mean <= t_quantile(0.975, n - 2) * sd / math.sqrt(n - 1)
    # and what it promises: with the same mean and spread, n seeds decide, n - 1 do not
    assert verdict(_exact(mean, sd, n), thr).outcome == WITHIN
    assert verdict(_exact(mean, sd, n - 1), thr).outcome == INCONCLUSIVE
    assert verdict(_exact(0.008, sd, seeds_needed(0.008, sd, thr)), thr).outcome == OUTSIDE
    assert seeds_needed(thr, sd, thr) is None  # a mean on the threshold: no number of seeds decides
    assert seeds_needed(0.0049, 0.5, thr, limit=50) is None


def _curve(values, start=10, every=10):
    return [(start + every * i, v) for i, v in enumerate(values)]


def test_tail_gap_averages_the_last_part_of_the_curve():
    ref = _curve([4.0, 3.0, 2.5, 2.0, 2.0])
    cur = _curve([4.0, 3.0, 2.5, 2.2, 2.1])
    # last 40% of 5 points = 2 points: (2.2 + 2.1) / (2.0 + 2.0) - 1
    assert tail_gaps([cur], [ref], 0.4) == pytest.approx([4.3 / 4.0 - 1])
    assert tail_gaps([cur], [ref], 0.01) == pytest.approx([2.1 / 2.0 - 1])  # at least one point


def test_first_departure_needs_a_confident_sustained_gap():
    rng = random.Random(7)
    steps = 20
    refs, leave, noisy = [], [], []
    for _ in range(4):
        base = [4.0 - 0.1 * i + rng.gauss(0, 0.002) for i in range(steps)]
        refs.append(_curve(base))
        # leaves from the 12th logged point (step 120) by 3%, a little noise per seed
        leave.append(_curve([b * (1.03 if i >= 11 else 1.0) + rng.gauss(0, 0.002) for i, b in enumerate(base)]))
        noisy.append(_curve([b * (1 + rng.gauss(0, 0.001)) for b in base]))
    assert first_departure(leave, refs, threshold=0.01) == 120
    assert first_departure(noisy, refs, threshold=0.01) is None
    # one spike above the threshold is not a departure (patience 3 logged points)
    spike = [_curve([b * (1.05 if i == 5 else 1.0) for i, (_, b) in enumerate(r)]) for r in refs]
    assert first_departure(spike, refs, threshold=0.01) is None
