"""Fork safety: a process forked after the parent ran the kernels on threads keeps working.

No thread survives ``fork`` but the one that called it. The kernels run in
OpenMP parallel regions, and GNU libgomp's pool does not survive a fork: a
child forked by a thread that led a region hangs in its first region with
more than one thread. So a child whose parent had other threads when it
forked (any may be a pool's) runs every call on its caller, and so do its
children (``src_c/_threads.h``); a child of a one-thread process keeps its
threads. Each scenario runs in a fresh interpreter under a timeout, so a
hang fails the test instead of freezing the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from helpers import (
    run_json,
    run_python,
)

import cposembed

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork") or sys.platform == "darwin",
    reason="needs fork (Linux); macOS forbids fork after threads anyway",
)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


TIMEOUT = 120  # seconds; a healthy run takes about one


# Parent and children share these inputs; sizes are far above SERIAL_THRESHOLD
# so that, without the fork guard, both sides would go parallel.
PRELUDE = textwrap.dedent(
    """
    import multiprocessing as mp
    import os
    import sys

    import numpy as np

    import cposembed
    from cposembed import _core, _threads

    L, d, B, T = 512, 256, 4, 512
    assert B * T * d > 4 * _threads.SERIAL_THRESHOLD
    rng = np.random.RandomState(0)
    table = rng.randn(L, d).astype(np.float32)
    pos = rng.randint(-L, L, size=(B, T))
    tokens = rng.randn(B, T, d).astype(np.float32)
    grad_out = rng.randn(B, T, d).astype(np.float32)

    def run_all(n_threads):
        a = cposembed.lookup(table, pos, num_threads=n_threads)
        b = cposembed.add_positions(tokens, table, num_threads=n_threads)
        g = cposembed.scatter_add(np.zeros_like(table), grad_out, pos, num_threads=n_threads)
        pe = cposembed.LearnedPositionEmbedding.from_pretrained(table)
        c = pe(pos)
        pe.backward(grad_out, pos)
        return a, b, g, c, pe.grad

    def reference():
        g = np.zeros_like(table)
        np.add.at(g, pos, grad_out)
        return table[pos], tokens + table[:T], g, table[pos], g

    def check(results):
        return all(np.array_equal(x, y) for x, y in zip(results, reference()))

    def load_libgomp():
        # The libgomp this process has loaded and an empty region body for
        # its GOMP_parallel; exits with SKIP where there is none.
        import ctypes
        maps = open("/proc/self/maps").read()
        paths = sorted({l.split()[-1] for l in maps.splitlines() if "libgomp" in l})
        if not paths:
            print("SKIP not libgomp"); sys.exit(0)
        gomp = ctypes.CDLL(paths[0])
        body = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: None)
        gomp.GOMP_parallel.argtypes = [type(body), ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        return gomp, body
    """
)


def _run(
    body: str, timeout: float = TIMEOUT, one_blas_thread: bool = False
) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(body)
    env = {"CPOSEMBED_NUM_THREADS": None, "OMP_NUM_THREADS": None}
    if one_blas_thread:  # NumPy's OpenBLAS starts no threads: a one-thread parent
        env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS=None, MKL_NUM_THREADS="1")
    return run_python(["-c", code], timeout, env, cwd=REPO)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.strip().endswith("OK"), proc.stdout


needs_openmp = pytest.mark.skipif(
    not cposembed.openmp_enabled(), reason="serial build: no OpenMP threads to fork"
)


# In a child of a process with threads: every call on its caller, even one
# that asks for two, and the results right.
CHILD_THREADS = """
def child_threads_ok():
    if not _core.thread_info()["serial_child"]:
        return False
    return _threads.effective_num_threads(2, 1 << 20, 100) == 1

def child_runs_on_its_own_team():
    return check(run_all(2)) and _core.last_team() == 1
"""


def _ok_with_child_checks(body: str) -> None:
    """Run ``body`` after CHILD_THREADS's checks; it must print OK."""
    _ok(_run(CHILD_THREADS + textwrap.dedent(body)))


@needs_openmp
def test_fork_pool_after_parallel_parent():
    """The issue's scenario: parent used 2 threads, then a fork Pool runs every kernel."""
    _ok_with_child_checks(
        """
        assert check(run_all(2))
        assert _core.thread_info()["went_parallel"], "parent did not actually go parallel"

        def child(i):
            # Explicit num_threads=2 as well as the default.
            return (
                child_threads_ok() and child_runs_on_its_own_team() and check(run_all(None))
            )

        with mp.get_context("fork").Pool(2) as pool:
            results = pool.map(child, range(16), chunksize=1)
        assert results == [True] * 16, results
        # The parent is not affected by the children and still runs parallel.
        assert _threads.effective_num_threads(2, 1 << 20, 100) == 2
        assert check(run_all(2))
        print("OK")
        """
    )


@needs_openmp
def test_fork_grandchild_and_repeated_forks():
    """Plain os.fork, nested: children and grandchildren all finish correctly."""
    _ok_with_child_checks(
        """
        assert check(run_all(2))
        for round_ in range(4):
            pid = os.fork()
            if pid == 0:
                ok = child_threads_ok() and child_runs_on_its_own_team()
                pid2 = os.fork()
                if pid2 == 0:
                    os._exit(0 if check(run_all(2)) else 3)
                _, st = os.waitpid(pid2, 0)
                os._exit(0 if ok and os.waitstatus_to_exitcode(st) == 0 else 2)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, (round_, status)
            assert check(run_all(2))  # parent between forks, parallel again
        print("OK")
        """
    )


@needs_openmp
def test_fork_after_another_library_used_libgomp():
    """Another extension on the same libgomp (scikit-learn, say) went parallel in
    the parent, cposembed never did: the child must not hang in cposembed."""
    proc = _run(
        """
        gomp, body = load_libgomp()
        gomp.GOMP_parallel(body, None, 2, 0)  # a 2-thread region led by this thread
        assert not _core.thread_info()["went_parallel"]

        def child(i):
            return check(run_all(2))

        with mp.get_context("fork").Pool(2) as pool:
            results = pool.map(child, range(4), chunksize=1)
        assert results == [True] * 4, results
        print("OK")
        """
    )
    if "SKIP" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    _ok(proc)


@needs_openmp
def test_fork_while_other_threads_run_kernels():
    """Forks while two other threads keep running kernels on the team: whatever
    the helpers were doing at the fork, the child's team starts clean. (Every
    module the loop needs is imported first: a child forked while another
    thread imports a module waits for that import's lock forever, in any
    Python program.)"""
    _ok_with_child_checks(
        """
        import threading
        assert check(run_all(2)) and check(run_all(None))
        stop = threading.Event()
        failures = []

        def busy():
            while not stop.is_set():
                if not check(run_all(2)):
                    failures.append(1)

        workers = [threading.Thread(target=busy) for _ in range(2)]
        for w in workers:
            w.start()
        try:
            for round_ in range(8):
                pid = os.fork()
                if pid == 0:
                    ok = child_threads_ok() and child_runs_on_its_own_team()
                    os._exit(0 if ok and check(run_all(None)) else 2)
                _, status = os.waitpid(pid, 0)
                assert os.waitstatus_to_exitcode(status) == 0, (round_, status)
        finally:
            stop.set()
            for w in workers:
                w.join()
        assert not failures
        print("OK")
        """
    )


@needs_openmp
def test_a_child_of_a_parent_that_led_regions_runs_on_its_caller():
    """The parent's thread led regions of the kernels; its forked child, where a
    libgomp region of two threads would hang, runs every call on its caller."""
    proc = _run(
        """
        assert check(run_all(2))
        assert _core.thread_info()["went_parallel"]
        pid = os.fork()
        if pid == 0:
            ok = _core.thread_info()["serial_child"] and check(run_all(2))
            os._exit(0 if ok and _core.last_team() == 1 else 2)
        import time
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                assert os.waitstatus_to_exitcode(status) == 0, status
                print("OK")
                sys.exit(0)
            time.sleep(0.05)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("HANG")
        """,
    )
    _ok(proc)


@needs_openmp
def test_fork_before_any_parallel_region_keeps_threads():
    """A child forked before the parent ran anything on threads uses threads too."""
    proc = _run(
        """
        assert not _core.thread_info()["went_parallel"]
        cposembed.set_num_threads(1)
        assert check(run_all(1))  # serial in the parent: no helper exists yet
        assert not _core.thread_info()["went_parallel"]
        assert _core.thread_info()["os_threads"] in (1, -1), _core.thread_info()["os_threads"]
        cposembed.set_num_threads(None)

        def child(i):
            n = _threads.effective_num_threads(2, 1 << 20, 100)
            return n == 2 and check(run_all(2)) and _core.thread_info()["went_parallel"]

        for _ in range(2):
            pid = os.fork()
            if pid == 0:
                os._exit(0 if child(0) else 2)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, status
        print("OK")
        """,
        one_blas_thread=True,
    )
    _ok(proc)


def test_fork_while_another_thread_runs_the_kernels():
    """A child forked while a worker thread is inside multithreaded kernels
    gets correct results and does not hang."""
    result = run_json(
        """
        import json, os, threading
        import numpy as np
        import cposembed as c
        t = np.random.rand(1024, 64).astype(np.float32)
        pos = np.random.randint(0, 1024, (4, 1024))
        g = np.ones((4, 1024, 64), np.float32)
        stop = False
        def worker():
            while not stop:
                c.lookup(t, pos, num_threads=2)
                c.scatter_add(np.zeros_like(t), g, pos, num_threads=2)
        th = threading.Thread(target=worker)
        th.start()
        codes = []
        for _ in range(4):
            pid = os.fork()
            if pid == 0:
                r = c.lookup(t, pos, num_threads=2)
                G = np.zeros_like(t)
                c.scatter_add(G, g, pos, num_threads=2)
                ref = np.zeros_like(t)
                np.add.at(ref, pos, g)
                os._exit(0 if np.array_equal(r, t[pos]) and np.array_equal(G, ref) else 3)
            codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        stop = True
        th.join()
        print(json.dumps({"codes": codes}))
        """,
        timeout=60,
    )
    assert result["codes"] == [0, 0, 0, 0]


def test_fork_while_other_threads_take_and_give_back_blocks():
    """Children forked while two threads take and free the allocator's blocks
    (large outputs, scratch, kept dense blocks, fresh zeroed tables released
    when freed): each child gets correct results and keeps blocks again,
    whatever the parent's lock was doing at the fork."""
    result = run_json(
        """
        import json, os, threading
        import numpy as np
        import cposembed as c
        from cposembed import _blocks
        t = np.random.rand(1024, 64).astype(np.float32)
        pos = np.random.randint(0, 1024, (17, 1024))  # a 4.25 MiB output: a block
        stop = False
        def worker(k):
            while not stop:
                r = c.lookup(t, pos, num_threads=1)
                del r
                blk = _blocks.block((256 + k) << 12)  # about 1 MiB: kept when freed
                del blk
                z = _blocks.zeros((1024 + k, 1024), np.float32)  # 4 MiB+: fresh, released
                del z
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
        for th in threads:
            th.start()
        codes = []
        for _ in range(20):
            pid = os.fork()
            if pid == 0:
                ok = True
                for _ in range(3):
                    r = c.lookup(t, pos, num_threads=2)
                    ok = ok and np.array_equal(r, t[pos])
                    del r
                ok = ok and _blocks.pool_info()[0] >= 1  # the child keeps blocks
                os._exit(0 if ok else 3)
            codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        stop = True
        for th in threads:
            th.join()
        print(json.dumps({"codes": codes}))
        """,
        timeout=120,
    )
    assert result["codes"] == [0] * 20
