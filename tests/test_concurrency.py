"""Python threads: the kernels release the GIL, and concurrent calls are correct.

GIL release is shown without any timing assertion: while one thread is inside
a kernel, another thread changes the kernel's *input* from Python code. If the
output then holds two different values that came from the same table row,
Python code ran in the middle of the kernel, which is only possible if the
kernel released the GIL. (A kernel holding the GIL makes each call atomic with
respect to Python code, so its output could only hold one value.)
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import cposembed
from cposembed import LearnedPositionEmbedding
from cposembed.reference import LearnedPositionEmbedding as Reference

N_THREADS = 8
MAX_ATTEMPTS = 500  # calls before giving up; one is almost always enough


def _observe_gil_release(call, mutate, mixed) -> int:
    """Run ``call`` in a worker while this thread keeps running ``mutate``.

    Returns the number of attempts it took until ``mixed(result)`` showed that
    ``mutate`` ran during a call; 0 if it never did.
    """
    results: list = []
    in_call = threading.Event()
    finished = threading.Event()

    def worker():
        try:
            for _ in range(MAX_ATTEMPTS):
                in_call.set()
                r = call()
                results.append(r)
                if mixed(r):
                    return
        finally:
            finished.set()

    t = threading.Thread(target=worker)
    t.start()
    in_call.wait()
    while not finished.is_set():
        mutate()
    t.join()
    return len(results) if mixed(results[-1]) else 0


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lookup_releases_gil(num_threads, dtype):
    # Every output row is a copy of table row 0, while the main thread keeps
    # bumping table[0, 0] from Python.
    table = np.zeros((4, 1), dtype=dtype)
    pos = np.zeros(1 << 20, dtype=np.int32)
    out = np.empty((pos.size, 1), dtype=dtype)

    def mutate():
        table[0, 0] += 1

    attempts = _observe_gil_release(
        lambda: cposembed.lookup(table, pos, out=out, num_threads=num_threads),
        mutate,
        lambda r: np.unique(r[:, 0]).size > 1,
    )
    assert attempts, "Python code never ran during lookup: the GIL was held"


@pytest.mark.parametrize("num_threads", [1, 2])
def test_add_positions_releases_gil(num_threads):
    table = np.zeros((4, 1), dtype=np.float32)
    tokens = np.zeros((1 << 20, 1), dtype=np.float32)
    pos = np.zeros(tokens.shape[0], dtype=np.int32)

    def mutate():
        table[0, 0] += 1

    attempts = _observe_gil_release(
        lambda: cposembed.add_positions(tokens, table, pos, num_threads=num_threads),
        mutate,
        lambda r: np.unique(r[:, 0]).size > 1,
    )
    assert attempts, "Python code never ran during add_positions: the GIL was held"


@pytest.mark.parametrize("num_threads", [1, 2])
def test_scatter_add_releases_gil(num_threads):
    # Rows 0..n-1 each receive one contribution from g[i] = i's value at the
    # time the kernel reads it; the main thread keeps adding to g[:, 0] from
    # Python (in whole-array steps of 1), so rows read at different moments
    # differ from their initial value by different amounts.
    n = 1 << 16
    g = np.zeros((n, 1), dtype=np.float64)
    pos = np.arange(n, dtype=np.int64)

    def mutate():
        g[n // 2 :, 0] += 1.0  # one numpy call: all of it before or after a row's read

    def call():
        grad = np.zeros((n, 1))
        return cposembed.scatter_add(grad, g, pos, num_threads=num_threads)

    # Without the GIL released, g[n//2:] is constant during the call, so the
    # grad rows n//2.. all hold the same value.
    attempts = _observe_gil_release(call, mutate, lambda r: np.unique(r[n // 2 :, 0]).size > 1)
    assert attempts, "Python code never ran during scatter_add: the GIL was held"


def _run_concurrently(fn, n_jobs):
    barrier = threading.Barrier(min(n_jobs, N_THREADS))

    def job(i):
        try:
            barrier.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass
        return fn(i)

    with ThreadPoolExecutor(N_THREADS) as ex:
        return list(ex.map(job, range(n_jobs)))


@pytest.mark.parametrize("num_threads", [None, 1, 2])
def test_many_threads_functions_correct(num_threads):
    L, d = 300, 96
    table = np.random.RandomState(0).randn(L, d).astype(np.float32)
    table.setflags(write=False)  # shared and read by all threads

    def job(i):
        rng = np.random.RandomState(100 + i)
        B, T = 1 + i % 3, 50 + 37 * i
        T = min(T, L)
        pos = rng.randint(-L, L, size=(B, T))
        tok = rng.randn(B, T, d).astype(np.float32)
        go = rng.randn(B, T, d).astype(np.float32)
        got_lookup = cposembed.lookup(table, pos, num_threads=num_threads)
        got_add = cposembed.add_positions(tok, table, num_threads=num_threads)
        got_add_p = cposembed.add_positions(tok, table, pos, num_threads=num_threads)
        grad = cposembed.scatter_add(np.zeros_like(table), go, pos, num_threads=num_threads)
        ref_grad = np.zeros_like(table)
        np.add.at(ref_grad, pos, go)
        return (
            np.array_equal(got_lookup, table[pos])
            and np.array_equal(got_add, tok + table[:T])
            and np.array_equal(got_add_p, tok + table[pos])
            and np.array_equal(grad, ref_grad)
        )

    assert _run_concurrently(job, 32) == [True] * 32


def test_many_threads_shared_instance_correct():
    """One instance, many threads calling it; each backward goes to its own instance."""
    L, d = 256, 64
    pe = LearnedPositionEmbedding(L, d, seed=3, dtype=np.float64)
    ref = Reference(L, d, seed=3)

    def job(i):
        rng = np.random.RandomState(i)
        pos = rng.randint(0, L, size=(2, 200))
        tok = rng.randn(2, 200, d)
        mine = LearnedPositionEmbedding.from_pretrained(pe.embeddings, dtype=np.float64)
        mine.backward(tok, pos)
        ref_grad = np.zeros((L, d))
        np.add.at(ref_grad, pos, tok)
        return (
            np.array_equal(pe(pos), ref(pos))
            and np.array_equal(pe.add_to(tok, pos), tok + ref(pos))
            and np.array_equal(pe.add_to(tok), tok + ref(np.arange(200)))
            and np.array_equal(mine.grad, ref_grad)
        )

    assert _run_concurrently(job, 24) == [True] * 24


def test_concurrent_set_num_threads_and_calls():
    """Changing the default thread count while other threads compute is safe."""
    L, d = 128, 512
    table = np.random.RandomState(1).randn(L, d).astype(np.float32)
    pos = np.random.RandomState(2).randint(0, L, size=1000)
    want = table[pos]
    try:

        def job(i):
            if i % 4 == 0:
                cposembed.set_num_threads(1 + i % 2)
                cposembed.set_num_threads(None)
            return np.array_equal(cposembed.lookup(table, pos), want)

        assert _run_concurrently(job, 40) == [True] * 40
    finally:
        cposembed.set_num_threads(None)


def test_gil_probe_detects_a_call_that_holds_the_gil(monkeypatch):
    """Control for the probe above: a C call that keeps the GIL (a bytes copy via
    the C API) is never seen mixed, so the GIL tests can fail."""
    ctypes = pytest.importorskip("ctypes")
    n = 16 << 20
    buf = np.zeros(n, dtype=np.uint8)
    copy = ctypes.pythonapi.PyBytes_FromStringAndSize
    copy.restype = ctypes.py_object
    copy.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
    ptr = buf.ctypes.data

    def call():
        b = copy(ptr, n)
        return b[0] != b[-1]

    def mutate():
        buf[:: n - 1] += 1  # first and last byte in one small (GIL-holding) NumPy call

    monkeypatch.setattr(sys.modules[__name__], "MAX_ATTEMPTS", 50)
    assert _observe_gil_release(call, mutate, lambda mixed: mixed) == 0
