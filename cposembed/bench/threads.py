"""Threads: cposembed on the run's threads against one thread (only with more than one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _membench
from ..functional import lookup, scatter_add
from ._common import OURS, Contender, Fixture, Group


def _versus_one(
    f: Fixture, op: str, run: Callable[[int], Callable[[], Any]], target: float
) -> Group:
    cs = [
        Contender(OURS, run(f.nt), f.rows_bytes),
        Contender("1 thread", run(1), f.rows_bytes, target=target),
    ]
    return Group(op, cs, f"{f.nt} threads vs 1")


def threads_lookup(f: Fixture) -> list[Group]:
    def run(n: int) -> Callable[[], Any]:
        return lambda: lookup(f.P, f.pos_ar, out=f.out, num_threads=n)

    group = _versus_one(f, "threads: lookup(out=)", run, 0.8)
    group.contenders.append(
        Contender(
            "limit: streaming fill",
            lambda: _membench.fill(f.probe_dst, f.probe_nt),
            f.rows_bytes,
        )
    )
    return [group]


def threads_scatter(f: Fixture) -> list[Group]:
    G = np.zeros_like(f.P)

    def run(n: int) -> Callable[[], Any]:
        return lambda: scatter_add(G, f.gout, f.pos_rand, num_threads=n)

    return [_versus_one(f, "threads: scatter_add random", run, 0.7)]
