"""Learning the table: padding_idx, sgd_step, resized, save/load, pickle,
positions_from_mask and the ``train`` command, each against plain NumPy."""

from __future__ import annotations

import copy
import io
import os
import pathlib
import pickle
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cposembed
import cposembed.train
from cposembed import LearnedPositionEmbedding, positions_from_mask
from cposembed.reference import LearnedPositionEmbedding as Reference

DTYPES = [np.float32, np.float64]
ROOT = pathlib.Path(__file__).resolve().parents[1]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


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
    np.add.at(expected, positions.reshape(-1), g.astype(dtype).reshape(-1, 5))
    np.add.at(expected, np.tile(np.arange(3), 2), g[:, :3].astype(dtype).reshape(-1, 5))
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
    assert list(np.flatnonzero(pe._grad.touched)) == [5]
    table = pe.embeddings.copy()
    pe.sgd_step(0.25)
    assert same_bits(pe.embeddings, table - 0.25 * pe.grad)
    assert same_bits(pe.embeddings[:5], table[:5])


def test_sgd_step_with_offset_and_broadcast_positions():
    rng = np.random.default_rng(2)
    pe = LearnedPositionEmbedding(20, 4, seed=0, dtype=np.float64)
    pe.backward(rng.standard_normal((3, 5, 4)), offset=7)
    pe.backward(rng.standard_normal((2, 3, 4)), np.array([[15, -1, 0]]))
    assert list(np.flatnonzero(pe._grad.touched)) == [0, 7, 8, 9, 10, 11, 15, 19]
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
    np.add.at(expected_grad, np.array(positions, dtype=np.intp), g.astype(dtype))
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


# -- save / load -----------------------------------------------------------------
ODD_NAMES = ["table", "table.npz", "table.npy", "with space.bin", "tabellé.npz.txt", ".hidden"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ODD_NAMES)
def test_save_load_round_trip_is_bitwise_for_any_name(tmp_path, dtype, name):
    pe = LearnedPositionEmbedding(11, 7, seed=9, dtype=dtype, padding_idx=-2)
    pe.embeddings[3, 1] = -0.0
    pe.embeddings[4, 2] = np.nan
    path = tmp_path / name
    pe.save(str(path))
    assert os.listdir(tmp_path) == [name]  # exactly that file, no ".npz" added
    back = LearnedPositionEmbedding.load(str(path))
    assert type(back) is LearnedPositionEmbedding
    assert same_bits(back.embeddings, pe.embeddings)
    assert back.dtype == pe.dtype and back.padding_idx == 9
    assert back.grad is None
    back2 = LearnedPositionEmbedding.load(path)  # a pathlib.Path works too
    assert same_bits(back2.embeddings, pe.embeddings)


def test_save_load_through_file_objects():
    pe = LearnedPositionEmbedding(5, 2, seed=0)
    buf = io.BytesIO()
    pe.save(buf)
    buf.seek(0)
    back = LearnedPositionEmbedding.load(buf)
    assert same_bits(back.embeddings, pe.embeddings) and back.padding_idx is None


def test_save_does_not_store_grad_and_load_is_trainable(tmp_path):
    pe = LearnedPositionEmbedding(5, 2, seed=0)
    pe.backward(np.ones((5, 2)))
    pe.save(tmp_path / "t")
    back = LearnedPositionEmbedding.load(tmp_path / "t")
    assert back.grad is None
    assert back.embeddings.flags.writeable and back.embeddings.flags.c_contiguous
    back.backward(np.ones((5, 2)))
    back.sgd_step(1.0)


def test_load_rejects_other_files(tmp_path):
    (tmp_path / "text").write_text("not an archive")
    with pytest.raises(ValueError, match="save"):
        LearnedPositionEmbedding.load(tmp_path / "text")
    np.save(tmp_path / "plain.npy", np.ones((3, 2)))
    with pytest.raises(ValueError, match="save"):
        LearnedPositionEmbedding.load(tmp_path / "plain.npy")
    with open(tmp_path / "other", "wb") as f:
        np.savez(f, weights=np.ones((3, 2)))
    with pytest.raises(ValueError, match="save"):
        LearnedPositionEmbedding.load(tmp_path / "other")
    with pytest.raises(FileNotFoundError):
        LearnedPositionEmbedding.load(tmp_path / "missing")


def test_load_rejects_a_newer_format(tmp_path):
    pe = LearnedPositionEmbedding(3, 2, seed=0)
    buf = io.BytesIO()
    pe.save(buf)
    buf.seek(0)
    with np.load(buf) as z:
        arrays = dict(z)
    arrays["format_version"] = np.array(99)
    with open(tmp_path / "future", "wb") as f:
        np.savez(f, **arrays)
    with pytest.raises(ValueError, match="version 99"):
        LearnedPositionEmbedding.load(tmp_path / "future")


