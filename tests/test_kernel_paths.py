"""Every internal path of the kernels against NumPy / np.add.at.

Streaming vs ordinary stores (aligned, unaligned and odd row lengths), the
distinct-positions ("arange") scatter-add path vs the general scan and
sorted paths (with column blocking forced), thread counts 1-4 bitwise equal,
both sides of each size threshold, the tiny-call fast paths of the class, the
reusable output blocks, and the machine-limit probes of the benchmark.
"""

import gc
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import reference_scatter
from hypothesis import given, settings
from hypothesis import strategies as st

import cposembed
from cposembed import _alloc, _fastcall, _kernels, _membench, _threads
from cposembed import functional as F

FLOATS = [np.float32, np.float64]
INDEX = [np.int32, np.int64]
THREADS = [1, 2, 3, 4]


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def _unaligned(shape, dtype, byte_offset):
    """A C-contiguous array whose data starts `byte_offset` bytes past an aligned address."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(n + 64 + byte_offset, np.uint8)
    start = (-raw.ctypes.data) % 64 + byte_offset
    return raw[start : start + n].view(dtype).reshape(shape)


# ------------------------------------------------------ streaming vs plain


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("index_dtype", INDEX)
@pytest.mark.parametrize("d", [1, 3, 4, 7, 16, 33, 130])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("threads", [1, 3])
def test_lookup_rows_streaming_and_plain(dtype, index_dtype, d, stream, threads):
    rng = np.random.default_rng(d)
    table = rng.standard_normal((50, d)).astype(dtype)
    pos = rng.integers(-50, 50, size=77).astype(index_dtype)
    expect = np.take(table, pos, axis=0)
    # Row starts at every 16-byte phase (element-aligned offsets).
    for off_elems in range(4):
        out = _unaligned((77, d), dtype, off_elems * np.dtype(dtype).itemsize)
        out[...] = -1
        _kernels.lookup_rows(table, pos, out, threads, stream)
        assert np.array_equal(_bits(out), _bits(expect))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("stream", [False, True])
def test_lookup_rows_misaligned_bytes(dtype, stream):
    # Not even aligned to the element size: the streaming path must fall
    # back to plain element stores and still be exact.
    table = np.random.default_rng(0).standard_normal((9, 21)).astype(dtype)
    pos = np.array([3, 0, -1, 8, 3], np.int64)
    out = _unaligned((5, 21), dtype, 1)
    _kernels.lookup_rows(table, pos, out, 1, stream)
    assert np.array_equal(out, table[pos])


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("d", [1, 5, 8, 31, 64])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_add_rows_streaming_and_plain(dtype, d, stream, in_place, threads):
    rng = np.random.default_rng(d)
    table = rng.standard_normal((40, d)).astype(dtype)
    m = 13
    pos = rng.integers(-40, 40, size=m).astype(np.int32)
    tok = rng.standard_normal((3 * m, d)).astype(dtype)
    expect = tok + table[np.tile(pos, 3)]
    for off_elems in (0, 1, 3):
        t = _unaligned(tok.shape, dtype, off_elems * np.dtype(dtype).itemsize)
        t[...] = tok
        out = t if in_place else _unaligned(tok.shape, dtype, off_elems * t.itemsize)
        _kernels.add_rows(t, table, pos, out, threads, stream)
        assert np.array_equal(_bits(out), _bits(expect))


@pytest.mark.parametrize("threshold", [0, 1 << 62])
@pytest.mark.parametrize("threads", [1, 2])
def test_functional_both_sides_of_stream_threshold(monkeypatch, threshold, threads):
    monkeypatch.setattr(F, "STREAM_THRESHOLD_BYTES", threshold)
    rng = np.random.default_rng(1)
    table = rng.standard_normal((300, 70)).astype(np.float32)
    pos = rng.integers(0, 300, size=(6, 200))
    tok = rng.standard_normal((6, 200, 70)).astype(np.float32)
    assert np.array_equal(cposembed.lookup(table, pos, num_threads=threads), table[pos])
    expect = tok + table[:200]
    assert np.array_equal(cposembed.add_positions(tok, table, num_threads=threads), expect)
    cposembed.add_positions(tok, table, out=tok, num_threads=threads)
    assert np.array_equal(tok, expect)


def test_streaming_flag_reports_the_build():
    import platform

    if platform.machine().lower() in ("x86_64", "amd64"):
        assert _kernels.streaming_stores_available()
    assert _membench.streaming_available() == _kernels.streaming_stores_available()


# ------------------------------------------------------------ scatter-add


def _scatter_all_paths(grad0, g, pos):
    """Every (path, threads) result of the kernel on copies of grad0."""
    L = grad0.shape[0]
    results = {}
    for threads in THREADS:
        for allow_distinct, mode, block in [
            (True, 0, 1 << 23),  # auto
            (False, 1, 1 << 23),  # scan, whole rows
            (False, 1, 64),  # scan, 16-column blocks
            (False, 1, 4096),  # scan, medium blocks
            (False, 2, 1 << 23),  # counting sort + prefetch
            (False, 3, 1 << 23),  # column bands per thread
            (False, 3, 64),  # column bands, 16-column blocks
        ]:
            grad = grad0.copy()
            _kernels.scatter_add_rows(
                grad,
                g,
                pos,
                np.empty(L + 1, np.int64),
                np.empty(pos.size, np.int64),
                threads,
                allow_distinct,
                mode,
                block,
            )
            results[(threads, allow_distinct, mode, block)] = grad
    return results


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("index_dtype", INDEX)
@pytest.mark.parametrize(
    "kind", ["arange", "offset_arange", "permutation", "random", "negative", "one_row"]
)
@pytest.mark.parametrize("nb", [1, 3])
def test_scatter_every_path_bitwise_np_add_at(dtype, index_dtype, kind, nb):
    rng = np.random.default_rng(7)
    L, d, m = 64, 37, 48
    if kind == "arange":
        pos = np.arange(m)
    elif kind == "offset_arange":
        pos = np.arange(m) + 9
    elif kind == "permutation":
        pos = rng.permutation(L)[:m]
    elif kind == "random":
        pos = rng.integers(0, L, size=m)
    elif kind == "negative":
        pos = rng.integers(-L, L, size=m)
    else:
        pos = np.full(m, 5)
    pos = pos.astype(index_dtype)
    g = rng.standard_normal((nb * m, d)).astype(dtype)
    grad0 = rng.standard_normal((L, d)).astype(dtype)
    expect = reference_scatter(grad0, g, np.tile(pos, nb))
    for key, got in _scatter_all_paths(grad0, g, pos).items():
        assert np.array_equal(_bits(got), _bits(expect)), key


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("positions", ["none", "random"])
def test_scatter_functional_threads_bitwise_above_threshold(dtype, positions):
    # Large enough to run threaded (above SERIAL_THRESHOLD), with many
    # repeats per row so that a changed summation order would show.
    rng = np.random.default_rng(3)
    L, d, B, T = 200, 64, 8, 160
    assert B * T * d > _threads.SERIAL_THRESHOLD
    g = rng.standard_normal((B, T, d)).astype(dtype)
    pos = None if positions == "none" else rng.integers(-L, L, size=(B, T))
    expect = reference_scatter(np.zeros((L, d), dtype), g, np.arange(T) if pos is None else pos)
    for threads in THREADS:
        got = cposembed.scatter_add(np.zeros((L, d), dtype), g, pos, num_threads=threads)
        assert np.array_equal(_bits(got), _bits(expect)), threads


def test_scatter_auto_picks_sorted_path_for_huge_tables():
    # With a tiny scan budget the auto mode must take the sorted path; the
    # bits stay np.add.at's either way.
    rng = np.random.default_rng(4)
    L, d = 40, 24
    pos = rng.integers(0, L, size=100).astype(np.int64)
    g = rng.standard_normal((100, d)).astype(np.float32)
    expect = reference_scatter(np.zeros((L, d), np.float32), g, pos)
    for threads in (1, 2):
        grad = np.zeros((L, d), np.float32)
        _kernels.scatter_add_rows(
            grad, g, pos, np.empty(L + 1, np.int64), np.empty(100, np.int64), threads, True, 0, 8
        )
        assert np.array_equal(grad, expect)


@settings(max_examples=40, deadline=None)
@given(
    L=st.integers(1, 30),
    d=st.integers(1, 40),
    m=st.integers(1, 40),
    nb=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from(FLOATS),
)
def test_scatter_paths_property(L, d, m, nb, seed, dtype):
    rng = np.random.default_rng(seed)
    pos = rng.integers(-L, L, size=m).astype(np.int64)
    g = rng.standard_normal((nb * m, d)).astype(dtype)
    grad0 = rng.standard_normal((L, d)).astype(dtype)
    expect = reference_scatter(grad0, g, np.tile(pos, nb))
    for key, got in _scatter_all_paths(grad0, g, pos).items():
        assert np.array_equal(_bits(got), _bits(expect)), key


# ------------------------------------------------------------ thresholds


@pytest.mark.parametrize("factor", [0.5, 4])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_lookup_both_sides_of_serial_threshold(factor, threads):
    d = 64
    n = int(_threads.SERIAL_THRESHOLD * factor) // d
    table = np.random.default_rng(0).standard_normal((500, d)).astype(np.float32)
    pos = np.random.default_rng(1).integers(-500, 500, size=n)
    out = np.empty((n, d), np.float32)
    cposembed.lookup(table, pos, out=out, num_threads=threads)
    assert np.array_equal(out, table[pos])


@pytest.mark.parametrize("delta", [-64, 0, 64])
def test_small_take_both_sides_of_its_threshold(delta):
    d = 64
    n = (_fastcall.SMALL_TAKE_ELEMENTS + delta) // d
    pe = cposembed.LearnedPositionEmbedding(300, d, seed=1)
    pos = np.random.default_rng(2).integers(-300, 300, size=n)
    expect = pe.embeddings[pos]
    for got in (pe(pos), pe(list(pos)), cposembed.lookup(pe.embeddings, pos)):
        assert np.array_equal(got, expect)
        assert not np.shares_memory(got, pe.embeddings)


# ------------------------------------------------------- tiny fast paths


def test_scalar_fast_path_copies_and_wraps():
    pe = cposembed.LearnedPositionEmbedding(10, 4, seed=0)
    row = pe(3)
    assert row.shape == (4,) and np.array_equal(row, pe.embeddings[3])
    row[:] = 0
    assert not np.array_equal(pe.embeddings[3], 0)  # a copy, not a view
    assert np.array_equal(pe(-1), pe.embeddings[9])
    assert np.array_equal(pe(-10), pe.embeddings[0])


@pytest.mark.parametrize("bad", [10, -11, 2**70, [10], [0, -11], np.array([3, 10])])
def test_fast_paths_give_the_full_paths_errors(bad):
    pe = cposembed.LearnedPositionEmbedding(10, 4, seed=0)
    with pytest.raises(IndexError, match="out of range"):
        pe(bad)
    with pytest.raises(IndexError, match="out of range"):
        cposembed.lookup(pe.embeddings, bad)


def test_fast_paths_keep_numpy_semantics_of_odd_indices():
    pe = cposembed.LearnedPositionEmbedding(10, 4, seed=0)
    table = pe.embeddings
    mask = [True, False] * 5
    assert np.array_equal(pe(mask), table[np.array(mask)])  # bool list = mask
    assert np.array_equal(pe(np.uint8(3)), table[3])
    assert np.array_equal(pe(np.array([1, 2], np.uint64)), table[[1, 2]])
    assert np.array_equal(pe([[1, 2], [3, 4]]), table[[[1, 2], [3, 4]]])
    assert pe([]).shape == (0, 4)
    with pytest.raises(IndexError):
        pe([1.5])
    # A bool is not the integer 1 but NumPy's scalar mask (not the int path).
    assert np.array_equal(pe(True), table[True])
    with pytest.raises((IndexError, ValueError)):  # ragged: as NumPy (ValueError)
        pe([[1, 2], [3]])


@pytest.mark.parametrize("tok_dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 3, 8), (5, 8), (4, 1, 8)])
@pytest.mark.parametrize("offset", [0, 7])
def test_add_to_decode_fast_path_matches_numpy(tok_dtype, shape, offset):
    pe = cposembed.LearnedPositionEmbedding(12, 8, seed=3)
    tok = np.random.default_rng(0).standard_normal(shape).astype(tok_dtype)
    T = shape[-2]
    if offset + T > 12:
        offset = 12 - T
    expect = tok + pe.embeddings[offset : offset + T]
    got = pe.add_to(tok, offset=offset)
    assert got.dtype == expect.dtype and np.array_equal(got, expect)
    assert not np.shares_memory(got, tok)


def test_add_to_decode_fast_path_errors_are_the_full_paths():
    pe = cposembed.LearnedPositionEmbedding(12, 8, seed=3)
    tok = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(IndexError, match="out of range"):
        pe.add_to(tok, offset=12)
    with pytest.raises(ValueError, match="non-negative"):
        pe.add_to(tok, offset=-1)
    with pytest.raises(ValueError, match=r"\(\.\.\., 8\)"):
        pe.add_to(np.zeros((1, 1, 7), np.float32), offset=0)
    with pytest.raises(TypeError):
        pe.add_to(tok, offset=True)
    # Integer tokens are not on the fast path but give NumPy's result.
    ti = np.ones((1, 2, 8), np.int64)
    assert np.array_equal(pe.add_to(ti, offset=3), ti + pe.embeddings[3:5])


def test_add_to_both_sides_of_small_threshold():
    d = 64
    pe = cposembed.LearnedPositionEmbedding(4096, d, seed=0)
    for n_tok in (_fastcall.SMALL_ADD_ELEMENTS // d, _fastcall.SMALL_ADD_ELEMENTS // d + 1):
        tok = np.random.default_rng(0).standard_normal((1, n_tok, d)).astype(np.float32)
        assert np.array_equal(pe.add_to(tok, offset=5), tok + pe.embeddings[5 : 5 + n_tok])


# ------------------------------------------------------- reusable outputs


def test_large_outputs_reuse_blocks_and_views_stay_valid():
    n_rows, d = 64, 256
    table = np.random.default_rng(0).standard_normal((n_rows, d)).astype(np.float32)
    n = F.POOL_MIN_BYTES // (d * 4) + 1
    pos_a = np.zeros(n, np.int64)
    pos_b = np.ones(n, np.int64)
    a = cposembed.lookup(table, pos_a)
    assert a.flags.writeable and a.flags.c_contiguous and a.flags.aligned
    assert np.array_equal(a, table[pos_a])
    view = a[-1]
    del a
    gc.collect()
    # The block is still in use through the view: a new output must not share it.
    b = cposembed.lookup(table, pos_b)
    assert np.array_equal(view, table[0]) and np.array_equal(b, table[pos_b])
    del view, b
    gc.collect()
    blk = _alloc.block(n * d * 4)
    assert blk.reused
    del blk
    c = cposembed.add_positions(np.zeros((n, d), np.float32), table, np.full(n, 2))
    assert np.array_equal(c, np.broadcast_to(table[2], (n, d)))


def test_pool_can_be_switched_off_and_cleared():
    try:
        _alloc.set_pool(False)
        assert _alloc.pool_info()[0] == 0
        blk = _alloc.block(1 << 20)
        del blk
        assert _alloc.pool_info()[0] == 0
        assert not _alloc.block(1 << 20).reused
    finally:
        _alloc.set_pool(True)
    blk = _alloc.block(1 << 20)
    del blk
    assert _alloc.pool_info()[0] >= 1
    _alloc.clear_pool()
    assert _alloc.pool_info()[:2] == (0, 0)


def test_small_outputs_are_plain_numpy():
    out = F.empty((3, 4), np.dtype(np.float64))
    assert out.base is None and out.shape == (3, 4)


# ------------------------------------------------------- limit probes


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 15, 16, 1000, 4099])
@pytest.mark.parametrize("stream", [False, True])
def test_membench_probes(threads, n, stream):
    src = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    dst = _unaligned((n,), np.float32, 4)
    _membench.fill(dst, threads, stream)
    assert np.all(dst == 1.0)
    _membench.copy(dst, src, threads, stream)
    assert np.array_equal(dst, src)
    assert _membench.read_sum(src, threads) == pytest.approx(
        float(src.sum(dtype=np.float64)), rel=1e-4, abs=1e-3
    )


def test_bench_quick_runs_and_writes_json(tmp_path, capsys):
    import json

    from cposembed import bench

    path = tmp_path / "b.json"
    code = bench.main(
        [
            "--quick",
            "--no-torch",
            "--repeats",
            "1",
            "--json",
            str(path),
            "--only",
            "lookup",
            "scatter_random",
            "tiny",
        ]
    )
    assert code == 0
    data = json.loads(path.read_text())
    ops = {r["op"] for r in data["results"]}
    assert {"lookup(out=)", "scatter_add random", "tiny: pe(5)"} <= ops
    assert all(not r["check"].startswith("MISMATCH") for r in data["results"])
    assert "cposembed" in capsys.readouterr().out


@pytest.mark.parametrize("shape", [(4, 50), (2, 3, 50), (1, 50)])
@pytest.mark.parametrize("same_rows", [True, False])
def test_scatter_explicit_repeated_positions_take_one_period(shape, same_rows):
    rng = np.random.default_rng(5)
    L, d = 60, 12
    pos = np.broadcast_to(rng.permutation(L)[:50], shape).copy()
    if not same_rows:
        pos.reshape(-1)[-1] = pos.reshape(-1)[0]  # last sequence differs
    g = rng.standard_normal(shape + (d,)).astype(np.float32)
    expect = reference_scatter(np.zeros((L, d), np.float32), g, pos)
    flat = pos.reshape(-1)
    short = F._shortest_period(flat, shape)
    assert short.size == (50 if same_rows else flat.size)
    for threads in THREADS:
        got = cposembed.scatter_add(np.zeros((L, d), np.float32), g, pos, num_threads=threads)
        assert np.array_equal(_bits(got), _bits(expect))


def test_reuse_can_be_turned_off_by_environment():
    code = (
        "import numpy as np, cposembed\n"
        "from cposembed import _alloc\n"
        "t = np.ones((2048, 768), np.float32)\n"
        "for _ in range(3):\n"
        "    r = cposembed.lookup(t, np.zeros((8, 1024), np.int64)); del r\n"
        "print(_alloc.pool_info()[0], _alloc.pool_info()[3])\n"
    )
    for value, expected in (("0", "0 False"), ("1", "1 True")):
        env = dict(os.environ, CPOSEMBED_REUSE_OUTPUTS=value)
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        )
        assert res.stdout.split() == expected.split()


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_repeats_every_finds_exact_periods(index_dtype):
    row = np.array([3, -1, 7, 7, 0], dtype=index_dtype)
    tiled = np.tile(row, 4)
    assert _kernels.repeats_every(tiled, 5)
    assert _kernels.repeats_every(row, 5)  # one period
    assert _kernels.repeats_every(tiled[:0], 5)
    for where in (5, 12, tiled.size - 1):  # a difference anywhere after the first period
        other = tiled.copy()
        other[where] += 1
        assert not _kernels.repeats_every(other, 5)
    assert not _kernels.repeats_every(tiled, 4)
