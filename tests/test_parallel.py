"""The kernels' OpenMP threads (src_c/_parallel.pxi, _threads.h): results,
bounds, refusals, the measured choice of one thread or several.

Work on more than one thread is cut into chunks that whichever thread is free
claims; what a chunk covers and the order of each row's sum are fixed, so the
bits never depend on the thread count or on which thread ran what. The
helper threads the runtime starts are bounded for all calling threads
together, and when the OS refuses one the call completes on the threads it
has. What could crash or exit runs in a child interpreter.
"""

from __future__ import annotations

import os
import sys
import textwrap

import numpy as np
import pytest
from helpers import assert_clean_exit, bits, last_json, reference_scatter, run_python, tuned
from hypothesis import given
from hypothesis import strategies as st

import cposembed
from cposembed import _core, _marks

needs_openmp = pytest.mark.skipif(not cposembed.openmp_enabled(), reason="serial build")
THREADS = (1, 2, 3, 4)
PLANS = (_core.PLAN_AUTO, _core.PLAN_DISTINCT, _core.PLAN_SCAN, _core.PLAN_SORT)


def _results(num_threads, table, tokens, pos, ids, vocab, plan):
    """Every operation once, with num_threads, on copies of the inputs."""
    L, d = table.shape
    grad = np.zeros_like(table)
    assert _core.scatter_add(grad, tokens, pos, 0, num_threads, None, -1, plan) is grad
    gtok, gpos = np.zeros_like(vocab), np.zeros_like(table)
    cposembed.embed_backward(gtok, gpos, tokens, ids, pos, num_threads=num_threads)
    stepped = table.copy()
    touched = _marks.RowMarks(L, np.isin(np.arange(L), pos))
    assert _core.sgd_step(stepped, grad, touched, 0.25, -1, num_threads)
    return [
        cposembed.lookup(table, pos, num_threads=num_threads),
        cposembed.add_positions(tokens, table, num_threads=num_threads),
        cposembed.add_positions(tokens, table, pos, num_threads=num_threads),
        grad,
        cposembed.embed(ids, vocab, table, num_threads=num_threads),
        gtok,
        gpos,
        stepped,
    ]


