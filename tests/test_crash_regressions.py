"""Inputs that have crashed the interpreter: NumPy's result or a documented error, never a crash.

Each reproduction runs in a child interpreter, so a segfault or an abort
fails its test (with the child's return code and stderr) instead of ending
the test run. The child prints one JSON line describing what happened; the
test compares it with NumPy's answer computed on copies taken before the
call, and on an error checks that nothing was written.
"""

from __future__ import annotations

import textwrap

import pytest
from helpers import assert_clean_exit, last_json, run_python

DOCUMENTED = ("ValueError", "IndexError", "TypeError")

# Defines `outcome(fn, expect, watched)` in the child: runs fn(); on success
# compares its result with `expect` (bitwise); on an exception checks that
# every array in `watched` is unchanged. Prints one JSON line.
CHILD_PRELUDE = """
import json, sys
import numpy as np
import cposembed
from cposembed import LearnedPositionEmbedding

def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()

def outcome(fn, expect, watched):
    before = [w.copy() for w in watched]
    try:
        got = fn()
    except Exception as exc:
        unchanged = all(same(w, b) for w, b in zip(watched, before))
        print(json.dumps({"raised": type(exc).__name__, "message": str(exc),
                          "unchanged": unchanged}))
        return
    print(json.dumps({"raised": None, "equal": same(got, expect),
                      "got": np.asarray(got).ravel()[:16].tolist(),
                      "expect": np.asarray(expect).ravel()[:16].tolist()}))
"""


def run_child(body: str, timeout: float = 120) -> dict:
    """Run the prelude and ``body`` in a child; its last stdout line as JSON."""
    proc = run_python(["-c", CHILD_PRELUDE + textwrap.dedent(body)], timeout)
    assert_clean_exit(proc)
    assert "Thread creation failed" not in proc.stderr, proc.stderr[-3000:]
    return last_json(proc)


def assert_numpy_or_refused(result: dict, allowed: tuple[str, ...], words: str = "") -> None:
    if result["raised"] is None:
        assert result["equal"], (
            f"succeeded with a result other than NumPy's: got {result['got']}, "
            f"expected {result['expect']}"
        )
        return
    assert result["raised"] in allowed, (
        f"expected NumPy's result or one of {allowed}; got {result['raised']}: {result['message']}"
    )
    assert result["unchanged"], f"{result['raised']} raised after writing: {result['message']}"
    if words:
        assert any(w in result["message"].lower() for w in words.split("|")), (
            f"the message should name the problem ({words}); got: {result['message']}"
        )


# -- a. positions sharing memory with what the call writes -----------------------
# `buf` holds the positions as int64 bits; the output (or tokens, or gradient)
# is a float64 view of the same bytes shifted by one element, so writing row
# i changes position i + 1. "zeros" is the layout of the issue; "mixed" holds
# distinct valid positions, so a kernel that reads a position after writing
# over it gives a visibly different result.
OVERLAP_SETUP = """
kind = {kind!r}
if kind == "zeros":
    buf = np.zeros(9)
    table = np.ones((4, 1))
else:
    buf = np.array([3, 1, 2, 0, 1, 3, 2, 0, 1], dtype=np.int64).view(np.float64)
    table = np.arange(1.0, 5.0).reshape(4, 1)
pos = buf.view(np.int64)[:-1]
pos_copy = pos.copy()
"""
OVERLAP_KINDS = ["zeros", "mixed"]
OVERLAP_WORDS = "overlap|share|memory"


def overlap_case(kind: str, body: str) -> dict:
    return run_child(OVERLAP_SETUP.format(kind=kind) + textwrap.dedent(body))


@pytest.mark.parametrize("kind", OVERLAP_KINDS)
def test_lookup_out_overlapping_positions(kind):
    """a. lookup(table, pos, out=out) where out shares memory with pos."""
    result = overlap_case(
        kind,
        """
        out = buf[1:].reshape(8, 1)
        expect = np.take(table, pos_copy, axis=0)
        outcome(lambda: cposembed.lookup(table, pos, out=out), expect, [buf, table])
        """,
    )
    assert_numpy_or_refused(result, ("ValueError",), OVERLAP_WORDS)


