"""Thread control: who decides how many OpenMP threads a kernel call uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from helpers import (
    run_child,
    run_python,
    tuned,
)
from plain import (
    CPUS,
    Snapshot,
    _declined,
)

import cposembed
from cposembed import _core, _threads


def test_set_and_get_num_threads():
    default = cposembed.get_num_threads()
    assert default >= 1
    try:
        cposembed.set_num_threads(1)
        assert cposembed.get_num_threads() == 1
        if cposembed.openmp_enabled():
            cposembed.set_num_threads(2)
            assert cposembed.get_num_threads() == min(2, len(os.sched_getaffinity(0)))
    finally:
        cposembed.set_num_threads(None)
    assert cposembed.get_num_threads() == default


@pytest.mark.skipif(not cposembed.openmp_enabled(), reason="serial build")
def test_env_var_sets_default_threads():
    code = "import cposembed; print(cposembed.get_num_threads())"
    for env, expected in (
        ({"CPOSEMBED_NUM_THREADS": "1"}, 1),
        ({"OMP_NUM_THREADS": "1"}, 1),
        ({"CPOSEMBED_NUM_THREADS": "1", "OMP_NUM_THREADS": "2"}, 1),
    ):
        res = run_python(["-c", code], env=env, check=True)
        assert int(res.stdout) == expected


def test_openmp_enabled_is_bool():
    assert isinstance(cposembed.openmp_enabled(), bool)


# -- absurd explicit thread counts ------------------------------------------------
ABSURD_THREADS = [100_000, 50_000, 2**31, 2**63, 2**100]


@pytest.mark.parametrize("op", ["lookup", "add_positions", "scatter_add"])
def test_absurd_num_threads(op):
    """num_threads of 100_000 .. 2**100 on a large call: the right result or ValueError."""
    body = f"""
    op = {op!r}
    rng = np.random.default_rng(0)
    table = rng.standard_normal((512, 256)).astype(np.float32)
    pos = rng.integers(0, 512, size=1024)
    tok = rng.standard_normal((1024, 256)).astype(np.float32)
    g = rng.standard_normal((1024, 256)).astype(np.float32)
    results = []
    for n in {ABSURD_THREADS!r}:
        if op == "lookup":
            expect = table[pos]
            fn = lambda: cposembed.lookup(table, pos, num_threads=n)
        elif op == "add_positions":
            expect = tok + table[pos]
            fn = lambda: cposembed.add_positions(tok, table, pos, num_threads=n)
        else:
            grad = np.zeros_like(table)
            expect = grad.copy()
            np.add.at(expect, pos, g)
            fn = lambda: cposembed.scatter_add(grad, g, pos, num_threads=n)
        try:
            got = fn()
            results.append([n, "ok" if np.array_equal(got, expect) else "WRONG RESULT"])
        except ValueError as exc:
            results.append([n, "ValueError"])
        except Exception as exc:
            results.append([n, f"{{type(exc).__name__}}: {{exc}}"])
    print(json.dumps({{"results": results}}))
    """
    result = run_child(body, timeout=300)
    for n, what in result["results"]:
        assert what in ("ok", "ValueError"), f"num_threads={n}: {what}"


def test_bad_num_threads_is_declined_then_worded():
    table = np.ones((8, 4), np.float32)
    out = np.zeros((2, 4), np.float32)
    tok = np.ones((1, 2, 4), np.float32)
    for bad in (0, -2, True, 2.0, "2", -(2**70), np.bool_(True)):
        snap = Snapshot(table, out, tok)
        _declined(_core.lookup(table, np.array([0, 1]), out, bad), snap)
        _declined(_core.add(tok, table, None, 0, None, bad), snap)
        _declined(_core.scatter_add(out, tok, None, 0, bad), snap)
        _declined(_core.sgd_step(table, out.repeat(4, 0), None, 1.0, -1, bad), snap)
        with pytest.raises((TypeError, ValueError), match="num_threads"):
            cposembed.lookup(table, np.array([0, 1]), out=out, num_threads=bad)
        with pytest.raises((TypeError, ValueError), match="num_threads"):
            cposembed.add_positions(tok, table, num_threads=bad)
        with pytest.raises((TypeError, ValueError), match="num_threads"):
            cposembed.scatter_add(out, tok, num_threads=bad)
        snap.unchanged()


def test_explicit_num_threads_is_capped_at_four_times_the_cpus():
    cap = 4 * CPUS if _core.openmp_enabled() else 1
    work = 1 << 30
    for asked, team in ((1, 1), (cap, cap), (cap + 1, cap), (2**31, cap), (2**70, cap)):
        assert _core.team(asked, work, work) == team
        assert _core.team(np.uint64(asked) if asked < 2**64 else asked, work, work) == team
    assert _core.team(None, 10, 10) == 1  # small work: one thread
    assert _core.team(2, work, 1) == 1  # one chunk: one thread
    for bad in (0, -1, True, 2.0, "3", -(2**70)):
        assert _core.team(bad, work, work) == 0
    table = np.ones((64, 1024), np.float32)
    with tuned(serial_below=0):
        _core.lookup(table, np.arange(64), None, 2**40)
        assert _core.last_team() == min(cap, 64)


def test_last_team_after_the_single_row_path():
    table = np.ones((100, 8), np.float32)
    with tuned(serial_below=0):
        _core.lookup(table, np.arange(50), None, 2)
    assert _core.last_team() == min(2, 4 * CPUS) or not _core.openmp_enabled()
    _core.lookup(table, 3, None, None)
    assert _core.last_team() == 1


# ============================================================ what broke
@pytest.mark.parametrize("n", [2**31, 2**63, 10**30, np.uint64(2**64 - 1)])
def test_set_num_threads_beyond_a_c_int_is_capped(n):
    try:
        cposembed.set_num_threads(n)
        assert 1 <= cposembed.get_num_threads() <= (os.cpu_count() or 1)
    finally:
        cposembed.set_num_threads(None)


@pytest.mark.parametrize("raw", ["\x1c1", "\xa01", "1\x1f"])
def test_env_num_threads_with_unicode_white_space_is_used_or_warned(monkeypatch, raw):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs to tell 1 thread from the default")
    monkeypatch.setenv("CPOSEMBED_NUM_THREADS", raw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = cposembed.get_num_threads()
    warned = any(issubclass(w.category, RuntimeWarning) for w in caught)
    assert n == 1 or warned, f"{raw!r}: ignored (default {n} threads) without a warning"


@pytest.mark.parametrize(
    "raw, read",
    [("0001", 1), ("  02 ", 2), ("000", -1), ("0", -1), ("00000000000000000003", 3)],
)
def test_env_num_threads_reads_the_value_whatever_its_leading_zeros(monkeypatch, raw, read):
    # The variable is read as a number: leading zeros neither count as
    # digits of a huge value nor make a zero valid.
    monkeypatch.setenv("CPOSEMBED_NUM_THREADS", raw)
    assert _core.env_threads() == read
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cposembed.get_num_threads()
    warned = any(issubclass(w.category, RuntimeWarning) for w in caught)
    if cposembed.openmp_enabled():  # a serial build reads no thread setting
        assert warned == (read < 0), (raw, caught)


threadpoolctl = pytest.importorskip("threadpoolctl")


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


CPU_LIMIT = _threads.cpu_limit()


needs_openmp = pytest.mark.skipif(not cposembed.openmp_enabled(), reason="serial build")


needs_2_cpus = pytest.mark.skipif(CPU_LIMIT < 2, reason="needs 2 CPUs")


# Large enough to be above SERIAL_THRESHOLD with many chunks.
L, D, N = 256, 128, 4096


assert N * D >= 4 * _threads.SERIAL_THRESHOLD


@pytest.fixture(autouse=True)
def _reset_default(monkeypatch):
    monkeypatch.delenv("CPOSEMBED_NUM_THREADS", raising=False)
    cposembed.set_num_threads(None)
    yield
    cposembed.set_num_threads(None)


@pytest.fixture
def spy(monkeypatch):
    """Records the threads each kernel call ran on (the C entries' last team)."""
    seen: list[tuple[str, int]] = []
    for name in ("lookup", "add", "scatter_add"):
        real = getattr(_core, name)

        def wrapper(*args, _real=real, _name=name):
            result = _real(*args)
            if result is not None:  # None: declined, nothing ran
                seen.append((_name, _core.last_team()))
            return result

        monkeypatch.setattr(_core, name, wrapper)
    return seen


def _call_all(num_threads=None):
    rng = np.random.RandomState(0)
    table = rng.randn(L, D).astype(np.float32)
    pos = rng.randint(0, L, size=N)
    tok = rng.randn(N, D).astype(np.float32)
    assert np.array_equal(cposembed.lookup(table, pos, num_threads=num_threads), table[pos])
    assert np.array_equal(
        cposembed.add_positions(tok, table, pos, num_threads=num_threads), tok + table[pos]
    )
    grad = cposembed.scatter_add(np.zeros_like(table), tok, pos, num_threads=num_threads)
    want = np.zeros_like(table)
    np.add.at(want, pos, tok)
    assert np.array_equal(grad, want)


def _threads_used(spy, num_threads=None) -> set[int]:
    spy.clear()
    _call_all(num_threads)
    assert [name for name, _ in spy] == ["lookup", "add", "scatter_add"]
    return {n for _, n in spy}


def _in_subprocess(env_updates: dict, code: str) -> dict:
    env = {"OMP_NUM_THREADS": None, "CPOSEMBED_NUM_THREADS": None, **env_updates}
    proc = run_python(["-c", textwrap.dedent(code)], env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


PROBE = """
    import json
    import cposembed
    from cposembed import _threads
    print(json.dumps({
        "default": cposembed.get_num_threads(),
        "effective": _threads.effective_num_threads(None, 1 << 24, 1 << 12),
        "explicit": _threads.effective_num_threads(2, 1 << 24, 1 << 12),
    }))
"""


# --- OMP_NUM_THREADS and CPOSEMBED_NUM_THREADS (fresh interpreters) -------------
@needs_openmp
@needs_2_cpus
def test_omp_num_threads_limits_default():
    r = _in_subprocess({"OMP_NUM_THREADS": "1"}, PROBE)
    assert r == {"default": 1, "effective": 1, "explicit": 2}
    r = _in_subprocess({"OMP_NUM_THREADS": "2"}, PROBE)
    assert r["default"] == 2 and r["effective"] == 2


@needs_openmp
def test_default_capped_by_cpus():
    r = _in_subprocess({"OMP_NUM_THREADS": str(CPU_LIMIT * 8)}, PROBE)
    assert r["default"] == CPU_LIMIT


@needs_openmp
@needs_2_cpus
def test_cposembed_num_threads_env_beats_omp_num_threads():
    r = _in_subprocess({"OMP_NUM_THREADS": "2", "CPOSEMBED_NUM_THREADS": "1"}, PROBE)
    assert r == {"default": 1, "effective": 1, "explicit": 2}
    r = _in_subprocess({"OMP_NUM_THREADS": "1", "CPOSEMBED_NUM_THREADS": "2"}, PROBE)
    assert r["default"] == 2 and r["effective"] == 2


@needs_openmp
@needs_2_cpus
def test_set_num_threads_beats_env():
    r = _in_subprocess(
        {"OMP_NUM_THREADS": "1", "CPOSEMBED_NUM_THREADS": "1"},
        """
        import json, cposembed
        cposembed.set_num_threads(2)
        a = cposembed.get_num_threads()
        cposembed.set_num_threads(None)
        print(json.dumps({"set": a, "restored": cposembed.get_num_threads()}))
        """,
    )
    assert r == {"set": 2, "restored": 1}


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5", " ", "\u0663"])
def test_bad_cposembed_num_threads_env_is_ignored_and_reported(monkeypatch, bad):
    """An invalid CPOSEMBED_NUM_THREADS is ignored alike by small and large calls
    (the default is then OpenMP's), with a warning and a line in show_config."""
    monkeypatch.delenv("CPOSEMBED_NUM_THREADS", raising=False)
    expected = cposembed.get_num_threads()
    monkeypatch.setenv("CPOSEMBED_NUM_THREADS", bad)
    if bad.strip() and cposembed.openmp_enabled():
        with pytest.warns(RuntimeWarning, match="CPOSEMBED_NUM_THREADS"):
            assert cposembed.get_num_threads() == expected
        cfg = cposembed._config.config()
        assert "CPOSEMBED_NUM_THREADS" in cfg["num_threads_from"]
        assert "ignored" in cfg["num_threads_from"]
    else:
        assert cposembed.get_num_threads() == expected
    table = np.ones((L, D), dtype=np.float32)
    for pos in (3, [1, 2], np.arange(N) % L):
        out = np.zeros(np.shape(pos) + (D,), np.float32)
        assert np.array_equal(cposembed.lookup(table, pos, out=out), table[pos])
        assert np.array_equal(cposembed.lookup(table, pos), table[pos])
    assert _threads.effective_num_threads(None, 1 << 24, 1 << 12) == expected


@needs_openmp
def test_cposembed_num_threads_env_read_at_call_time(monkeypatch, spy):
    monkeypatch.setenv("CPOSEMBED_NUM_THREADS", "1")
    assert cposembed.get_num_threads() == 1
    assert _threads_used(spy) == {1}


# --- threadpoolctl ---------------------------------------------------------------
@needs_openmp
def test_threadpoolctl_lists_the_extensions_openmp_runtime():
    """The OpenMP library threadpoolctl sees is the one the extension brought in,
    and limiting exactly that library changes the kernels' default."""
    r = _in_subprocess(
        {},
        """
        import json
        import numpy  # numpy may bring BLAS; it must not bring OpenMP
        import threadpoolctl
        before = [i["filepath"] for i in threadpoolctl.threadpool_info()
                  if i["user_api"] == "openmp"]
        import cposembed
        from cposembed import _core
        after = [i["filepath"] for i in threadpoolctl.threadpool_info()
                 if i["user_api"] == "openmp"]
        ctl = threadpoolctl.ThreadpoolController()
        new = [lib for lib in ctl.lib_controllers
               if lib.user_api == "openmp" and lib.filepath not in before]
        limited = None
        if new:
            new[0].set_num_threads(1)
            limited = _core.omp_max_threads()
        print(json.dumps({"before": before, "after": after,
                          "new": [lib.filepath for lib in new], "limited": limited,
                          "kernels": _core.__file__}))
        """,
    )
    assert r["new"], f"importing cposembed loaded no new OpenMP runtime: {r}"
    assert r["limited"] == 1
    # The runtime the dynamic linker resolved for the extension is that file.
    if sys.platform.startswith("linux"):
        ldd = subprocess.run(["ldd", r["kernels"]], capture_output=True, text=True, check=False)
        if ldd.returncode == 0:
            linked = [
                os.path.realpath(line.split("=>")[1].split("(")[0].strip())
                for line in ldd.stdout.splitlines()
                if "=>" in line and any(n in line for n in ("gomp", "libomp", "iomp"))
            ]
            assert linked and os.path.realpath(r["new"][0]) in linked, (linked, r)
    info = cposembed._config.config()["openmp_runtime"]
    assert os.path.basename(r["new"][0]) in info


@needs_openmp
@needs_2_cpus
def test_threadpool_limits_limits_the_default(spy):
    assert cposembed.get_num_threads() == min(CPU_LIMIT, _core.omp_max_threads())
    before = _threads_used(spy)
    with threadpoolctl.threadpool_limits(1, user_api="openmp"):
        assert _core.omp_max_threads() == 1
        assert cposembed.get_num_threads() == 1
        assert _threads_used(spy) == {1}
    assert _threads_used(spy) == before
    with threadpoolctl.threadpool_limits(1):  # all APIs
        assert _threads_used(spy) == {1}
    with threadpoolctl.threadpool_limits(2, user_api="openmp"):
        assert _threads_used(spy) == {min(2, CPU_LIMIT)}


@needs_openmp
@needs_2_cpus
def test_explicit_num_threads_wins_over_threadpool_limits(spy):
    with threadpoolctl.threadpool_limits(1, user_api="openmp"):
        assert _threads_used(spy, num_threads=2) == {2}


@needs_openmp
@needs_2_cpus
def test_set_num_threads_wins_over_threadpool_limits(spy):
    with threadpoolctl.threadpool_limits(1, user_api="openmp"):
        cposembed.set_num_threads(2)
        assert cposembed.get_num_threads() == 2
        assert _threads_used(spy) == {2}
        assert _threads_used(spy, num_threads=1) == {1}  # and the call beats both
        cposembed.set_num_threads(None)
        assert _threads_used(spy) == {1}


# --- the rest of the rules -------------------------------------------------------
@needs_openmp
def test_explicit_num_threads_may_exceed_cpus_up_to_a_cap(spy):
    """Oversubscription is the caller's choice, up to four times the CPUs; beyond
    that a request is capped, never handed to OpenMP as it is."""
    n = CPU_LIMIT + 2
    assert _threads_used(spy, num_threads=n) == {n}
    for huge in (
        4 * CPU_LIMIT + 1,
        50_000,
        100_000,
        2**31,
        2**63,
        2**100,
        np.int64(2**62),
    ):
        assert _threads_used(spy, num_threads=huge) == {4 * CPU_LIMIT}


@needs_openmp
def test_small_work_runs_serially(spy):
    table = np.ones((4, 4), dtype=np.float32)
    spy.clear()
    cposembed.lookup(table, [0, 1, 2], num_threads=2)
    cposembed.add_positions(np.ones((3, 4), np.float32), table, num_threads=2)
    cposembed.scatter_add(np.zeros_like(table), np.ones((3, 4), np.float32), num_threads=2)
    assert {n for _, n in spy} == {1}


@needs_openmp
def test_threads_capped_by_chunks(spy):
    """scatter_add into a 2-row table cannot use more than 2 threads."""
    grad = np.zeros((2, 1 << 16), dtype=np.float32)
    spy.clear()
    cposembed.scatter_add(grad, np.ones((4, 1 << 16), np.float32), [0, 1, 0, 1], num_threads=8)
    assert spy == [("scatter_add", 2)]
    assert np.all(grad == 2)


@pytest.mark.parametrize("bad", [0, -1, -(2**70), 1.5, "2", True, np.bool_(True), np.array([2])])
def test_bad_num_threads_rejected(bad):
    table = np.ones((4, 4), dtype=np.float32)
    with pytest.raises((TypeError, ValueError), match="num_threads"):
        cposembed.lookup(table, [0], num_threads=bad)
    with pytest.raises((TypeError, ValueError), match="num_threads"):
        cposembed.set_num_threads(bad)


def test_results_identical_for_every_thread_count():
    rng = np.random.RandomState(5)
    table = rng.randn(L, D)
    pos = rng.randint(-L, L, size=(4, N // 4))
    g = rng.randn(4, N // 4, D)
    ref = np.zeros_like(table)
    np.add.at(ref, pos, g)
    for n in (1, 2, 3, 4, 7):
        assert np.array_equal(cposembed.lookup(table, pos, num_threads=n), table[pos])
        assert np.array_equal(
            cposembed.scatter_add(np.zeros_like(table), g, pos, num_threads=n), ref
        )
