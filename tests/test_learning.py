"""Learning the table: padding_idx, sgd_step (and its C entry's plain case), resized,
a training loop and the ``train`` function, each against plain NumPy."""

from __future__ import annotations

import numpy as np
import plain as cases
import pytest
from helpers import DTYPES, run_child, same_bits, tuned
from hypothesis import event, given, settings
from hypothesis import strategies as st

import cposembed
import cposembed.train
from cposembed import LearnedPositionEmbedding, _core, _marks
from cposembed.reference import LearnedPositionEmbedding as Reference


# -- a user-assigned grad of the wrong shape ----------------------------------------
@pytest.mark.parametrize("positions", ["[50 % 8, 3]", "[50]"], ids=["valid-rows", "row-50"])
def test_user_assigned_grad_of_the_wrong_shape(positions):
    """pe.grad = a (100, 2) array for an (8, 2) table, then backward: ValueError, nothing written."""
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


# ---------------------------------------------------------------- sgd_step
@given(data=st.data())
def test_sgd_entry_accepts_exactly_the_plain_case(data):
    plain, L, d, dtype, rng, table = cases._entry_case(data)
    grad = rng.standard_normal((L, d)).astype(dtype)
    grad_kind = cases._pick(
        data.draw,
        ["plain"],
        ["dtype", "shape", "strided", "subclass", "on_table", "readonly", "swapped", "list"],
        plain=plain,
    )
    if grad_kind == "shape":
        grad = np.ones((L, d + 1), dtype)
    elif grad_kind == "on_table" and cases._plain_table(table) and table.size:
        grad = table[...]
    else:
        grad = cases._array_form(grad, grad_kind)  # read only is fine: the step reads it
    touched_kind = cases._pick(data.draw, ["none", "plain"], ["length", "mask"], plain=plain)
    touched = None
    if touched_kind == "plain":
        touched = _marks.RowMarks(L, rng.random(L) < 0.5)
    elif touched_kind == "length":
        touched = _marks.RowMarks(L + 1, np.ones(L + 1, bool))
    elif touched_kind == "mask":
        touched = np.ones(L, bool)  # a bare mask, not RowMarks
    lr = data.draw(st.floats(-10, 10, allow_nan=False), label="lr")
    skip_row = cases._pick(data.draw, [-1, 0, L - 1], [-2, L], 0.1, plain=plain)
    num_threads = data.draw(cases.PLAIN_THREADS if plain else cases.THREADS, label="num_threads")
    serial_below = data.draw(st.sampled_from([None, 0]))

    accept = (
        cases._plain_table(table)
        and table.flags.writeable
        and cases._plain(grad, table.dtype)
        and grad.shape == table.shape
        and cases._disjoint(grad, table)
        and (touched is None or (isinstance(touched, _marks.RowMarks) and touched.n_rows == L))
        and -1 <= skip_row < L
        and cases._threads_ok(num_threads)
    )
    expect = None
    if accept:
        rows = np.flatnonzero(touched.mask) if touched is not None else np.arange(L)
        rows = rows[rows != skip_row]
        expect = table.copy()
        step = dtype.type(lr)
        expect[rows] = expect[rows] - step * grad[rows]
    event("accepted" if accept else "declined")
    snap = cases.Snapshot(table, grad, touched)
    with tuned(serial_below=serial_below):
        result = _core.sgd_step(table, grad, touched, lr, skip_row, num_threads)
        if not accept:
            cases._declined(result, snap)
            return
        assert result is True
        n = rows.size
        assert _core.last_team() == cases._expected_team(num_threads, n * d, n)
    snap.unchanged(but=(table,))
    cases._same_bits(table, expect)


def test_padding_idx_setter_on_a_read_only_grad_changes_nothing_or_succeeds():
    pe = LearnedPositionEmbedding(5, 3, seed=0)
    grad = np.ones((5, 3), np.float32)
    grad.setflags(write=False)
    pe.grad = grad
    try:
        pe.padding_idx = 1
    except (ValueError, TypeError) as exc:
        assert "assignment destination" not in str(exc), str(exc)
        assert pe.padding_idx is None
    else:
        assert pe.padding_idx == 1


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    cposembed.set_num_threads(request.param)
    yield request.param
    cposembed.set_num_threads(None)


