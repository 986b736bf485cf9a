"""float16 and bfloat16 in the functional operations (lookup, add_positions,
scatter_add, embed, embed_backward): bitwise NumPy's answer (with ml_dtypes) at
every pair of the four float dtypes, on both sides of the serial threshold, on
1-4 threads; the issue's facts; every bit pattern of the half dtypes; nothing
written on error."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from half_oracle import (
    PAIRS,
    assert_bitwise,
    no_common_type,
    numpy_add,
    numpy_add_at,
    pair_id,
    uint_bits,
    unchanged,
)
from helpers import _sizes, tuned
from hypothesis import given, note, settings
from hypothesis import strategies as st
from strategies import BFLOAT16, TABLE_DTYPES, edge_values, layout

import cposembed

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
HALVES = [F16, BFLOAT16]
HALF_IDS = ["float16", "bfloat16"]
DTYPE_IDS = [dt.name for dt in TABLE_DTYPES]
PAIR_IDS = [pair_id(p) for p in PAIRS]
THREADS = st.sampled_from([None, 1, 2, 3, 4])
# serial_below: the default rule (tiny calls on one thread), or threads for any size.
SIDES = st.sampled_from([None, 0])
INDEX_DTYPES = st.sampled_from([np.int64, np.int32, np.int16, np.intp])
# The properties run once per dtype pair (16 times): each takes a share of the
# profile's examples (40 of ci's 100, 2,000 of slow's 5,000).
PER_PAIR = settings(max_examples=max(10, settings.default.max_examples * 2 // 5))
# Row widths: short rows (the scalar tails) and rows of several 8-lane blocks.
WIDTHS = st.one_of(st.integers(0, 6), st.integers(7, 40))
# The TypeError of float16 with bfloat16 names both.
MIXED_HALVES = "float16.*bfloat16|bfloat16.*float16"


# ------------------------------------------------------------------ strategies
@st.composite
def positions_for(draw, n_rows: int, lead: tuple[int, ...]):
    """(positions, offset, rows): the call's arguments and the rows they mean.
    Default positions (an offset), explicit positions of the leading shape (with
    duplicates and negatives), or one row of them broadcast, sometimes as a list."""
    T = lead[-1] if lead else 0
    modes = ["explicit", "row"]
    if lead and T <= n_rows:
        modes += ["default"]
    mode = draw(st.sampled_from(modes))
    note(f"positions {mode}")
    if mode == "default":
        offset = draw(st.integers(0, n_rows - T))
        return None, offset, np.arange(offset, offset + T)
    shape = lead if mode == "explicit" else lead[-1:]
    size = int(np.prod(shape))
    values = draw(st.lists(st.integers(-n_rows, n_rows - 1), min_size=size, max_size=size))
    rows = np.array(values, dtype=np.int64).reshape(shape)
    positions = rows.astype(draw(INDEX_DTYPES))
    if size and draw(st.integers(0, 4)) == 0:
        positions = positions.tolist()
    return positions, 0, rows


@st.composite
def table_and_rows(draw, table_dtype, rows_dtype):
    """(table, rows, positions, offset, table rows): an (L, d) table and a
    (*lead, d) array of rows (tokens or grad_output) with their positions."""
    L = draw(st.integers(1, 8), label="L")
    d = draw(WIDTHS, label="d")
    table = draw(edge_values((L, d), table_dtype), label="table")
    lead = _lead(draw)
    rows_array = draw(edge_values(lead + (d,), rows_dtype), label="rows")
    return (table, rows_array, *draw(positions_for(L, lead)))


def _lead(draw, max_dims: int = 3) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(0, 4), min_size=1, max_size=max_dims)))


def _fresh_out(draw, shape, dtype) -> np.ndarray:
    """An ``out=`` array filled with any bits (so that a skipped element shows)."""
    return draw(edge_values(shape, dtype))


def _forward_agrees(call, side, *, refusal, out, want, arrays, read) -> None:
    """``call()`` (on the ``side`` of the serial threshold) raises a TypeError
    matching ``refusal`` with every array of ``arrays`` unchanged, or (refusal
    None) returns ``want``'s bits, in ``out`` when given, with ``read`` unchanged."""
    kept = unchanged(*arrays) if refusal else unchanged(*read)
    with tuned(serial_below=side):
        if refusal:
            with pytest.raises(TypeError, match=refusal):
                call()
            kept()
            return
        got = call()
    if out is not None:
        assert got is out
    assert_bitwise(got, *want)
    kept()


