"""The argument checks every operation shares: one integer checker, one table
checker, offsets, masked arrays and other subclasses, NumPy scalars in messages,
framework tensors in from_pretrained; huge shapes, extreme positions, either
byte order and NaN/Inf, property-based."""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest
from helpers import run_python
from hypothesis import assume, given
from hypothesis import strategies as st
from strategies import (
    same_bits,
    same_values,
    tables,
)

import cposembed
from cposembed import LearnedPositionEmbedding, NotAnIntegerError
from cposembed._validation import check_int, describe

INTEGERS = [3, np.int8(3), np.uint16(3), np.int64(3), np.uint64(3), np.array(3)]


NOT_INTEGERS = [1.5, 3.0, "3", None, True, np.bool_(True), np.float32(3), [3], np.array([3])]


@pytest.mark.parametrize("value", INTEGERS)
def test_check_int_accepts_every_integer_form(value):
    n = check_int(value, "n", min_value=1)
    assert n == 3 and type(n) is int


@pytest.mark.parametrize("value", NOT_INTEGERS)
def test_check_int_refuses_non_integers_with_the_public_error(value):
    with pytest.raises(NotAnIntegerError, match="n must be a positive integer") as info:
        check_int(value, "n", min_value=1)
    # A TypeError as NumPy and torch raise; a ValueError as the handbook's API promises.
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert type(info.value) is cposembed.NotAnIntegerError


@pytest.mark.parametrize(
    "call",
    [
        lambda: LearnedPositionEmbedding(16.0, 4),
        lambda: LearnedPositionEmbedding(16, "4"),
        lambda: cposembed.TokenPositionEmbedding(10.0, 8, 4),
        lambda: LearnedPositionEmbedding(16, 4).resized(8.0),
        lambda: cposembed.set_num_threads("2"),
        lambda: cposembed.lookup(np.ones((4, 2)), [0], num_threads=2.0),
    ],
)
def test_non_integer_sizes_and_counts_raise_the_public_type_error(call):
    with pytest.raises(TypeError) as info:
        call()
    assert type(info.value) is NotAnIntegerError and "must be a positive integer" in str(info.value)
    assert NotAnIntegerError.__module__ == "cposembed"


@pytest.mark.parametrize("value", [0, -1, np.int64(-5)])
def test_check_int_range_is_a_value_error_with_python_values(value):
    with pytest.raises(ValueError, match=r"got -?\d+$") as info:
        check_int(value, "n", min_value=1)
    assert not isinstance(info.value, TypeError)
    assert "np." not in str(info.value)


def test_describe_prints_numpy_scalars_as_python_values():
    assert describe(np.int64(2)) == "int 2"
    assert describe(np.float32(1.5)) == "float 1.5"
    assert "np." not in describe(np.uint64(2**64 - 1))


@pytest.mark.parametrize("name", ["max_seq_len", "embed_dim"])
@pytest.mark.parametrize("bad", [1.5, 0, True, "4"])
def test_constructor_sizes_raise_value_error_naming_the_argument(name, bad):
    kwargs = {"max_seq_len": 4, "embed_dim": 2, name: bad}
    with pytest.raises(ValueError, match=name):
        LearnedPositionEmbedding(**kwargs)


@pytest.mark.parametrize("bad", [1.5, True, "0", np.float64(1.0)])
def test_padding_idx_must_be_an_integer(bad):
    with pytest.raises(TypeError, match="padding_idx"):
        LearnedPositionEmbedding(4, 2, padding_idx=bad)


def test_padding_idx_numpy_integer_is_accepted():
    pe = LearnedPositionEmbedding(4, 2, seed=0, padding_idx=np.int64(-1))
    assert pe.padding_idx == 3 and type(pe.padding_idx) is int


# --- offsets -----------------------------------------------------------------
@pytest.mark.parametrize("offset", [np.int8(2), np.uint64(2), np.int64(2), np.array(2)])
def test_numpy_integer_offsets_match_python_int(offset):
    table = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    tok = np.ones((2, 3, 3), np.float32)
    want = tok + table[2:5]
    assert np.array_equal(cposembed.add_positions(tok, table, offset=offset), want)
    pe = LearnedPositionEmbedding.from_pretrained(table)
    assert np.array_equal(pe.add_to(tok, offset=offset), want)


@pytest.mark.parametrize("offset", [np.array([1, 2]), [1, 2], 1.0, np.float64(1), True])
def test_array_or_float_offset_gets_a_worded_error(offset):
    table = np.zeros((8, 3), np.float32)
    tok = np.ones((2, 3, 3), np.float32)
    with pytest.raises((TypeError, ValueError), match="offset must be"):
        cposembed.add_positions(tok, table, offset=offset)
    grad = np.zeros_like(table)
    with pytest.raises((TypeError, ValueError), match="offset must be"):
        cposembed.scatter_add(grad, tok, offset=offset)
    assert not grad.any()


