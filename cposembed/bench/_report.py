"""Reporting: the table (each row's ``ours/this``, its rule and verdict), the JSON rows,
the Markdown, the missed targets and the summary line."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ._common import OURS, Contender, Group


def fmt_ms(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:9.2f} us"
    return f"{s * 1e3:9.2f} ms"


QUICK_VERDICT = "n/a (quick)"
RATIO = "ours/this"
# Printed above the table and in the Markdown: the one direction of every ratio.
RATIO_LEGEND = (
    "ours/this = time(cposembed) / time(this contender), from the same run: "
    "below 1, cposembed is faster. A target is the largest ours/this that meets it."
)
# The exception for the threads rows: more threads need not help once
# cposembed already runs within this factor of the machine's limit.
THREADS_LIMIT_FACTOR = 1.1


def _rule(group: Group, target: float) -> str:
    """The rule a row with ``target`` is judged by, as the table prints it."""
    rule = f"{RATIO} <= {target:g}"
    if group.op.startswith("threads:") and _limit_of(group) is not None:
        rule += f", or ours/limit <= {THREADS_LIMIT_FACTOR:g}"
    return rule


def _limit_of(group: Group) -> Contender | None:
    return next((c for c in group.contenders if c.name.startswith("limit:")), None)


def _ratio(group: Group, ours: Contender, c: Contender) -> float:
    """ours/this: the ratio of the medians; for batched groups (time_batched, whose
    rounds run each contender once) the median of the rounds' ratios, which a
    drift of the machine's speed over the run moves less."""
    if group.batch_s and ours.times and len(ours.times) == len(c.times):
        return float(np.median(np.divide(ours.times, c.times)))
    return ours.median / c.median


def _judge(group: Group, ratio: float, target: float) -> tuple[bool, str]:
    """Whether a row meets its target, and the verdict with the numbers that decided it."""
    if ratio <= target:
        return True, "ok"
    limit = _limit_of(group)
    if group.op.startswith("threads:") and limit is not None:
        ours = next(c for c in group.contenders if c.name == OURS)
        to_limit = ours.median / limit.median
        if to_limit <= THREADS_LIMIT_FACTOR:
            return True, f"ok (ours/limit {to_limit:.2f})"
        return False, f"MISS (ours/limit {to_limit:.2f})"
    return False, "MISS"


def report(
    groups: list[Group], file: Any = None, judge: bool = True, why_no_peer: str = ""
) -> list[dict[str, Any]]:
    """Print the table; ``judge=False`` (a --quick run) shows targets without verdicts.

    A row's ``met`` is True/False when its target was judged, else None; its
    ``rule`` says what was judged (``ours/this <= target``, and for the
    threads rows the limit exception). Groups with no contender but
    cposembed are not comparisons: they are left out, and ``why_no_peer``
    (e.g. "torch not installed") is printed with their names. ``file`` defaults to the current ``sys.stdout``.
    """
    if file is None:
        file = sys.stdout
    rows: list[dict[str, Any]] = []
    lines: list[tuple[str, ...] | str] = []
    lonely = [g.op for g in groups if len(g.contenders) < 2]
    for g in groups:
        if len(g.contenders) < 2:
            continue
        ours = next(c for c in g.contenders if c.name == OURS)
        lines.append(f"{g.op}  [{g.note}]" if g.note else g.op)
        for c in g.contenders:
            med = c.median
            gbs = c.nbytes / med / 1e9 if c.nbytes and med > 0 else float("nan")
            ratio = _ratio(g, ours, c) if c is not ours else 1.0
            target = c.target
            rule = _rule(g, target) if target is not None else ""
            verdict = ""
            met = None
            if target is not None and not judge:
                verdict = f"{rule}: {QUICK_VERDICT}"
            elif target is not None:
                met, said = _judge(g, ratio, target)
                verdict = f"{rule}: {said}"
            lines.append(
                (
                    f"  {c.name}",
                    fmt_ms(med).strip(),
                    f"{gbs:.2f}" if gbs == gbs else "",
                    f"{ratio:.3f}" if c is not ours else "",
                    c.check,
                    verdict,
                )
            )
            rows.append(
                {
                    "op": g.op,
                    "contender": c.name,
                    "note": g.note,
                    "median_s": med,
                    "runs": len(c.times),
                    "gb_per_s": gbs if gbs == gbs else None,
                    "ratio_ours_to_this": ratio,
                    "target": target,
                    "rule": rule or None,
                    "met": met,
                    "check": c.check,
                }
            )
    head = ("op / contender", "time", "GB/s", RATIO, "check", "target: verdict")
    cells = [x for x in lines if isinstance(x, tuple)]
    widths = [max(len(row[i]) for row in [head, *cells]) for i in range(len(head))]

    def fmt(row: tuple[str, ...]) -> str:
        name, time_s, gbs_s, ratio_s, check, verdict = row
        return (
            f"{name:<{widths[0]}}  {time_s:>{widths[1]}}  {gbs_s:>{widths[2]}}  "
            f"{ratio_s:>{widths[3]}}  {check:<{widths[4]}}  {verdict}"
        ).rstrip()

    print(RATIO_LEGEND, file=file)
    print(fmt(head), file=file)
    for line in lines:
        print(line if isinstance(line, str) else fmt(line), file=file)
    if lonely:
        print(f"not compared ({why_no_peer or 'no peer'}): {', '.join(lonely)}", file=file)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The results as a Markdown table (``--markdown``)."""
    lines = [
        RATIO_LEGEND,
        "",
        f"| op | contender | time | GB/s | {RATIO} | target | check |",
        "| --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    last = None
    for r in rows:
        op = r["op"] if r["op"] != last else ""
        last = r["op"]
        t = r["median_s"]
        time_s = f"{t * 1e6:.2f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"
        gbs = f"{r['gb_per_s']:.2f}" if r["gb_per_s"] else ""
        ratio = "" if r["contender"] == OURS else f"{r['ratio_ours_to_this']:.3f}"
        target = ""
        if r["target"] is not None:
            verdict = {True: "ok", False: "**miss**", None: QUICK_VERDICT}[r["met"]]
            target = f"{r['rule']}: {verdict}"
        lines.append(
            f"| {op} | {r['contender']} | {time_s} | {gbs} | {ratio} | {target} | {r['check']} |"
        )
    return "\n".join(lines) + "\n"


def mismatched(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows whose output differed from the peer's."""
    return [r for r in rows if r["check"].startswith("MISMATCH")]


def summary(rows: list[dict[str, Any]], judged: bool) -> str:
    """The one line that ends every run: targets met and missed, check mismatches."""
    mismatches = len(mismatched(rows))
    if not judged:
        return f"summary: quick run, targets not judged; {mismatches} check mismatches"
    with_target = [r for r in rows if r["target"] is not None]
    ok = sum(bool(r["met"]) for r in with_target)
    return (
        f"summary: {len(with_target)} rows with targets, {ok} ok, "
        f"{len(with_target) - ok} miss; {mismatches} check mismatches"
    )


def missed(rows: list[dict[str, Any]]) -> list[str]:
    """One line per judged row that missed its target: what, its ratio, its rule."""
    return [
        f"missed: {r['op']} vs {r['contender']}: {RATIO} {r['ratio_ours_to_this']:.3f}, "
        f"rule {r['rule']}"
        for r in rows
        if r["met"] is False
    ]
