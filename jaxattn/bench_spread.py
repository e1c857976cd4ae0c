"""How far `jaxattn bench`'s repeats of a cell agree, and which cells are too unsteady to compare.

Every timed row carries its per-repeat times ("repeat_us"); its median is "time_us" and its
fastest / slowest repeat "min_us" / "max_us". Implementations of a cell are timed in rounds, one
loop each, the order reversed every other round (`jaxattn.bench.run_bench`), so round r of two
implementations ran back to back: the ratio against torch's fastest backend is taken per round
("paired"), and a drift of the host's speed, which moves whole rounds, cancels within a pair.

A row is "unsteady" (marked `MARK` in the table) when, on this machine, its numbers cannot be
trusted to compare implementations:

    - its slowest repeat took more than `SPREAD_LIMIT` times its fastest;
    - the same holds for the torch backend it is compared with;
    - its paired ratios fall on both sides of 1 and their max / min exceeds `SPREAD_LIMIT`;
    - its forward was timed slower than its forward+backward of the same shape (impossible on a
      machine that runs both at the same speed).
"""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

#: Slowest / fastest repeat above which a measurement is called unsteady.
SPREAD_LIMIT = 1.5
MARK = "!"
LEGEND = (f"{MARK} unsteady: the repeats disagree by more than {SPREAD_LIMIT:g}x (or the forward was timed "
          "slower than the forward+backward); do not compare this row")


def spread(values: Sequence[float]) -> Optional[float]:
    """max / min of positive values (1.0: every repeat equal); None without values."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    low = min(values)
    if not low > 0:
        raise ValueError(f"values={list(values)!r}: expected positive times; a time of zero or less means the "
                         "clock did not measure the call.")
    return max(values) / low


def paired_ratios(reference_us: Sequence[float], row_us: Sequence[float]) -> list[float]:
    """Per round, the reference's time over the row's (> 1: the row is faster)."""
    if len(reference_us) != len(row_us):
        raise ValueError(f"reference_us has {len(reference_us)} repeats and row_us {len(row_us)}: expected the "
                         "same rounds for both (paired timing).")
    return [ref / own for ref, own in zip(reference_us, row_us)]


def ratio_summary(ratios: Sequence[float]) -> dict:
    """The row keys of paired ratios: median, min and max (None each without ratios)."""
    if not ratios:
        return {"vs_torch_paired": None, "vs_torch_min": None, "vs_torch_max": None}
    return {"vs_torch_paired": statistics.median(ratios), "vs_torch_min": min(ratios), "vs_torch_max": max(ratios)}


def _row_spread(row: dict) -> Optional[float]:
    if row.get("repeat_us"):
        return spread(row["repeat_us"])
    if row.get("min_us") and row.get("max_us"):  # a bench.json written before per-repeat times were kept
        return row["max_us"] / row["min_us"]
    return None


def unsteady_reasons(row: dict, reference: Optional[dict]) -> list[str]:
    """Why one timed row (and its torch reference row of the same cell) cannot be compared; [] if it can."""
    reasons = []
    own = _row_spread(row)
    if own is not None and own > SPREAD_LIMIT:
        reasons.append(f"repeats spread {own:.1f}x")
    if reference is not None and reference is not row:
        ref = _row_spread(reference)
        if ref is not None and ref > SPREAD_LIMIT:
            reasons.append(f"{reference['impl']} repeats spread {ref:.1f}x")
    lo, hi = row.get("vs_torch_min"), row.get("vs_torch_max")
    if lo is not None and hi is not None and lo < 1 < hi and hi / lo > SPREAD_LIMIT:
        reasons.append(f"ratio {lo:.2f}x to {hi:.2f}x")
    return reasons


def mark_unsteady(rows: Sequence[dict]) -> int:
    """Sets "unsteady" (bool) and "unsteady_why" (text) on every timed row; returns how many are unsteady."""
    by_cell: dict = {}
    for r in rows:
        by_cell.setdefault((r["case"], r["dtype"], r["mode"]), {})[r["impl"]] = r
    count = 0
    for r in rows:
        if r["status"] != "ok":
            r["unsteady"], r["unsteady_why"] = None, None
            continue
        cell = by_cell[(r["case"], r["dtype"], r["mode"])]
        reasons = unsteady_reasons(r, cell.get(r.get("torch_best")))
        if r["mode"] == "fwd":
            both = by_cell.get((r["case"], r["dtype"], "fwd+bwd"), {}).get(r["impl"])
            if both is not None and both["status"] == "ok" and r["time_us"] > both["time_us"]:
                reasons.append("forward timed slower than forward+backward")
        elif r["mode"] == "fwd+bwd":
            fwd = by_cell.get((r["case"], r["dtype"], "fwd"), {}).get(r["impl"])
            if fwd is not None and fwd["status"] == "ok" and fwd["time_us"] > r["time_us"]:
                reasons.append("forward timed slower than forward+backward")
        r["unsteady"] = bool(reasons)
        r["unsteady_why"] = "; ".join(reasons) or None
        count += bool(reasons)
    return count


def loaded_warning(rows: Sequence[dict], repeats: Optional[int]) -> Optional[str]:
    """The closing warning when some timed rows are unsteady (after `mark_unsteady`); None otherwise."""
    timed = [r for r in rows if r["status"] == "ok"]
    bad = [r for r in timed if r.get("unsteady")]
    if not bad:
        return None
    more = f"raise --repeats (this run: {repeats})" if repeats else "raise --repeats"
    return (f"warning: {len(bad)} of {len(timed)} timed rows are unsteady ({MARK}): this machine looks loaded, "
            f"so those numbers do not compare. For steadier numbers run on a quiet machine (close other "
            f"programs, no parallel jobs) and {more}.")
