"""Timing: warm-up, alternating rounds in shuffled order, medians; the busy process."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import time
import timeit
from collections.abc import Iterator

from ._common import Group


def round_orders(n: int, rounds: int) -> list[list[int]]:
    """A shuffled order of the n contenders per round (seeded: repeatable).

    A rotating order keeps the cyclic sequence, so each contender would
    always run right after the same other one; shuffling spreads whatever a
    contender leaves behind (spinning OpenMP workers of another runtime,
    dirty cache lines) over all of them.
    """
    rng = random.Random(n * 1000 + rounds)
    orders = []
    for _ in range(rounds):
        order = list(range(n))
        rng.shuffle(order)
        orders.append(order)
    return orders


def time_group(group: Group, repeats: int, slow_s: float = 0.3) -> None:
    """Warm-up, then alternating rounds in shuffled order, each run right after
    the one before it (no pause: a peer's OpenMP threads, still spinning or slow
    to wake, meet the next contender as they meet a user's next call); fills
    ``.times``."""
    for c in group.contenders:
        t0 = time.perf_counter()
        c.fn()
        c.times = []
        c.warm_s = time.perf_counter() - t0
    for order in round_orders(len(group.contenders), repeats):
        for k in order:
            c = group.contenders[k]
            # A contender taking seconds (np.add.at) gets 3 runs, not all.
            if c.warm_s > slow_s and len(c.times) >= 3:
                continue
            t0 = time.perf_counter()
            c.fn()
            c.times.append(time.perf_counter() - t0)


def _time_batches(group: Group, rounds: int, budget_s: float, calibrate: int) -> None:
    """Alternating rounds in shuffled order, each run a batch of back-to-back calls
    of at least ``budget_s`` (per-call time from ``calibrate`` calls after a warm-up;
    one call if a call takes longer); fills ``.times`` with every batch's mean per call."""
    for c in group.contenders:
        c.fn()
        per_call = timeit.Timer(c.fn).timeit(calibrate) / calibrate
        c.number = max(1, int(budget_s / max(per_call, 1e-8)))
        c.times = []
    for order in round_orders(len(group.contenders), rounds):
        for k in order:
            c = group.contenders[k]
            c.times.append(timeit.Timer(c.fn).timeit(c.number) / c.number)


def time_tiny(group: Group, repeats: int, budget_s: float = 0.005) -> None:
    """Per-call times of microsecond calls: batches of calls, alternating."""
    _time_batches(group, repeats * 3, budget_s, 50)
    for c in group.contenders:
        # The fastest batches: the ones least disturbed by other processes.
        c.times = sorted(c.times)[: max(3, len(c.times) // 3)]


def time_batched(group: Group, repeats: int) -> None:
    """Alternating rounds in shuffled order, each run a batch of back-to-back
    calls of at least ``group.batch_s`` (one call if a call takes longer), its
    mean per call; fills ``.times`` with every batch's (medians, unlike
    time_tiny's fastest batches: a busy machine's slow batches count)."""
    _time_batches(group, repeats, group.batch_s, 3)


def measure(group: Group, repeats: int) -> None:
    """Time ``group`` as its kind says: tiny, batched or one call per run, beside a
    busy process or not."""
    with busy_process() if group.busy else contextlib.nullcontext():
        if group.timer is not None:
            group.timer(group, repeats)
        elif group.tiny:
            time_tiny(group, repeats)
        elif group.batch_s:
            time_batched(group, repeats)
        else:
            time_group(group, repeats)


# The busy process: pure Python arithmetic (no memory traffic to speak of).
# It ends by itself within milliseconds when the bench is gone (its parent is
# no longer the bench, whose pid it gets as its argument: read in the child,
# the parent could already have died and left init as "the parent"), so even
# a bench killed by a signal leaves none behind.
BUSY_CODE = (
    "import os, sys\n"
    "parent = int(sys.argv[1])\n"
    "while os.getppid() == parent:\n"
    "    for _ in range(100000):\n"
    "        pass\n"
)


@contextlib.contextmanager
def busy_process() -> Iterator[subprocess.Popen[bytes]]:
    """A CPU-bound child process for the block, killed at its end (also on an
    error or Ctrl-C)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", BUSY_CODE, str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.2)  # past its start-up, into the loop
        yield proc
    finally:
        proc.kill()
        proc.wait()
