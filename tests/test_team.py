"""The team that runs the kernels (src_c/_team.pxi): results, bounds, refusals.

Work on more than one thread is cut into chunks that whichever thread is free
claims; what a chunk covers and the order of each row's sum are fixed, so the
bits never depend on the thread count or on which thread ran what. The
helper threads are a bounded set shared by every calling thread, and when
the OS refuses one the call completes on the threads it has. What could
crash or exit runs in a child interpreter.
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
from cposembed import _core

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
    touched = _core.RowMarks(L, np.isin(np.arange(L), pos))
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
    # serial_below=0 and a tiny scan budget: every call runs on the team, in
    # many small chunks, through every plan.
    T = min(T, L)
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((L, d)).astype(dtype)
    vocab = rng.standard_normal((V, d)).astype(dtype)
    tokens = rng.standard_normal((B, T, d)).astype(dtype)
    # Few distinct rows (many repeats per row) or many: both orders show.
    pos = rng.integers(0, rng.integers(1, L + 1), size=(B, T))
    ids = rng.integers(0, V, size=(B, T))
    # A chunk of a few rows, and no back-off after calls the helpers did not
    # speed up (tiny calls never are): the helpers take part.
    with tuned(
        serial_below=0,
        scan_block_bytes=int(rng.integers(1, 4096)),
        chunk_elems=int(rng.integers(1, 4 * d + 1)),
        judge=False,
    ):
        want = _results(1, table, tokens, pos, ids, vocab, plan)
        for n in THREADS[1:]:
            got = _results(n, table, tokens, pos, ids, vocab, plan)
            for k, (a, b) in enumerate(zip(got, want)):
                assert np.array_equal(bits(a), bits(b)), (n, k)
    ref = reference_scatter(np.zeros_like(table), tokens, pos)
    assert np.array_equal(bits(want[3]), bits(ref))


@needs_openmp
def test_helpers_take_part_in_calls_planned_on_several_threads():
    # The thread count a call is planned on is only an upper bound: the
    # caller steals the chunks of a helper that has not started. Over many
    # calls of many chunks, helpers must run some of them.
    if _core.team_info()["max"] == 0:
        pytest.skip("no team on this platform")
    table = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    pos = np.arange(64 * 256) % 64
    before = _core.team_info()["helped"]
    with tuned(serial_below=0, chunk_elems=32, judge=False):
        for _ in range(2000):
            got = cposembed.lookup(table, pos, num_threads=2)
            if _core.team_info()["helped"] > before:
                break
    assert np.array_equal(got, table[pos])
    assert _core.team_info()["helped"] > before, "no helper took part in 2000 calls"


@needs_openmp
def test_results_stay_bitwise_while_other_threads_compete_for_the_team():
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

        _core.set_team_refused(True)
        table = np.random.default_rng(0).standard_normal((512, 256)).astype(np.float32)
        pos = np.arange(4 * 512).reshape(4, 512) % 512
        g = np.ones((4, 512, 256), np.float32)
        ok = np.array_equal(cposembed.lookup(table, pos, num_threads=4), table[pos])
        grad = cposembed.scatter_add(np.zeros_like(table), g, pos, num_threads=4)
        ok = ok and np.array_equal(grad, np.full_like(table, 4))
        print(json.dumps({"ok": bool(ok), "team": _core.team_info(),
                          "last": _core.last_team()}))
        """
    )
    proc = run_python(["-c", code])
    assert_clean_exit(proc)
    r = last_json(proc)
    assert r["ok"] and r["team"]["started"] == 0 and r["team"]["refused"], r
    assert r["last"] == 4  # the plan was 4 threads; the caller ran it alone


