"""add_positions and add_to: against NumPy, in place, ``out=`` aliasing and overlap,
and the C entry's plain case."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    FLOAT_TYPES,
    _deep,
    _rows_for,
    _sizes,
    _table,
    assert_same,
    make_out,
    needs_numpy2,
    run_child,
    tuned,
)
from hypothesis import assume, event, given, note
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from plain import (
    FLOATS,
    HUGE,
    PLAIN_THREADS,
    THREADS,
    Snapshot,
    _array_form,
    _declined,
    _default_rows,
    _disjoint,
    _entry_case,
    _expected_team,
    _explicit_rows,
    _fresh,
    _lead_and_positions,
    _mark_team,
    _pick,
    _plain,
    _plain_table,
    _rng,
    _same_bits,
    _threads_ok,
)
from strategies import (
    CLEAR_ERRORS,
    SIZED_INT_DTYPES,
    _bits,
    float_values,
    index_arrays,
    numpy_or_error,
    row_arrays,
    same_values,
    tables,
)

import cposembed
from cposembed import LearnedPositionEmbedding, _core


# -- masked arrays -----------------------------------------------------------------
@pytest.mark.parametrize("positions", ["None", "[[0, 2, 1]]"], ids=["default", "explicit"])
def test_add_to_masked_array_keeps_the_mask_or_refuses(positions):
    """pe.add_to(masked array): a masked result with NumPy's mask, or TypeError."""
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


@given(data=st.data())
def test_add_entry_accepts_exactly_the_plain_case(data):
    plain, L, d, dtype, rng, table = _entry_case(data)
    lead, positions, offset = _lead_and_positions(data, L, plain)
    tok = rng.standard_normal(lead + (d,)).astype(dtype)
    tok_kind = _pick(
        data.draw,
        ["plain"],
        ["dtype", "float16", "int", "swapped", "strided", "subclass", "unaligned", "readonly"]
        + ["list", "wrong_d", "on_table"],
        plain=plain,
    )
    if tok_kind == "wrong_d":
        tok = np.ones(lead + (d + 1,), dtype)
    elif tok_kind == "on_table" and _plain_table(table) and tok.size:
        # Tokens that are the table's own memory: read only, so that is fine...
        buf = np.zeros(table.size + tok.size, dtype)
        buf[...] = rng.standard_normal(buf.size)
        table = buf[: table.size].reshape(table.shape)
        tok = buf[data.draw(st.integers(0, table.size)) :][: tok.size].reshape(tok.shape)
    else:
        tok = _array_form(tok, tok_kind)
    out_kind = _pick(
        data.draw,
        ["none", "plain", "tokens"],
        ["dtype", "shape", "readonly", "strided", "subclass", "on_tokens", "on_table"],
        plain=plain,
    )
    shape = np.shape(tok)
    out = None
    if out_kind == "plain":
        out = make_out("plain", shape, dtype, fill=-3)
    elif out_kind == "tokens":
        out = tok
    elif out_kind == "dtype":
        out = make_out("wrong_dtype", shape, dtype)
    elif out_kind == "shape":
        out = np.zeros(shape + (1,), dtype)
    elif out_kind == "readonly":
        out = make_out("read_only", shape, dtype)
    elif out_kind == "strided" and len(shape) >= 1:
        out = make_out("strided", shape, dtype)
    elif out_kind == "subclass":
        out = make_out("subclass", shape, dtype)
    elif out_kind in ("on_tokens", "on_table") and _plain(tok, dtype) and tok.size:
        # ...but no output may share memory with what the call reads.
        host = tok if out_kind == "on_tokens" else table
        if isinstance(host, np.ndarray) and host.size and _plain(host):
            buf = np.zeros(host.size + tok.size, dtype)
            view = buf[: host.size].reshape(host.shape)
            view[...] = host
            if out_kind == "on_tokens":
                tok = view
            else:
                table = view
            start = data.draw(st.integers(0, host.size - 1))
            out = buf[start : start + tok.size].reshape(tok.shape)
    num_threads = data.draw(PLAIN_THREADS if plain else THREADS, label="num_threads")
    serial_below = data.draw(st.sampled_from([None, 0]))

    if positions is None:
        rows = _default_rows(lead, offset, L) if _plain_table(table) else None
    else:
        rows = _explicit_rows(positions, offset, lead, L) if _plain_table(table) else None
    in_place = out is tok
    accept = (
        rows is not None
        and _plain(tok, table.dtype)
        and tok.ndim >= 1
        and tok.shape[-1] == d
        and _threads_ok(num_threads)
        and (
            out is None
            or (in_place and tok.flags.writeable and _disjoint(tok, table))
            or (
                not in_place
                and _plain(out, table.dtype)
                and out.flags.writeable
                and out.shape == tok.shape
                and _disjoint(out, table)
                and _disjoint(out, tok)
            )
        )
    )
    expect = None
    if accept:
        expect = tok + table[rows]
    event("accepted" if accept else "declined")
    snap = Snapshot(table, tok, positions, out)
    with tuned(serial_below=serial_below):
        team = 0
        if accept:
            n = int(np.prod(lead))
            team = _expected_team(num_threads, n * d, n)
            _mark_team(avoid=team)
        result = _core.add(tok, table, positions, offset, out, num_threads)
        if not accept:
            _declined(result, snap)
            return
        assert result is not None, "the entry declined a plain call"
        assert _core.last_team() == team
    snap.unchanged(but=(out,))
    _same_bits(result, expect)
    if out is None:
        _fresh(result, table, tok)
    else:
        assert result is out


