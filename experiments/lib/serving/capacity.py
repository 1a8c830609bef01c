"""Capacity: the highest request rate a configuration sustains within an SLO, from a sweep of rates or a search;
and rank agreement between two orderings of the same configurations (Kendall's tau).

A rate *meets* the SLO when at least `attainment` (a fraction, e.g. 0.9) of its requests meet every SLO (their TTFT,
TPOT and E2EL under the limits; a failed request does not) — DistServe's "SLO attainment". A configuration's
capacity over measured points is the highest rate below which every measured rate met it: a sweep over
0.5, 1, 2, 4 whose 2 fails has capacity 1, whatever 4 did. `search_capacity` brackets it by doubling (or halving)
from a start rate, then bisects geometrically until the bracket is within a relative tolerance.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from experiments.lib.serving.metrics import RequestRecord, meets_slo


def slo_attainment(records: Sequence[RequestRecord], slo: dict[str, float]) -> float:
    """The fraction of `records` that succeeded and met every SLO (milliseconds; {}: every success counts)."""
    if not records:
        raise ValueError("slo_attainment: no requests")
    return sum(1 for r in records if r.success and meets_slo(r, slo)) / len(records)


@dataclasses.dataclass
class Capacity:
    """The capacity found over the measured points: `rate` is the highest sustained rate (None: even the lowest
    rate tried failed, the capacity is below `below`); `above` is the lowest failing rate (None: every rate tried
    met the SLO, the capacity is at least `rate`)."""

    rate: float | None
    above: float | None
    tried: list[tuple[float, bool]]  # (rate, met), in the order they were run

    @property
    def bounded(self) -> bool:
        """Bracketed on both sides (a sustained and a failing rate)."""
        return self.rate is not None and self.above is not None

    def describe(self) -> str:
        if self.rate is None:
            return f"< {_r(self.above)}/s"
        if self.above is None:
            return f">= {_r(self.rate)}/s"
        return f"{_r(self.rate)}/s"

    def to_dict(self) -> dict:
        return {"rate": self.rate, "failing_rate": self.above, "bounded": self.bounded, "text": self.describe(),
                "tried": [{"rate": r, "met": ok} for r, ok in self.tried]}


def _r(x: float) -> str:
    return f"{x:.3g}"


def capacity_from_points(points: Sequence[tuple[float, bool]]) -> Capacity:
    """The capacity over (rate, met) points: the highest rate below the lowest failing one."""
    if not points:
        raise ValueError("capacity_from_points: no points")
    failing = [r for r, ok in points if not ok]
    first_fail = min(failing, default=None)
    sustained = [r for r, ok in points if ok and (first_fail is None or r < first_fail)]
    return Capacity(rate=max(sustained, default=None), above=first_fail, tried=list(points))


def search_capacity(meets: Callable[[float], bool], start: float, *, rel_tol: float = 0.1, max_points: int = 12,
                    factor: float = 2.0) -> Capacity:
    """Bracket the capacity by multiplying (or dividing) `start` by `factor` until `meets(rate)` changes, then bisect
    the bracket geometrically until hi / lo - 1 <= rel_tol; at most `max_points` calls of `meets`. Assumes a rate
    that fails is failed by every higher rate (the search never retries below a failure)."""
    if not (start > 0 and math.isfinite(start)):
        raise ValueError(f"search_capacity: start must be a finite rate > 0, got {start}")
    if not rel_tol > 0 or factor <= 1 or max_points < 1:
        raise ValueError(f"search_capacity: need rel_tol > 0, factor > 1, max_points >= 1; got {rel_tol}, {factor}, "
                         f"{max_points}")
    tried: list[tuple[float, bool]] = []

    def run(rate: float) -> bool:
        ok = bool(meets(rate))
        tried.append((rate, ok))
        return ok

    lo = hi = None
    rate = start
    while len(tried) < max_points and (lo is None or hi is None):
        if run(rate):
            lo = rate
            rate *= factor
        else:
            hi = rate
            rate /= factor
        if lo is not None and hi is not None:
            break
    while lo is not None and hi is not None and hi / lo - 1 > rel_tol and len(tried) < max_points:
        mid = math.sqrt(lo * hi)
        if run(mid):
            lo = mid
        else:
            hi = mid
    return Capacity(rate=lo, above=hi, tried=tried)


def ranking(capacities: dict[str, Capacity], rel_tie: float = 0.0) -> list[list[str]]:
    """Configurations grouped best first by capacity (unbounded-above first among equals, then by rate; a capacity
    below every rate tried last); names whose rates differ by at most `rel_tie` share a group."""
    def key(name: str) -> tuple:
        c = capacities[name]
        if c.rate is None:
            return (0, -(c.above or 0.0))
        return (1, c.rate, c.above is None)

    order = sorted(capacities, key=key, reverse=True)
    groups: list[list[str]] = []
    for name in order:
        if groups and _tied(capacities[groups[-1][0]], capacities[name], rel_tie):
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


def _tied(a: Capacity, b: Capacity, rel_tie: float) -> bool:
    if (a.rate is None) != (b.rate is None) or (a.above is None) != (b.above is None):
        return False
    x, y = (a.rate, b.rate) if a.rate is not None else (a.above, b.above)
    return abs(x - y) <= rel_tie * max(x, y)


def format_ranking(capacities: dict[str, Capacity], rel_tie: float = 0.0) -> str:
    """'sarathi (4.1/s) > vllm (2.9/s) = exllamav2 (2.9/s)'."""
    return " > ".join(" = ".join(f"{n} ({capacities[n].describe()})" for n in g)
                      for g in ranking(capacities, rel_tie))


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Kendall's tau-b between two scorings of the same items (ties handled; None when either is constant or there
    are fewer than two items): 1 = the same order, -1 = reversed."""
    if len(a) != len(b):
        raise ValueError(f"kendall_tau: {len(a)} and {len(b)} scores")
    conc = disc = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                conc += 1
            else:
                disc += 1
    denom = math.sqrt((conc + disc + ties_a) * (conc + disc + ties_b))
    return None if denom == 0 else (conc - disc) / denom
