"""Which calls take the C entries and which the entries decline and the Python
routes serve: the count of entry calls, shared memory, odd layouts, no leaks."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import (
    OVERLAP_KINDS,
    OVERLAP_WORDS,
    assert_numpy_or_refused,
    make_out,
    overlap_case,
    run_json,
)
from hypothesis import given
from hypothesis import strategies as st
from plain import (
    FLOATS,
    INT_DTYPES,
    Snapshot,
    _array_form,
    _declined,
    _disjoint,
    _plain,
    _rng,
    _same_bits,
    _scatter_expect,
    _Sub,
)

import cposembed
from cposembed import _core, _routes


@pytest.mark.parametrize(
    "table",
    [
        np.ones((12, 5), np.float32)[:, ::2],
        np.asfortranarray(np.ones((12, 5))),
        np.ones((12, 5), ">f4"),
        np.ones((12, 5), np.complex64),
        np.ones((12, 5), np.int64),
        np.ones((12, 5), np.float32)[0],
        np.ones((12, 5), np.float32)[None],
        np.ones((12, 5), np.float32).tolist(),
        np.ones((12, 5), np.float32).view(_Sub),
        np.frombuffer(bytearray(1 + 12 * 5 * 8), np.float64, offset=1).reshape(12, 5),
        np.ma.masked_array(np.ones((12, 5), np.float32)),
    ],
    ids=lambda t: f"{type(t).__name__}",
)
def test_entries_take_only_plain_tables(table):
    tok = np.ones((1, 2, 5), np.float32)
    for call in (
        lambda: _core.lookup(table, 1, None, None),
        lambda: _core.lookup(table, [1, 2], None, 1),
        lambda: _core.add(tok, table, None, 0, None, None),
        lambda: _core.scatter_add(table, tok, None, 0, None),
        lambda: _core.sgd_step(table, np.ones((12, 5), np.float32), None, 0.5, -1),
    ):
        snap = Snapshot(table, tok)
        _declined(call(), snap)
    # ...and the functions serve every float table all the same (a byte-misaligned
    # one: see test_misaligned_inputs_through_the_public_functions).
    if (
        type(table) is not np.ma.MaskedArray
        and np.ndim(table) == 2
        and np.asarray(table).dtype.kind == "f"
        and np.asarray(table).dtype.itemsize >= 4
        and np.asarray(table).flags.aligned
    ):
        expect = np.asarray(table)[[1, -2]]
        got = cposembed.lookup(table, [1, -2])
        assert np.array_equal(got, expect) and got.dtype == expect.dtype.newbyteorder("=")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize(
    "kind",
    [
        "plain",
        "dtype",
        "float16",
        "int",
        "swapped",
        "strided",
        "subclass",
        "unaligned",
        "readonly",
        "list",
    ],
)
def test_contract_checkers_agree_with_the_oracle(dtype, kind):
    # _core.is_canonical / _core.disjoint are what the Python layer asks; plain.py's
    # own _plain / _disjoint stay the independent statement of the rule.
    a = _array_form(np.arange(24, dtype=dtype).reshape(4, 6), kind)
    writable = isinstance(a, np.ndarray) and a.flags.writeable
    assert _core.is_canonical(a, dtype) == _plain(a, dtype)
    assert _core.is_canonical(a, dtype, writable=True) == (_plain(a, dtype) and writable)
    flat = np.zeros(10, dtype)
    for x, y in [(flat[:5], flat[5:]), (flat[:6], flat[5:]), (flat[:0], flat), (flat, flat)]:
        assert _core.disjoint(x, y) == _disjoint(x, y)
    # Not C-contiguous, or not an exact ndarray: "may meet".
    assert not _core.disjoint(flat[::2], flat[1::2]) and not _core.disjoint(
        flat.view(_Sub), flat[:0]
    )


def test_entries_at_the_table_edge_sizes():
    empty_rows = np.zeros((0, 3), np.float32)
    _same_bits(_core.lookup(empty_rows, [], None, None), np.zeros((0, 3), np.float32))
    _same_bits(
        _core.lookup(empty_rows, np.zeros(0, np.int8), None, 2), np.zeros((0, 3), np.float32)
    )
    assert _core.lookup(empty_rows, 0, None, None) is None
    assert _core.lookup(empty_rows, [-1], None, None) is None
    no_cols = np.zeros((4, 0), np.float64)
    _same_bits(_core.lookup(no_cols, [1, -4], None, None), np.zeros((2, 0)))
    assert _core.lookup(no_cols, 4, None, None) is None
    tok = np.zeros((2, 3, 0))
    _same_bits(_core.add(tok, no_cols, None, 1, None, None), tok)
    grad = np.zeros((4, 0))
    assert _core.scatter_add(grad, tok, [0, 3, -4], 0, None) is grad
    assert _core.sgd_step(no_cols, grad, None, 1.0, -1) is True


# ------------------------------------------------------------- memory safety
@given(data=st.data())
def test_outputs_may_share_memory_with_the_positions(data):
    """Positions are read into the call's own buffer before anything is written:
    an output over the positions' bytes gets NumPy's result on the positions as
    they were (any layout of either)."""
    op = data.draw(st.sampled_from(["lookup", "add", "scatter"]))
    dtype = data.draw(st.sampled_from(FLOATS))
    index = data.draw(st.sampled_from(INT_DTYPES))
    L = data.draw(st.integers(1, 20))
    d = data.draw(st.integers(1, 6))
    n = data.draw(st.integers(1, 12))
    step = data.draw(st.sampled_from([1, 2, -1, -3]))
    threads = data.draw(st.integers(1, 4))
    rng = _rng(L * 100 + n)
    table = rng.standard_normal((L, d)).astype(dtype)
    out_rows = L if op == "scatter" else n
    out_bytes = out_rows * d * dtype.itemsize
    pos_span = n * abs(step) * index.itemsize
    raw = np.zeros(out_bytes + pos_span + 64, np.uint8)
    out_at = data.draw(st.integers(0, 8)) * dtype.itemsize
    out = raw[out_at : out_at + out_bytes].view(dtype).reshape(out_rows, d)
    # The positions start anywhere inside the output (any byte offset).
    pos_at = data.draw(st.integers(out_at, out_at + out_bytes - 1))
    stride = step * index.itemsize
    first = pos_at if step > 0 else pos_at + (n - 1) * abs(stride)
    positions = np.ndarray((n,), index, buffer=raw, offset=first, strides=(stride,))
    lo = 0 if index.kind == "u" else -L
    values = rng.integers(lo, L, size=n).astype(index)
    positions[...] = values
    assert np.shares_memory(positions, out)
    before = positions.copy()
    if op == "lookup":
        expect = table[before]
        result = _core.lookup(table, positions, out, threads)
    elif op == "add":
        tok = rng.standard_normal((n, d)).astype(dtype)
        expect = tok + table[before]
        result = _core.add(tok, table, positions, 0, out, threads)
    else:
        g = rng.standard_normal((n, d)).astype(dtype)
        expect, _ = _scatter_expect(out, g, before, None, -1)
        result = _core.scatter_add(out, g, positions, 0, threads)
    assert result is out
    assert np.array_equal(out, expect, equal_nan=True)
    _same_bits(out[~np.isnan(expect)], expect[~np.isnan(expect)])


@pytest.mark.parametrize("dtype", FLOATS)
def test_positions_inside_a_public_output_of_another_layout(dtype):
    # The function's own route (out not plain: computed aside, then copied).
    table = _rng(0).standard_normal((12, 4)).astype(dtype)
    raw = np.zeros((8, 4, 2), dtype)
    out = raw[..., 0]  # strided: declined by the entry
    pos = raw.reshape(-1).view(np.int32 if dtype == np.float32 else np.int64)[:16:2]
    pos[...] = [3, -1, 0, 11, 5, 5, -12, 2]
    before = pos.copy()
    assert cposembed.lookup(table, pos, out=out) is out
    _same_bits(out, table[before])


@pytest.mark.parametrize("dtype", FLOATS)
def test_outputs_over_what_a_call_reads_are_declined_and_served_as_numpy(dtype):
    """An output sharing memory with the table, the tokens or the gradient is
    declined by the entry; the function gives NumPy's result (computed on the
    inputs as they were) all the same."""
    rng = _rng(2)
    L, d, n = 10, 6, 8
    table0 = rng.standard_normal((L, d)).astype(dtype)
    pos = rng.integers(-L, L, size=n)
    tok0 = rng.standard_normal((n, d)).astype(dtype)
    for start in (0, 1, 7, L * d - 1, L * d - n * d + 3):
        start = max(0, min(start, L * d - 1))
        # lookup: out over the table
        buf = np.zeros(L * d + n * d, dtype)
        table = buf[: L * d].reshape(L, d)
        table[...] = table0
        out = buf[start : start + n * d].reshape(n, d)
        snap = Snapshot(table, out)
        _declined(_core.lookup(table, pos, out, None), snap)
        assert cposembed.lookup(table, pos, out=out) is out
        _same_bits(out, table0[pos])
        # add: out over the table
        table[...] = table0
        snap = Snapshot(table, out, tok0)
        _declined(_core.add(tok0, table, pos, 0, out, None), snap)
        _declined(_core.add(tok0, table, None, 0, out, 2), snap)
        assert cposembed.add_positions(tok0, table, pos, out=out) is out
        _same_bits(out, tok0 + table0[pos])
        # add in place on tokens that are the table's memory
        table[...] = table0
        if start + n * d <= L * d:
            snap = Snapshot(table, out)
            _declined(_core.add(out, table, pos, 0, out, None), snap)
            tok_before = out.copy()
            cposembed.add_positions(out, table, pos, out=out)
            _same_bits(out, tok_before + table0[pos])
    for shift in (1, d, n * d - 1):
        # add: out over the tokens (not the tokens themselves)
        buf = np.zeros(2 * n * d, dtype)
        tok = buf[: n * d].reshape(n, d)
        tok[...] = tok0
        out = buf[shift : shift + n * d].reshape(n, d)
        snap = Snapshot(tok, out, table0)
        _declined(_core.add(tok, table0, pos, 0, out, None), snap)
        assert cposembed.add_positions(tok, table0, pos, out=out) is out
        _same_bits(out, tok0 + table0[pos])
        # scatter: gradient over the table being accumulated into
        buf = rng.standard_normal(L * d + n * d).astype(dtype)
        grad = buf[: L * d].reshape(L, d)
        g = buf[shift : shift + n * d].reshape(n, d)
        expect, _ = _scatter_expect(grad, g.copy(), pos, None, -1)
        snap = Snapshot(grad, g)
        _declined(_core.scatter_add(grad, g, pos, 0, None), snap)
        assert cposembed.scatter_add(grad, g, pos) is grad
        _same_bits(grad, expect)


# --------------------------------------------------------- the public route
@pytest.fixture
def entry_calls(monkeypatch):
    """Spies on the four entries: for each, whether each call was accepted."""
    calls: dict[str, list[bool]] = {}
    for name in ("lookup", "add", "scatter_add", "sgd_step"):
        real = getattr(_core, name)
        log = calls.setdefault(name, [])

        def spy(*args, _real=real, _log=log, **kwargs):
            result = _real(*args, **kwargs)
            _log.append(result is not None)
            return result

        monkeypatch.setattr(_core, name, spy)

    def take():
        got = {k: list(v) for k, v in calls.items() if v}
        for v in calls.values():
            v.clear()
        return got

    return take


ONCE = [True]


TWICE = [False, True]


# An `out` the entry cannot write (another layout, or over an input): declined
# as given, declined again when offered after normalising, then the result is
# computed aside and copied in.
ASIDE = [False, False, True]


@pytest.mark.parametrize("dtype", FLOATS)
def test_public_functions_call_each_entry_once_or_twice(entry_calls, dtype):
    rng = _rng(5)
    L, d, B, T = 64, 8, 3, 10
    table = rng.standard_normal((L, d)).astype(dtype)
    pos = rng.integers(-L, L, size=(B, T))
    tok = rng.standard_normal((B, T, d)).astype(dtype)
    other = np.float32 if dtype == np.float64 else np.float64

    def check(call, expect_calls, expect_value):
        got = call()
        assert entry_calls() == expect_calls, call
        if isinstance(expect_value, np.ndarray):
            _same_bits(got, expect_value)

    # lookup: plain forms once; the rest normalised, then accepted
    check(lambda: cposembed.lookup(table, pos), {"lookup": ONCE}, table[pos])
    check(lambda: cposembed.lookup(table, pos.tolist()), {"lookup": ONCE}, table[pos])
    check(lambda: cposembed.lookup(table, 3), {"lookup": ONCE}, table[3])
    check(
        lambda: cposembed.lookup(table, pos.astype(np.uint16) % L), {"lookup": ONCE}, table[pos % L]
    )
    check(lambda: cposembed.lookup(table, pos.T, num_threads=2), {"lookup": ONCE}, table[pos.T])
    out = np.empty((B, T, d), dtype)
    check(lambda: cposembed.lookup(table, pos, out=out), {"lookup": ONCE}, table[pos])
    check(lambda: cposembed.lookup(table, pos.astype(">i8")), {"lookup": TWICE}, table[pos])
    check(lambda: cposembed.lookup(np.asfortranarray(table), pos), {"lookup": TWICE}, table[pos])
    check(lambda: cposembed.lookup(table.astype(other), pos), {"lookup": ONCE}, None)
    with pytest.raises(TypeError):
        cposembed.lookup(table.astype(np.int32), pos)
    assert entry_calls() == {"lookup": [False]}
    check(lambda: cposembed.lookup(table, [True, False] * 32), {"lookup": TWICE}, table[::2])
    check(lambda: cposembed.lookup(table, slice(2, 5)), {"lookup": TWICE}, table[2:5])
    check(lambda: cposembed.lookup(table, np.int64(-1)), {"lookup": ONCE}, table[-1])
    fortran_out = np.empty((T, B, d), dtype, order="F").transpose(1, 0, 2)
    check(lambda: cposembed.lookup(table, pos, out=fortran_out), {"lookup": ASIDE}, table[pos])
    on_table = np.zeros(L * d + 8, dtype)
    t_view = on_table[: L * d].reshape(L, d)
    t_view[...] = table
    check(
        lambda: cposembed.lookup(t_view, pos[0], out=on_table[8 : 8 + T * d].reshape(T, d)),
        {"lookup": ASIDE},
        table[pos[0]],
    )
    check(lambda: cposembed.lookup(table, (slice(None), 0)), {"lookup": [False]}, table[:, 0])
    with pytest.raises(IndexError):
        cposembed.lookup(table, [L])
    assert entry_calls() == {"lookup": [False]}
    with pytest.raises(ValueError):
        cposembed.lookup(table, pos, num_threads=0)
    assert entry_calls() == {"lookup": [False]}

    # add
    check(lambda: cposembed.add_positions(tok, table), {"add": ONCE}, tok + table[:T])
    check(
        lambda: cposembed.add_positions(tok, table, offset=4), {"add": ONCE}, tok + table[4 : 4 + T]
    )
    check(lambda: cposembed.add_positions(tok, table, pos), {"add": ONCE}, tok + table[pos])
    check(lambda: cposembed.add_positions(tok, table, pos[0]), {"add": ONCE}, tok + table[pos[0]])
    check(
        lambda: cposembed.add_positions(tok, table, pos[:, :1]),
        {"add": TWICE},
        tok + table[pos[:, :1]],
    )
    check(
        lambda: cposembed.add_positions(tok[:, ::-1], table),
        {"add": TWICE},
        tok[:, ::-1] + table[:T],
    )
    swapped = tok.astype(tok.dtype.newbyteorder())
    check(lambda: cposembed.add_positions(swapped, table), {"add": TWICE}, tok + table[:T])
    # float32 table, float64 tokens: NumPy's promoting add; the other way round
    # the tokens are converted to the table's dtype.
    promote = {"add": [False]} if dtype == np.float32 else {"add": TWICE}
    check(
        lambda: cposembed.add_positions(tok.astype(other), table),
        promote,
        tok.astype(other) + table[:T],
    )
    tok_copy = tok.copy()
    check(
        lambda: cposembed.add_positions(tok_copy, table, out=tok_copy),
        {"add": ONCE},
        tok + table[:T],
    )
    buf = np.zeros(tok.size + d, dtype)
    t_in = buf[: tok.size].reshape(tok.shape)
    t_in[...] = tok
    check(
        lambda: cposembed.add_positions(t_in, table, out=buf[d:].reshape(tok.shape)),
        {"add": ASIDE},
        tok + table[:T],
    )
    with pytest.raises(IndexError):
        cposembed.add_positions(tok, table, offset=L - T + 1)
    assert entry_calls() == {"add": [False]}

    # scatter_add
    def added(g, p):
        want = np.zeros((L, d), dtype)
        np.add.at(want, p, np.asarray(g, dtype))
        return want

    def added_as_is(g, p):  # another dtype: each add in the wider one, rounded
        want = np.zeros((L, d), dtype)
        np.add.at(want, p, g)
        return want

    fortran = np.zeros((L, d), dtype, order="F")
    for call, calls, expect in [
        (lambda: cposembed.scatter_add(np.zeros((L, d), dtype), tok, pos), ONCE, added(tok, pos)),
        (
            lambda: cposembed.scatter_add(np.zeros((L, d), dtype), tok, pos.tolist()),
            ONCE,
            added(tok, pos),
        ),
        (
            lambda: cposembed.scatter_add(np.zeros((L, d), dtype), tok),
            ONCE,
            added(tok, np.broadcast_to(np.arange(T), (B, T))),
        ),
        (
            lambda: cposembed.scatter_add(np.zeros((L, d), dtype), tok.astype(other), pos),
            ONCE,
            added_as_is(tok.astype(other), pos),
        ),
        (lambda: cposembed.scatter_add(fortran, tok, pos), TWICE, added(tok, pos)),
        (
            lambda: cposembed.scatter_add(np.zeros((L, d), dtype), tok[:, ::-1], pos[:, ::-1]),
            TWICE,
            added(tok[:, ::-1], pos[:, ::-1]),
        ),
        (
            lambda: cposembed.scatter_add(np.zeros((L, d), dtype), tok, pos[:, :1]),
            TWICE,
            added(tok, np.broadcast_to(pos[:, :1], (B, T))),
        ),
    ]:
        check(call, {"scatter_add": calls}, expect)

    # the class: lookup, backward and sgd_step
    pe = cposembed.LearnedPositionEmbedding.from_pretrained(table, dtype=dtype)
    # (pe(...) enters the lookup entry from C, unseen by the spy; what it
    # declines is normalised and offered again through cposembed._core.lookup.)
    check(lambda: pe(pos), {}, table[pos])
    check(lambda: pe(pos.astype(">i4")), {"lookup": ONCE}, table[pos])
    pe.backward(tok, pos)
    pe.sgd_step(0.5)
    assert entry_calls() == {"scatter_add": ONCE, "sgd_step": ONCE}
    _same_bits(pe.embeddings, table - dtype.type(0.5) * added(tok, pos))
    pe.grad = pe.grad.astype(other)  # another dtype: NumPy's arithmetic, same rule
    expect = pe.embeddings.copy()
    expect -= 0.25 * pe.grad
    pe.sgd_step(0.25)
    assert entry_calls() == {"sgd_step": [False]}
    _same_bits(pe.embeddings, expect)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("threads", [None, 1, 2, 3])
def test_plain_calls_above_the_serial_threshold_take_one_entry_call(entry_calls, dtype, threads):
    rng = _rng(5)
    L, d, B, T = 256, 48, 8, 200
    assert B * T * d > _core.SERIAL_THRESHOLD
    table = rng.standard_normal((L, d)).astype(dtype)
    pos = rng.integers(-L, L, size=(B, T))
    out = np.empty((B, T, d), dtype)
    assert cposembed.lookup(table, pos, out=out, num_threads=threads) is out
    _same_bits(out, table[pos])
    tok = rng.standard_normal((B, T, d)).astype(dtype)
    got = cposembed.add_positions(tok, table, offset=3, out=out, num_threads=threads)
    assert got is out
    _same_bits(out, tok + table[3 : 3 + T])
    for positions in (None, pos, np.tile(np.arange(T), (B, 1))):
        grad = np.zeros((L, d), dtype)
        rows = np.arange(T) if positions is None else positions
        want, _ = _scatter_expect(grad, tok, rows, None, -1)
        cposembed.scatter_add(grad, tok, positions, num_threads=threads)
        _same_bits(grad, want)
    assert entry_calls() == {"lookup": ONCE, "add": ONCE, "scatter_add": ONCE * 3}


def test_class_calls_go_straight_to_the_lookup_entry(monkeypatch):
    """Tiny calls never reach the normalising route (broken here on purpose)."""

    def broken(*args, **kwargs):
        raise AssertionError("normalised")

    monkeypatch.setattr(_routes, "lookup", broken)
    pe = cposembed.LearnedPositionEmbedding(128, 64, seed=0)
    table = pe.embeddings
    a4 = _rng(1).integers(0, 128, size=(4, 128))
    for pos in (5, -1, np.int16(7), [0], [[1, np.int8(-2)]], np.arange(10), a4, np.array(3)):
        _same_bits(pe(pos), table[np.asarray(pos, np.int64)])
    out = np.empty(64, np.float32)
    assert pe(5, out=out) is out and np.array_equal(out, table[5])
    for other in (
        lambda: pe(128),
        lambda: pe(True),
        lambda: pe([1.0]),
        lambda: pe(5, out=np.empty(64)),
    ):
        with pytest.raises(AssertionError, match="normalised"):
            other()


# ------------------------------------------ positions with more axes than the rows
def test_entries_decline_positions_with_more_axes_than_the_rows():
    table = np.arange(20, dtype=np.float32).reshape(10, 2)
    tok = np.zeros((3, 2), np.float32)
    pos = np.zeros((1, 1, 3), np.int64)
    with pytest.raises(ValueError, match="broadcast"):
        cposembed.add_positions(tok.astype(np.float64), table, pos)
    assert _core.add(tok, table, pos, 0, None, None) is None
    assert _core.scatter_add(np.zeros((10, 2), np.float32), tok, pos, 0, None) is None
    with pytest.raises(ValueError, match="broadcast"):
        cposembed.add_positions(tok, table, pos)


def test_empty_arrays_inside_the_table_give_numpys_result():
    t = np.ones((4, 3), np.float32)
    empty = t[1:][:0]  # shape (0, 3), data pointer 12 bytes into the table
    assert cposembed.lookup(t, [], out=empty) is empty
    cposembed.add_positions(empty, t, np.zeros(0, int), out=empty)
    cposembed.add_positions(np.zeros((0, 3), np.float32), t, np.zeros(0, int), out=empty)
    cposembed.scatter_add(t, empty, np.zeros(0, int))
    cposembed.scatter_add(t, empty.reshape(1, 0, 3))
    assert np.all(t == 1)


@pytest.mark.parametrize(
    "which", ["lookup-table", "add-table", "add-tokens", "scatter-grad_output", "scatter-grad"]
)
def test_misaligned_inputs_through_the_public_functions(which):
    def misaligned(a):
        return make_out("misaligned", like=a)

    table = _rng(0).standard_normal((12, 5))
    tok = _rng(1).standard_normal((2, 3, 5))
    if which == "lookup-table":
        _same_bits(cposembed.lookup(misaligned(table), [1, -2]), table[[1, -2]])
    elif which == "add-table":
        _same_bits(cposembed.add_positions(tok, misaligned(table)), tok + table[:3])
    elif which == "add-tokens":
        _same_bits(cposembed.add_positions(misaligned(tok), table), tok + table[:3])
    elif which == "scatter-grad_output":
        got = cposembed.scatter_add(np.zeros((12, 5)), misaligned(tok))
        _same_bits(got, _scatter_expect(np.zeros((12, 5)), tok, np.arange(3), None, -1)[0])
    else:
        grad = misaligned(np.zeros((12, 5)))
        cposembed.scatter_add(grad, tok)
        _same_bits(grad, _scatter_expect(np.zeros((12, 5)), tok, np.arange(3), None, -1)[0])


@pytest.mark.skipif(
    "asan" in os.environ.get("LD_PRELOAD", ""),
    reason="AddressSanitizer holds freed memory in quarantine: RSS grows by design",
)
def test_no_memory_growth_over_many_accepted_declined_and_failing_calls():
    """RSS stays flat over thousands of calls on every route (accepted by the C
    entry, declined and normalised, and refused with an error)."""
    result = run_json(
        """
        import gc, json
        import numpy as np
        import cposembed as c
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096
        t = np.random.rand(64, 16).astype(np.float32)
        m = c.TokenPositionEmbedding(100, 64, 16, seed=0)
        tok = np.ones((2, 40, 16), np.float32)
        ids = np.arange(80).reshape(2, 40)
        ops = [
            lambda: c.lookup(t, list(range(64))),
            lambda: c.lookup(t, [1, 2, 64]),
            lambda: c.lookup(t, np.arange(40)[::-1].astype(">i4")),
            lambda: c.add_positions(tok, t, offset=30),
            lambda: c.scatter_add(np.zeros_like(t), tok, np.arange(40) + 30),
            lambda: m(ids + 50),
            lambda: m([list(range(40)), list(range(60, 100)) + [100]]),
            lambda: m.backward(tok, ids),
            lambda: m.backward(tok, ids, offset=30),
            lambda: c.lookup(t, [1, 2], num_threads=-1),
        ]
        def loop(k):
            for _ in range(k):
                for op in ops:
                    try:
                        op()
                    except Exception:
                        pass
        loop(300)
        gc.collect()
        before = rss()
        loop(3000)
        gc.collect()
        print(json.dumps({"grew": rss() - before}))
        """,
        timeout=120,
    )
    assert result["grew"] < 4 << 20, f"RSS grew by {result['grew']} bytes"


@pytest.mark.parametrize(
    "positions",
    [
        3,
        -1,
        np.int16(-4),
        [[1, -2], [0, 3]],
        np.array([5, 250, 0], np.uint8)[::2],
        np.arange(12, dtype=">i4").reshape(3, 4)[:, 1:] % 6,
        np.ones((1,) * (_core.MAX_POSITION_DIMS + 1), np.int64),  # deeper than the reader
        slice(1, None, 2),
        np.array([True, False] * 3),
        [],
    ],
    ids=repr,
)
def test_routes_read_positions_with_the_entries_reader(positions):
    """The routes' positions are NumPy's rows (wrapped into [0, L)), read by the
    entries' own reader: what it reads directly it gives as the routes do."""
    L = 6
    expect = np.arange(L)[positions]
    got = cposembed._validation.as_positions(positions, L)
    assert got.dtype == np.int64 and got.shape == np.shape(expect)
    assert np.array_equal(got, expect)
    direct = _core.index_rows(positions, L)
    assert direct is None or np.array_equal(direct, got)
    assert _core.index_rows(7, L) is None and _core.index_rows([0, -7], L) is None


