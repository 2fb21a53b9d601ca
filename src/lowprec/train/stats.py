"""Small-sample statistics for ``lowprec compare``: pure functions on lists of floats, no torch.

A parity verdict from one seed says nothing: on the quickstart config the seed-to-seed spread
of an FP8-vs-bf16 validation-loss gap was about 20x the 0.5% we promise. So every
number here comes with a Student-t 95% interval over seeds, and the precisions are compared
*paired* (same seed = same initialisation, data order and validation split), which removes the
part of the spread the two runs share.

* :func:`t_quantile`: Student's t quantile (the regularized incomplete beta function by its
  continued fraction, then bisection) so the package needs no scipy.
* :func:`interval`: mean, sample standard deviation and the t interval of the mean.
* :func:`relative_gaps`: per-seed ``(x - ref) / |ref|``, positive = worse than the reference.
* :func:`verdict`: within / outside / inconclusive against a one-sided threshold, and the seeds
  an inconclusive result would need (:func:`seeds_needed`).
* :func:`tail_gaps`, :func:`first_departure`: the curve-level comparison.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence, cast

__all__ = [
    "t_quantile",
    "Interval",
    "interval",
    "relative_gaps",
    "Verdict",
    "verdict",
    "seeds_needed",
    "tail_gaps",
    "gap_curves",
    "first_departure",
    "WITHIN",
    "OUTSIDE",
    "INCONCLUSIVE",
]

WITHIN, OUTSIDE, INCONCLUSIVE = "within", "outside", "inconclusive"


# ------------------------------------------------------------------ Student's t
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), converges for
    x < (a + 1) / (a + b + 2)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lnfront = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lnfront) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lnfront) * _betacf(b, a, 1.0 - x) / b


def _t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom: 1 - I_{df/(df+t^2)}(df/2, 1/2) / 2
    for t >= 0, by symmetry otherwise."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


@functools.lru_cache(maxsize=512)  # the same few (level, n - 1) pairs come back for every step of a curve
def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (``t_quantile(0.975, 4) = 2.776``), by bisection on the CDF."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile(p={p}, df={df}): need 0 < p < 1 and df > 0")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:  # t(0.9995, 1) is 637: doubling finds a bracket in a few steps
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# ------------------------------------------------------------------ intervals
@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values with its two-sided ``level`` t interval ``[low, high]``; ``sd`` is the
    sample standard deviation (n - 1). With one value there is no spread: sd, low, high are None."""

    n: int
    mean: float
    sd: Optional[float]
    low: Optional[float]
    high: Optional[float]
    level: float = 0.95

    @property
    def half_width(self) -> Optional[float]:
        return None if self.high is None else self.high - self.mean

    def to_dict(self) -> dict:
        return asdict(self)


def interval(values: Sequence[float], level: float = 0.95) -> Interval:
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("interval() of no values")
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return Interval(n, mean, None, None, None, level)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    return Interval(n, mean, sd, mean - half, mean + half, level)


def relative_gaps(values: Sequence[float], reference: Sequence[float]) -> list[float]:
    """Per seed ``(x - ref) / |ref|``: positive means a higher (worse) loss than the reference."""
    if len(values) != len(reference):
        raise ValueError(f"paired gaps need one value per seed on both sides ({len(values)} vs {len(reference)})")
    return [(x - r) / abs(r) for x, r in zip(values, reference)]


# ------------------------------------------------------------------ verdict
@dataclass(frozen=True)
class Verdict:
    """``outcome``: within (the whole interval at or below +threshold), outside (the whole interval
    above it) or inconclusive. ``seeds_needed``: for inconclusive, the total seeds that would put
    the interval on one side of the threshold if the mean and spread stay as measured (None when
    no estimate is possible, with ``reason`` saying why)."""

    outcome: str
    threshold: float
    gap: Interval
    seeds_needed: Optional[int] = None
    reason: str = ""

    def to_dict(self) -> dict:
        return {
            "outcome": self.outcome,
            "threshold": self.threshold,
            "gap": self.gap.to_dict(),
            "seeds_needed": self.seeds_needed,
            "reason": self.reason,
        }


