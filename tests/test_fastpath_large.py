"""cposembed._fastcall's large-call entries: lookup_into, add_into, scatter_into.

They take the plain, common case of ``lookup(out=)``, ``add_positions(out=)``
with ``positions=None`` and ``scatter_add`` straight into the kernels, and
return the number of threads they ran on; anything else returns 0 with nothing
written, and the full path (``_validation``) handles it. So each entry must be
either exactly the full path's result or a no-op, and the functional API must
route plain calls through it.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import reference_scatter
from hypothesis import given, settings
from hypothesis import strategies as st

import cposembed
from cposembed import _fastcall, _kernels, _threads
from cposembed import functional as F

FLOATS = [np.float32, np.float64]
SERIAL = _threads.SERIAL_THRESHOLD
STREAM = F.STREAM_THRESHOLD_BYTES


def _bits(a):
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


def _rng(seed):
    return np.random.default_rng(seed)


# ------------------------------------------------------------------ lookup


@settings(deadline=None)
@given(
    dtype=st.sampled_from(FLOATS),
    index=st.sampled_from([np.int32, np.int64]),
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    L=st.integers(1, 40),
    d=st.integers(1, 70),
    threads=st.integers(1, 4),
    serial_below=st.sampled_from([0, 1 << 40]),
    stream_bytes=st.sampled_from([0, 1 << 40]),
    seed=st.integers(0, 2**16),
)
def test_lookup_into_is_table_indexing(
    dtype, index, shape, L, d, threads, serial_below, stream_bytes, seed
):
    rng = _rng(seed)
    table = rng.standard_normal((L, d)).astype(dtype)
    pos = rng.integers(-L, L, size=shape).astype(index)
    out = np.full(tuple(shape) + (d,), np.nan, dtype)
    used = _fastcall.lookup_into(table, pos, out, threads, serial_below, stream_bytes)
    assert used >= 1
    assert used == (1 if serial_below else min(threads, pos.size))
    assert np.array_equal(_bits(out), _bits(table[pos]))


def _refused(entry, *args):
    """``entry(*args)`` declines (returns 0) and leaves every array argument as it was."""
    arrays = [a for a in args if isinstance(a, np.ndarray)]
    before = [a.copy() for a in arrays]
    assert entry(*args) == 0
    for a, b in zip(arrays, before):
        assert np.array_equal(a, b, equal_nan=True)


def _lookup_refused(table, pos, out):
    _refused(_fastcall.lookup_into, table, pos, out, 2, 0, STREAM)


@pytest.mark.parametrize("dtype", FLOATS)
def test_lookup_into_refuses_all_but_the_plain_case(dtype):
    rng = _rng(1)
    table = rng.standard_normal((10, 6)).astype(dtype)
    pos = rng.integers(0, 10, size=(3, 4))
    out = np.zeros((3, 4, 6), dtype)
    _lookup_refused(table, pos + 10, out)  # out of range
    _lookup_refused(table, pos - 20, out)
    _lookup_refused(table, pos.astype(np.int16), out)  # other index dtypes
    _lookup_refused(table, pos.astype(np.uint64), out)
    _lookup_refused(table, pos.astype(">i8"), out)  # byte-swapped
    _lookup_refused(table, pos.T, np.zeros((4, 3, 6), dtype))  # not C-contiguous
    _lookup_refused(table, np.int64(3), np.zeros(6, dtype))  # 0-d
    _lookup_refused(table, pos[:0], np.zeros((0, 4, 6), dtype))  # empty
    _lookup_refused(table, pos.tolist(), out)  # not an ndarray
    _lookup_refused(
        table, pos, np.zeros((3, 4, 6), np.float16 if dtype == np.float32 else np.float32)
    )
    _lookup_refused(table, pos, np.zeros((3, 4, 7), dtype))  # shape
    _lookup_refused(table, pos, np.zeros((12, 6), dtype))
    _lookup_refused(table, pos, np.zeros((3, 4, 12), dtype)[..., ::2])  # strided
    readonly = np.zeros((3, 4, 6), dtype)
    readonly.flags.writeable = False
    _lookup_refused(table, pos, readonly)
    _lookup_refused(table.astype(table.dtype.newbyteorder()), pos, out)
    _lookup_refused(table.tolist(), pos, out)
    # out overlapping the table or the positions
    big = np.zeros(10 * 6 + 3 * 4 * 6, dtype)
    t_view = big[: 10 * 6].reshape(10, 6)
    t_view[:] = table
    _lookup_refused(t_view, pos, big[30 : 30 + 72].reshape(3, 4, 6))
    raw = np.zeros(3 * 4 * 6 * 8 + 12 * 8, np.uint8)
    p_view = raw[:96].view(np.int64).reshape(3, 4)
    p_view[:] = pos
    o_view = raw[48 : 48 + 3 * 4 * 6 * np.dtype(dtype).itemsize].view(dtype).reshape(3, 4, 6)
    _lookup_refused(table, p_view, o_view)


def test_lookup_out_of_range_still_raises_ours_and_writes_nothing():
    table = np.ones((8, 4), np.float32)
    out = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(IndexError, match="position 8 is out of range"):
        cposembed.lookup(table, np.array([[0, 1, 2], [3, 4, 8]]), out=out)
    assert not out.any()


# -------------------------------------------------------------------- add


@settings(deadline=None)
@given(
    dtype=st.sampled_from(FLOATS),
    lead=st.lists(st.integers(1, 6), min_size=0, max_size=2),
    T=st.integers(1, 12),
    L=st.integers(12, 30),
    d=st.integers(1, 70),
    in_place=st.booleans(),
    offset_frac=st.floats(0, 1),
    threads=st.integers(1, 4),
    serial_below=st.sampled_from([0, 1 << 40]),
    stream_bytes=st.sampled_from([0, 1 << 40]),
    seed=st.integers(0, 2**16),
)
def test_add_into_is_tokens_plus_rows(
    dtype, lead, T, L, d, in_place, offset_frac, threads, serial_below, stream_bytes, seed
):
    rng = _rng(seed)
    table = rng.standard_normal((L, d)).astype(dtype)
    tok = rng.standard_normal(tuple(lead) + (T, d)).astype(dtype)
    offset = int(offset_frac * (L - T))
    expect = tok + table[offset : offset + T]
    out = tok if in_place else np.full_like(tok, np.nan)
    used = _fastcall.add_into(tok, table, offset, out, threads, serial_below, stream_bytes)
    n = tok.size // d
    assert used == (1 if serial_below else min(threads, n))
    assert np.array_equal(_bits(out), _bits(expect))


def _add_refused(tok, table, offset, out):
    _refused(_fastcall.add_into, tok, table, offset, out, 2, 0, STREAM)


@pytest.mark.parametrize("dtype", FLOATS)
def test_add_into_refuses_all_but_the_plain_case(dtype):
    rng = _rng(2)
    table = rng.standard_normal((10, 6)).astype(dtype)
    tok = rng.standard_normal((2, 4, 6)).astype(dtype)
    out = np.zeros_like(tok)
    for bad_offset in (-1, 7, True, 1.0, np.int64(1), None, 2**70):
        _add_refused(tok, table, bad_offset, out)
    other = np.float32 if dtype == np.float64 else np.float64
    _add_refused(tok.astype(other), table, 0, np.zeros(tok.shape, other))  # promotion
    _add_refused(tok, table, 0, np.zeros(tok.shape, other))
    _add_refused(tok[:, ::-1], table, 0, out)  # not C-contiguous tokens
    _add_refused(tok, table, 0, np.zeros((2, 4, 12), dtype)[..., ::2])
    _add_refused(tok[0, 0], table, 0, out[0, 0])  # 1-D: (T, d) needed
    _add_refused(tok[:, :0], table, 0, out[:, :0])  # T == 0
    _add_refused(tok, table, 0, np.zeros((2, 4, 7), dtype))
    _add_refused(tok, table, 0, np.zeros((8, 6), dtype))
    readonly = np.zeros_like(tok)
    readonly.flags.writeable = False
    _add_refused(tok, table, 0, readonly)
    _add_refused(tok.tolist(), table, 0, out)
    _add_refused(tok, table, 0, out.tolist())
    # out overlapping the tokens without being them; anything on the table
    buf = np.zeros(2 * 4 * 6 + 6, dtype)
    a = buf[:48].reshape(2, 4, 6)
    a[:] = tok
    _add_refused(a, table, 0, buf[6:].reshape(2, 4, 6))
    tbuf = np.zeros(10 * 6 + 48, dtype)
    tv = tbuf[:60].reshape(10, 6)
    tv[:] = table
    _add_refused(tok, tv, 0, tbuf[54 : 54 + 48].reshape(2, 4, 6))
    _add_refused(tbuf[12 : 12 + 48].reshape(2, 4, 6), tv, 0, out)


@pytest.mark.parametrize("dtype", FLOATS)
def test_add_in_place_through_the_fast_path(dtype):
    rng = _rng(3)
    table = rng.standard_normal((64, 32)).astype(dtype)
    tok = rng.standard_normal((8, 40, 32)).astype(dtype)
    expect = tok + table[5:45]
    got = cposembed.add_positions(tok, table, offset=5, out=tok)
    assert got is tok
    assert np.array_equal(_bits(tok), _bits(expect))


# ------------------------------------------------------------- scatter-add


@settings(deadline=None)
@given(
    dtype=st.sampled_from(FLOATS),
    index=st.sampled_from([np.int32, np.int64]),
    kind=st.sampled_from(["none", "random", "repeating", "arange_rows", "one_row"]),
    B=st.integers(1, 5),
    T=st.integers(1, 12),
    L=st.integers(12, 40),
    d=st.integers(1, 40),
    threads=st.integers(1, 4),
    serial_below=st.sampled_from([0, 1 << 40]),
    seed=st.integers(0, 2**16),
)
def test_scatter_into_is_bitwise_np_add_at(
    dtype, index, kind, B, T, L, d, threads, serial_below, seed
):
    rng = _rng(seed)
    g = rng.standard_normal((B, T, d)).astype(dtype)
    grad0 = rng.standard_normal((L, d)).astype(dtype)
    offset = 0
    if kind == "none":
        positions = None
        offset = int(rng.integers(0, L - T + 1))
        pos = np.broadcast_to(np.arange(offset, offset + T), (B, T))
    elif kind == "random":
        pos = positions = rng.integers(-L, L, size=(B, T)).astype(index)
    elif kind == "repeating":
        pos = positions = np.tile(rng.integers(-L, L, size=T), (B, 1)).astype(index)
    elif kind == "arange_rows":
        pos = positions = np.tile(np.arange(T), (B, 1)).astype(index)
    else:
        pos = positions = np.full((B, T), 3, index)
    expect = reference_scatter(grad0, g, pos)
    grad = grad0.copy()
    used = _fastcall.scatter_into(grad, g, positions, offset, threads, serial_below)
    assert used >= 1
    if serial_below:
        assert used == 1
    assert np.array_equal(_bits(grad), _bits(expect))


def _scatter_refused(grad, g, positions, offset=0):
    _refused(_fastcall.scatter_into, grad, g, positions, offset, 2, 0)


@pytest.mark.parametrize("dtype", FLOATS)
def test_scatter_into_refuses_all_but_the_plain_case(dtype):
    rng = _rng(4)
    grad = rng.standard_normal((10, 6)).astype(dtype)
    g = rng.standard_normal((2, 4, 6)).astype(dtype)
    pos = rng.integers(0, 10, size=(2, 4))
    _scatter_refused(grad, g, pos + 10)  # out of range
    _scatter_refused(grad, g, pos, offset=1)  # offset only with positions=None
    _scatter_refused(grad, g, pos[0])  # broadcasting: the full path's job
    _scatter_refused(grad, g, pos.astype(np.uint8))
    _scatter_refused(grad, g, pos.tolist())
    _scatter_refused(grad, g, None, offset=7)  # offset + T > L
    _scatter_refused(grad, g, None, offset=-1)
    _scatter_refused(grad, g, None, offset=False)
    _scatter_refused(grad, g[0, 0], None)  # 1-D gradient with positions=None
    _scatter_refused(grad, g.astype(np.float16), None)
    _scatter_refused(grad, g[:, ::-1], None)
    _scatter_refused(grad, g.tolist(), None)
    _scatter_refused(grad, g[:, :, :5], None)
    _scatter_refused(grad[:, :5], g[:, :, :5].copy(), None)  # non-contiguous grad
    readonly = grad.copy()
    readonly.flags.writeable = False
    _scatter_refused(readonly, g, None)
    # the gradient or the positions overlapping the table
    buf = np.zeros(60 + 48, dtype)
    gv = buf[:60].reshape(10, 6)
    _scatter_refused(gv, buf[30 : 30 + 48].reshape(2, 4, 6), None)
    raw = np.zeros(60 * 8, np.uint8)
    tv = raw.view(dtype)[:60].reshape(10, 6)
    _scatter_refused(tv, g, raw[:64].view(np.int64).reshape(2, 4))


# ---------------------------------------------------------------- wiring


@pytest.fixture
def no_python_kernels(monkeypatch):
    """The full path's kernel entry points raise: only the fast path can work."""

    def refuse(*args, **kwargs):
        raise AssertionError("the full path ran")

    for name in ("lookup_rows", "add_rows", "scatter_add_rows", "index_bounds"):
        monkeypatch.setattr(_kernels, name, refuse)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("threads", [None, 1, 2, 3])
