"""Python threads: the kernels release the GIL, and concurrent calls (and inputs
changed by another thread mid-call) are correct or refused, never a crash."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from helpers import (
    run_child,
    run_json,
)

import cposembed
from cposembed import LearnedPositionEmbedding
from cposembed.reference import LearnedPositionEmbedding as Reference


def test_kernels_release_the_gil_and_agree_across_python_threads():
    from concurrent.futures import ThreadPoolExecutor

    table = np.random.RandomState(0).randn(512, 64).astype(np.float32)
    positions = np.random.RandomState(1).randint(0, 512, size=(16, 256))
    expected = table[positions]

    def work(_):
        return cposembed.lookup(table, positions).tobytes() == expected.tobytes()

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(16)))


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


# -- positions changed by another thread during the calls ---------------------
RACE = """
import threading, time
table = np.random.default_rng(0).standard_normal(({L}, {d}))
valid = (np.arange({n}) * 7) % {L}
pos = valid.copy()
bad = np.full({n}, 10**12, dtype=np.int64)
stop = threading.Event()

def flipper():
    while not stop.is_set():
        pos[:] = bad
        pos[:] = valid

t = threading.Thread(target=flipper, daemon=True)
t.start()
tok = np.random.default_rng(1).standard_normal(({n}, {d}))
g = np.random.default_rng(2).standard_normal(({n}, {d}))
want_rows = table[valid]
want_grad = np.zeros_like(table)
np.add.at(want_grad, valid, g)
out = np.empty(({n}, {d}))
grad = np.zeros_like(table)
counts = {{"ok": 0, "IndexError": 0}}
problems = []
deadline = time.monotonic() + {seconds}
for i in range({calls}):
    if time.monotonic() > deadline:
        break
    which = i % 4
    try:
        if which == 0:
            r = cposembed.lookup(table, pos)
            good = np.array_equal(r, want_rows)
        elif which == 1:
            out.fill(np.nan)
            r = cposembed.lookup(table, pos, out=out)
            good = r is out and np.array_equal(out, want_rows)
        elif which == 2:
            grad.fill(0.0)
            cposembed.scatter_add(grad, g, pos)
            good = np.allclose(grad, want_grad, rtol=0, atol=1e-9)
        else:
            r = cposembed.add_positions(tok, table, pos)
            good = np.array_equal(r, tok + want_rows)
        counts["ok"] += 1
        if not good:
            problems.append(f"call {{i}} (kind {{which}}) succeeded with rows of no valid state")
    except IndexError:
        counts["IndexError"] += 1
        if which == 1 and not np.isnan(out).all():
            problems.append(f"call {{i}}: lookup(out=) raised IndexError after writing")
        if which == 2 and grad.any():
            problems.append(f"call {{i}}: scatter_add raised IndexError after writing")
    except Exception as exc:
        problems.append(f"call {{i}} (kind {{which}}): {{type(exc).__name__}}: {{exc}}")
stop.set()
t.join()
print(json.dumps({{"counts": counts, "problems": problems[:10]}}))
"""


@pytest.mark.parametrize(
    "L,d,n", [(64, 256, 512), (16, 8, 32)], ids=["multithreaded-kernels", "small-serial"]
)
def test_positions_changed_by_another_thread_during_calls(L, d, n):
    """A thread flips shared positions between valid values and 10**12 during the calls."""
    result = run_child(RACE.format(L=L, d=d, n=n, calls=4000, seconds=10), timeout=180)
    assert result["problems"] == [], result
    assert sum(result["counts"].values()) > 0, result


# -- the class's table swapped during calls -------------------------------------------
SWAP = """
import threading, time
L, d, n = 64, 256, 4096
a = np.arange(L * d, dtype=np.float32).reshape(L, d)
b = -a
pe = LearnedPositionEmbedding.from_pretrained(a)
pos = np.random.default_rng(0).integers(0, L, size=n)
stop = threading.Event()

def swapper():
    k = 0
    while not stop.is_set():
        table = (a.copy(), b.copy(), None, "table", a[:, :8].copy())[k % 5]
        pe._embeddings = table
        k += 1
        if isinstance(table, np.ndarray):  # (the others for a moment only)
            time.sleep(20e-6)