# -- pickle ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_pickle_round_trip_keeps_grad_and_touched_rows(dtype):
    rng = np.random.default_rng(5)
    pe = LearnedPositionEmbedding(10, 4, seed=0, dtype=dtype, padding_idx=3)
    pe.backward(rng.standard_normal((2, 3, 4)), [[1, 3, 8]])
    back = pickle.loads(pickle.dumps(pe))
    assert same_bits(back.embeddings, pe.embeddings)
    assert same_bits(back.grad, pe.grad)
    assert back.padding_idx == 3 and back.dtype == pe.dtype
    assert back.embeddings is not pe.embeddings
    pe.grad[0] = 7.0  # an untouched row: ignored by both
    back.grad[0] = 7.0
    pe.sgd_step(0.2)
    back.sgd_step(0.2)
    assert same_bits(back.embeddings, pe.embeddings)
    # training continues on the copy
    back.backward(np.ones((1, 4)), [9])
    assert back.grad[9].any()


def test_pickle_and_copy_without_grad():
    pe = LearnedPositionEmbedding(4, 2, seed=0)
    for back in (pickle.loads(pickle.dumps(pe)), copy.deepcopy(pe)):
        assert back.grad is None and back.padding_idx is None
        assert same_bits(back.embeddings, pe.embeddings)
        back.backward(np.ones((4, 2)))
        back.sgd_step(0.5)
        assert not same_bits(back.embeddings, pe.embeddings)


# -- positions_from_mask ---------------------------------------------------------
def positions_loop(mask, offset=0, pad_position=0):
    mask = np.asarray(mask)
    out = np.empty(mask.shape, dtype=np.int64)
    for b in range(mask.shape[0]):
        off = offset[b] if np.ndim(offset) else offset
        seen = 0
        for t in range(mask.shape[1]):
            if mask[b, t]:
                out[b, t] = off + seen
                seen += 1
            else:
                out[b, t] = pad_position
    return out


def test_left_and_right_padding():
    right = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    left = right[:, ::-1].copy()
    pos_r = positions_from_mask(right)
    pos_l = positions_from_mask(left)
    assert pos_r.dtype == np.int64 and pos_l.dtype == np.int64
    assert pos_r.tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    assert pos_l.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    assert positions_from_mask(left, pad_position=-1).tolist()[0] == [-1, -1, 0, 1, 2]


@settings(max_examples=80, deadline=None)
@given(
    mask=st.tuples(st.integers(0, 5), st.integers(0, 6)).flatmap(
        lambda bt: st.lists(st.integers(0, 1), min_size=bt[0] * bt[1], max_size=bt[0] * bt[1]).map(
            lambda flat: np.array(flat, dtype=np.int64).reshape(bt)
        )
    ),
    offset=st.integers(0, 50),
    pad=st.integers(-3, 3),
    as_bool=st.booleans(),
)
def test_positions_from_mask_matches_a_loop(mask, offset, pad, as_bool):
    arr = mask.astype(bool) if as_bool else mask
    got = positions_from_mask(arr, offset=offset, pad_position=pad)
    assert got.dtype == np.int64 and got.shape == arr.shape
    assert np.array_equal(got, positions_loop(arr, offset, pad))


def test_per_row_offsets_and_incremental_decoding():
    rng = np.random.default_rng(6)
    full = np.ones((4, 12), dtype=np.int32)
    for b, n_pad in enumerate([0, 3, 5, 11]):
        full[b, :n_pad] = 0  # left padding
    whole = positions_from_mask(full)
    # decoding token by token: mask of the new column, offset = tokens seen so far
    for t in range(6, 12):
        seen = full[:, :t].sum(axis=1)
        step = positions_from_mask(full[:, t : t + 1], offset=seen)
        assert np.array_equal(step, whole[:, t : t + 1])
    # a scalar offset when every row has seen the same number of tokens
    assert positions_from_mask(np.ones((2, 3)), offset=4).tolist() == [[4, 5, 6]] * 2
    offs = rng.integers(0, 9, size=4)
    assert np.array_equal(positions_from_mask(full, offset=offs), positions_loop(full, offs))


def test_left_padded_batch_gets_the_unpadded_rows():
    rng = np.random.default_rng(7)
    pe = LearnedPositionEmbedding(16, 4, seed=0)
    tokens = rng.standard_normal((1, 5, 4)).astype(np.float32)
    unpadded = pe.add_to(tokens)
    padded = np.concatenate([np.zeros((1, 3, 4), np.float32), tokens], axis=1)
    mask = np.array([[0, 0, 0, 1, 1, 1, 1, 1]])
    out = pe.add_to(padded, positions_from_mask(mask))
    assert same_bits(out[:, 3:], unpadded)