@pytest.mark.parametrize("kind", OVERLAP_KINDS)
def test_class_call_out_overlapping_positions(kind):
    """a. pe(pos, out=out) where out shares memory with pos."""
    result = overlap_case(
        kind,
        """
        pe = LearnedPositionEmbedding.from_pretrained(table, dtype=np.float64)
        out = buf[1:].reshape(8, 1)
        expect = np.take(table, pos_copy, axis=0)
        outcome(lambda: pe(pos, out=out), expect, [buf, pe.embeddings])
        """,
    )
    assert_numpy_or_refused(result, ("ValueError",), OVERLAP_WORDS)


@pytest.mark.parametrize("kind", OVERLAP_KINDS)
def test_add_positions_out_overlapping_positions(kind):
    """a. add_positions(tok, table, pos, out=out), tok separate, out sharing memory with pos."""
    result = overlap_case(
        kind,
        """
        tok = np.arange(8.0).reshape(8, 1) + 0.5
        out = buf[1:].reshape(8, 1)
        expect = tok + table[pos_copy]
        outcome(lambda: cposembed.add_positions(tok, table, pos, out=out), expect,
                [buf, table, tok])
        """,
    )
    assert_numpy_or_refused(result, ("ValueError",), OVERLAP_WORDS)


@pytest.mark.parametrize("kind", OVERLAP_KINDS)
def test_add_positions_in_place_on_tokens_overlapping_positions(kind):
    """a. add_positions(tok, table, pos, out=tok) where tok shares memory with pos."""
    result = overlap_case(
        kind,
        """
        tok = buf[1:].reshape(8, 1)
        expect = tok.copy() + table[pos_copy]
        outcome(lambda: cposembed.add_positions(tok, table, pos, out=tok), expect,
                [buf, table])
        """,
    )
    assert_numpy_or_refused(result, ("ValueError",), OVERLAP_WORDS)


@pytest.mark.parametrize("kind", OVERLAP_KINDS)
def test_scatter_add_grad_output_overlapping_positions(kind):
    """a. scatter_add(grad, g, pos) where g shares memory with pos (only read, never written)."""
    result = overlap_case(
        kind,
        """
        grad = np.zeros((4, 1))
        g = buf[1:].reshape(8, 1)
        expect = grad.copy()
        np.add.at(expect, pos_copy, g.copy())
        outcome(lambda: cposembed.scatter_add(grad, g, pos), expect, [buf, grad])
        """,
    )
    assert_numpy_or_refused(result, ("ValueError",), OVERLAP_WORDS)


@pytest.mark.parametrize("kind", OVERLAP_KINDS)
def test_scatter_add_grad_table_overlapping_positions(kind):
    """a. scatter_add(grad, g, pos) where the gradient table shares memory with pos."""
    result = overlap_case(
        kind,
        """
        grad = buf[1:5].reshape(4, 1)
        if kind == "mixed":
            pos[:] = [3, 1, 2, 0, 1, 3, 2, 0]  # rows 1..4 of pos are grad's rows 0..3
            pos_copy = pos.copy()
        g = np.arange(1.0, 9.0).reshape(8, 1)
        expect = grad.copy()
        np.add.at(expect, pos_copy, g)
        outcome(lambda: cposembed.scatter_add(grad, g, pos), expect, [buf, g])
        """,
    )
    assert_numpy_or_refused(result, ("ValueError",), OVERLAP_WORDS)


# -- b. positions changed by another thread during the calls ---------------------
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
    """b. A thread flips shared positions between valid values and 10**12 during the calls."""
    result = run_child(RACE.format(L=L, d=d, n=n, calls=4000, seconds=10), timeout=180)
    assert result["problems"] == [], result
    assert sum(result["counts"].values()) > 0, result


# -- c. absurd explicit thread counts ------------------------------------------------
ABSURD_THREADS = [100_000, 50_000, 2**31, 2**63, 2**100]


@pytest.mark.parametrize("op", ["lookup", "add_positions", "scatter_add"])
def test_absurd_num_threads(op):
    """c. num_threads of 100_000 .. 2**100 on a large call: the right result or ValueError."""
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