@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data())
def test_add_entry_special_values_and_decode_steps(dtype, data):
    L, D = 12, 5
    table = _rng(0).standard_normal((L, D)).astype(dtype)
    table[0, 0] = -0.0
    table[1, :] = [np.inf, -np.inf, np.nan, 0.0, np.finfo(dtype).tiny / 4]
    shapes = [(1, 1, D), (2, 3, D), (5, D), (4, 1, D), (1, 0, D), (0, 2, D), (2, 1, 1, D)]
    shapes.append(data.draw(hnp.array_shapes(min_dims=2, max_dims=4, max_side=4))[:-1] + (D,))
    for shape in shapes:
        floats = st.floats(width=dtype.itemsize * 8)
        tok = data.draw(hnp.arrays(dtype, shape, elements=floats))
        T = shape[-2]
        for offset in (0, 1, L - T) + ((HUGE, 2**70) if T == 0 else ()):
            with np.errstate(invalid="ignore", over="ignore"):  # inf - inf
                expect = tok + table[offset : offset + T]
            got = _core.add(tok, table, None, offset, None, None)
            assert got.dtype == expect.dtype and got.shape == expect.shape
            assert np.array_equal(got, expect, equal_nan=True)
            nan = np.isnan(expect)
            _same_bits(got[~nan], expect[~nan])  # NaN payloads may differ by operand order
            _fresh(got, tok, table)
            if T and offset + T <= L:  # the class's decode step: the same entry
                pe = cposembed.LearnedPositionEmbedding.from_pretrained(table, dtype=dtype)
                assert np.array_equal(pe.add_to(tok, offset=offset), expect, equal_nan=True)
        bad = (-1, -(2**70), True, 0.0, None, np.float64(0), np.bool_(False))
        for bad_offset in bad + ((L - T + 1, HUGE + 1, 2**70) if T else ()):
            snap = Snapshot(tok, table)
            _declined(_core.add(tok, table, None, bad_offset, None, None), snap)


@pytest.mark.parametrize("dtype", FLOATS)
def test_add_in_place_through_the_entry(dtype):
    rng = _rng(3)
    table = rng.standard_normal((64, 32)).astype(dtype)
    tok = rng.standard_normal((8, 40, 32)).astype(dtype)
    expect = tok + table[5:45]
    got = cposembed.add_positions(tok, table, offset=5, out=tok)
    assert got is tok
    _same_bits(tok, expect)
    tok = rng.standard_normal((8, 40, 32)).astype(dtype)
    pos = rng.integers(-64, 64, size=40).astype(np.int16)
    expect = tok + table[pos]
    assert _core.add(tok, table, pos, 0, tok, 2) is tok
    _same_bits(tok, expect)


