"""Threads on a busy machine: default threads (``num_threads=None``) against one thread,
idle and with a CPU-bound process of the bench's own beside them, for ``add_positions``
and ``scatter_add`` of random positions at sizes from tiny to large, then a short
``cposembed.train.train`` run as a whole; and beside other thread pools in the same
process (``pools``). Public API only."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _core, _threads
from ..functional import add_positions, scatter_add
from ..train import train
from ._common import OURS, Contender, Fixture, Group
from .pools import pools

# The sizes (B, T) of the token arrays, and the training run's steps.
CONTENTION_SIZES = ((8, 16), (8, 128), (32, 1024))
CONTENTION_TRAIN_STEPS = 30
# The largest acceptable time(default threads) / time(1 thread), per load; idle,
# the large calls (LARGE_SIZE) must gain from the threads.
LOAD_TARGETS = {"idle": 1.05, "busy": 1.2}
LARGE_SIZE = (32, 1024)
LARGE_IDLE_TARGET = 0.7
# Each timed run is a batch of back-to-back calls of at least this long: one
# microsecond call timed alone varies by more than the 5 % the idle rows allow
# (a loop of calls is also how the back-off of the team meets them).
CONTENTION_BATCH_S = 0.004
TRAIN_TARGETS: dict[str, float | None] = {"idle": None, "busy": 1.2}


def _versus_one(run: Callable[..., Any], nbytes: int, target: float | None) -> list[Contender]:
    return [
        Contender(OURS, lambda: run(num_threads=None), nbytes),
        Contender("1 thread", lambda: run(num_threads=1), nbytes, target=target),
    ]


def _run_train(num_threads: int | None) -> None:
    before = _core.user_threads() or None  # set_num_threads(n), or None: not set
    _threads.set_num_threads(num_threads)
    try:
        train(steps=CONTENTION_TRAIN_STEPS, progress=False)
    finally:
        _threads.set_num_threads(before)


def contention(f: Fixture) -> list[Group]:
    d, dt = f.d, f.dt
    # The table holds the largest T (a --quick run's table may not).
    Lc = max(f.L, max(t for _, t in CONTENTION_SIZES))
    table = f.rng.standard_normal((Lc, d)).astype(dt)
    groups = []
    note = f"table {Lc} x {d}, default threads vs num_threads=1"
    for load, target in LOAD_TARGETS.items():
        for b, t in CONTENTION_SIZES:
            x = f.rng.standard_normal((b, t, d)).astype(dt)
            pos = f.rng.integers(0, Lc, size=(b, t), dtype=np.int64)
            runs = {
                "add_positions": functools.partial(add_positions, x, table, out=np.empty_like(x)),
                "scatter_add": functools.partial(scatter_add, np.zeros_like(table), x, pos),
            }
            large_idle = load == "idle" and (b, t) == LARGE_SIZE
            size_target = LARGE_IDLE_TARGET if large_idle else target
            for op, run in runs.items():
                groups.append(
                    Group(
                        f"contention {load}: {op} ({b}, {t}, d)",
                        _versus_one(run, x.nbytes, size_target),
                        note,
                        busy=load == "busy",
                        batch_s=CONTENTION_BATCH_S,
                    )
                )
    train_note = f"cposembed.train.train(steps={CONTENTION_TRAIN_STEPS}), default settings"
    for load, train_target in TRAIN_TARGETS.items():
        groups.append(
            Group(
                f"contention {load}: train",
                _versus_one(_run_train, 0, train_target),
                train_note,
                busy=load == "busy",
                batch_s=CONTENTION_BATCH_S,
            )
        )
    return groups + pools(f)
