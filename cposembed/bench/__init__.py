"""``python -m cposembed bench``: cposembed side by side with the machine and its peers.

Every comparison runs in this one process on the same arrays with the same
threads: warm-up first, then rounds in which each contender runs once, in a
fresh shuffled order each round (so drifting machine load hits all alike,
and no contender always follows the same other one: a peer whose OpenMP
threads still spin after its call would otherwise always slow down the same
contender); the median per contender is reported, and ratios are
``time(cposembed) / time(other)`` (below 1: cposembed is faster).

The machine's own limits are measured in the same run on the same number of
bytes: a streaming (non-temporal store) fill, a streaming copy and a
vectorised read-only sum (``cposembed._membench``). Peers: the handbook's
NumPy class, plain NumPy (``np.take``, ``tok + P[pos]``, ``np.add.at``) and,
when it is installed, PyTorch's CPU ops. Outputs are checked equal to each
peer's before timing.

Options: ``--quick`` (a few seconds, a smoke test for CI), ``--table L D``, ``--vocab V``,
``--batch B T``, ``--threads N``, ``--repeats R``, ``--dtype``, ``--json FILE``,
``--no-torch``, ``--only NAME...``. Progress goes to stderr, the table to stdout:
each row's ``ours/this`` ratio and, for a row with a target, the rule it is
judged by (``ours/this <= 0.65``; the threads rows also pass within 1.1 x
the machine's limit) and the verdict. Comparisons whose only peer is PyTorch
are named as not compared when torch is missing. The table ends with a line
per missed target and a one-line summary (targets met and missed, output
check mismatches). A ``--quick`` run measures at small sizes, where the
targets (set for the full sizes) say nothing: it reports them as
``n/a (quick)``.

Layout: ``_timing`` (alternating runs, medians, the busy process),
``_report`` (the table, its rules, the summary, JSON rows, Markdown),
``_common`` (contenders, groups, the run's shared arrays), one module per
kind of comparison (``lookup``, ``add``, ``scatter``, ``backward``,
``threads``, ``tiny``, ``layer``, ``half``, ``torch``, ``optim``,
``contention``), each comparison a function of the shared Fixture returning
its groups, with each target on its contender; ``_groups.GROUPS`` lists
them once, in the order they run; ``_cli`` is the command line.
"""

from __future__ import annotations

from typing import Any

from ._cli import machine_info, main, make_parser, parse_args
from ._common import OURS, Contender, Fixture, Group
from ._groups import GROUP_NAMES, GROUPS, build_groups, targets
from ._report import (
    QUICK_VERDICT,
    RATIO,
    RATIO_LEGEND,
    THREADS_LIMIT_FACTOR,
    _judge,
    _rule,
    markdown,
    missed,
    report,
    summary,
)
from ._timing import BUSY_CODE, busy_process

__all__ = [
    "BUSY_CODE",
    "GROUPS",
    "GROUP_NAMES",
    "OURS",
    "QUICK_VERDICT",
    "RATIO",
    "RATIO_LEGEND",
    "THREADS_LIMIT_FACTOR",
    "Contender",
    "Fixture",
    "Group",
    "_judge",
    "_rule",
    "build_groups",
    "busy_process",
    "machine_info",
    "main",
    "make_parser",
    "markdown",
    "missed",
    "parse_args",
    "report",
    "summary",
    "targets",
]

_targets: dict[tuple[str, str], float] = {}


def __getattr__(name: str) -> Any:
    # TARGETS, every (op, contender) -> target, is read off the groups on
    # first use (it builds them on small arrays).
    if name == "TARGETS":
        if not _targets:
            _targets.update(targets())
        return _targets
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