def seeds_needed(mean: float, sd: float, threshold: float, level: float = 0.95, limit: int = 1000) -> Optional[int]:
    """Smallest n with ``t(n-1) * sd / sqrt(n) < |threshold - mean|``: the interval's half-width
    falls below the distance of the measured mean gap to the threshold. None when the mean sits
    on the threshold or more than ``limit`` seeds would be needed."""
    distance = abs(threshold - mean)
    if sd == 0.0:
        return 2
    if distance == 0.0:
        return None
    q = 0.5 + level / 2.0
    for n in range(2, limit + 1):
        if t_quantile(q, n - 1) * sd / math.sqrt(n) < distance:
            return n
    return None


def verdict(gaps: Sequence[float], threshold: float, level: float = 0.95) -> Verdict:
    """One-sided parity test of paired relative gaps (positive = worse than the reference):
    within when the upper bound of the ``level`` interval is at most ``threshold``, outside when
    the lower bound exceeds it, else inconclusive. Being better than the reference never fails."""
    gap = interval(gaps, level)
    if gap.n < 2:
        return Verdict(INCONCLUSIVE, threshold, gap, None, "one seed has no spread to measure: run --seeds 3 or more")
    # interval() sets sd, low and high whenever n >= 2
    high, low, sd = cast(float, gap.high), cast(float, gap.low), cast(float, gap.sd)
    if high <= threshold:
        return Verdict(WITHIN, threshold, gap)
    if low > threshold:
        return Verdict(OUTSIDE, threshold, gap)
    need = seeds_needed(gap.mean, sd, threshold, level)
    why = (
        f"about {need} seeds in all would resolve it at the measured spread"
        if need is not None
        else "the mean gap sits on the threshold: more seeds will not resolve it; more steps or a lower variance config may"
    )
    return Verdict(INCONCLUSIVE, threshold, gap, need, why)


# ------------------------------------------------------------------ curves
Curve = Sequence[Sequence[float]]  # (step, loss) pairs


def gap_curves(curves: Sequence[Curve], refs: Sequence[Curve]) -> dict[int, list[float]]:
    """Per logged step present in every run: the paired relative gaps, one per seed."""
    maps = [{int(s): float(v) for s, v in c} for c in curves]
    ref_maps = [{int(s): float(v) for s, v in c} for c in refs]
    steps = sorted(set.intersection(*(set(m) for m in maps + ref_maps))) if maps else []
    return {s: relative_gaps([m[s] for m in maps], [r[s] for r in ref_maps]) for s in steps}


def tail_gaps(curves: Sequence[Curve], refs: Sequence[Curve], fraction: float = 0.2) -> list[float]:
    """Per seed, the relative gap of the mean loss over the last ``fraction`` of the logged steps:
    an average over many logging windows, so less noisy than the final window alone."""
    per_step = gap_curves(curves, refs)
    steps = sorted(per_step)
    if not steps:
        return []
    last = max(1, math.ceil(fraction * len(steps)))
    tail = set(steps[-last:])
    out = []
    for c, r in zip(curves, refs):
        cm, rm = {int(s): float(v) for s, v in c}, {int(s): float(v) for s, v in r}
        x, y = sum(cm[s] for s in tail), sum(rm[s] for s in tail)
        out.append((x - y) / abs(y))
    return out


def first_departure(
    curves: Sequence[Curve], refs: Sequence[Curve], threshold: float, level: float = 0.95, patience: int = 3
) -> Optional[int]:
    """The first logged step from which the paired gap is above ``threshold`` at ``level``
    confidence (the lower bound of its interval; the gap itself with one seed) for ``patience``
    logged points in a row (fewer at the end of the run): where the curve leaves the reference
    band. None when it never does."""
    per_step = gap_curves(curves, refs)
    steps = sorted(per_step)
    above = []
    for s in steps:
        iv = interval(per_step[s], level)
        above.append((iv.mean if iv.low is None else iv.low) > threshold)
    for i, s in enumerate(steps):
        run = above[i : i + patience]
        if run and all(run):
            return s
    return None