@pytest.mark.parametrize("with_positions", [False, True])
@pytest.mark.parametrize("T", [0, 3])
@pytest.mark.parametrize("offset", [0, 1, 2, 3, -1, np.int64(2), 2**63, 2**70, -(2**70)])
def test_entries_and_routes_keep_one_offset_rule(offset, T, with_positions):
    """The entry accepts an offset exactly when the route's check passes it."""
    L = 5
    table = np.arange(L * 2, dtype=np.float32).reshape(L, 2)
    tokens = np.ones((1, T, 2), np.float32)
    positions = np.zeros(T, np.int64) if with_positions else None
    accepted = _core.add(tokens, table, positions, offset, None, None) is not None
    try:
        _routes.check_offset(offset, with_positions, 0 if with_positions else T, L)
    except (ValueError, IndexError):
        assert not accepted
    else:
        assert accepted
    if not with_positions and T == 3 and 0 <= offset <= 2:
        expect = tokens + table[offset : offset + 3]
        assert np.array_equal(cposembed.add_positions(tokens, table, offset=offset), expect)


def test_offset_errors_name_the_rule_they_break():
    table = np.zeros((5, 2), np.float32)
    tokens = np.zeros((1, 3, 2), np.float32)
    with pytest.raises(IndexError, match=r"position 5 \(offset 3 \+ 3 tokens\)"):
        cposembed.add_positions(tokens, table, offset=3)
    with pytest.raises(ValueError, match="only applies with positions=None"):
        cposembed.add_positions(tokens, table, [0, 1, 2], offset=1)
    with pytest.raises(ValueError, match="offset must be a non-negative integer; got -1"):
        cposembed.add_positions(tokens, table, offset=-1)
    with pytest.raises(cposembed.NotAnIntegerError, match="offset must be a non-negative"):
        cposembed.add_positions(tokens, table, offset=1.5)
    # A 0-d integer array is an integer; the route passes it on as one.
    got = cposembed.add_positions(tokens, table, offset=np.array(2))
    assert np.array_equal(got, tokens + table[2:5])


