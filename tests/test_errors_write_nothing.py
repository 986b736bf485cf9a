"""Nothing lost: every error path leaves ``out``, ``grad`` and the table bitwise
untouched."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pytest
from helpers import tuned

import cposembed
from cposembed import LearnedPositionEmbedding, _blocks, _core, _marks, _threads, embedding

L, D = 64, 512


B, T = 4, 64


assert B * T * D >= 2 * _threads.SERIAL_THRESHOLD


def _pattern(shape, dtype, seed):
    """Random bits (finite values and NaNs with payloads): any write shows."""
    rng = np.random.RandomState(seed)
    dt = np.dtype(dtype)
    raw = rng.randint(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape).copy()


class Buffers(NamedTuple):
    table: np.ndarray
    grad: np.ndarray
    tokens: np.ndarray
    out: np.ndarray  # (B, T, D) table dtype, for lookup/add_positions
    pos: np.ndarray  # (B, T) valid positions
    bad_pos: np.ndarray  # like pos, last entry out of range


@pytest.fixture(params=[np.float32, np.float64])
def buf(request):
    dt = request.param
    pos = np.random.RandomState(9).randint(-L, L, size=(B, T))
    bad = pos.copy()
    bad[-1, -1] = L
    return Buffers(
        _pattern((L, D), dt, 1),
        _pattern((L, D), dt, 2),
        _pattern((B, T, D), dt, 3),
        _pattern((B, T, D), dt, 4),
        pos,
        bad,
    )


class Case(NamedTuple):
    error: type
    match: str
    call: Callable[[Buffers], object]


def _uint64_with_huge_last(pos):
    p = (pos % L).astype(np.uint64)
    p[-1, -1] = 2**63
    return p


def _readonly(a):
    a = a.view()
    a.setflags(write=False)
    return a


CASES = {
    # -- lookup ------------------------------------------------------------
    "lookup/position-too-big": Case(
        IndexError, "out of range", lambda b: cposembed.lookup(b.table, b.bad_pos, out=b.out)
    ),
    "lookup/position-too-negative": Case(
        IndexError,
        "out of range",
        lambda b: cposembed.lookup(
            b.table, np.where(b.pos == b.pos[-1, -1], -L - 1, b.pos), out=b.out
        ),
    ),
    "lookup/uint64-beyond-int64": Case(
        IndexError,
        "out of range",
        lambda b: cposembed.lookup(b.table, _uint64_with_huge_last(b.pos), out=b.out),
    ),
    "lookup/list-with-huge-int": Case(
        IndexError,
        "out of range",
        lambda b: cposembed.lookup(b.table, list(b.pos[0]) + [2**70], out=b.out[0, :1]),
    ),
    "lookup/float-positions": Case(
        IndexError, "integer", lambda b: cposembed.lookup(b.table, b.pos.astype(float), out=b.out)
    ),
    "lookup/out-wrong-shape": Case(
        ValueError, "shape", lambda b: cposembed.lookup(b.table, b.pos[:, 1:], out=b.out)
    ),
    "lookup/out-wrong-dtype": Case(
        TypeError,
        "dtype",
        lambda b: cposembed.lookup(
            b.table.astype(np.float32 if b.table.dtype == np.float64 else np.float64),
            b.pos,
            out=b.out,
        ),
    ),
    "lookup/out-read-only": Case(
        ValueError, "read-only", lambda b: cposembed.lookup(b.table, b.pos, out=_readonly(b.out))
    ),
    "lookup/out-not-ndarray": Case(
        TypeError, "out", lambda b: cposembed.lookup(b.table, b.pos, out=b.out.tolist())
    ),
    "lookup/bad-num-threads": Case(
        ValueError,
        "num_threads",
        lambda b: cposembed.lookup(b.table, b.pos, out=b.out, num_threads=0),
    ),
    "lookup/numpy-path-out-wrong-shape": Case(
        ValueError, "shape", lambda b: cposembed.lookup(b.table, (slice(None), 0), out=b.out)
    ),
    "lookup/table-wrong-dtype": Case(
        TypeError, "dtype", lambda b: cposembed.lookup(b.table.astype(np.float16), b.pos, out=b.out)
    ),
    "lookup/table-not-2d": Case(
        ValueError, "2-D", lambda b: cposembed.lookup(b.table[None], b.pos, out=b.out)
    ),
    # -- add_positions (out may be tokens itself) -----------------------------
    "add/position-too-big": Case(
        IndexError,
        "out of range",
        lambda b: cposembed.add_positions(b.tokens, b.table, b.bad_pos, out=b.out),
    ),
    "add/position-too-big-in-place": Case(
        IndexError,
        "out of range",
        lambda b: cposembed.add_positions(b.tokens, b.table, b.bad_pos, out=b.tokens),
    ),
    "add/offset-past-end-in-place": Case(
        IndexError,
        "out of range",
        lambda b: cposembed.add_positions(b.tokens, b.table, offset=L - T + 1, out=b.tokens),
    ),
    "add/negative-offset": Case(
        ValueError,
        "offset",
        lambda b: cposembed.add_positions(b.tokens, b.table, offset=-1, out=b.tokens),
    ),
    "add/offset-not-int": Case(
        TypeError,
        "offset",
        lambda b: cposembed.add_positions(b.tokens, b.table, offset=1.0, out=b.tokens),
    ),
    "add/offset-with-positions": Case(
        ValueError,
        "offset",
        lambda b: cposembed.add_positions(b.tokens, b.table, b.pos, offset=1, out=b.tokens),
    ),
    "add/positions-do-not-broadcast": Case(
        ValueError,
        "broadcast",
        lambda b: cposembed.add_positions(b.tokens, b.table, b.pos[:, :-1], out=b.tokens),
    ),
    "add/positions-index-embedding-axis": Case(
        IndexError,
        "embedding axis",
        lambda b: cposembed.add_positions(b.tokens, b.table, (slice(None), 0), out=b.tokens),
    ),
    "add/tokens-wrong-d": Case(
        ValueError,
        "embed_dim",
        lambda b: cposembed.add_positions(b.tokens[..., :-1], b.table, out=b.out),
    ),
    "add/tokens-complex": Case(
        TypeError,
        "real",
        lambda b: cposembed.add_positions(b.tokens.astype(complex), b.table, out=b.out),
    ),
    "add/tokens-object": Case(
        TypeError,
        "real",
        lambda b: cposembed.add_positions(b.tokens.astype(object), b.table, out=b.out),
    ),
    "add/tokens-1d-no-positions": Case(
        ValueError,
        "shape",
        lambda b: cposembed.add_positions(b.tokens[0, 0], b.table, out=b.out[0, 0]),
    ),
    "add/out-wrong-shape": Case(
        ValueError, "shape", lambda b: cposembed.add_positions(b.tokens[:, 1:], b.table, out=b.out)
    ),
    "add/out-wrong-dtype": Case(
        TypeError,
        "dtype",
        lambda b: cposembed.add_positions(
            b.tokens.astype(np.float16), b.table, out=b.out.astype(np.float16)
        ),
    ),
    "add/out-read-only": Case(
        ValueError,
        "read-only",
        lambda b: cposembed.add_positions(b.tokens, b.table, out=_readonly(b.out)),
    ),
    "add/bad-num-threads-in-place": Case(
        TypeError,
        "num_threads",
        lambda b: cposembed.add_positions(b.tokens, b.table, out=b.tokens, num_threads=2.0),
    ),
    # -- scatter_add ----------------------------------------------------------
    "scatter/position-too-big": Case(
        IndexError, "out of range", lambda b: cposembed.scatter_add(b.grad, b.tokens, b.bad_pos)
    ),
    "scatter/position-too-negative": Case(
        IndexError,
        "out of range",
        lambda b: cposembed.scatter_add(
            b.grad, b.tokens, np.concatenate([b.pos.ravel()[:-1], [-L - 1]]).reshape(B, T)
        ),
    ),
    "scatter/offset-past-end": Case(
        IndexError,
        "out of range",
        lambda b: cposembed.scatter_add(b.grad, b.tokens, offset=L - T + 1),
    ),
    "scatter/negative-offset": Case(
        ValueError, "offset", lambda b: cposembed.scatter_add(b.grad, b.tokens, offset=-3)
    ),
    "scatter/offset-with-positions": Case(
        ValueError, "offset", lambda b: cposembed.scatter_add(b.grad, b.tokens, b.pos, offset=2)
    ),
    "scatter/positions-do-not-broadcast": Case(
        ValueError, "broadcast", lambda b: cposembed.scatter_add(b.grad, b.tokens, b.pos.T)
    ),
    "scatter/grad-output-wrong-d": Case(
        ValueError, "embed_dim", lambda b: cposembed.scatter_add(b.grad, b.tokens[..., 1:])
    ),
    "scatter/grad-output-strings": Case(
        TypeError, "real", lambda b: cposembed.scatter_add(b.grad, b.tokens.astype("U8"))
    ),
    "scatter/grad-read-only": Case(
        ValueError, "read-only", lambda b: cposembed.scatter_add(_readonly(b.grad), b.tokens)
    ),
    "scatter/grad-wrong-dtype": Case(
        TypeError, "dtype", lambda b: cposembed.scatter_add(b.grad.view(np.uint8), b.tokens)
    ),
    "scatter/grad-not-ndarray": Case(
        TypeError, "ndarray", lambda b: cposembed.scatter_add(b.grad.tolist(), b.tokens)
    ),
    "scatter/bad-num-threads": Case(
        ValueError,
        "num_threads",
        lambda b: cposembed.scatter_add(b.grad, b.tokens, b.pos, num_threads=-1),
    ),
    "scatter/positions-index-embedding-axis": Case(
        IndexError,
        "embedding axis",
        lambda b: cposembed.scatter_add(b.grad, b.tokens, (slice(None), 0)),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_error_path_writes_nothing(name, buf):
    case = CASES[name]
    before = {k: getattr(buf, k).tobytes() for k in ("table", "grad", "tokens", "out")}
    with pytest.raises(case.error, match=case.match), np.errstate(all="ignore"):
        case.call(buf)
    for k, data in before.items():
        assert getattr(buf, k).tobytes() == data, f"{name}: {k} was written"


# -- the class: table, grad and out ------------------------------------------------
@pytest.fixture(params=[np.float32, np.float64])
def pe(request):
    pe = LearnedPositionEmbedding.from_pretrained(
        _pattern((L, D), request.param, 5), dtype=request.param
    )
    return pe


def _snapshot(pe):
    return pe.embeddings.tobytes(), None if pe.grad is None else pe.grad.tobytes()


CLASS_CASES = {
    "call/out-of-range": lambda pe, b: pe(b.bad_pos, out=b.out),
    "call/out-read-only": lambda pe, b: pe(b.pos, out=_readonly(b.out)),
    "add_to/out-of-range-in-place": lambda pe, b: pe.add_to(b.tokens, b.bad_pos, out=b.tokens),
    "add_to/offset-past-end": lambda pe, b: pe.add_to(b.tokens, offset=L, out=b.out),
    "backward/out-of-range": lambda pe, b: pe.backward(b.tokens, b.bad_pos),
    "backward/offset-past-end": lambda pe, b: pe.backward(b.tokens, offset=L - T + 1),
    "backward/wrong-d": lambda pe, b: pe.backward(b.tokens[..., :-1]),
    "backward/complex": lambda pe, b: pe.backward(b.tokens * 1j),
    "embeddings-setter/wrong-shape": lambda pe, b: setattr(pe, "embeddings", b.table[:-1]),
    "embeddings-setter/strings": lambda pe, b: setattr(pe, "embeddings", b.table.astype("U4")),
}


@pytest.mark.parametrize("warm", [False, True], ids=["no-grad-yet", "grad-accumulated"])
@pytest.mark.parametrize("name", list(CLASS_CASES))
def test_class_error_path_writes_nothing(name, warm, pe):
    b = Buffers(
        pe.embeddings,
        None,
        _pattern((B, T, D), pe.dtype, 6),
        _pattern((B, T, D), pe.dtype, 7),
        np.random.RandomState(3).randint(0, L, size=(B, T)),
        None,
    )
    bad = b.pos.copy()
    bad[-1, -1] = -L - 1
    b = b._replace(bad_pos=bad)
    if warm:
        pe.backward(np.ones((B, T, D), pe.dtype), b.pos)
    table0, grad0 = _snapshot(pe)
    tok0, out0 = b.tokens.tobytes(), b.out.tobytes()
    with pytest.raises((IndexError, TypeError, ValueError)), np.errstate(all="ignore"):
        CLASS_CASES[name](pe, b)
    assert _snapshot(pe) == (table0, grad0)
    assert b.tokens.tobytes() == tok0 and b.out.tobytes() == out0
    if not warm:
        assert pe.grad is None


# ------------------------------------------------------- no memory for scratch

_NO_POSITIONS = "cannot allocate the buffer for the call's positions"


def _scratch_failure_calls():
    """(name, call, failures spared, message, arrays the call may write)."""
    rng = np.random.default_rng(5)
    table = rng.standard_normal((1000, 4)).astype(np.float32)
    many = rng.integers(0, 1000, 600)  # beyond the Index's inline rows
    tokens = rng.standard_normal((1, 600, 4)).astype(np.float32)
    grad = np.zeros((1000, 4), np.float32)
    g = rng.standard_normal((3, 4)).astype(np.float32)
    touched = _marks.RowMarks(1000)
    ids = rng.integers(0, 1000, (1, 600))
    pair = (np.zeros((1000, 4), np.float32), np.zeros((1000, 4), np.float32))
    marks = (_marks.RowMarks(1000), _marks.RowMarks(1000))
    out = np.full((600, 4), 7.0, np.float32)
    return [
        ("lookup", lambda: _core.lookup(table, many, out, None), 0, _NO_POSITIONS, [out]),
        ("public lookup", lambda: cposembed.lookup(table, many, out=out), 0, _NO_POSITIONS, [out]),
        (
            "pe",
            lambda: embedding.LearnedPositionEmbedding(1000, 4, seed=0)(many),
            0,
            _NO_POSITIONS,
            [],
        ),
        ("add arange", lambda: _core.add(tokens, table, None, 0, None, None), 0, _NO_POSITIONS, []),
        (
            "add",
            lambda: _core.add(tokens, table, many, 0, tokens, None),
            0,
            _NO_POSITIONS,
            [tokens],
        ),
        # Three positions into 1000 rows: the sparse plan's two blocks come first.
        (
            "scatter_add",
            lambda: _core.scatter_add(grad, g, [1, 2, 1], 0, None, touched, 2),
            2,
            "cannot allocate the scatter-add's scratch",
            [grad, touched.mask],
        ),
        (
            "scatter_add sparse plan",
            lambda: _core.scatter_add(grad, g, [1, 2, 1], 0, None, touched, 2),
            0,
            "cannot allocate the sparse plan's scratch",
            [grad, touched.mask],
        ),
        (
            "scatter_add sparse rows",
            lambda: _core.scatter_add(grad, g, [1, 2, 1], 0, None, touched, 2),
            1,
            "cannot allocate the sparse plan's rows",
            [grad, touched.mask],
        ),
        (
            "public scatter_add",
            lambda: cposembed.scatter_add(grad, g, [1, 2, 1]),
            2,
            "cannot allocate the scatter-add's scratch",
            [grad],
        ),
        (
            "sgd_step",
            lambda: _core.sgd_step(table, grad, touched, 0.5, -1),
            0,
            "cannot allocate the SGD step's row list",
            [table],
        ),
        (
            "embed ids",
            lambda: _core.embed(ids, table, table, None, 0, None, None),
            0,
            _NO_POSITIONS,
            [],
        ),
        (
            "embed positions",
            lambda: _core.embed(ids, table, table, None, 0, None, None),
            1,
            _NO_POSITIONS,
            [],
        ),
        (
            "embed_backward",
            lambda: _core.embed_backward(*pair, tokens, ids, None, 0, 2, *marks, 3),
            2,
            "cannot allocate the backward pass's scratch",
            [*pair, marks[0].mask, marks[1].mask],
        ),
        (
            "embed_backward positions",
            lambda: _core.embed_backward(*pair, tokens, ids, None, 0, 2, *marks, 3),
            1,
            _NO_POSITIONS,
            [*pair, marks[0].mask, marks[1].mask],
        ),
    ]


@pytest.mark.parametrize(
    "case",
    range(len(_scratch_failure_calls())),
    ids=[c[0] for c in _scratch_failure_calls()],
)
def test_no_memory_for_scratch_is_a_memory_error_with_nothing_written(case):
    """Each entry's allocation failure: its MemoryError, raised where the
    allocation failed, nothing written, and nothing left behind: the same
    call runs once memory is back."""
    name, call, spared, message, written = _scratch_failure_calls()[case]
    if name == "embed_backward" and not _core.openmp_enabled():
        pytest.skip("one thread: the backward pass needs no scratch")
    before = [a.copy() for a in written]
    with tuned(serial_below=1):  # two threads where asked: the pair's scratch
        _blocks.fail_scratch(1, after=spared)
        try:
            with pytest.raises(MemoryError, match=f"^{message}$"):
                call()
        finally:
            left = _blocks.fail_scratch(0)
        assert left == 0  # the failure was the call's, not a later one's
        for a, b in zip(written, before):
            assert np.array_equal(a, b)
        assert call() is not None
