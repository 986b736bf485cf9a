"""Fork safety: a process forked after the parent ran OpenMP threads keeps working."""

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
    """
)


NO_PAUSE = "_threads._omp_pause = None  # force the serial fallback\n"


def _run(
    body: str, timeout: float = TIMEOUT, fallback: bool = False
) -> subprocess.CompletedProcess:
    code = PRELUDE + (NO_PAUSE if fallback else "") + textwrap.dedent(body)
    env = {"CPOSEMBED_NUM_THREADS": None, "OMP_NUM_THREADS": None}
    return run_python(["-c", code], timeout, env, cwd=REPO)


def _ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.strip().endswith("OK"), proc.stdout


needs_openmp = pytest.mark.skipif(
    not cposembed.openmp_enabled(), reason="serial build: no OpenMP threads to fork"
)


fallback = pytest.mark.parametrize(
    "fallback", [False, True], ids=["pool-release", "serial-fallback"]
)


# In the child: with the pool released the kernels may use threads again;
# in the fallback they must be serial.
CHILD_THREADS = """
def child_threads_ok():
    n = _threads.effective_num_threads(2, 1 << 20, 100)
    if _threads._omp_pause is None:
        return _core.serial_child() and n == 1
    return not _core.serial_child() and n == 2
"""


@needs_openmp
@fallback
def test_fork_pool_after_parallel_parent(fallback):
    """The issue's scenario: parent used 2 threads, then a fork Pool runs every kernel."""
    proc = _run(
        CHILD_THREADS
        + textwrap.dedent("""
        assert check(run_all(2))
        assert _core.went_parallel(), "parent did not actually go parallel"

        def child(i):
            # Explicit num_threads=2 as well as the default.
            return child_threads_ok() and check(run_all(2)) and check(run_all(None))

        with mp.get_context("fork").Pool(2) as pool:
            results = pool.map(child, range(16), chunksize=1)
        assert results == [True] * 16, results
        # The parent is not affected by the children and still runs parallel.
        assert _threads.effective_num_threads(2, 1 << 20, 100) == 2
        assert check(run_all(2))
        print("OK")
        """),
        fallback=fallback,
    )
    _ok(proc)


@needs_openmp
@fallback
def test_fork_grandchild_and_repeated_forks(fallback):
    """Plain os.fork, nested: children and grandchildren all finish correctly."""
    proc = _run(
        CHILD_THREADS
        + textwrap.dedent("""
        assert check(run_all(2))
        for round_ in range(4):
            pid = os.fork()
            if pid == 0:
                ok = child_threads_ok() and check(run_all(2))
                pid2 = os.fork()
                if pid2 == 0:
                    os._exit(0 if check(run_all(2)) else 3)
                _, st = os.waitpid(pid2, 0)
                os._exit(0 if ok and os.waitstatus_to_exitcode(st) == 0 else 2)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, (round_, status)
            assert check(run_all(2))  # parent between forks, parallel again
        print("OK")
        """),
        fallback=fallback,
    )
    _ok(proc)


@needs_openmp
def test_fork_after_another_library_used_libgomp():
    """Another extension on the same libgomp (scikit-learn, say) went parallel in
    the parent, cposembed never did: the child must not hang in cposembed."""
    proc = _run(
        """
        import ctypes
        maps = open("/proc/self/maps").read()
        paths = sorted({l.split()[-1] for l in maps.splitlines() if "libgomp" in l})
        if not paths:
            print("SKIP not libgomp"); sys.exit(0)
        gomp = ctypes.CDLL(paths[0])
        body = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: None)
        gomp.GOMP_parallel.argtypes = [type(body), ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        gomp.GOMP_parallel(body, None, 2, 0)  # a 2-thread region led by this thread
        assert not _core.went_parallel()

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
def test_fork_before_any_parallel_region_keeps_threads():
    """The guard only costs threads when needed: a child forked before the parent
    went parallel may still use OpenMP threads (libgomp has no pool to lose)."""
    proc = _run(
        """
        assert not _core.went_parallel()
        cposembed.set_num_threads(1)
        assert check(run_all(1))  # serial in the parent: no OpenMP pool exists yet
        assert not _core.went_parallel()
        cposembed.set_num_threads(None)

        def child(i):
            assert not _core.serial_child()
            n = _threads.effective_num_threads(2, 1 << 20, 100)
            return n == 2 and check(run_all(2))

        with mp.get_context("fork").Pool(2) as pool:
            results = pool.map(child, range(4), chunksize=1)
        assert results == [True] * 4, results
        print("OK")
        """
    )
    _ok(proc)


@needs_openmp
def test_guard_is_load_bearing_with_libgomp():
    """Without either guard, a forked child that goes parallel hangs (GNU libgomp).

    This proves the tests above test something: if the runtime ever becomes
    fork-safe this test skips rather than fails.
    """
    proc = _run(
        """
        assert check(run_all(2))
        pid = os.fork()
        if pid == 0:
            _core.set_serial_child(False)  # defeat the serial fallback
            cposembed.lookup(table, pos, num_threads=2)
            os._exit(0)
        import time
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                print("NOHANG")
                sys.exit(0)
            time.sleep(0.05)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("HANG")
        """,
        timeout=60,
        fallback=True,  # and the pool release
    )
    assert proc.returncode == 0, proc.stderr
    if "NOHANG" in proc.stdout:
        pytest.skip("this OpenMP runtime survives fork; the guard is a no-op here")
    assert "HANG" in proc.stdout


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