def reference_table(n, d, seed, dtype):
    state = np.random.get_state()
    try:
        return Reference(n, d, seed=seed).embeddings.astype(dtype)
    finally:
        np.random.set_state(state)


# -- padding_idx ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pad, row", [(0, 0), (3, 3), (-1, 9), (-10, 0)])
def test_padding_row_starts_at_zero_others_as_reference(dtype, pad, row):
    pe = LearnedPositionEmbedding(10, 6, seed=5, dtype=dtype, padding_idx=pad)
    ref = reference_table(10, 6, 5, dtype)
    assert pe.padding_idx == row
    assert not pe.embeddings[row].any()
    others = np.arange(10) != row
    assert same_bits(pe.embeddings[others], ref[others])
    # lookups still return the (zero) row
    assert same_bits(pe(row), np.zeros(6, dtype=dtype))
    assert same_bits(pe([row, row]), np.zeros((2, 6), dtype=dtype))


@pytest.mark.parametrize("bad", [10, -11, 100])
def test_padding_idx_out_of_range(bad):
    with pytest.raises(ValueError, match="padding_idx"):
        LearnedPositionEmbedding(10, 4, padding_idx=bad)
    with pytest.raises(ValueError, match="padding_idx"):
        LearnedPositionEmbedding.from_pretrained(np.ones((10, 4)), padding_idx=bad)


@pytest.mark.parametrize("bad", [1.0, "0", True, [0]])
def test_padding_idx_not_an_integer(bad):
    with pytest.raises(TypeError, match="padding_idx"):
        LearnedPositionEmbedding(10, 4, padding_idx=bad)


def test_padding_idx_accepts_numpy_integers():
    assert LearnedPositionEmbedding(10, 4, padding_idx=np.int8(-2)).padding_idx == 8


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_row_gets_no_gradient_and_never_moves(dtype):
    rng = np.random.default_rng(0)
    pe = LearnedPositionEmbedding(8, 5, seed=1, dtype=dtype, padding_idx=2)
    positions = np.array([[2, 0, 2, 5], [1, 2, 2, 7]])
    g = rng.standard_normal((2, 4, 5))
    pe.backward(g, positions)
    pe.backward(g[:, :3])  # positions None: 0, 1, 2
    expected = np.zeros((8, 5), dtype=dtype)
    np.add.at(expected, positions.reshape(-1), g.reshape(-1, 5))
    np.add.at(expected, np.tile(np.arange(3), 2), g[:, :3].reshape(-1, 5))
    expected[2] = 0
    assert same_bits(pe.grad, expected)
    before = pe.embeddings.copy()
    pe.sgd_step(0.5)
    assert not pe.embeddings[2].any()
    assert same_bits(pe.embeddings, before - dtype(0.5) * expected)


def test_from_pretrained_keeps_the_padding_row_like_torch():
    table = np.arange(12.0).reshape(4, 3)
    pe = LearnedPositionEmbedding.from_pretrained(table, padding_idx=1)
    assert same_bits(pe.embeddings, table.astype(np.float32))
    pe.backward(np.ones((4, 3)), [0, 1, 1, 3])
    assert not pe.grad[1].any()
    pe.sgd_step(1.0)
    assert same_bits(pe.embeddings[1], table[1].astype(np.float32))


# -- sgd_step --------------------------------------------------------------------
def expected_step(table, grad, rows, lr):
    out = table.copy()
    # What NumPy does for `table -= lr * grad` with a Python float lr.
    out[rows] = table[rows] - lr * grad[rows]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 8), (3000, 64)], ids=["small", "above-threshold"])