# ----------------------------------------------------------------------- lookup
@pytest.mark.parametrize("dtype", TABLE_DTYPES, ids=DTYPE_IDS)
@given(data=st.data(), threads=THREADS, side=SIDES)
def test_lookup_is_the_table_indexed_bitwise(dtype, data, threads, side):
    L = data.draw(st.integers(1, 8), label="L")
    d = data.draw(WIDTHS, label="d")
    table = data.draw(layout(data.draw(edge_values((L, d), dtype))), label="table")
    lead = _lead(data.draw)
    positions, _, rows = data.draw(positions_for(L, lead))
    if positions is None:
        positions = rows
    want = table[rows]
    table_kept = unchanged(table)
    with tuned(serial_below=side):
        assert_bitwise(cposembed.lookup(table, positions, num_threads=threads), want)
        out = _fresh_out(data.draw, want.shape, dtype)
        assert cposembed.lookup(table, positions, out=out, num_threads=threads) is out
    assert_bitwise(out, want)
    table_kept()


# ------------------------------------------------------------------------- add
@pytest.mark.parametrize("tok_dtype,table_dtype", PAIRS, ids=PAIR_IDS)
@PER_PAIR
@given(data=st.data(), threads=THREADS, side=SIDES)
def test_add_positions_is_numpy_bitwise(tok_dtype, table_dtype, data, threads, side):
    """``tokens + table[positions]`` in NumPy's result dtype, each element rounded
    once; float16 with bfloat16 a TypeError; out= fresh or the tokens themselves."""
    table, tokens, positions, offset, rows = data.draw(table_and_rows(table_dtype, tok_dtype))
    lead, d = tokens.shape[:-1], table.shape[1]
    out_kind = data.draw(st.sampled_from(["none", "fresh", "tokens"]))
    note(f"out {out_kind}")
    table = data.draw(layout(table), label="table layout")
    tokens = data.draw(layout(tokens, writable=out_kind == "tokens"), label="tokens layout")
    refused = no_common_type(tok_dtype, table_dtype)
    if not refused:
        want, nan_pairs = numpy_add(tokens, table, rows)
        # out=tokens takes only a result of the tokens' dtype (out is never cast).
        refused = out_kind == "tokens" and want.dtype != tokens.dtype
    if out_kind == "fresh":
        out_dtype = tok_dtype if refused else want.dtype
        out = _fresh_out(data.draw, lead + (d,), out_dtype)
    else:
        out = tokens if out_kind == "tokens" else None
    mixed = no_common_type(tok_dtype, table_dtype)
    _forward_agrees(
        lambda: cposembed.add_positions(
            tokens, table, positions, offset=offset, out=out, num_threads=threads
        ),
        side,
        refusal=(MIXED_HALVES if mixed else "dtype") if refused else None,
        out=out,
        want=None if refused else (want, nan_pairs),
        arrays=(tokens, table, out),
        read=(table,) if out is tokens else (tokens, table),
    )


# ------------------------------------------------------------------ scatter_add
@pytest.mark.parametrize("grad_dtype,g_dtype", PAIRS, ids=PAIR_IDS)
@PER_PAIR
@given(data=st.data(), threads=THREADS, side=SIDES)
def test_scatter_add_is_np_add_at_bitwise(grad_dtype, g_dtype, data, threads, side):
    """grad_output of any of the four dtypes into a table of any of the four:
    ``np.add.at``'s bits (computed in float64 if either is float64, else in float32,
    rounded after each add); float16 with bfloat16 that or a TypeError."""
    grad, g, positions, offset, rows = data.draw(table_and_rows(grad_dtype, g_dtype))
    grad = data.draw(layout(grad, writable=True), label="grad layout")
    g = data.draw(layout(g), label="grad_output layout")
    want, nan_pairs = numpy_add_at(grad, rows, g)
    grad_kept, g_kept = unchanged(grad), unchanged(g)
    with tuned(serial_below=side):
        try:
            result = cposembed.scatter_add(grad, g, positions, offset=offset, num_threads=threads)
        except TypeError:
            assert no_common_type(grad_dtype, g_dtype), "refused a pair NumPy adds"
            grad_kept()
            return
    assert result is grad
    assert_bitwise(grad, want, nan_pairs)
    g_kept()


