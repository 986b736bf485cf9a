"""Large arrays: 64-bit sizes everywhere (more than 2**31 elements).

Skipped unless ``CPOSEMBED_TEST_LARGE=1``: each test allocates about 8.5 GB
(float32), one test at a time, so a machine with 12 GB free runs them all.
A 32-bit ``int`` anywhere in an offset computation (``i * d``, ``k * m + j``,
``p * d``) would wrap at 2**31 elements and read or write the wrong place.
Results are checked chunk by chunk (or against a closed form) so checking
does not double the memory.

    CPOSEMBED_TEST_LARGE=1 python -m pytest -q tests/test_large.py
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import cposembed

pytestmark = pytest.mark.skipif(
    os.environ.get("CPOSEMBED_TEST_LARGE", "") not in ("1", "true", "yes"),
    reason="needs ~9 GB of RAM per test; set CPOSEMBED_TEST_LARGE=1",
)

D = 1024
N_ROWS = (1 << 21) + 3  # N_ROWS * D > 2**31
assert N_ROWS * D > 2**31
CHUNK = 1 << 16


@pytest.fixture(autouse=True)
def _free_memory():
    yield
    gc.collect()


@pytest.mark.parametrize("num_threads", [1, 2])
def test_lookup_output_over_2_31_elements(num_threads):
    L = 4096
    table = np.random.RandomState(0).randn(L, D).astype(np.float32)
    pos = np.random.RandomState(1).randint(-L, L, size=N_ROWS).astype(np.int32)
    out = cposembed.lookup(table, pos, num_threads=num_threads)
    assert out.shape == (N_ROWS, D) and out.size > 2**31
    for s in range(0, N_ROWS, CHUNK):
        assert np.array_equal(out[s : s + CHUNK], table[pos[s : s + CHUNK]]), s
    # The last rows sit beyond 2**31 elements: check them explicitly too.
    assert np.array_equal(out[-3:], table[pos[-3:]])


def test_lookup_from_table_over_2_31_elements():
    table = np.empty((N_ROWS, D), dtype=np.float32)
    table[:, 0] = np.arange(N_ROWS, dtype=np.float32)  # exact up to 2**24
    table[:, -1] = -np.arange(N_ROWS, dtype=np.float32)
    pos = np.array([N_ROWS - 1, 0, -1, N_ROWS // 2, 1 << 21, -N_ROWS], dtype=np.int32)
    rows = pos % N_ROWS
    for n in (1, 2):
        out = cposembed.lookup(table, pos, num_threads=n)
        assert np.array_equal(out[:, 0], rows.astype(np.float32))
        assert np.array_equal(out[:, -1], -rows.astype(np.float32))


@pytest.mark.parametrize("num_threads", [1, 2])
def test_scatter_add_grad_output_over_2_31_elements(num_threads):
    L = 4093
    g = np.ones((N_ROWS, D), dtype=np.float32)
    g[:, -1] = 2.0
    pos = (np.arange(N_ROWS, dtype=np.int64) * 7) % L
    grad = np.zeros((L, D), dtype=np.float32)
    cposembed.scatter_add(grad, g, pos, num_threads=num_threads)
    counts = np.bincount(pos, minlength=L).astype(np.float32)  # < 2**24: exact
    assert np.array_equal(grad[:, 0], counts)
    assert np.array_equal(grad[:, D // 2], counts)
    assert np.array_equal(grad[:, -1], 2 * counts)


def test_scatter_add_into_table_over_2_31_elements():
    grad = np.zeros((N_ROWS, D), dtype=np.float32)
    pos = np.array([N_ROWS - 1, 0, N_ROWS - 1, 1 << 21], dtype=np.int64)
    g = np.arange(4 * D, dtype=np.float32).reshape(4, D)
    cposembed.scatter_add(grad, g, pos, num_threads=2)
    assert np.array_equal(grad[N_ROWS - 1], g[0] + g[2])
    assert np.array_equal(grad[0], g[1])
    assert np.array_equal(grad[1 << 21], g[3])
    grad[[N_ROWS - 1, 0, 1 << 21]] = 0
    assert not grad[::1024].any() and not grad[-1024:].any()


def test_add_positions_and_backward_period_over_2_31_elements():
    """positions=None over (B, T, d) with B*T*d > 2**31: the i % m period path."""
    T = 4096
    B = N_ROWS // T + 1
    L = T
    table = np.zeros((L, D), dtype=np.float32)
    table[:, 0] = np.arange(L)
    tokens = np.ones((B, T, D), dtype=np.float32)
    assert tokens.size > 2**31
    cposembed.add_positions(tokens, table, out=tokens, num_threads=2)  # in place
    want = np.arange(T, dtype=np.float32) + 1
    assert np.array_equal(tokens[0, :, 0], want)
    assert np.array_equal(tokens[-1, :, 0], want)
    assert np.all(tokens[-1, :, 1:] == 1)
    tokens[:, :, 0] = 1
    grad = np.zeros_like(table)
    cposembed.scatter_add(grad, tokens, None, num_threads=2)
    assert np.all(grad == B)