def test_sgd_step_is_numpy_bitwise_on_touched_rows(dtype, shape, threads):
    rng = np.random.default_rng(1)
    n, d = shape
    pe = LearnedPositionEmbedding(n, d, seed=3, dtype=dtype)
    positions = rng.integers(-n, n, size=(4, n // 4))
    pe.backward(rng.standard_normal((4, n // 4, d)), positions)
    touched = np.unique(positions % n)
    assert len(touched) < n  # some rows are untouched
    table, grad = pe.embeddings.copy(), pe.grad.copy()
    lr = 0.0371
    pe.sgd_step(lr)
    assert same_bits(pe.embeddings, expected_step(table, grad, touched, lr))
    # and that is `embeddings - lr * grad` everywhere, untouched rows unchanged
    assert same_bits(pe.embeddings, table - lr * grad)
    untouched = np.setdiff1d(np.arange(n), touched)
    assert same_bits(pe.embeddings[untouched], table[untouched])


def test_sgd_step_only_visits_rows_backward_touched():
    pe = LearnedPositionEmbedding(6, 3, seed=0)
    pe.backward(np.ones((2, 3)), [1, 4])
    pe.grad[0] = 100.0  # an in-place edit of an untouched row: not seen
    table = pe.embeddings.copy()
    pe.sgd_step(1.0)
    assert same_bits(pe.embeddings[0], table[0])
    assert same_bits(pe.embeddings[[1, 4]], table[[1, 4]] - np.float32(1.0) * pe.grad[[1, 4]])


def test_zero_grad_resets_touched_rows():
    pe = LearnedPositionEmbedding(6, 3, seed=0)
    pe.backward(np.ones((2, 3)), [0, 1])
    pe.zero_grad()
    pe.backward(np.ones((1, 3)), [5])
    assert list(np.flatnonzero(pe._grad.touched.mask)) == [5]
    assert list(pe._grad.touched.rows()) == [5]
    table = pe.embeddings.copy()
    pe.sgd_step(0.25)
    assert same_bits(pe.embeddings, table - 0.25 * pe.grad)
    assert same_bits(pe.embeddings[:5], table[:5])


def test_sgd_step_with_offset_and_broadcast_positions():
    rng = np.random.default_rng(2)
    pe = LearnedPositionEmbedding(20, 4, seed=0, dtype=np.float64)
    pe.backward(rng.standard_normal((3, 5, 4)), offset=7)
    pe.backward(rng.standard_normal((2, 3, 4)), np.array([[15, -1, 0]]))
    assert list(np.flatnonzero(pe._grad.touched.mask)) == [0, 7, 8, 9, 10, 11, 15, 19]
    assert sorted(pe._grad.touched.rows()) == [0, 7, 8, 9, 10, 11, 15, 19]
    table, grad = pe.embeddings.copy(), pe.grad.copy()
    pe.sgd_step(-3.5)  # a negative rate ascends, still the same arithmetic
    assert same_bits(pe.embeddings, table - (-3.5) * grad)


def test_sgd_step_without_grad_is_a_no_op():
    pe = LearnedPositionEmbedding(5, 3, seed=0)
    table = pe.embeddings.copy()
    assert pe.sgd_step(0.1) is None
    assert pe.grad is None
    assert same_bits(pe.embeddings, table)


def test_sgd_step_after_failed_backward_changes_nothing():
    pe = LearnedPositionEmbedding(5, 3, seed=0)
    with pytest.raises(IndexError):
        pe.backward(np.ones((2, 3)), [0, 5])
    table = pe.embeddings.copy()
    pe.sgd_step(0.1)
    assert same_bits(pe.embeddings, table)


@pytest.mark.parametrize(
    "lr, exc",
    [
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (-np.inf, ValueError),
        ("0.1", TypeError),
        (None, TypeError),
        (1 + 2j, TypeError),
        (True, TypeError),
        (np.array([0.1]), TypeError),
    ],
)
def test_sgd_step_rejects_bad_learning_rates(lr, exc):
    pe = LearnedPositionEmbedding(5, 3, seed=0)
    pe.backward(np.ones((5, 3)))
    table = pe.embeddings.copy()
    with pytest.raises(exc, match="lr"):
        pe.sgd_step(lr)
    assert same_bits(pe.embeddings, table)


@pytest.mark.parametrize("lr", [np.float32(0.1), np.float64(0.1), 1, np.int64(2)])
def test_sgd_step_accepts_numpy_and_int_rates(lr):
    pe = LearnedPositionEmbedding(5, 3, seed=0)
    pe.backward(np.ones((5, 3)))
    table = pe.embeddings.copy()
    pe.sgd_step(lr)
    assert same_bits(pe.embeddings, table - float(lr) * pe.grad)


def test_assigned_grad_updates_every_row():
    rng = np.random.default_rng(3)
    pe = LearnedPositionEmbedding(6, 3, seed=0)
    pe.backward(np.ones((1, 3)), [2])
    pe.grad = rng.standard_normal((6, 3)).astype(np.float32)
    table = pe.embeddings.copy()
    pe.sgd_step(0.3)
    assert same_bits(pe.embeddings, table - 0.3 * pe.grad)
    # a float64 gradient on a float32 table: NumPy's own rule
    pe.grad = rng.standard_normal((6, 3))
    expected = pe.embeddings.copy()
    expected -= 0.3 * pe.grad
    pe.sgd_step(0.3)
    assert same_bits(pe.embeddings, expected)


def test_backward_into_an_assigned_grad_keeps_all_its_rows():
    pe = LearnedPositionEmbedding(4, 2, seed=0)
    pe.grad = np.ones((4, 2), dtype=np.float32)
    pe.backward(np.ones((1, 2)), [0])
    table = pe.embeddings.copy()
    pe.sgd_step(1.0)
    assert same_bits(pe.embeddings, table - np.float32(1.0) * pe.grad)


def test_sgd_step_rejects_a_grad_of_the_wrong_shape():
    pe = LearnedPositionEmbedding(4, 2, seed=0)
    pe.grad = np.ones((3, 2), dtype=np.float32)
    table = pe.embeddings.copy()
    with pytest.raises(ValueError, match="shape"):
        pe.sgd_step(0.1)
    assert same_bits(pe.embeddings, table)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    d=st.integers(1, 9),
    positions=st.lists(st.integers(-40, 39), min_size=0, max_size=30),
    lr=st.floats(-10, 10, allow_nan=False),
    f64=st.booleans(),
)
def test_sgd_step_property(n, d, positions, lr, f64):
    dtype = np.float64 if f64 else np.float32
    positions = [p for p in positions if -n <= p < n]
    rng = np.random.default_rng(len(positions))
    pe = LearnedPositionEmbedding(n, d, seed=1, dtype=dtype)
    g = rng.standard_normal((len(positions), d))
    pe.backward(g, np.array(positions, dtype=np.int64))
    expected_grad = np.zeros((n, d), dtype=dtype)
    np.add.at(expected_grad, np.array(positions, dtype=np.intp), g)
    assert same_bits(pe.grad, expected_grad)
    table = pe.embeddings.copy()
    pe.sgd_step(lr)
    assert same_bits(pe.embeddings, table - lr * expected_grad)


def test_training_loop_matches_numpy():
    rng = np.random.default_rng(4)
    pe = LearnedPositionEmbedding(12, 4, seed=0, dtype=np.float64)
    table = pe.embeddings.copy()
    for _ in range(5):
        g = rng.standard_normal((3, 7, 4))
        pe.zero_grad()
        pe.backward(g)
        pe.sgd_step(0.1)
        grad = np.zeros_like(table)
        np.add.at(grad, np.tile(np.arange(7), 3), g.reshape(-1, 4))
        table -= 0.1 * grad
    assert same_bits(pe.embeddings, table)


# -- resized ---------------------------------------------------------------------
def interp_reference(table, new_len):
    n = table.shape[0]
    x = np.arange(new_len) * (n - 1) / (new_len - 1)
    return np.stack([np.interp(x, np.arange(n), table[:, k]) for k in range(table.shape[1])], 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, new", [(10, 25), (10, 4), (7, 7), (2, 5), (16, 1000)])
def test_resized_linear_interpolates_and_keeps_the_ends(dtype, n, new):
    pe = LearnedPositionEmbedding(n, 5, seed=2, dtype=dtype)
    big = pe.resized(new)
    assert isinstance(big, LearnedPositionEmbedding)
    assert big.embeddings.shape == (new, 5) and big.dtype == pe.dtype
    assert same_bits(big.embeddings[0], pe.embeddings[0])
    assert same_bits(big.embeddings[-1], pe.embeddings[-1])
    ref = interp_reference(pe.embeddings.astype(np.float64), new)
    tol = 1e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(big.embeddings, ref, rtol=tol, atol=tol)
    assert big.grad is None and big.embeddings is not pe.embeddings


def test_resized_by_an_integer_factor_keeps_every_old_row():
    pe = LearnedPositionEmbedding(9, 4, seed=0)
    big = pe.resized(17)  # new row 2k sits exactly on old row k
    assert same_bits(big.embeddings[::2], pe.embeddings)
    mid = (pe.embeddings[:-1].astype(np.float64) + pe.embeddings[1:]) / 2
    np.testing.assert_allclose(big.embeddings[1::2], mid, rtol=1e-6)


@pytest.mark.parametrize("method", ["linear", "repeat"])
def test_resized_one_row_cases(method):
    one = LearnedPositionEmbedding(1, 3, seed=0)
    assert same_bits(one.resized(4, method).embeddings, np.repeat(one.embeddings, 4, axis=0))
    pe = LearnedPositionEmbedding(6, 3, seed=0)
    assert same_bits(pe.resized(1, method).embeddings, pe.embeddings[:1])


@pytest.mark.parametrize("n, new", [(5, 12), (5, 3), (5, 5), (1, 3)])
def test_resized_repeat_tiles_and_cuts(n, new):
    pe = LearnedPositionEmbedding(n, 3, seed=0, dtype=np.float64)
    expected = np.tile(pe.embeddings, (new // n + 1, 1))[:new]
    assert same_bits(pe.resized(new, method="repeat").embeddings, expected)


@pytest.mark.parametrize("new", [0, -3, 2.5, "8", None])
def test_resized_rejects_bad_lengths(new):
    with pytest.raises(ValueError, match="new_max_len"):
        LearnedPositionEmbedding(4, 2).resized(new)


@pytest.mark.parametrize("method", ["nearest", "LINEAR", None, ""])
def test_resized_rejects_bad_methods(method):
    with pytest.raises(ValueError, match="method"):
        LearnedPositionEmbedding(4, 2).resized(8, method=method)


def test_resized_keeps_padding_idx_and_its_row():
    pe = LearnedPositionEmbedding(8, 3, seed=0, padding_idx=1)
    big = pe.resized(20)
    assert big.padding_idx == 1 and not big.embeddings[1].any()
    assert same_bits(big.embeddings[0], pe.embeddings[0])
    with pytest.raises(ValueError, match="padding_idx"):
        LearnedPositionEmbedding(8, 3, padding_idx=-1).resized(4)


# -- train -------------------------------------------------------------------------
def test_train_function_builds_structure():
    from cposembed.train import train

    result = train(
        steps=80, max_seq_len=32, embed_dim=16, batch_size=8, seed=1, out=None, progress=False
    )
    assert abs(result.similarity_before) < 0.2
    assert result.similarity_after > result.similarity_before + 0.4
    assert result.loss_last < result.loss_first
    assert result.pictures == []


def test_train_with_sgd_and_adam_both_learn():
    from cposembed.train import train

    common = dict(steps=80, max_seq_len=32, embed_dim=16, batch_size=8, seed=1, progress=False)
    sgd = train(optimizer="sgd", **common)
    adam = train(optimizer="adam", **common)
    for result in (sgd, adam):
        assert result.similarity_after > result.similarity_before + 0.4
        assert result.loss_last < result.loss_first
    with pytest.raises(ValueError, match="optimizer"):
        train(optimizer="lbfgs", **common)


def test_padding_idx_can_be_set_later_like_torch():
    pe = LearnedPositionEmbedding(6, 2, seed=0)
    row = pe.embeddings[4].copy()
    pe.backward(np.ones((6, 2)))
    pe.padding_idx = -2
    assert pe.padding_idx == 4
    assert same_bits(pe.embeddings[4], row)  # not zeroed
    assert not pe.grad[4].any()
    pe.sgd_step(1.0)
    assert same_bits(pe.embeddings[4], row)
    with pytest.raises(ValueError, match="padding_idx"):
        pe.padding_idx = 6
    pe.padding_idx = None
    assert pe.padding_idx is None


def test_sgd_step_rejects_an_overflowing_rate():
    pe = LearnedPositionEmbedding(3, 2, seed=0)
    pe.backward(np.ones((3, 2)))
    with pytest.raises(ValueError, match="lr"):
        pe.sgd_step(10**400)