def test_positions_from_mask_one_row_and_empty():
    assert positions_from_mask([1, 0, 1]).tolist() == [0, 0, 1]
    assert positions_from_mask(np.zeros((3, 0))).shape == (3, 0)
    assert positions_from_mask(np.zeros((0, 4))).shape == (0, 4)
    assert positions_from_mask(np.array([[1.0, 0.0]])).tolist() == [[0, 0]]


@pytest.mark.parametrize("mask", [[[0, 2]], [[1, -1]], [[0.5, 1]], [[np.nan, 1]]])
def test_positions_from_mask_rejects_values_other_than_0_and_1(mask):
    with pytest.raises(ValueError, match="0"):
        positions_from_mask(np.array(mask))


def test_positions_from_mask_rejects_bad_arguments():
    with pytest.raises(ValueError, match="0-d"):
        positions_from_mask(1)
    with pytest.raises(TypeError, match="attention_mask"):
        positions_from_mask(np.array([["a", "b"]]))
    with pytest.raises(ValueError, match="non-negative"):
        positions_from_mask([[1, 1]], offset=-1)
    with pytest.raises(ValueError, match="one value per row"):
        positions_from_mask([[1, 1], [1, 0]], offset=[1, 2, 3])
    with pytest.raises(ValueError, match="non-negative"):
        positions_from_mask([[1, 1], [1, 0]], offset=[1, -2])
    with pytest.raises(TypeError, match="offset"):
        positions_from_mask([[1, 1]], offset=1.5)
    with pytest.raises(TypeError, match="pad_position"):
        positions_from_mask([[1, 1]], pad_position=0.5)


def test_positions_from_mask_is_exported():
    assert "positions_from_mask" in cposembed.__all__
    assert cposembed.positions_from_mask is positions_from_mask


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


def test_train_command_takes_an_optimizer(tmp_path):
    args = ["train", "--steps", "20", "--max-seq-len", "16", "--embed-dim", "8", "--no-progress"]
    sgd = run_cli([*args, "--optimizer", "sgd", "--out", str(tmp_path)], cwd=tmp_path)
    assert sgd.returncode == 0, sgd.stderr
    assert "SGD lr 5, seed 0" in sgd.stdout
    adam = run_cli([*args, "--out", str(tmp_path)], cwd=tmp_path)
    assert adam.returncode == 0, adam.stderr
    assert "Adam lr 0.01, seed 0" in adam.stdout
    adjacent_line(adam.stdout)
    bad = run_cli([*args, "--optimizer", "adam", "--lr", "-1"], cwd=tmp_path)
    assert bad.returncode == 2 and "--lr" in bad.stderr


def run_cli(args, cwd, block_matplotlib=False):
    code = "import sys\n"
    if block_matplotlib:
        code += "sys.modules['matplotlib'] = None\n"
    code += "from cposembed.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        check=False,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def adjacent_line(stdout):
    line = next(s for s in stdout.splitlines() if "adjacent positions" in s)
    before = float(line.split("before ")[1].split(",")[0])
    after = float(line.split("after ")[1])
    return before, after


def test_train_command(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "pics"
    proc = run_cli(
        [
            "train",
            "--steps",
            "60",
            "--max-seq-len",
            "32",
            "--embed-dim",
            "16",
            "--seed",
            "3",
            "--out",
            str(out),
            "--save",
            str(tmp_path / "trained"),
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    before, after = adjacent_line(proc.stdout)
    assert after > before + 0.3
    assert "training [" in proc.stderr or "training:" in proc.stderr  # the progress bar
    names = sorted(os.listdir(out))
    assert names == sorted(cposembed.train.PICTURES)
    for name in names:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pe = LearnedPositionEmbedding.load(tmp_path / "trained")
    assert pe.embeddings.shape == (32, 16)


def test_train_command_without_matplotlib(tmp_path):
    proc = run_cli(
        ["train", "--steps", "20", "--max-seq-len", "16", "--embed-dim", "8", "--no-progress"],
        cwd=tmp_path,
        block_matplotlib=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "skipped the pictures" in proc.stdout
    assert 'pip install ".[plot]"' in proc.stdout
    assert os.listdir(tmp_path) == []
    adjacent_line(proc.stdout)


def test_train_command_rejects_bad_options(tmp_path):
    proc = run_cli(["train", "--steps", "0"], cwd=tmp_path)
    assert proc.returncode == 2 and "--steps" in proc.stderr


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


def test_unpickles_an_instance_pickled_before_padding_idx_existed():
    pe = LearnedPositionEmbedding(4, 2, seed=0)
    old_state = {"_embeddings": pe.embeddings.copy(), "grad": np.ones((4, 2), np.float32)}
    back = LearnedPositionEmbedding.__new__(LearnedPositionEmbedding)
    back.__setstate__(old_state)
    assert back.padding_idx is None and same_bits(back.embeddings, pe.embeddings)
    back.sgd_step(1.0)  # no bookkeeping: every row is updated
    assert same_bits(back.embeddings, pe.embeddings - np.float32(1.0))