# ------------------------------------------------------------------------ embed
@st.composite
def layer_arrays(draw, wte_dtype, wpe_dtype, writable=False):
    """Token and position tables (in any layout, ``writable`` ones for the
    gradients), token ids, and positions."""
    vocab = draw(st.integers(1, 8), label="vocab")
    n_pos = draw(st.integers(1, 6), label="n_pos")
    d = draw(WIDTHS, label="d")
    lead = _lead(draw, max_dims=2)
    size = int(np.prod(lead))
    ids = np.array(
        draw(st.lists(st.integers(-vocab, vocab - 1), min_size=size, max_size=size)), np.int64
    ).reshape(lead)
    positions, offset, rows = draw(positions_for(n_pos, lead))
    wte = draw(layout(draw(edge_values((vocab, d), wte_dtype)), writable), label="wte")
    wpe = draw(layout(draw(edge_values((n_pos, d), wpe_dtype)), writable), label="wpe")
    return wte, wpe, ids, positions, offset, rows


@pytest.mark.parametrize("wte_dtype,wpe_dtype", PAIRS, ids=PAIR_IDS)
@PER_PAIR
@given(data=st.data(), threads=THREADS, side=SIDES)
def test_embed_is_numpy_bitwise(wte_dtype, wpe_dtype, data, threads, side):
    """``wte[ids] + wpe[positions]``: NumPy's dtype and bits; float16 with bfloat16
    a TypeError with ``out`` untouched."""
    wte, wpe, ids, positions, offset, rows = data.draw(layer_arrays(wte_dtype, wpe_dtype))
    refused = no_common_type(wte_dtype, wpe_dtype)
    shape = ids.shape + (wte.shape[1],)
    if not refused:
        want, nan_pairs = numpy_add(wte[ids], wpe, np.broadcast_to(rows, ids.shape))
    use_out = data.draw(st.booleans(), label="out")
    out = _fresh_out(data.draw, shape, F32 if refused else want.dtype) if use_out else None
    _forward_agrees(
        lambda: cposembed.embed(
            ids, wte, wpe, positions, offset=offset, out=out, num_threads=threads
        ),
        side,
        refusal=MIXED_HALVES if refused else None,
        out=out,
        want=None if refused else (want, nan_pairs),
        arrays=(wte, wpe, out),
        read=(wte, wpe),
    )


@pytest.mark.parametrize("table_dtype,g_dtype", PAIRS, ids=PAIR_IDS)
@PER_PAIR
@given(data=st.data(), threads=THREADS, side=SIDES)
def test_embed_backward_is_np_add_at_on_each_table(table_dtype, g_dtype, data, threads, side):
    """Each gradient table gets ``np.add.at``'s bits of grad_output as is (any
    dtype); the position table's dtype is the token table's or any other; a
    table may be None."""
    gp_dtype = data.draw(st.sampled_from([table_dtype, *TABLE_DTYPES]), label="gp dtype")
    gt, gp, ids, positions, offset, rows = data.draw(layer_arrays(table_dtype, gp_dtype, True))
    g = data.draw(edge_values(ids.shape + (gt.shape[1],), g_dtype), label="grad_output")
    g = data.draw(layout(g), label="grad_output layout")
    which = data.draw(st.sampled_from(["both", "tokens", "positions"]))
    gt_arg = None if which == "positions" else gt
    gp_arg = None if which == "tokens" else gp
    want_t, nan_t = numpy_add_at(gt, ids, g)
    want_p, nan_p = numpy_add_at(gp, np.broadcast_to(rows, ids.shape), g)
    kept = unchanged(gt, gp)
    g_kept = unchanged(g)
    with tuned(serial_below=side):
        try:
            cposembed.embed_backward(
                gt_arg, gp_arg, g, ids, positions, offset=offset, num_threads=threads
            )
        except TypeError:
            dtypes = [a.dtype for a in (gt_arg, gp_arg) if a is not None]
            assert no_common_type(g_dtype, *dtypes), "refused dtypes NumPy adds"
            kept()
            return
    if gt_arg is not None:
        assert_bitwise(gt, want_t, nan_t)
    if gp_arg is not None:
        assert_bitwise(gp, want_p, nan_p)
    g_kept()