# -- d. crafted pickled state, then sgd_step -------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("touched", "np.ones(1 << 22, bool)"),
        ("touched", "np.ones(3, bool)"),
        ("grad", "np.ones((2, 4), np.float32)"),
        ("grad", "np.ones((1 << 16, 4), np.float32)"),
    ],
    ids=["touched-long", "touched-short", "grad-small", "grad-large"],
)
def test_crafted_state_then_sgd_step(field, value):
    """d. __setstate__ with a touched mask or grad of the wrong size, then sgd_step."""
    body = f"""
    pe = LearnedPositionEmbedding(8, 4, seed=0)
    state = pe.__getstate__()
    state["grad"] = np.ones((8, 4), np.float32)
    state["touched"] = np.ones(8, bool)
    state[{field!r}] = {value}
    table = pe.embeddings

    def run():
        pe.__setstate__(state)
        pe.sgd_step(0.1)
        return pe.embeddings

    outcome(run, None, [table])
    """
    result = run_child(body)
    assert result["raised"] == "ValueError", result
    assert result["unchanged"], result
    assert field in result["message"], result["message"]


# -- e. a user-assigned grad of the wrong shape ----------------------------------------
@pytest.mark.parametrize("positions", ["[50 % 8, 3]", "[50]"], ids=["valid-rows", "row-50"])
def test_user_assigned_grad_of_the_wrong_shape(positions):
    """e. pe.grad = a (100, 2) array for an (8, 2) table, then backward: ValueError, nothing written."""
    body = f"""
    pe = LearnedPositionEmbedding(8, 2, seed=0)
    user = np.zeros((100, 2))
    pe.grad = user
    positions = {positions}
    g = np.ones((len(positions), 2))
    outcome(lambda: pe.backward(g, positions), None, [user, pe.embeddings])
    """
    result = run_child(body)
    assert result["raised"] == "ValueError", (
        f"expected ValueError for a grad of shape (100, 2) on an (8, 2) table; got {result}"
    )
    assert result["unchanged"], "the user's grad array (or the table) was written"
    assert "grad" in result["message"], result["message"]


# -- f. masked arrays -----------------------------------------------------------------
@pytest.mark.parametrize("positions", ["None", "[[0, 2, 1]]"], ids=["default", "explicit"])
def test_add_to_masked_array_keeps_the_mask_or_refuses(positions):
    """f. pe.add_to(masked array): a masked result with NumPy's mask, or TypeError."""
    body = f"""
    pe = LearnedPositionEmbedding(4, 2, seed=0, dtype=np.float64)
    data = np.arange(12.0).reshape(2, 3, 2)
    mask = np.zeros((2, 3, 2), bool)
    mask[0, 1, 0] = mask[1, 2, 1] = True
    tok = np.ma.masked_array(data, mask=mask)
    positions = {positions}
    idx = np.arange(3) if positions is None else np.asarray(positions)
    expect = tok + pe.embeddings[idx]
    try:
        got = pe.add_to(tok, positions)
    except TypeError as exc:
        print(json.dumps({{"raised": "TypeError", "message": str(exc)}}))
    else:
        print(json.dumps({{
            "raised": None,
            "masked": isinstance(got, np.ma.MaskedArray),
            "same_mask": bool(np.array_equal(np.ma.getmaskarray(got), np.ma.getmaskarray(expect))),
            "same_values": bool(np.array_equal(np.ma.filled(got, 0), np.ma.filled(expect, 0))),
        }}))
    """
    result = run_child(body)
    if result["raised"] is not None:
        assert result["raised"] == "TypeError", result
        return
    assert result["masked"], "the result is a plain array: the mask was silently dropped"
    assert result["same_mask"] and result["same_values"], result


# -- g. the class's table swapped during calls -------------------------------------------
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
for i in range(3000):
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
    """g. pe(positions) (the C call) while another thread swaps ``pe._embeddings``
    between tables, None and a string: one table's rows or a worded error."""
    result = run_child(SWAP, timeout=180)
    assert result["problems"] == [], result
    assert result["counts"].get("ok", 0) > 0 and result["counts"].get("TypeError", 0) > 0, result
