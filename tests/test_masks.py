"""positions_from_mask: against a plain loop, and near the int64 limits exact
positions or a ValueError, never a wrap."""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import same_bits
from hypothesis import given, settings
from hypothesis import strategies as st

import cposembed
import cposembed.train
from cposembed import LearnedPositionEmbedding, positions_from_mask


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


INT64_MAX = 2**63 - 1


INT64_MIN = -(2**63)


def positions_in_python(mask, offsets, pad):
    """Each row's positions with Python ints (no overflow possible)."""
    rows = []
    for row, off in zip(mask, offsets):
        seen = 0
        out = []
        for m in row:
            out.append(off + seen if m else pad)
            seen += int(m)
        rows.append(out)
    return rows


def fits(values) -> bool:
    return all(INT64_MIN <= x <= INT64_MAX for row in values for x in row)


near_limit = st.one_of(
    st.integers(0, 10),
    st.integers(INT64_MAX - 10, INT64_MAX + 10),
    st.integers(2**64 - 3, 2**64 - 1),
    st.integers(0, 2**64 - 1),
)


masks = st.integers(1, 4).flatmap(
    lambda b: st.integers(0, 5).flatmap(
        lambda t: st.lists(
            st.lists(st.integers(0, 1), min_size=t, max_size=t), min_size=b, max_size=b
        )
    )
)


@given(mask=masks, offset=near_limit, form=st.sampled_from(["int", "int64", "uint64", "0-d"]))
def test_scalar_offset_gives_exact_positions_or_refuses(mask, offset, form):
    if form == "int64" and offset > INT64_MAX:
        form = "int"
    if form == "uint64":
        arg = np.uint64(offset)
    elif form == "int64":
        arg = np.int64(offset)
    elif form == "0-d":
        arg = np.array(offset, dtype=np.uint64)
    else:
        arg = offset
    want = positions_in_python(mask, [offset] * len(mask), 0)
    if offset <= INT64_MAX and fits(want):
        got = positions_from_mask(mask, offset=arg)
        assert got.dtype == np.int64
        assert got.tolist() == want
    else:
        with pytest.raises(ValueError, match=f"offset {offset}|got {offset}"):
            positions_from_mask(mask, offset=arg)


@given(
    data=st.data(),
    mask=masks,
    dtype=st.sampled_from([np.uint64, np.int64, "list"]),
)
def test_per_row_offsets_give_exact_positions_or_refuse(data, mask, dtype):
    limit = INT64_MAX if dtype is np.int64 else 2**64 - 1
    offsets = data.draw(
        st.lists(near_limit.filter(lambda x: x <= limit), min_size=len(mask), max_size=len(mask))
    )
    arg = (
        offsets
        if dtype == "list" and max(offsets) <= INT64_MAX
        else np.array(offsets, dtype=np.uint64 if dtype == "list" else dtype)
    )
    want = positions_in_python(mask, offsets, 0)
    if max(offsets) <= INT64_MAX and fits(want):
        assert positions_from_mask(mask, offset=arg).tolist() == want
    else:
        with pytest.raises(ValueError, match="offset") as info:
            positions_from_mask(mask, offset=arg)
        # the message names an offset that does not fit, as a plain number
        named = [int(x) for x in re.findall(r"offset (\d+)|got (\d+)", str(info.value))[0] if x]
        assert named and named[0] in offsets
        assert "np." not in str(info.value)


def test_offsets_at_the_uint64_and_int64_limits_refuse_instead_of_wrapping():
    with pytest.raises(ValueError, match="18446744073709551615"):
        positions_from_mask([[1, 1]], offset=np.uint64(2**64 - 1))
    with pytest.raises(ValueError, match="offset 9223372036854775807"):
        positions_from_mask([[1, 1]], offset=2**63 - 1)
    # one token at the very last position fits
    assert positions_from_mask([[1, 0]], offset=2**63 - 1).tolist() == [[INT64_MAX, 0]]
    # a row without tokens uses no offset
    assert positions_from_mask([[0, 0], [1, 1]], offset=[INT64_MAX, 3]).tolist() == [
        [0, 0],
        [3, 4],
    ]


@pytest.mark.parametrize("pad", [2**63, -(2**63) - 1, 2**64, np.uint64(2**64 - 1)])
def test_pad_position_outside_int64_is_refused(pad):
    with pytest.raises(ValueError, match=f"pad_position.*got {int(pad)}$"):
        positions_from_mask([[0, 1]], pad_position=pad)


@pytest.mark.parametrize("pad", [INT64_MAX, INT64_MIN, np.int64(INT64_MIN), np.uint64(INT64_MAX)])
def test_pad_position_at_the_int64_limits_is_kept(pad):
    assert positions_from_mask([[0, 1]], pad_position=pad).tolist() == [[int(pad), 0]]


@pytest.mark.parametrize(
    "mask,shown",
    [(np.array([[1, 2]], np.int64), "2"), (np.array([[0.5]]), "0.5"), (np.array([[-1]]), "-1")],
)
def test_bad_mask_values_are_shown_as_python_values(mask, shown):
    with pytest.raises(ValueError) as info:
        positions_from_mask(mask)
    assert str(info.value).endswith(f"found {shown}"), str(info.value)


def test_a_negative_offset_in_an_array_is_shown_as_a_python_value():
    with pytest.raises(ValueError) as info:
        positions_from_mask([[1], [1]], offset=np.array([3, -2], np.int8))
    assert str(info.value).endswith("; got -2") and "non-negative" in str(info.value)