def test_array_offset_points_to_explicit_positions():
    with pytest.raises(TypeError, match="positions_from_mask"):
        cposembed.add_positions(np.ones((2, 1, 3)), np.zeros((8, 3)), offset=np.array([1, 2]))


@pytest.mark.parametrize("offset", [-1, np.int64(-1), 2**63, 2**100])
def test_offsets_out_of_range(offset):
    table = np.zeros((8, 3), np.float32)
    tok = np.ones((2, 3, 3), np.float32)
    with pytest.raises((ValueError, IndexError), match="offset"):
        cposembed.add_positions(tok, table, offset=offset)


def test_huge_offset_with_no_tokens_looks_nothing_up():
    table = np.zeros((8, 3), np.float32)
    tok = np.ones((2, 0, 3), np.float32)
    assert cposembed.add_positions(tok, table, offset=2**70).shape == (2, 0, 3)


# --- masked arrays and other subclasses ------------------------------------
def _masked(shape):
    data = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    return np.ma.masked_array(data, mask=data % 2 == 0)


def test_masked_tokens_are_refused_not_silently_unmasked():
    pe = LearnedPositionEmbedding(8, 3, seed=0)
    tok = _masked((2, 4, 3))
    with pytest.raises(TypeError, match="masked"):
        pe.add_to(tok)
    with pytest.raises(TypeError, match="masked"):
        pe.add_to(tok, np.arange(4))
    with pytest.raises(TypeError, match="masked"):
        cposembed.add_positions(tok, pe.embeddings, out=tok)
    assert np.array_equal(tok.data, np.arange(24, dtype=np.float32).reshape(2, 4, 3))


def test_masked_table_positions_grad_and_out_are_refused():
    table = np.zeros((8, 3), np.float32)
    with pytest.raises(TypeError, match="masked"):
        cposembed.lookup(_masked((8, 3)), [0])
    with pytest.raises(TypeError, match="masked"):
        cposembed.lookup(table, np.ma.masked_array([0, 1], mask=[0, 1]))
    grad = _masked((8, 3))
    before = grad.data.copy()
    with pytest.raises(TypeError, match="masked"):
        cposembed.scatter_add(grad, np.ones((2, 3), np.float32), [0, 1])
    assert np.array_equal(grad.data, before)
    out = _masked((2, 3))
    with pytest.raises(TypeError, match="masked"):
        cposembed.lookup(table, [0, 1], out=out)
    with pytest.raises(TypeError, match="masked"):
        LearnedPositionEmbedding.from_pretrained(_masked((8, 3)))


class Tagged(np.ndarray):
    """A subclass without semantics of its own (as np.memmap for the kernels)."""


def test_plain_subclasses_are_read_and_written_as_their_memory():
    rng = np.random.default_rng(1)
    table = rng.standard_normal((8, 3)).astype(np.float32)
    t_sub = table.view(Tagged)
    pos = np.array([1, 7, 0]).view(Tagged)
    assert np.array_equal(cposembed.lookup(t_sub, pos), table[[1, 7, 0]])
    out = np.zeros((3, 3), np.float32).view(Tagged)
    cposembed.lookup(table, [1, 7, 0], out=out)
    assert np.array_equal(out, table[[1, 7, 0]])
    tok = rng.standard_normal((3, 3)).astype(np.float32).view(Tagged)
    want = np.asarray(tok) + table[[1, 7, 0]]
    cposembed.add_positions(tok, table, [1, 7, 0], out=tok)
    assert np.array_equal(np.asarray(tok), want)
    grad = np.zeros_like(table).view(Tagged)
    cposembed.scatter_add(grad, np.ones((3, 3), np.float32), [1, 1, 0])
    assert np.array_equal(np.asarray(grad)[:2], [[1, 1, 1], [2, 2, 2]])


def test_memmap_table_and_output(tmp_path):
    table = np.lib.format.open_memmap(tmp_path / "t.npy", "w+", np.float32, (6, 4))
    table[:] = np.arange(24).reshape(6, 4)
    out = np.memmap(tmp_path / "o.bin", np.float32, "w+", shape=(2, 4))
    cposembed.lookup(table, [5, 0], out=out)
    assert np.array_equal(out, np.asarray(table)[[5, 0]])


# --- from_pretrained takes any array-like ----------------------------------
class FakeTensor:
    """What from_pretrained needs of a framework tensor that requires grad:
    ``__array__`` refuses (as torch does) and ``.detach().cpu()`` gives values."""

    def __init__(self, values, requires_grad=True):
        self.values = np.asarray(values)
        self.requires_grad = requires_grad

    def __array__(self, dtype=None, copy=None):
        if self.requires_grad:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad")
        return self.values if dtype is None else self.values.astype(dtype)

    def detach(self):
        return FakeTensor(self.values, requires_grad=False)

    def cpu(self):
        return self