t = threading.Thread(target=swapper)
t.start()
counts, problems = {}, []
# 3000 calls, and on until both outcomes were seen (the swapper holds a
# non-table for a moment only: on a busy machine the calls can miss it).
deadline = time.time() + 60
i = 0
while i < 3000 or (counts.get("TypeError", 0) == 0 and time.time() < deadline):
    i += 1
    try:
        got = pe(pos)
    except (TypeError, ValueError) as exc:
        counts[type(exc).__name__] = counts.get(type(exc).__name__, 0) + 1
        continue
    except Exception as exc:
        problems.append(f"call {i}: {type(exc).__name__}: {exc}")
        continue
    counts["ok"] = counts.get("ok", 0) + 1
    if not any(np.array_equal(got, t[pos]) for t in (a, b, a[:, :8])):
        problems.append(f"call {i}: rows of no table")
stop.set()
t.join()
print(json.dumps({"counts": counts, "problems": problems[:10]}))
"""


def test_class_table_swapped_by_another_thread_during_calls():
    """pe(positions) (the C call) while another thread swaps ``pe._embeddings``
    between tables, None and a string: one table's rows or a worded error."""
    result = run_child(SWAP, timeout=180)
    assert result["problems"] == [], result
    assert result["counts"].get("ok", 0) > 0 and result["counts"].get("TypeError", 0) > 0, result


def test_ids_and_positions_changed_by_another_thread_during_embed():
    """Another thread flips the token ids and positions between two valid arrays
    and an out-of-range value while embed / embed_backward run (large enough to
    release the GIL): every call gives rows from a valid snapshot, or IndexError
    with nothing written."""
    result = run_json(
        """
        import json, threading, time
        import numpy as np
        import cposembed as c
        rng = np.random.RandomState(0)
        V, L, d, B, T = 64, 256, 8, 64, 256
        wte = rng.randn(V, d)
        wpe = rng.randn(L, d)
        A, Bv = rng.randint(0, V, (B, T)), rng.randint(0, V, (B, T))
        PA, PB = rng.randint(0, L, (B, T)), rng.randint(0, L, (B, T))
        ids, pos = A.copy(), PA.copy()
        g = np.ones((B, T, d))
        stop = time.time() + 3
        def writer():
            while time.time() < stop:
                ids[...] = Bv; pos[...] = PB
                ids[5, 5] = 10**12; pos[7, 7] = -(10**12)
                ids[...] = A; pos[...] = PA
        th = threading.Thread(target=writer)
        th.start()
        problems, counts = [], {"ok": 0, "IndexError": 0}
        while time.time() < stop:
            for explicit in (False, True):
                out = np.full((B, T, d), 7.0)
                try:
                    if explicit:
                        c.embed(ids, wte, wpe, pos, out=out)
                    else:
                        c.embed(ids, wte, wpe[:T], out=out)
                except IndexError:
                    counts["IndexError"] += 1
                    if not (out == 7.0).all():
                        problems.append("embed wrote before IndexError")
                    continue
                counts["ok"] += 1
                p_rows = (wpe[PA], wpe[PB]) if explicit else (wpe[:T], wpe[:T])
                good = np.zeros((B, T), bool)
                for t_rows in (wte[A], wte[Bv]):
                    for pr in p_rows:
                        good |= (out == t_rows + pr).all(-1)
                if not good.all():
                    problems.append("embed row from no snapshot")
            G, P = np.zeros((V, d)), np.zeros((L, d))
            try:
                c.embed_backward(G, P, g, ids, pos)
            except IndexError:
                counts["IndexError"] += 1
                if G.any() or P.any():
                    problems.append("embed_backward wrote before IndexError")
                continue
            counts["ok"] += 1
            if G.sum() != B * T * d or P.sum() != B * T * d:
                problems.append("embed_backward lost or invented contributions")
        th.join()
        print(json.dumps({"problems": problems[:5], "counts": counts}))
        """,
        timeout=60,
    )
    assert result["problems"] == [], result
    assert result["counts"]["ok"] > 0, result