@given(
    L=st.integers(1, 70),
    V=st.integers(1, 90),
    d=st.integers(1, 40),
    B=st.integers(1, 4),
    T=st.integers(1, 70),
    dtype=st.sampled_from([np.float32, np.float64]),
    plan=st.sampled_from(PLANS),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_operation_bitwise_the_same_on_1_to_4_threads(L, V, d, B, T, dtype, plan, seed):
    # serial_below=0 and a tiny scan budget: every call runs on threads, in
    # many small chunks, through every plan.
    T = min(T, L)
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((L, d)).astype(dtype)
    vocab = rng.standard_normal((V, d)).astype(dtype)
    tokens = rng.standard_normal((B, T, d)).astype(dtype)
    # Few distinct rows (many repeats per row) or many: both orders show.
    pos = rng.integers(0, rng.integers(1, L + 1), size=(B, T))
    ids = rng.integers(0, V, size=(B, T))
    # A chunk of a few rows.
    with tuned(
        serial_below=0,
        scan_block_bytes=int(rng.integers(1, 4096)),
        chunk_elems=int(rng.integers(1, 4 * d + 1)),
        adapt=False,
    ):
        want = _results(1, table, tokens, pos, ids, vocab, plan)
        for n in THREADS[1:]:
            got = _results(n, table, tokens, pos, ids, vocab, plan)
            for k, (a, b) in enumerate(zip(got, want)):
                assert np.array_equal(bits(a), bits(b)), (n, k)
    ref = reference_scatter(np.zeros_like(table), tokens, pos)
    assert np.array_equal(bits(want[3]), bits(ref))


@needs_openmp
def test_results_stay_bitwise_while_other_threads_compete_for_the_threads():
    # The same calls from 6 Python threads at once (helpers taken by one
    # caller or another, chunks claimed in whatever order) give the bits of
    # one thread alone, every time.
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(7)
    L, d = 300, 128
    table = rng.standard_normal((L, d)).astype(np.float32)
    g = rng.standard_normal((8, 512, d)).astype(np.float32)
    pos = rng.integers(0, L, size=(8, 512))
    want = reference_scatter(np.zeros_like(table), g, pos)
    want_add = g + table[pos]

    def job(i):
        n = 1 + i % 4
        ok = True
        for _ in range(5):
            grad = cposembed.scatter_add(np.zeros_like(table), g, pos, num_threads=n)
            ok &= np.array_equal(bits(grad), bits(want))
            ok &= np.array_equal(cposembed.add_positions(g, table, pos, num_threads=n), want_add)
        return ok

    with ThreadPoolExecutor(6) as ex:
        assert all(ex.map(job, range(24)))


@needs_openmp
def test_calls_complete_when_no_helper_may_start():
    """As if the OS refused every new thread: calls run on their callers."""
    code = textwrap.dedent(
        """
        import json
        import numpy as np
        import cposembed
        from cposembed import _core

        _core.set_threads_refused(True)
        table = np.random.default_rng(0).standard_normal((512, 256)).astype(np.float32)
        pos = np.arange(4 * 512).reshape(4, 512) % 512
        g = np.ones((4, 512, 256), np.float32)
        ok = np.array_equal(cposembed.lookup(table, pos, num_threads=4), table[pos])
        grad = cposembed.scatter_add(np.zeros_like(table), g, pos, num_threads=4)
        ok = ok and np.array_equal(grad, np.full_like(table, 4))
        print(json.dumps({"ok": bool(ok), "info": _core.thread_info(),
                          "parallel": _core.thread_info()["went_parallel"], "last": _core.last_team()}))
        """
    )
    proc = run_python(["-c", code])
    assert_clean_exit(proc)
    r = last_json(proc)
    assert r["ok"] and r["info"]["reserved"] == 0 and r["info"]["refused"], r
    assert not r["parallel"], r  # no region ran
    assert r["last"] == 4  # the plan was 4 threads; the caller ran it alone


@needs_openmp
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread CPU times: Linux")
def test_idle_helpers_sleep_instead_of_spinning():
    """After its calls a process uses no CPU: the runtime's helpers sleep after
    a short spin."""
    code = textwrap.dedent(
        """
        import json, resource, time
        import numpy as np
        import cposembed
        from cposembed import _core

        tokens = np.ones((8, 1024, 256), np.float32)
        table = np.ones((1024, 256), np.float32)
        for _ in range(50):
            cposembed.add_positions(tokens, table, num_threads=2)
        time.sleep(0.3)  # longer than libgomp's default spin
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(0.5)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        print(json.dumps({"cpu": cpu, "parallel": _core.thread_info()["went_parallel"]}))
        """
    )
    proc = run_python(["-c", code], env={"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None})
    assert_clean_exit(proc)
    r = last_json(proc)
    assert r["parallel"], r
    assert r["cpu"] < 0.05, r  # 0.5 s of a spinning helper would be 0.5 s


@needs_openmp
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_the_cpu_limit_is_read_again_after_the_affinity_changes():
    code = textwrap.dedent(
        """
        import json, os, time
        import cposembed
        before = cposembed.get_num_threads()
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        time.sleep(0.06)  # the limit is read at most every 50 ms
        print(json.dumps({"before": before, "after": cposembed.get_num_threads(),
                          "cpus": os.cpu_count()}))
        """
    )
    proc = run_python(["-c", code], env={"OMP_NUM_THREADS": None, "CPOSEMBED_NUM_THREADS": None})
    assert_clean_exit(proc)
    r = last_json(proc)
    assert r["after"] == 1, r


def test_one_thread_is_chosen_only_while_it_measures_faster():
    """The rule (cpe_choose, cpe_took) on a kind no kernel uses: several
    threads first; one now and then; one thread once it beat them by the
    margin; several again as soon as one call on them beats one thread."""
    kind, work, n = 7, 1 << 20, 2
    choose, took = _core.choose_threads, _core.took_threads
    old = _core.set_tuning(adapt=True)  # forgets what was measured
    try:
        counts = []
        for _ in range(40):  # idle: several threads take half the time
            k = choose(kind, work, n)
            counts.append(k)
            took(kind, work, k, 1_000_000 if k == 1 else 550_000)
        assert counts[0] == n and 1 in counts and counts.count(n) >= 30, counts
        # The CPUs get busy: several threads become twice as slow as one.
        for _ in range(3):
            k = choose(kind, work, n)
            took(kind, work, k, 1_000_000 if k == 1 else 2_000_000)
        counts = [choose(kind, work, n) for _ in range(3)]
        assert counts == [1, 1, 1], counts
        # Busy, one thread: several are tried now and then, and lose.
        counts = []
        for _ in range(64):
            k = choose(kind, work, n)
            counts.append(k)
            took(kind, work, k, 1_000_000 if k == 1 else 2_000_000)
        assert 1 <= counts.count(n) <= 16, counts  # tried, rarely: each try costs
        # The CPUs are free again: the next try wins, and several stay.
        counts = []
        for _ in range(40):
            k = choose(kind, work, n)
            counts.append(k)
            took(kind, work, k, 1_000_000 if k == 1 else 550_000)
        first = counts.index(n)
        assert first < 32 and counts[first:].count(n) >= len(counts[first:]) - 3, counts
        # A call on one thread reported before any on several (a caller the
        # budget left alone): counted, with no median of nothing taken.
        _core.set_tuning(adapt=True)
        assert choose(kind, work, n) == n
        took(kind, work, 1, 1_000_000)
        assert choose(kind, work, n) == n
        # Off: the plan as it is.
        _core.set_tuning(adapt=False)
        assert all(choose(kind, work, n) == n for _ in range(50))
    finally:
        _core.set_tuning(**old)


# Counts the threads of this process while many Python threads call the
# kernels at once: the helpers are one set for all callers.
_COUNT_THREADS = """
import json, os, threading, time
import numpy as np
import cposembed
from cposembed import _core, _marks

CALLERS = {callers}
table = np.random.default_rng(0).standard_normal((1024, 256)).astype(np.float32)
pos = np.random.default_rng(1).integers(0, 1024, size=(8, 256))
g = np.ones((8, 256, 256), np.float32)
want_grad = np.zeros_like(table)
np.add.at(want_grad, pos, g)
want_add = g + table[pos]
baseline = len(os.listdir("/proc/self/task"))
start = threading.Barrier(CALLERS + 1)
stop = threading.Event()
bad = []

def caller(i):
    start.wait()
    n = None if i % 2 else {explicit}
    for _ in range(20):
        grad = cposembed.scatter_add(np.zeros_like(table), g, pos, num_threads=n)
        out = cposembed.add_positions(g, table, pos, num_threads=n)
        if not (np.array_equal(grad, want_grad) and np.array_equal(out, want_add)):
            bad.append(i)

threads = [threading.Thread(target=caller, args=(i,)) for i in range(CALLERS)]
for t in threads:
    t.start()
start.wait()
peak = 0
while any(t.is_alive() for t in threads):
    peak = max(peak, len(os.listdir("/proc/self/task")))
for t in threads:
    t.join()
# A joined thread may linger in /proc for a moment while it exits.
# A joined thread may still be ending (and giving its helpers back).
for _ in range(500):
    after = len(os.listdir("/proc/self/task"))
    if after <= baseline + 1 and _core.thread_info()["reserved"] <= 1:
        break
    time.sleep(0.01)
print(json.dumps({{"baseline": baseline, "peak": peak, "bad": bad, "after": after,
                   "info": _core.thread_info(), "cpus": _core.cpu_limit()}}))
"""


@needs_openmp
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc/self/task")
@pytest.mark.parametrize("explicit", [2, 1000])
def test_threads_stay_bounded_with_many_calling_threads(explicit):
    callers = 64
    proc = run_python(["-c", _COUNT_THREADS.format(callers=callers, explicit=explicit)])
    assert_clean_exit(proc)
    r = last_json(proc)
    assert r["bad"] == []
    cap = 4 * r["cpus"] - 1
    assert r["info"]["room"] == cap
    # The callers' own threads, the helpers, nothing else; the callers that
    # ended gave their helpers back.
    assert r["peak"] <= r["baseline"] + callers + cap, r
    assert r["info"]["reserved"] <= 1, r  # the main thread's, if it went parallel
    assert r["after"] <= r["baseline"] + 1, r


# 100 Python threads call the kernels under an OS limit on this user's
# threads that leaves room for only two helpers: the calls take what the OS
# allows, the rest run on their callers, and the process ends cleanly
# (libgomp exits the process when it cannot start a thread).
_UNDER_NPROC_LIMIT = """
import json, os, resource, threading
import numpy as np
import cposembed
from cposembed import _core, _marks

CALLERS = 100
HELPER_ROOM = 2
table = np.random.default_rng(0).standard_normal((1024, 256)).astype(np.float32)
pos = np.random.default_rng(1).integers(0, 1024, size=(8, 256))
g = np.ones((8, 256, 256), np.float32)
want_grad = np.zeros_like(table)
np.add.at(want_grad, pos, g)
want_look = table[pos]
# Everything these calls need is loaded before the switch of user (the
# interpreter's files may not be readable by it); one thread, no helper yet.
cposembed.scatter_add(np.zeros_like(table), g, pos, num_threads=1)
cposembed.lookup(table, pos, num_threads=1)
assert not _core.thread_info()["went_parallel"]
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
limit = len(os.listdir("/proc/self/task")) + CALLERS + HELPER_ROOM
resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
start = threading.Barrier(CALLERS)
results = [None] * CALLERS

def caller(i):
    start.wait()
    ok = True
    for _ in range(5):
        grad = cposembed.scatter_add(np.zeros_like(table), g, pos, num_threads=4)
        ok = ok and np.array_equal(grad, want_grad)
        ok = ok and np.array_equal(cposembed.lookup(table, pos), want_look)
    results[i] = bool(ok)

threads = [threading.Thread(target=caller, args=(i,)) for i in range(CALLERS)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"results": results, "info": _core.thread_info()}))
"""


def _can_switch_user() -> bool:
    return hasattr(os, "setuid") and os.geteuid() == 0


@needs_openmp
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_NPROC per user: Linux")
@pytest.mark.skipif(
    not _can_switch_user(),
    reason="needs root, to run the child as an unprivileged user (root ignores RLIMIT_NPROC)",
)
def test_100_calling_threads_under_an_os_thread_limit_complete_and_exit_cleanly():
    proc = run_python(["-c", _UNDER_NPROC_LIMIT], timeout=300)
    assert_clean_exit(proc)
    r = last_json(proc)
    assert r["results"] == [True] * 100
    # The limit was reached: the OS refused a helper, and the calls went on.
    assert r["info"]["refused"], r