@needs_openmp
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread CPU times: Linux")
def test_idle_helpers_sleep_instead_of_spinning():
    """After its calls a process uses no CPU: its helpers sleep, not spin."""
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
        time.sleep(0.05)  # longer than any spin
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(0.5)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        print(json.dumps({"cpu": cpu, "team": _core.team_info()}))
        """
    )
    proc = run_python(["-c", code])
    assert_clean_exit(proc)
    r = last_json(proc)
    assert r["team"]["started"] >= 1, r
    assert r["cpu"] < 0.05, r  # 0.5 s of a spinning helper would be 0.5 s


@needs_openmp
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_a_helper_on_its_callers_cpu_is_seen_and_the_team_backs_off():
    """A process pinned to one CPU, calls asked for on 2 threads: each helper
    that takes part finds itself on its caller's CPU, leaves its share to the
    caller and the call counts as shared; with judging on, such a call sends
    the next calls to their callers alone (a back-off of at least 30 s here,
    so that a slow build's calls all fall inside it). The bits stay
    np.add.at's."""
    code = textwrap.dedent(
        """
        import json, os, time
        import numpy as np
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        import cposembed
        from cposembed import _core

        rng = np.random.default_rng(3)
        table = rng.standard_normal((512, 256)).astype(np.float32)
        g = rng.standard_normal((8, 512, 256)).astype(np.float32)
        pos = rng.integers(0, 512, size=(8, 512))
        want = np.zeros_like(table)
        np.add.at(want, pos.ravel(), g.reshape(-1, 256))
        ok = True

        def calls():
            global ok
            grad = cposembed.scatter_add(np.zeros_like(table), g, pos, num_threads=2)
            out = cposembed.add_positions(g, table, pos, num_threads=2)
            ok &= bool(np.array_equal(grad, want) and np.array_equal(out, g + table[pos]))

        def until(key, before):
            t0 = time.monotonic()
            while _core.team_info()[key] == before and time.monotonic() - t0 < 30:
                calls()
            return dict(_core.team_info())

        _core.set_tuning(judge=False)
        unjudged = until("shared", 0)
        # A call no helper took part in is a loss too: until a loss comes
        # with a shared call (for up to 60 s), each try starting a fresh
        # back-off.
        t_end = time.monotonic() + 60
        while time.monotonic() < t_end:
            _core.set_tuning(judge=True, backoff_s=30.0)
            before = dict(_core.team_info())
            judged = until("losses", before["losses"])
            if judged["shared"] > before["shared"]:
                break
        calls()
        after = _core.team_info()
        print(json.dumps({"ok": ok, "unjudged": unjudged, "before": before, "judged": judged,
                          "after": after}))
        """
    )
    proc = run_python(["-c", code], timeout=240)  # 30 s and 60 s of tries at most
    assert_clean_exit(proc)
    r = last_json(proc)
    assert r["ok"], r
    u, b, j, a = r["unjudged"], r["before"], r["judged"], r["after"]
    if u["max"] == 0:
        pytest.skip("no team on this platform")
    assert u["shared"] >= 1 and u["losses"] == 0, r  # seen; no back-off without judging
    assert j["losses"] > b["losses"] and j["shared"] > b["shared"], r
    assert a["helped"] == j["helped"], r  # the back-off: the next calls ran alone


# Counts the threads of this process while many Python threads call the
# kernels at once: the helpers are one set for all callers.
_COUNT_THREADS = """
import json, os, threading, time
import numpy as np
import cposembed
from cposembed import _core

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
team = _core.team_info()
for _ in range(200):
    after = len(os.listdir("/proc/self/task"))
    if after <= baseline + team["started"]:
        break
    time.sleep(0.01)
print(json.dumps({{"baseline": baseline, "peak": peak, "bad": bad, "after": after,
                   "team": team, "cpus": _core.cpu_limit()}}))
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
    assert r["team"]["max"] == cap
    assert 1 <= r["team"]["started"] <= cap
    # The callers' own threads, the helpers, nothing else.
    assert r["peak"] <= r["baseline"] + callers + cap, r
    assert r["after"] == r["baseline"] + r["team"]["started"], r


# 100 Python threads call the kernels under an OS limit on this user's
# threads that leaves room for only two helpers: the team starts what the
# OS allows, the rest of each call runs on its caller, and the process ends
# cleanly (libgomp, starting a team per calling thread, called exit(1) here).
_UNDER_NPROC_LIMIT = """
import json, os, resource, threading
import numpy as np
import cposembed
from cposembed import _core

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
assert _core.team_info()["started"] == 0
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
print(json.dumps({"results": results, "team": _core.team_info()}))
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
    assert r["team"]["refused"], r
    assert r["team"]["started"] <= 2, r


@needs_openmp
@pytest.mark.skipif(sys.platform == "win32", reason="no team on Windows")
def test_the_judge_counts_a_call_as_a_loss_unless_helpers_made_it_faster():
    """The rule the back-off starts on (cpe_is_loss): a call is a loss unless
    it took at most 90 % less 5 us of its caller's pace over all its chunks,
    the caller's longest chunk left out; a call whose threads shared a CPU is
    a loss whatever it took."""
    judge = _core.team_judges_loss
    even = [100_000] * 10  # the caller's 10 of 20 chunks at 100 us: alone 2 ms
    assert not judge(1_000_000, even, 20, False)
    assert judge(1_000_000, even, 20, True)  # shared: a loss however fast
    assert judge(1_900_000, even, 20, False)
    assert not judge(1_795_000, even, 20, False) and judge(1_796_000, even, 20, False)
    # The longest chunk (the scheduler took the CPU away) is left out: alone 2 ms.
    assert judge(3_000_000, [100_000] * 9 + [5_000_000], 20, False)
    assert not judge(1_000_000, [100_000] * 9 + [5_000_000], 20, False)
    # One chunk is the whole pace; a small call must gain 5 us as well as 10 %.
    assert not judge(100_000, [100_000], 2, False) and judge(100_000, [100_000], 2, True)
    assert judge(1_000, [1_000], 2, False)
    assert judge(14_000, [1_000] * 10, 20, False) and not judge(12_000, [1_000] * 10, 20, False)
    assert not judge(10**9, [], 4, True)  # no chunk of the caller's: nothing to judge by
    for bad in (-1, 10**16, 10**30):
        with pytest.raises(ValueError, match="chunk times"):
            judge(1, [bad], 2, False)
    with pytest.raises(ValueError, match="n_chunks must be"):
        judge(1, [1, 1, 1], 2, False)
