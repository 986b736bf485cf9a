"""Beside other thread pools in the same process: four large calls on the default
threads, each with another pool's work before every call (PyTorch ops on its own
libgomp copy, or a libgomp loop: the streaming fill of ``_membench``) and right after
such work, against the same calls alone in a fresh process that imports no other pool.

Nothing pauses between the other pool's work and the timed call: what its threads
leave behind (spinning, or asleep and slow to wake) is what a training step meets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _core, _membench, _threads
from ..functional import lookup, scatter_add
from ..layer import embed, embed_backward
from ._common import OURS, Contender, Fixture, Group

# Per round: this many calls each with the other pool's work before it, then this
# many calls right after, alone.
BESIDE_CALLS = 8
AFTER_CALLS = 4
# How many fresh processes time the calls alone, each followed by an equal
# share of the rounds in this process.
ALONE_PROCESSES = 3
# The largest acceptable time(with the other pool) / time(alone, fresh process).
BESIDE_TARGET = 1.15
AFTER_TARGET = 1.1
# PyTorch's work between two calls: what a training step does between the
# embedding's calls (an activation over a (4096, 768) tensor and a small matmul).
TORCH_OPS_SHAPE = (4096, 768)
TORCH_MATMUL = 512


def _calls(f: Fixture) -> dict[str, Callable[[], Any]]:
    """The four calls on the default threads, on the fixture's arrays."""
    wte, wpe, ids = f.layer.wte, f.layer.wpe, f.layer.ids
    G = np.zeros_like(f.P)
    g_wte, g_wpe = np.zeros_like(wte), np.zeros_like(wpe)
    return {
        "embed(out=) GPT-2": lambda: embed(ids, wte, wpe, out=f.out),
        "lookup(out=) (B, T, d)": lambda: lookup(f.P, f.pos_ar, out=f.out),
        "scatter_add random (B, T, d)": lambda: scatter_add(G, f.gout, f.pos_rand),
        "embed_backward GPT-2": lambda: embed_backward(g_wte, g_wpe, f.gout, ids),
    }


def _fixture_args(f: Fixture) -> dict[str, Any]:
    return {
        "table": [f.L, f.d],
        "batch": [f.B, f.T],
        "threads": f.nt,
        "vocab": f.vocab,
        "dtype": f.dt.name,
        "quick": f.quick,
    }


def _time_alone(calls: dict[str, Callable[[], Any]], n: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    for name, call in calls.items():
        call()
        times[name] = []
        for _ in range(n):
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    return times


def alone_main(argv: list[str]) -> None:
    """In a fresh process: time each call alone, back to back; print the times as JSON."""
    spec = json.loads(argv[0])
    f = Fixture(argparse.Namespace(**spec["fixture"]), None)
    print(json.dumps(_time_alone(_calls(f), spec["n"])))


def _alone_in_fresh_process(f: Fixture, n: int) -> dict[str, list[float]]:
    spec = json.dumps({"fixture": _fixture_args(f), "n": n})
    code = "import sys; from cposembed.bench.pools import alone_main; alone_main(sys.argv[1:])"
    env = dict(os.environ, CPOSEMBED_NUM_THREADS=str(f.nt))
    done = subprocess.run(
        [sys.executable, "-c", code, spec], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the fresh process timing the calls alone failed:\n{done.stderr}")
    times: dict[str, list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return times


def _block_means(times: list[float], size: int) -> list[float]:
    """The mean of each run of ``size`` consecutive times (a short last run dropped)."""
    return [float(np.mean(times[i : i + size])) for i in range(0, len(times) - size + 1, size)]


def _peers(f: Fixture) -> dict[str, Callable[[], Any]]:
    """The other pools' work: a libgomp loop always, PyTorch's ops when torch imports."""
    peers: dict[str, Callable[[], Any]] = {
        "a libgomp loop": lambda: _membench.fill(f.probe_dst, f.probe_nt),
    }
    torch = f.torch
    if torch is not None:
        x = torch.randn(*TORCH_OPS_SHAPE)
        a = torch.randn(TORCH_MATMUL, TORCH_MATMUL)

        def torch_ops() -> None:
            torch.nn.functional.gelu(x)
            torch.mm(a, a)

        peers["PyTorch ops"] = torch_ops
    return peers


def _round(call: Callable[[], Any], peer: Callable[[], Any]) -> tuple[float, float]:
    """One round: the mean time of the calls each after the peer's work, and of
    the calls right after them, alone."""
    beside = []
    for _ in range(BESIDE_CALLS):
        peer()
        t0 = time.perf_counter()
        call()
        beside.append(time.perf_counter() - t0)
    after = []
    for _ in range(AFTER_CALLS):
        t0 = time.perf_counter()
        call()
        after.append(time.perf_counter() - t0)
    return float(np.mean(beside)), float(np.mean(after))


def _timer(
    f: Fixture,
    peers: dict[str, Callable[[], Any]],
    groups: dict[tuple[str, str], tuple[Group, Group]],
) -> Callable[[Group, int], None]:
    """Times every pools group at once, whichever is measured first (they share
    the fresh processes): the calls alone in a fresh process, then ``repeats // 2``
    rounds in this one, the two alternating ALONE_PROCESSES times (once, --quick).
    Both sides are means of blocks of the same number of calls."""
    calls = _calls(f)
    done = False

    def time_all(_group: Group, repeats: int) -> None:
        nonlocal done
        if done:
            return
        done = True
        n_proc = 1 if f.quick else ALONE_PROCESSES
        rounds = max(1, repeats // 2 // n_proc)
        before = _core.user_threads() or None  # set_num_threads(n), or None: not set
        _threads.set_num_threads(f.nt)
        try:
            for _ in range(n_proc):
                alone = _alone_in_fresh_process(f, BESIDE_CALLS * rounds)
                for (name, _peer), (beside, after) in groups.items():
                    # Blocks of as many calls as the rounds' blocks, their means.
                    beside.contenders[1].times.extend(_block_means(alone[name], BESIDE_CALLS))
                    after.contenders[1].times.extend(_block_means(alone[name], AFTER_CALLS))
                for _ in range(rounds):
                    for (name, peer), (beside, after) in groups.items():
                        b, a = _round(calls[name], peers[peer])
                        beside.contenders[0].times.append(b)
                        after.contenders[0].times.append(a)
        finally:
            _threads.set_num_threads(before)

    return time_all


def pools(f: Fixture) -> list[Group]:
    """Per call and other pool: a group with the pool's work before each call and
    one for the calls right after, each against the call alone in a fresh process."""
    peers = _peers(f)
    note = (
        f"default threads ({f.nt}); per round {BESIDE_CALLS} calls each after the "
        f"other pool's work, then {AFTER_CALLS} alone, no pause; "
        f"the mean per call of each, median over rounds"
    )
    groups: dict[tuple[str, str], tuple[Group, Group]] = {}
    for name in _calls(f):
        for peer in peers:
            beside, after = (
                Group(
                    op,
                    [
                        Contender(OURS, lambda: None, f.rows_bytes),
                        Contender(
                            "alone, fresh process", lambda: None, f.rows_bytes, target=target
                        ),
                    ],
                    note,
                )
                for op, target in (
                    (f"pools: {name}, {peer} before each call", BESIDE_TARGET),
                    (f"pools: {name}, right after {peer}", AFTER_TARGET),
                )
            )
            groups[(name, peer)] = (beside, after)
    timer = _timer(f, peers, groups)
    out = []
    for beside, after in groups.values():
        beside.timer = after.timer = timer
        out += [beside, after]
    return out
