"""Every bad input from API.md: the promised exception, a useful message, nothing written."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import cposembed
from cposembed import LearnedPositionEmbedding

L, D = 16, 4


@contextlib.contextmanager
def untouched(*arrays):
    """The block must raise and leave every array bitwise as it was."""
    before = [a.tobytes() for a in arrays]
    yield
    assert [a.tobytes() for a in arrays] == before


def _pe():
    pe = LearnedPositionEmbedding(L, D, seed=0)
    pe.backward(np.ones((1, 3, D), np.float32))
    return pe


# ---------------------------------------------------------------- constructor
@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", None, True, np.float64(3.0)])
@pytest.mark.parametrize("arg", ["max_seq_len", "embed_dim"])
def test_constructor_sizes(arg, bad):
    kwargs = {"max_seq_len": 8, "embed_dim": 4, arg: bad}
    with pytest.raises(ValueError, match=arg):
        LearnedPositionEmbedding(**kwargs)


@pytest.mark.parametrize(
    "bad",
    [np.int32, np.complex64, "foo", object, int, "bfloat17", "float8_e4m3fn", "V2", ">f2"],
)
def test_constructor_dtype(bad):
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64") as info:
        LearnedPositionEmbedding(8, 4, dtype=bad)
    assert "<class" not in str(info.value)  # a dtype by its name


@pytest.mark.parametrize(
    "bad, got",
    [(np.int8, "got int8"), (">f2", "got float16, big-endian"), ("foo", "got 'foo'")],
)
def test_constructor_dtype_names_what_came(bad, got):
    with pytest.raises(TypeError, match=f"{got}$"):
        LearnedPositionEmbedding(8, 4, dtype=bad)


@pytest.mark.parametrize(
    "table, exc",
    [
        (np.ones(4), ValueError),
        (np.ones((0, 4)), ValueError),
        (np.ones((2, 2, 2)), ValueError),
        (np.ones((3, 4), complex), TypeError),
        (np.array([["a"]]), TypeError),
    ],
)
def test_from_pretrained_bad_tables(table, exc):
    with pytest.raises(exc):
        LearnedPositionEmbedding.from_pretrained(table)


# ---------------------------------------------------------------- positions
@pytest.mark.parametrize(
    "positions, bad",
    [
        (L, L),
        (-L - 1, -L - 1),
        ([0, L], L),
        ([[-L - 1, 0]], -L - 1),
        (10**30, 10**30),
        (np.array([0, 5, L + 3], np.int8), L + 3),
        (np.array([2**40], np.uint64), 2**40),
        (np.array([2**64 - 1], np.uint64), 2**64 - 1),
        (np.array([-(2**31)], np.int32), -(2**31)),
        # every value below the range: the smallest is named, as pandas does
        ([-L - 5, -L - 1], -L - 5),
        (np.array([[-L - 1], [-3 * L]], np.int8), -3 * L),
        ([-(10**30), -L - 1], -(10**30)),
    ],
)
def test_out_of_range_names_value_and_range(positions, bad):
    pe = _pe()
    out = np.full(np.shape(positions) + (D,), 5.0, np.float32)
    with untouched(out, pe.embeddings), pytest.raises(IndexError) as info:
        pe(positions, out=out)
    msg = str(info.value)
    assert str(bad) in msg and str(-L) in msg and str(L) in msg


@pytest.mark.parametrize(
    "positions",
    [
        1.0,
        np.array([1.0, 2.0]),
        [0.5],
        "3",
        np.array(["a"]),
        object(),
        np.array([1 + 2j]),
        np.array([1, 2], dtype=object),
    ],
    ids=repr,
)
def test_non_integer_positions_raise_index_error(positions):
    pe = _pe()
    with pytest.raises(IndexError):
        pe(positions)
    with untouched(pe.grad), pytest.raises(IndexError):
        pe.backward(np.ones((np.size(positions), D)), positions)


def test_bad_positions_in_add_and_backward_write_nothing():
    pe = _pe()
    tok = np.ones((2, 3, D), np.float32)
    out = np.zeros_like(tok)
    for kwargs in ({"positions": [0, 1, L]}, {"offset": L - 2}, {"positions": [[-L - 1]]}):
        with untouched(tok, out, pe.embeddings, pe.grad), pytest.raises(IndexError):
            pe.add_to(tok, out=out, **kwargs)
        with untouched(pe.grad), pytest.raises(IndexError):
            pe.backward(tok, **kwargs)


def test_first_backward_error_leaves_grad_none():
    pe = LearnedPositionEmbedding(L, D, seed=0)
    with pytest.raises(IndexError):
        pe.backward(np.ones((3, D)), [0, 1, L])
    assert pe.grad is None


# ---------------------------------------------------------------- add / backward inputs
@pytest.mark.parametrize(
    "tokens, exc, words",
    [
        (np.ones((2, 3, D + 1), np.float32), ValueError, "(..., 4)"),
        (np.ones((2, 3, D), complex), TypeError, "complex"),
        (np.array([[["a"] * D]]), TypeError, "<U1"),
        (np.ones((2, 3, D), object), TypeError, "object"),
        (np.ones(D, np.float32), ValueError, "(..., T, d)"),
        (np.float32(1.0), ValueError, "(..., 4)"),
    ],
)
def test_add_to_bad_tokens(tokens, exc, words):
    pe = _pe()
    with untouched(pe.embeddings), pytest.raises(exc) as info:
        pe.add_to(tokens)
    assert words in str(info.value)


@pytest.mark.parametrize(
    "grad_output, exc",
    [
        (np.ones((2, 3, D + 1)), ValueError),
        (np.ones((2, 3, D), complex), TypeError),
        (np.ones((2, 3, D), object), TypeError),
        (np.ones(D), ValueError),
    ],
)
def test_backward_bad_grad_output(grad_output, exc):
    pe = _pe()
    with untouched(pe.grad, pe.embeddings), pytest.raises(exc):
        pe.backward(grad_output)


def test_positions_that_do_not_broadcast():
    pe = _pe()
    tok = np.ones((2, 3, D), np.float32)
    for positions in (np.zeros(4, int), np.zeros((3, 3), int), np.zeros((2, 2, 3), int)):
        with untouched(tok, pe.grad), pytest.raises(ValueError, match="broadcast"):
            pe.add_to(tok, positions, out=tok)
        with untouched(pe.grad), pytest.raises(ValueError, match="broadcast"):
            pe.backward(tok, positions)


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"offset": -1}, ValueError, "non-negative"),
        ({"offset": 1.5}, TypeError, "offset"),
        ({"offset": 2, "positions": [0, 1, 2]}, ValueError, "positions=None"),
        ({"offset": True}, TypeError, "offset"),
    ],
)
def test_offset_rules(kwargs, exc, words):
    pe = _pe()
    tok = np.ones((2, 3, D), np.float32)
    with untouched(tok, pe.grad), pytest.raises(exc, match=words):
        pe.add_to(tok, out=tok, **kwargs)
    with untouched(pe.grad), pytest.raises(exc, match=words):
        pe.backward(tok, **kwargs)


def test_index_into_embedding_axis_only_for_lookup():
    pe = _pe()
    with pytest.raises(IndexError, match="rows of the table"):
        pe.add_to(np.ones((L, D), np.float32), (slice(None), 0))


# ---------------------------------------------------------------- out
def test_bad_out():
    pe = _pe()
    tok = np.ones((2, 3, D), np.float32)
    ro = np.zeros((2, 3, D), np.float32)
    ro.flags.writeable = False
    cases = [
        (np.zeros((2, 3, D + 1), np.float32), ValueError, "shape"),
        (np.zeros((2, 3, D), np.float64), TypeError, "dtype"),
        (ro, ValueError, "read-only"),
        ([[0.0] * D], TypeError, "ndarray"),
    ]
    for out, exc, words in cases:
        with pytest.raises(exc, match=words):
            pe([[0, 1, 2], [3, 4, 5]], out=out)
        with pytest.raises(exc, match=words):
            pe.add_to(tok, out=out)
        if isinstance(out, np.ndarray):
            assert not out.any()


# ---------------------------------------------------------------- functional specifics
def test_functional_bad_tables_and_grad_tables():
    g = np.ones((3, D))
    with pytest.raises(TypeError, match="float32 or float64"):
        cposembed.lookup(np.ones((L, D), np.int64), [0])
    with pytest.raises(ValueError, match="2-D"):
        cposembed.lookup(np.ones(L), [0])
    with pytest.raises(TypeError, match="float32 or float64"):
        cposembed.scatter_add(np.zeros((L, D), np.int32), g, [0, 1, 2])
    with pytest.raises(TypeError, match="ndarray"):
        cposembed.scatter_add([[0.0] * D] * L, g, [0, 1, 2])
    ro = np.zeros((L, D))
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        cposembed.scatter_add(ro, g, [0, 1, 2])


@pytest.mark.parametrize(
    "bad, exc",
    [(0, ValueError), (-2, ValueError), ("2", TypeError), (1.5, TypeError), (True, TypeError)],
)
def test_bad_num_threads(bad, exc):
    table = np.ones((L, D))
    grad = np.zeros((L, D))
    with pytest.raises(exc, match="num_threads"):
        cposembed.lookup(table, [0], num_threads=bad)
    with untouched(grad), pytest.raises(exc, match="num_threads"):
        cposembed.scatter_add(grad, np.ones((1, D)), [0], num_threads=bad)
    with pytest.raises(exc, match="num_threads"):
        cposembed.set_num_threads(bad)


def test_messages_show_numpy_scalars_as_python_values():
    table = np.zeros((5, 3), np.float32)
    with pytest.raises(IndexError) as info:
        cposembed.lookup(table, [np.float32(1.5), 2])
    assert "np." not in str(info.value), str(info.value)
    with pytest.raises(ValueError) as info:
        LearnedPositionEmbedding(4, 2).resized(8, method=np.str_("cubic"))
    assert "np." not in str(info.value), str(info.value)


def test_backward_into_an_int32_user_grad_names_grad():
    pe = LearnedPositionEmbedding(5, 3, seed=0)
    pe.grad = np.zeros((5, 3), np.int32)
    with pytest.raises(TypeError, match=r"\bgrad\b"):
        pe.backward(np.ones((2, 3), np.float32), [0, 1])
    assert not pe.grad.any()