# Outputs and inputs that share memory with the positions, in a child process;
# each body sees OVERLAP_SETUP's buf, pos, pos_copy and table.
OVERLAP_CASES = {
    # lookup(table, pos, out=out) where out shares memory with pos.
    "lookup_out": """
    out = buf[1:].reshape(8, 1)
    expect = np.take(table, pos_copy, axis=0)
    outcome(lambda: cposembed.lookup(table, pos, out=out), expect, [buf, table])
    """,
    # pe(pos, out=out) where out shares memory with pos.
    "class_call_out": """
    pe = LearnedPositionEmbedding.from_pretrained(table, dtype=np.float64)
    out = buf[1:].reshape(8, 1)
    expect = np.take(table, pos_copy, axis=0)
    outcome(lambda: pe(pos, out=out), expect, [buf, pe.embeddings])
    """,
    # add_positions(tok, table, pos, out=out), tok separate, out sharing memory with pos.
    "add_positions_out": """
    tok = np.arange(8.0).reshape(8, 1) + 0.5
    out = buf[1:].reshape(8, 1)
    expect = tok + table[pos_copy]
    outcome(lambda: cposembed.add_positions(tok, table, pos, out=out), expect,
            [buf, table, tok])
    """,
    # add_positions(tok, table, pos, out=tok) where tok shares memory with pos.
    "add_positions_in_place_on_tokens": """
    tok = buf[1:].reshape(8, 1)
    expect = tok.copy() + table[pos_copy]
    outcome(lambda: cposembed.add_positions(tok, table, pos, out=tok), expect,
            [buf, table])
    """,
    # scatter_add(grad, g, pos) where g shares memory with pos (only read, never written).
    "scatter_add_grad_output": """
    grad = np.zeros((4, 1))
    g = buf[1:].reshape(8, 1)
    expect = grad.copy()
    np.add.at(expect, pos_copy, g.copy())
    outcome(lambda: cposembed.scatter_add(grad, g, pos), expect, [buf, grad])
    """,
    # scatter_add(grad, g, pos) where the gradient table shares memory with pos.
    "scatter_add_grad_table": """
    grad = buf[1:5].reshape(4, 1)
    if kind == "mixed":
        pos[:] = [3, 1, 2, 0, 1, 3, 2, 0]  # rows 1..4 of pos are grad's rows 0..3
        pos_copy = pos.copy()
    g = np.arange(1.0, 9.0).reshape(8, 1)
    expect = grad.copy()
    np.add.at(expect, pos_copy, g)
    outcome(lambda: cposembed.scatter_add(grad, g, pos), expect, [buf, g])
    """,
}


@pytest.mark.parametrize("kind", OVERLAP_KINDS)
@pytest.mark.parametrize("case", OVERLAP_CASES)
def test_overlapping_positions_give_numpys_result_or_refuse(case, kind):
    """Each call whose output or input shares memory with its positions gives
    NumPy's result from the positions as they were, or a ValueError."""
    result = overlap_case(kind, OVERLAP_CASES[case])
    assert_numpy_or_refused(result, ("ValueError",), OVERLAP_WORDS)