def test_from_pretrained_copies_a_tensor_that_requires_grad():
    values = np.arange(6.0).reshape(3, 2)
    pe = LearnedPositionEmbedding.from_pretrained(FakeTensor(values), dtype=np.float64)
    assert np.array_equal(pe.embeddings, values)
    values[0, 0] = 99  # a copy, not a view
    assert pe.embeddings[0, 0] == 0


def test_from_pretrained_big_endian_and_lists():
    big = np.arange(6, dtype=">f8").reshape(3, 2)
    pe = LearnedPositionEmbedding.from_pretrained(big, dtype=np.float64)
    assert pe.embeddings.dtype == np.float64 and pe.embeddings.dtype.isnative
    assert np.array_equal(pe.embeddings, big)
    pe = LearnedPositionEmbedding.from_pretrained([[1, 2], [3, 4]])
    assert pe.embeddings.dtype == np.float32


def test_in_place_add_with_read_only_tokens_viewing_out():
    """The tokens a read-only view of `out`'s memory: NumPy's np.add(tok, rows, out=buf)."""
    table = np.random.default_rng(3).standard_normal((8, 3)).astype(np.float32)
    buf = np.ones((2, 4, 3), np.float32)
    tok = buf.view()
    tok.flags.writeable = False
    want = np.asarray(tok) + table[:4]
    assert cposembed.add_positions(tok, table, out=buf) is buf
    assert np.array_equal(buf, want)


@pytest.mark.skipif(
    "asan" in os.environ.get("LD_PRELOAD", ""), reason="ASan needs far more address space"
)
def test_no_memory_for_the_positions_buffer_is_a_memory_error():
    """Not an internal error: the entry says why it cannot run."""
    code = textwrap.dedent(
        """
        import resource
        import numpy as np
        import cposembed
        table = np.zeros((4, 1), np.float32)
        pos = np.zeros(80_000_000, ">i8")  # byte-swapped: normalised into a fresh copy
        resource.setrlimit(resource.RLIMIT_AS, (1_700_000_000, resource.RLIM_INFINITY))
        try:
            cposembed.lookup(table, pos)
        except MemoryError as exc:
            print("MemoryError", exc)
        """
    )
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("MemoryError"), proc.stdout + proc.stderr[-1000:]
    assert "positions" in proc.stdout  # the entry's own, not a later allocation's


_HUGE_SCRIPT = textwrap.dedent(
    """
    import json, numpy as np, cposembed
    from cposembed import _core
    table = np.ones((10, 2), np.float32)
    results = {}
    for shape in [(2**62,), (3, 2**61), (2**58,), (1, 2**62)]:
        for dtype in (np.int8, np.uint8):
            pos = np.broadcast_to(np.zeros((), dtype), shape)
            calls = {
                "core.lookup": lambda: _core.lookup(table, pos, None, None),
                "core.lookup(1)": lambda: _core.lookup(table, pos, None, 1),
                "core.add": lambda: _core.add(np.ones((1, 2), np.float32), table, pos, 0, None, None),
                "core.scatter": lambda: _core.scatter_add(np.zeros((10, 2), np.float32),
                                                          np.ones((1, 2), np.float32), pos, 0, None),
                "lookup": lambda: cposembed.lookup(table, pos),
                "add": lambda: cposembed.add_positions(np.ones((1, 2), np.float32), table, pos),
                "scatter": lambda: cposembed.scatter_add(np.zeros((10, 2), np.float32),
                                                         np.ones((1, 2), np.float32), pos),
                "class": lambda: cposembed.LearnedPositionEmbedding(10, 2, seed=0)(pos),
            }
            for name, call in calls.items():
                try:
                    r = call()
                    outcome = "None" if r is None else "returned"
                except (MemoryError, ValueError) as exc:
                    outcome = type(exc).__name__
                results[f"{name} {shape} {np.dtype(dtype)}"] = outcome
    print(json.dumps(results))
    """
)


def test_huge_broadcast_positions_never_crash():
    """Stride-0 positions of 2**62 elements: MemoryError (no buffer for them can be
    had) or ValueError, from the entries and the public functions alike (a crash
    would kill only the child, and fail here)."""
    res = run_python(["-c", _HUGE_SCRIPT])
    assert res.returncode == 0, res.stderr[-2000:]
    results = json.loads(res.stdout)
    assert len(results) == 4 * 2 * 8
    for name, outcome in results.items():
        assert outcome in ("MemoryError", "ValueError"), (name, outcome)