# -------------------------------------------------- both sides of the threshold
def _zipf_rows(rng, n_rows, shape):
    """Positions drawn Zipf-like: a few rows take most contributions (the scan
    and sort plans of the scatter-adds), the rest once or never."""
    p = 1.0 / np.arange(1, n_rows + 1) ** 1.2
    return rng.permutation(n_rows)[rng.choice(n_rows, size=shape, p=p / p.sum())]


def _mostly_normal(rng, shape, dtype):
    """Normal values with some edges sprinkled in (ties, NaNs, infinities, subnormals)."""
    values = rng.standard_normal(shape) * 100
    sprinkle = rng.random(shape) < 0.01
    edges = np.array([2049.0, 257.0, np.nan, np.inf, -np.inf, -0.0, 2.0**-24, 2.0**-133])
    values[sprinkle] = rng.choice(edges, size=int(sprinkle.sum()))
    with np.errstate(all="ignore"):
        return values.astype(dtype)


D = 48


def _big(which):
    """(B, T) of about _sizes()[which] elements of width D: below and above the threshold."""
    T = 64
    return max(1, _sizes()[which] // (T * D)), T


def _forward_case(dtype_a, dtype_b, which, seed):
    """A large forward case's generator and (B, T); float16 with bfloat16 is
    skipped (a TypeError, which the property tests check)."""
    if no_common_type(dtype_a, dtype_b):
        pytest.skip("float16 with bfloat16: a TypeError (the property test checks it)")
    return (np.random.default_rng(seed), *_big(which))


@pytest.mark.parametrize("which", [0, 1], ids=["below", "above"])
@pytest.mark.parametrize("dtype", TABLE_DTYPES, ids=DTYPE_IDS)
def test_lookup_every_thread_count_large(dtype, which):
    rng = np.random.default_rng(1)
    table = _mostly_normal(rng, (300, D), dtype)
    rows = rng.integers(-300, 300, size=_big(which))
    want = table[rows]
    for threads in (1, 2, 3, 4):
        out = np.empty_like(want)
        assert_bitwise(cposembed.lookup(table, rows, out=out, num_threads=threads), want)
        assert_bitwise(cposembed.lookup(table, rows, num_threads=threads), want)


@pytest.mark.parametrize("which", [0, 1], ids=["below", "above"])
@pytest.mark.parametrize("tok_dtype,table_dtype", PAIRS, ids=PAIR_IDS)
def test_add_positions_every_thread_count_large(tok_dtype, table_dtype, which):
    rng, B, T = _forward_case(tok_dtype, table_dtype, which, seed=2)
    table = _mostly_normal(rng, (T + 3, D), table_dtype)
    tokens = _mostly_normal(rng, (B, T, D), tok_dtype)
    explicit = rng.integers(-(T + 3), T + 3, size=(B, T))
    for positions, rows in ((None, np.arange(T)), (explicit, explicit)):
        want, nan_pairs = numpy_add(tokens, table, rows)
        for threads in (1, 2, 3, 4):
            got = cposembed.add_positions(tokens, table, positions, num_threads=threads)
            assert_bitwise(got, want, nan_pairs)
        if want.dtype == tokens.dtype:  # in place
            work = tokens.copy()
            assert cposembed.add_positions(work, table, positions, out=work) is work
            assert_bitwise(work, want, nan_pairs)


def _scatter_on_threads(grad0, g, positions, rows, threads) -> None:
    """scatter_add into a copy of ``grad0`` on each thread count: np.add.at's bits,
    or (float16 with bfloat16 only) a TypeError with nothing written."""
    want, nan_pairs = numpy_add_at(grad0, rows, g)
    for n in threads:
        grad = grad0.copy()
        try:
            cposembed.scatter_add(grad, g, positions, num_threads=n)
        except TypeError:
            assert no_common_type(grad0.dtype, g.dtype)
            assert grad.tobytes() == grad0.tobytes()
            continue
        assert_bitwise(grad, want, nan_pairs)


@pytest.mark.parametrize("which", [0, 1], ids=["below", "above"])
@pytest.mark.parametrize("grad_dtype,g_dtype", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("kind", ["default", "zipf"])
def test_scatter_add_every_thread_count_large(grad_dtype, g_dtype, kind, which):
    rng = np.random.default_rng(3)
    B, T = _big(which)
    n_rows = 257
    grad0 = _mostly_normal(rng, (n_rows, D), grad_dtype)
    g = _mostly_normal(rng, (B, T, D), g_dtype)
    if kind == "default":
        positions, rows = None, np.arange(T)
    else:
        positions = rows = _zipf_rows(rng, n_rows, (B, T))
    _scatter_on_threads(grad0, g, positions, rows, (1, 2, 3, 4))


@pytest.mark.parametrize("which", [0, 1], ids=["below", "above"])
@pytest.mark.parametrize("wte_dtype,wpe_dtype", PAIRS, ids=PAIR_IDS)
def test_embed_every_thread_count_large(wte_dtype, wpe_dtype, which):
    rng, B, T = _forward_case(wte_dtype, wpe_dtype, which, seed=4)
    wte = _mostly_normal(rng, (3000, D), wte_dtype)
    wpe = _mostly_normal(rng, (T, D), wpe_dtype)
    ids = _zipf_rows(rng, 3000, (B, T))
    want, nan_pairs = numpy_add(wte[ids], wpe, np.arange(T))
    for threads in (1, 2, 3, 4):
        assert_bitwise(cposembed.embed(ids, wte, wpe, num_threads=threads), want, nan_pairs)
        out = np.empty_like(want)
        assert cposembed.embed(ids, wte, wpe, out=out, num_threads=threads) is out
        assert_bitwise(out, want, nan_pairs)


@pytest.mark.parametrize("which", [0, 1], ids=["below", "above"])
@pytest.mark.parametrize("table_dtype,g_dtype", PAIRS, ids=PAIR_IDS)
def test_embed_backward_every_thread_count_large(table_dtype, g_dtype, which):
    rng = np.random.default_rng(5)
    B, T = _big(which)
    gt0 = _mostly_normal(rng, (3000, D), table_dtype)
    gp0 = _mostly_normal(rng, (T + 5, D), table_dtype)
    g = _mostly_normal(rng, (B, T, D), g_dtype)
    ids = _zipf_rows(rng, 3000, (B, T))
    pos = rng.integers(0, T + 5, size=(B, T))
    want_t, nan_t = numpy_add_at(gt0, ids, g)
    want_p, nan_p = numpy_add_at(gp0, pos, g)
    for threads in (1, 2, 3, 4):
        gt, gp = gt0.copy(), gp0.copy()
        try:
            cposembed.embed_backward(gt, gp, g, ids, pos, num_threads=threads)
        except TypeError:
            assert no_common_type(table_dtype, g_dtype)
            assert gt.tobytes() == gt0.tobytes() and gp.tobytes() == gp0.tobytes()
            continue
        assert_bitwise(gt, want_t, nan_t)
        assert_bitwise(gp, want_p, nan_p)


# ---------------------------------------------------------------- the facts
@pytest.mark.parametrize("g_dtype", TABLE_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("side", [None, 0], ids=["default", "threaded"])
def test_a_hundred_adds_of_one_leave_a_float16_2048(g_dtype, side):
    """2048 + 1 is a tie in float16 (to even: 2048), and the table rounds after
    each add, so a hundred ones leave 2048, as np.add.at leaves it."""
    ones = np.ones((100, 4), g_dtype)
    want = np.full((3, 4), 2048, np.float16)
    np.add.at(want, np.zeros(100, np.int64), ones)
    assert (want == 2048).all()
    with tuned(serial_below=side):
        for threads in (1, 2, 4):
            grad = np.full((3, 4), 2048, np.float16)
            cposembed.scatter_add(grad, ones, np.zeros(100, np.int64), num_threads=threads)
            assert_bitwise(grad, want)
            gt = np.full((3, 4), 2048, np.float16)
            gp = np.full((3, 4), 2048, np.float16)
            cposembed.embed_backward(gt, gp, ones[None], np.zeros((1, 100), np.int64), [0] * 100)
            assert_bitwise(gt, want)
            assert_bitwise(gp, want)


def test_float64_to_bfloat16_follows_the_installed_ml_dtypes():
    """1 + 2**-8 + 2**-30 is just above a bfloat16 tie: one rounding gives
    1.0078125, rounding through float32 (ml_dtypes 0.6) loses the 2**-30 and
    rounds the tie to even, 1.0. A float64 gradient into a bfloat16 table is
    converted as the installed ml_dtypes converts."""
    x = 1 + 2.0**-8 + 2.0**-30
    installed = np.array([x]).astype(BFLOAT16)
    through_float32 = np.array([x]).astype(np.float32).astype(BFLOAT16)
    assert float(through_float32[0]) == 1.0
    assert float(installed[0]) in (1.0, 1.0078125), ml_dtypes.__version__
    g = np.full((4, 3), x)
    grad = np.full((1, 3), -0.0, BFLOAT16)  # -0.0 + x is x, exactly, in float64
    cposembed.scatter_add(grad, g[:1], [0])
    assert_bitwise(grad, np.full((1, 3), installed[0]))
    want, _ = numpy_add_at(np.zeros((2, 3), BFLOAT16), [0, 1, 0, 1], g)
    grad = np.zeros((2, 3), BFLOAT16)
    cposembed.scatter_add(grad, g, [0, 1, 0, 1])
    assert_bitwise(grad, want)


@pytest.mark.parametrize("side", [None, 0], ids=["default", "threaded"])
def test_a_float64_gradient_into_a_float32_table_is_np_add_at(side):
    """Added in float64 and rounded once per add: 1 + (2**-24 + 2**-50) is just
    above a float32 tie and rounds up; converted to float32 first, the 2**-50 is
    lost and the tie rounds to 1.0."""
    g = np.full((1, 1, 5), 2.0**-24 + 2.0**-50)
    grad = np.ones((2, 5), np.float32)
    with tuned(serial_below=side):
        cposembed.scatter_add(grad, g, [1])
    assert (grad[1] == np.float32(1 + 2.0**-23)).all() and (grad[0] == 1).all()
    converted_first = np.ones((2, 5), np.float32)
    np.add.at(converted_first, [1], g[0].astype(np.float32))
    assert (converted_first == 1).all()
    rng = np.random.default_rng(6)
    big = rng.standard_normal((16, 512, 32)) * 1e-7
    grad0 = np.ones((700, 32), np.float32)
    pos = _zipf_rows(rng, 700, (16, 512))
    want, _ = numpy_add_at(grad0, pos, big)
    for threads in (1, 2, 3, 4):
        grad = grad0.copy()
        cposembed.scatter_add(grad, big, pos, num_threads=threads)
        assert_bitwise(grad, want)
    gt, gp = grad0.copy(), grad0[:512].copy()
    cposembed.embed_backward(gt, gp, big, pos)
    assert_bitwise(gt, want)
    assert_bitwise(gp, numpy_add_at(grad0[:512], np.arange(512), big)[0])


# ------------------------------------------------------------- every bit pattern
def _every_pattern(dtype) -> np.ndarray:
    """All 65536 values of a half dtype, as a (4096, 16) table."""
    return np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(dtype).reshape(4096, 16)


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_every_half_pattern_through_lookup(dtype):
    table = _every_pattern(dtype)
    rows = np.random.default_rng(7).permutation(4096)
    assert_bitwise(cposembed.lookup(table, rows), table[rows])
    assert uint_bits(cposembed.lookup(table, np.arange(4096))).tobytes() == table.tobytes()


@pytest.mark.parametrize("other", TABLE_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_every_half_pattern_through_add(dtype, other):
    """Every pattern as tokens and as the table, against every pattern (same
    dtype) or -0.0 (the other dtypes: x + -0.0 is x converted, exactly)."""
    if no_common_type(dtype, other):
        pytest.skip("float16 with bfloat16: a TypeError")
    every = _every_pattern(dtype)
    rng = np.random.default_rng(8)
    if other == dtype:
        partner = every.reshape(-1)[rng.permutation(2**16)].reshape(4096, 16)
    else:
        partner = np.full((4096, 16), -0.0, other)
    for tokens, table in ((every[None], partner), (partner[None], every)):
        rows = rng.permutation(4096)
        want, nan_pairs = numpy_add(tokens, table, rows)
        for threads in (1, 2):
            got = cposembed.add_positions(tokens, table, rows, num_threads=threads)
            assert_bitwise(got, want, nan_pairs)
        want, nan_pairs = numpy_add(tokens, table, np.arange(4096))
        assert_bitwise(cposembed.add_positions(tokens, table), want, nan_pairs)


@pytest.mark.parametrize("other", TABLE_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_every_half_pattern_through_scatter_add(dtype, other):
    """Every pattern as grad_output into a table of the other dtype holding -0.0
    (the conversion, exactly) or, for the same dtype, holding every pattern (the
    sums); and every pattern as the table, with one add of every pattern.
    float16 with bfloat16: np.add.at's bits or a TypeError with nothing written."""
    every = _every_pattern(dtype)
    rng = np.random.default_rng(9)
    rows = rng.permutation(4096)
    start = every[rng.permutation(4096)] if other == dtype else np.full((4096, 16), -0.0, other)
    for grad0, g in ((start, every), (every, start)):
        _scatter_on_threads(grad0, g, rows, rows, (1, 2))


def _near_ties(dtype) -> np.ndarray:
    """float64 values at, just below and just above every midpoint between two
    neighbouring finite values of a half dtype (and the values themselves)."""
    finite = _every_pattern(dtype).reshape(-1).astype(np.float64)
    finite = np.unique(finite[np.isfinite(finite)])
    mid = (finite[:-1] + finite[1:]) / 2
    return np.concatenate([finite, mid, np.nextafter(mid, -np.inf), np.nextafter(mid, np.inf)])


@pytest.mark.parametrize("g_dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_every_rounding_tie_into_a_half_table(dtype, g_dtype):
    """A float32 or float64 gradient at every tie of a half dtype (and either
    side of it), added into -0.0: the table gets the value rounded as NumPy
    and ml_dtypes round it, for every representable neighbourhood."""
    with np.errstate(all="ignore"):
        values = _near_ties(dtype).astype(g_dtype)
    values = values[: values.size - values.size % 16].reshape(-1, 16)
    grad0 = np.full(values.shape, -0.0, dtype)
    rows = np.arange(values.shape[0])
    want, _ = numpy_add_at(grad0, rows, values)
    for threads in (1, 2):
        grad = grad0.copy()
        cposembed.scatter_add(grad, values, rows, num_threads=threads)
        assert_bitwise(grad, want)


@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_every_half_plus_half_tie_rounds_once_to_even(dtype):
    """Every finite value v plus half its distance to the next value: an exact
    tie in float32, rounded once to even (or up, for the next value's sake, when
    that one is even), as NumPy and ml_dtypes round it."""
    v = _every_pattern(dtype).reshape(-1)
    after = (uint_bits(v) + 1).view(dtype)
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(v.astype(np.float64)) & np.isfinite(after.astype(np.float64))
    v = v[finite]
    step = (uint_bits(v) + 1).view(dtype).astype(np.float64) - v.astype(np.float64)
    half = (step / 2).astype(dtype)
    exact = half.astype(np.float64) == step / 2
    tokens = v[exact][: exact.sum() - exact.sum() % 16].reshape(1, -1, 16)
    table = half[exact][: tokens.size].reshape(-1, 16)
    rows = np.arange(table.shape[0])
    want, _ = numpy_add(tokens, table, rows)
    for threads in (1, 2):
        assert_bitwise(cposembed.add_positions(tokens, table, num_threads=threads), want)
    assert_bitwise(cposembed.embed(np.arange(table.shape[0]), tokens[0], table), want[0])


# ------------------------------------------------------------- nothing written
L_ERR, D_ERR = 64, 512
B_ERR, T_ERR = 4, 64


def _pattern(shape, dtype, seed):
    """Random bits (finite values and NaNs with payloads): any write shows."""
    dt = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * dt.itemsize)
    return raw.astype(np.uint8).view(dt).reshape(shape)


def _bad_positions():
    pos = np.random.default_rng(10).integers(-L_ERR, L_ERR, size=(B_ERR, T_ERR))
    pos[-1, -1] = L_ERR
    return pos


def _error_cases(dtype):
    """(name, exception, call on (table, tokens, out, grad, wpe)) for a half dtype."""
    other = BFLOAT16 if dtype == F16 else F16
    bad = _bad_positions()
    ids = np.zeros((B_ERR, T_ERR), np.int64)
    return [
        ("lookup/position-out-of-range", IndexError,
         lambda t, tok, out, g, wpe: cposembed.lookup(t, bad, out=out)),
        ("lookup/out-of-the-other-half-dtype", TypeError,
         lambda t, tok, out, g, wpe: cposembed.lookup(t, bad % L_ERR, out=out.view(other))),
        ("lookup/out-float32", TypeError,
         lambda t, tok, out, g, wpe: cposembed.lookup(
             t, bad % L_ERR, out=np.zeros(out.shape, np.float32))),
        ("add/position-out-of-range-in-place", IndexError,
         lambda t, tok, out, g, wpe: cposembed.add_positions(tok, t, bad, out=tok)),
        ("add/position-out-of-range", IndexError,
         lambda t, tok, out, g, wpe: cposembed.add_positions(tok, t, bad, out=out)),
        ("add/offset-past-the-end-in-place", IndexError,
         lambda t, tok, out, g, wpe: cposembed.add_positions(
             tok, t, offset=L_ERR - T_ERR + 1, out=tok)),
        ("add/float16-with-bfloat16-in-place", TypeError,
         lambda t, tok, out, g, wpe: cposembed.add_positions(tok, t.view(other), out=tok)),
        ("add/float16-with-bfloat16-out", TypeError,
         lambda t, tok, out, g, wpe: cposembed.add_positions(tok.view(other), t, out=out)),
        ("add/half-tokens-float32-table-in-place", TypeError,
         lambda t, tok, out, g, wpe: cposembed.add_positions(
             tok, t.astype(np.float32), out=tok)),
        ("scatter/position-out-of-range", IndexError,
         lambda t, tok, out, g, wpe: cposembed.scatter_add(g, tok, bad)),
        ("scatter/float64-grad-out-of-range", IndexError,
         lambda t, tok, out, g, wpe: cposembed.scatter_add(g, tok.astype(np.float64), bad)),
        ("scatter/offset-past-the-end", IndexError,
         lambda t, tok, out, g, wpe: cposembed.scatter_add(g, tok, offset=L_ERR - T_ERR + 1)),
        ("embed/id-out-of-range", IndexError,
         lambda t, tok, out, g, wpe: cposembed.embed(bad, t, wpe, out=out)),
        ("embed/float16-with-bfloat16", TypeError,
         lambda t, tok, out, g, wpe: cposembed.embed(ids, t, wpe.view(other), out=out)),
        ("embed_backward/id-out-of-range", IndexError,
         lambda t, tok, out, g, wpe: cposembed.embed_backward(g, wpe, tok, bad)),
        ("embed_backward/position-out-of-range", IndexError,
         lambda t, tok, out, g, wpe: cposembed.embed_backward(g, wpe, tok, ids, bad)),
    ]  # fmt: skip


ERROR_NAMES = [name for name, _, _ in _error_cases(F16)]


@pytest.mark.parametrize("side", [None, 0], ids=["default", "threaded"])
@pytest.mark.parametrize("case", range(len(ERROR_NAMES)), ids=ERROR_NAMES)
@pytest.mark.parametrize("dtype", HALVES, ids=HALF_IDS)
def test_error_path_writes_nothing(dtype, case, side):
    name, error, call = _error_cases(dtype)[case]
    arrays = (
        _pattern((L_ERR, D_ERR), dtype, 1),
        _pattern((B_ERR, T_ERR, D_ERR), dtype, 2),
        _pattern((B_ERR, T_ERR, D_ERR), dtype, 3),
        _pattern((L_ERR, D_ERR), dtype, 4),
        _pattern((L_ERR, D_ERR), dtype, 5),
    )
    kept = unchanged(*arrays)
    with tuned(serial_below=side), pytest.raises(error), np.errstate(all="ignore"):
        call(*arrays)
    kept()