# ---------------------------------------------------------------- add
@pytest.mark.parametrize("dtype", FLOAT_TYPES)
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("offset", [0, 5])
def test_add_default_positions(dtype, which, offset):
    d = 64
    n_rows = 300
    T = 50
    B = max(1, _rows_for(_sizes()[which], d) // T)
    table = _table(n_rows, d, dtype)
    tok = _table(B * T, d, dtype, seed=2).reshape(B, T, d)
    expected = tok + table[offset + np.arange(T)]
    for threads in (1, 2, 4):
        got = cposembed.add_positions(tok, table, offset=offset, num_threads=threads)
        assert got.dtype == expected.dtype
        assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize(
    "tok_shape, pos_shape",
    [
        ((4, 6, 8), (6,)),
        ((4, 6, 8), (4, 6)),
        ((4, 6, 8), (1, 6)),
        ((4, 6, 8), (4, 1)),
        ((4, 6, 8), ()),
        ((6, 8), (6,)),
        ((2, 3, 6, 8), (3, 6)),
        ((2, 3, 6, 8), (2, 1, 6)),
        ((8,), ()),
        ((0, 6, 8), (6,)),
    ],
)
def test_add_explicit_positions_broadcast(tok_shape, pos_shape):
    table = _table(20, 8, np.float32)
    rng = np.random.RandomState(3)
    tok = rng.randn(*tok_shape).astype(np.float32)
    positions = rng.randint(-20, 20, size=pos_shape)
    expected = tok + table[positions]
    got = cposembed.add_positions(tok, table, positions)
    assert got.shape == expected.shape
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize(
    "tok_dtype", [np.float16, np.float32, np.float64, np.int8, np.int32, np.uint16, np.bool_]
)
@pytest.mark.parametrize("table_dtype", FLOAT_TYPES)
def test_add_result_dtype_follows_numpy(tok_dtype, table_dtype):
    table = _table(10, 4, table_dtype)
    tok = (np.random.RandomState(4).randn(2, 5, 4) * 3).astype(tok_dtype)
    expected = tok + table[np.arange(5)]
    got = cposembed.add_positions(tok, table)
    assert got.dtype == expected.dtype
    assert got.tobytes() == expected.tobytes()


def test_add_in_place_and_layouts():
    table = _table(16, 8, np.float32)
    tok = _table(32, 8, np.float32, seed=5).reshape(2, 16, 8)
    expected = tok + table[np.arange(16)]
    res = cposembed.add_positions(tok, table, out=tok)
    assert res is tok
    assert tok.tobytes() == expected.tobytes()
    # Non-contiguous and Fortran tokens, non-contiguous out.
    base = _table(64, 8, np.float32, seed=6).reshape(2, 32, 8)
    view = base[:, ::2]
    expected = view + table[np.arange(16)]
    np.testing.assert_array_equal(cposembed.add_positions(view, table), expected)
    np.testing.assert_array_equal(cposembed.add_positions(np.asfortranarray(view), table), expected)
    cposembed.add_positions(view, table, out=view)
    np.testing.assert_array_equal(view, expected)


def test_add_out_partially_overlapping_tokens_matches_numpy():
    table = _table(8, 4, np.float64)
    buf = _table(10, 4, np.float64, seed=7)
    tok = buf[:8]
    expected = tok + table[np.arange(8)]
    cposembed.add_positions(tok[None], table, out=buf[2:10][None])
    np.testing.assert_array_equal(buf[2:10], expected)


def test_add_tokens_are_the_table():
    # add_to(table, out=table): each row reads rows the call also writes.
    table = _table(8, 4, np.float64)
    positions = np.array([7, 6, 5, 4, 3, 2, 1, 0])
    expected = table + table[positions]
    cposembed.add_positions(table, table, positions, out=table)
    np.testing.assert_array_equal(table, expected)


def test_add_zero_tokens_checks_nothing():
    table = _table(8, 4, np.float32)
    tok = np.zeros((3, 0, 4), np.float32)
    assert cposembed.add_positions(tok, table, offset=100).shape == (3, 0, 4)


@given(table=tables(), data=st.data())
def test_add_positions_any_tokens_matches_numpy(table, data):
    L, d = table.shape
    lead = tuple(data.draw(st.lists(st.integers(0, 4), min_size=0, max_size=3), label="lead"))
    tokens = data.draw(row_arrays(lead, d), label="tokens")
    explicit = data.draw(st.booleans())
    tok_before, table_before = _bits(tokens), _bits(table)
    if explicit:
        pshape = tuple(data.draw(st.lists(st.integers(0, 4), max_size=3), label="pshape"))
        if data.draw(st.booleans()) and lead:
            pshape = lead[len(lead) - data.draw(st.integers(0, len(lead))) :]
        positions = data.draw(index_arrays(L, shape=pshape), label="positions")
        offset = 0

        def reference():
            result = tokens + table[positions]
            if result.shape != tokens.shape:  # positions must broadcast to tokens
                raise ValueError("does not broadcast")
            return result
    else:
        positions = None
        offset = data.draw(st.integers(0, L + 1), label="offset")

        def reference():
            if not lead:
                raise ValueError("1-D tokens")
            T = lead[-1]
            if T and offset + T > L:
                raise IndexError("out of range")
            return tokens + table[offset : offset + T]

    want, ref_exc = numpy_or_error(reference)
    real = tokens.dtype.kind in "biuf"
    if ref_exc is None and real:
        got = cposembed.add_positions(tokens, table, positions, offset=offset)
        assert same_values(got, want), (got, want)
    else:
        with pytest.raises(CLEAR_ERRORS):
            cposembed.add_positions(tokens, table, positions, offset=offset)
    assert _bits(tokens) == tok_before and _bits(table) == table_before


@given(table=tables(), data=st.data())
def test_add_positions_out_alias_and_overlap(table, data):
    """``out`` is tokens itself, a partial overlap of tokens, or the table: the
    result is NumPy's copy-inputs-first result, or a clear error with nothing written."""
    L, d = table.shape
    B = data.draw(st.integers(1, 3))
    T = data.draw(st.integers(1, L))
    base = data.draw(float_values((B * T + 2, d), table.dtype))
    shift = data.draw(st.integers(0, 2))
    tokens = base[: B * T].reshape(B, T, d)
    mode = data.draw(st.sampled_from(["inplace", "shifted", "reversed", "table", "fresh-strided"]))
    note(f"mode {mode}, shift {shift}")
    work_table = table.copy()
    if mode == "inplace":
        out = tokens
    elif mode == "shifted":
        out = base[shift : shift + B * T].reshape(B, T, d)
    elif mode == "reversed":
        out = tokens[::-1]
    elif mode == "table":
        assume(B * T * d <= work_table.size and d > 0)
        out = work_table.reshape(-1)[: B * T * d].reshape(B, T, d)
    else:
        out = np.zeros((B, T, 2 * d), dtype=table.dtype)[..., ::2]
    positions = data.draw(
        st.one_of(st.none(), index_arrays(L, shape=(T,), dtypes=st.sampled_from(SIZED_INT_DTYPES)))
    )
    if positions is not None:
        assume(
            positions.size == 0
            or (positions.astype(np.int64).min() >= -L and positions.astype(np.int64).max() < L)
        )
    pos = np.arange(T) if positions is None else positions
    with np.errstate(all="ignore"):
        want = tokens.copy() + work_table.copy()[pos]  # inputs copied first, as NumPy does
    out_before = _bits(out)
    try:
        got = cposembed.add_positions(tokens, work_table, positions, out=out)
    except CLEAR_ERRORS:
        assert _bits(out) == out_before
        return
    assert got is out
    assert same_values(out, want)


@needs_numpy2
@pytest.mark.parametrize("nd", [32, 33])
@pytest.mark.parametrize("via", ["function", "class"])
def test_add_positions_with_positions_of_32_or_more_axes(nd, via):
    rng = np.random.RandomState(0)
    table = rng.randn(5, 3).astype(np.float32)
    pos = np.array([4, 0, -1]).reshape(_deep(nd, 3))
    tok = rng.randn(*pos.shape, 3).astype(np.float32)
    expect = tok + table[pos]
    if via == "function":
        got = cposembed.add_positions(tok, table, pos)
    else:
        got = LearnedPositionEmbedding.from_pretrained(table).add_to(tok, pos)
    assert_same(got, expect)