def test_plain_calls_take_the_fast_path(no_python_kernels, dtype, threads):
    rng = _rng(5)
    L, d, B, T = 256, 48, 8, 200
    assert B * T * d > SERIAL
    table = rng.standard_normal((L, d)).astype(dtype)
    pos = rng.integers(-L, L, size=(B, T))
    out = np.empty((B, T, d), dtype)
    assert cposembed.lookup(table, pos, out=out, num_threads=threads) is out
    assert np.array_equal(out, table[pos])
    tok = rng.standard_normal((B, T, d)).astype(dtype)
    got = cposembed.add_positions(tok, table, offset=3, out=out, num_threads=threads)
    assert got is out and np.array_equal(out, tok + table[3 : 3 + T])
    for positions in (None, pos, np.tile(np.arange(T), (B, 1))):
        grad = np.zeros((L, d), dtype)
        want = reference_scatter(
            np.zeros((L, d), dtype), tok, np.arange(T) if positions is None else positions
        )
        F.scatter_add(grad, tok, positions, num_threads=threads)
        assert np.array_equal(_bits(grad), _bits(want))


def test_other_calls_still_take_the_full_path(monkeypatch):
    calls = []
    real = _kernels.lookup_rows

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_kernels, "lookup_rows", spy)
    table = np.ones((8, 4), np.float32)
    out = np.zeros((6, 4), np.float32)
    cposembed.lookup(table, [0, 1, 2, 3, 4, 5], out=out)  # a list: full path
    cposembed.lookup(table, np.arange(6, dtype=np.int16), out=out)
    assert len(calls) == 2 and np.all(out == 1)


def test_bad_num_threads_is_worded_by_the_full_path():
    table = np.ones((8, 4), np.float32)
    out = np.zeros((2, 4), np.float32)
    for bad in (0, -2, True, 2.0):
        with pytest.raises((TypeError, ValueError), match="num_threads"):
            cposembed.lookup(table, np.array([0, 1]), out=out, num_threads=bad)
    assert not out.any()