@given(table=tables(), data=st.data())
def test_nan_inf_pass_through_unchanged(table, data):
    """Special values travel bit for bit through lookup and the table side of add."""
    L, d = table.shape
    assume(d > 0)
    table = table.copy()
    flat = table.reshape(-1)
    flat[data.draw(st.integers(0, flat.size - 1))] = data.draw(
        st.sampled_from([np.nan, np.inf, -np.inf, -0.0])
    )
    # A NaN with a payload, as a model checkpoint might carry one.
    bits = np.array([0x7FF8DEADBEEF0001], dtype=np.uint64).view(np.float64)
    flat[0] = bits[0].astype(table.dtype) if table.dtype == np.float64 else np.float32(np.nan)
    pos = np.arange(-L, L)
    assert same_bits(cposembed.lookup(table, pos), table[pos])
    zeros = np.zeros((2, L, d), dtype=table.dtype)
    assert same_values(cposembed.add_positions(zeros, table), zeros + table)
    grad = np.zeros_like(table)
    cposembed.scatter_add(grad, table[None], None)
    want = np.zeros_like(table)
    np.add.at(want, np.arange(L), table)
    assert same_values(grad, want)


# --- huge shapes: a clear error, never a crash or an attempt to touch memory ---
HUGE_SHAPES = [
    (2**40,),  # 1 Ti positions of int8 (a zero-stride view)
    (2**31, 2**31),  # B*T overflows int32 and B*T*d overflows int64
    (2**62,),  # B*T*d overflows int64 for any d > 1
    (3, 2**61),
]


@pytest.mark.parametrize("shape", HUGE_SHAPES)
def test_huge_shapes_raise_clear_errors(shape):
    table = np.zeros((4, 8), dtype=np.float32)
    pos = np.broadcast_to(np.int8(0), shape)
    big_rows = (
        np.broadcast_to(np.int8(1), shape + (8,))
        if np.prod(shape, dtype=object) * 8 < 2**63
        else None
    )
    with pytest.raises((ValueError, MemoryError, IndexError)):
        cposembed.lookup(table, pos)
    grad = np.zeros_like(table)
    if big_rows is not None:
        with pytest.raises((ValueError, MemoryError)):
            cposembed.add_positions(big_rows, table, pos)
        with pytest.raises((ValueError, MemoryError)):
            cposembed.scatter_add(grad, big_rows, pos)
        with pytest.raises((ValueError, MemoryError, IndexError)):
            cposembed.add_positions(big_rows, table)
    assert not grad.any()


def test_huge_table_view_raises_clear_error():
    table = np.broadcast_to(np.float32(0), (4, 2**45))
    with pytest.raises((ValueError, MemoryError)):
        cposembed.lookup(table, [0])


@pytest.mark.parametrize("bad", [-5, 4, -(2**63), 2**63 - 1, 2**63, 2**64, 2**100, -(2**100)])
def test_extreme_position_values(bad):
    """Out-of-range values of any magnitude: IndexError naming the value and range."""
    table = np.zeros((4, 2), dtype=np.float32)
    match = f"position {bad} is out of range.*-4 <= position < 4"
    for positions in (bad, [0, bad], [[0], [bad]]):
        with pytest.raises(IndexError, match=match):
            cposembed.lookup(table, positions)
        with pytest.raises(IndexError, match=match):
            cposembed.scatter_add(np.zeros_like(table), np.ones((2, 2)), [bad, 0])
    if -(2**63) <= bad < 2**64:
        arr = np.array([0, bad], dtype=np.uint64 if bad >= 2**63 else np.int64)
        with pytest.raises(IndexError, match=match):
            cposembed.lookup(table, arr)
        with pytest.raises(IndexError, match=match):
            cposembed.scatter_add(np.zeros_like(table), np.ones((2, 2)), arr)


@pytest.mark.parametrize("dtype", ["<f4", ">f4", "<f8", ">f8"])
def test_table_and_grad_in_either_byte_order(dtype):
    """A big-endian checkpoint is still float32/float64: same values as NumPy."""
    rng = np.random.RandomState(0)
    table = rng.randn(6, 3).astype(dtype)
    pos = np.array([[0, 5, -1], [2, 2, -6]])
    tok = rng.randn(2, 3, 3).astype(np.dtype(dtype).newbyteorder("="))
    assert np.array_equal(cposembed.lookup(table, pos), table[pos])
    assert np.array_equal(cposembed.add_positions(tok, table, pos), tok + table[pos])
    grad = np.zeros((6, 3), dtype=dtype)
    g = rng.randn(2, 3, 3)
    assert cposembed.scatter_add(grad, g, pos) is grad
    want = np.zeros((6, 3), dtype=dtype)
    np.add.at(want, pos, g)
    assert grad.dtype == np.dtype(dtype) and np.array_equal(grad, want)
