"""Shared test helpers: the NumPy answers the package must reproduce, and child
interpreters for what might crash."""

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import cposembed
import cposembed.train
from cposembed import (
    LearnedPositionEmbedding,
    _core,
    _threads,
)

# The directory holding the cposembed under test, for child interpreters.
PACKAGE_ROOT = str(pathlib.Path(cposembed.__file__).resolve().parents[1])

INDEX_DTYPES = [
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
]


def bits(a):
    """a's bytes, C order, as a uint8 array: for comparisons that must be bitwise."""
    return np.ascontiguousarray(a).view(np.uint8)


@contextlib.contextmanager
def tuned(**kw):
    """_core.set_tuning(**kw) for the block, the previous size rules restored after."""
    old = _core.set_tuning(**kw)
    try:
        yield
    finally:
        _core.set_tuning(**old)


def reference_scatter(grad, grad_output, positions):
    """np.add.at: the unbuffered, in-order accumulation the kernel must equal bitwise.

    A float gradient (float16, bfloat16, float32, float64) is added as it is (np.add.at
    adds in float64 if either side is float64, else in float32, and rounds each add);
    another dtype (bool, integers) is converted to the table's first, as cposembed does.
    """
    grad = grad.copy()
    g = np.asarray(grad_output)
    if g.dtype.newbyteorder("=") not in FLOAT_TABLE_DTYPES:
        g = g.astype(grad.dtype)
    idx = np.broadcast_to(positions, g.shape[:-1])
    np.add.at(grad, idx, g)
    return grad


def default_positions(tokens_shape, offset=0):
    return offset + np.arange(tokens_shape[-2])


def run_python(args, timeout=120, env=None, cwd=None, check=False, stdout=None):
    """``python *args`` in a fresh interpreter on this cposembed (``["-c", code]``,
    ``["-m", "cposembed", ...]``): a crash there is a return code here, not the
    end of the test run. Every test that starts a child Python starts it here.

    The child imports the cposembed under test: ``PYTHONPATH`` is the directory
    holding it, whether that is an editable install, the in-place build or an
    installed wheel. ``env`` updates the environment; a value of None removes the
    variable. stdout and stderr are captured as text, unless ``stdout`` is given
    (a file descriptor), which then takes the child's stdout."""
    full_env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT)
    for name, value in (env or {}).items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    out = (
        {"capture_output": True}
        if stdout is None
        else {"stdout": stdout, "stderr": subprocess.PIPE}
    )
    return subprocess.run(
        [sys.executable, *args],
        **out,
        text=True,
        env=full_env,
        cwd=cwd or PACKAGE_ROOT,
        timeout=timeout,
        check=check,
    )


def assert_clean_exit(proc):
    assert proc.returncode == 0, (
        f"the child exited with {proc.returncode} (negative: killed by a signal, "
        f"-11 a segfault, -6 an abort)\nstderr:\n{proc.stderr[-3000:]}"
    )


def last_json(proc):
    """The child's last stdout line, as JSON."""
    lines = proc.stdout.strip().splitlines()
    assert lines, f"the child printed nothing\nstderr:\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


def run_module(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return run_python(["-m", "cposembed", *args], timeout=300, cwd=cwd)


# Defines `outcome(fn, expect, watched)` in the child: runs fn(); on success
# compares its result with `expect` (bitwise); on an exception checks that
# every array in `watched` is unchanged. Prints one JSON line.
CHILD_PRELUDE = """
import json, sys
import numpy as np
import cposembed
from cposembed import LearnedPositionEmbedding

def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()

def outcome(fn, expect, watched):
    before = [w.copy() for w in watched]
    try:
        got = fn()
    except Exception as exc:
        unchanged = all(same(w, b) for w, b in zip(watched, before))
        print(json.dumps({"raised": type(exc).__name__, "message": str(exc),
                          "unchanged": unchanged}))
        return
    print(json.dumps({"raised": None, "equal": same(got, expect),
                      "got": np.asarray(got).ravel()[:16].tolist(),
                      "expect": np.asarray(expect).ravel()[:16].tolist()}))
"""


def run_child(body: str, timeout: float = 120) -> dict:
    """Run the prelude and ``body`` in a child; its last stdout line as JSON."""
    proc = run_python(["-c", CHILD_PRELUDE + textwrap.dedent(body)], timeout)
    assert_clean_exit(proc)
    assert "Thread creation failed" not in proc.stderr, proc.stderr[-3000:]
    return last_json(proc)


def assert_numpy_or_refused(result: dict, allowed: tuple[str, ...], words: str = "") -> None:
    if result["raised"] is None:
        assert result["equal"], (
            f"succeeded with a result other than NumPy's: got {result['got']}, "
            f"expected {result['expect']}"
        )
        return
    assert result["raised"] in allowed, (
        f"expected NumPy's result or one of {allowed}; got {result['raised']}: {result['message']}"
    )
    assert result["unchanged"], f"{result['raised']} raised after writing: {result['message']}"
    if words:
        assert any(w in result["message"].lower() for w in words.split("|")), (
            f"the message should name the problem ({words}); got: {result['message']}"
        )


# -- positions sharing memory with what the call writes -----------------------
# `buf` holds the positions as int64 bits; the output (or tokens, or gradient)
# is a float64 view of the same bytes shifted by one element, so writing row
# i changes position i + 1. "zeros" holds positions that are all 0; "mixed" holds
# distinct valid positions, so a kernel that reads a position after writing
# over it gives a visibly different result.
OVERLAP_SETUP = """
kind = {kind!r}
if kind == "zeros":
    buf = np.zeros(9)
    table = np.ones((4, 1))
else:
    buf = np.array([3, 1, 2, 0, 1, 3, 2, 0, 1], dtype=np.int64).view(np.float64)
    table = np.arange(1.0, 5.0).reshape(4, 1)
pos = buf.view(np.int64)[:-1]
pos_copy = pos.copy()
"""


OVERLAP_KINDS = ["zeros", "mixed"]


OVERLAP_WORDS = "overlap|share|memory"


def overlap_case(kind: str, body: str) -> dict:
    return run_child(OVERLAP_SETUP.format(kind=kind) + textwrap.dedent(body))


FLOAT_TYPES = [np.float32, np.float64]


def _table(n_rows, d, dtype, seed=0):
    return np.random.RandomState(seed).randn(n_rows, d).astype(dtype)


def _rows_for(elements, d):
    """Number of rows giving about `elements` output elements."""
    return max(1, elements // d)


# Sizes just below and well above the serial threshold (read at run time, so
# the tests follow any retuning of the threshold).
def _sizes():
    t = _threads.SERIAL_THRESHOLD
    return [t // 4, 4 * t]


# Arrays of more than 32 axes (the deep-position tests need 33): NumPy 2 only.
needs_numpy2 = pytest.mark.skipif(
    np.lib.NumpyVersion(np.__version__) < "2.0.0", reason="NumPy 1.x allows 32 axes"
)


def run_json(code: str, timeout: float = 120, env: dict | None = None) -> dict:
    """Run ``code`` in a child interpreter; its last stdout line as JSON."""
    proc = run_python(["-c", textwrap.dedent(code)], timeout, env)
    assert_clean_exit(proc)
    return last_json(proc)


def assert_same(got, expect) -> None:
    got, expect = np.asarray(got), np.asarray(expect)
    assert got.shape == expect.shape, (got.shape, expect.shape)
    assert got.dtype == expect.dtype, (got.dtype, expect.dtype)
    assert got.tobytes() == expect.tobytes(), "values differ from NumPy's"


def add_at(table: np.ndarray, positions, grad_output) -> None:
    """``np.add.at`` on flattened indices (np.add.at itself segfaults for
    indices of more than 32 dimensions, NumPy 2.4)."""
    pos = np.asarray(positions).reshape(-1)
    np.add.at(table, pos, np.asarray(grad_output).reshape(pos.size, -1))


def _deep(nd: int, last: int) -> tuple[int, ...]:
    return (1,) * (nd - 1) + (last,)


DTYPES = [np.float32, np.float64]
HALF_DTYPES = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
# Every table dtype: float32, float64 and the half-precision ones.
FLOAT_TABLE_DTYPES = [np.dtype(np.float32), np.dtype(np.float64), *HALF_DTYPES]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def trained(dtype=np.float32, padding_idx=None) -> LearnedPositionEmbedding:
    pe = LearnedPositionEmbedding(9, 4, seed=3, dtype=dtype, padding_idx=padding_idx)
    pe.backward(np.random.default_rng(0).standard_normal((2, 3, 4)), [[1, 4, 7]])
    return pe


class _Sub(np.ndarray):
    """A plain ndarray subclass: the C entries decline it, the routes serve it (the
    name shows in test ids)."""


def make_out(kind, shape=None, dtype=None, *, like=None, fill=0):
    """An array of ``shape`` and ``dtype`` filled with ``fill``, or a copy of ``like``,
    odd in one way: the hand-made ``out=`` (and other) arrays of the tests.

    ``kind``: ``"plain"`` (C-contiguous, aligned, writable), ``"wrong_dtype"``
    (float64 for float32, float32 otherwise), ``"read_only"``, ``"subclass"``
    (a :class:`_Sub`), ``"byteswapped"`` (the other byte order), ``"strided"``
    (every other element of a last axis twice as long), ``"misaligned"`` (data one
    byte past an aligned address).
    """
    if like is not None:
        like = np.asarray(like)
        shape, dtype, fill = like.shape, like.dtype, like
    dtype = np.dtype(dtype)
    if kind == "plain":
        out = np.zeros(shape, dtype)
    elif kind == "wrong_dtype":
        out = np.zeros(shape, np.float64 if dtype == np.float32 else np.float32)
    elif kind == "read_only":
        out = np.zeros(shape, dtype)
    elif kind == "subclass":
        out = np.zeros(shape, dtype).view(_Sub)
    elif kind == "byteswapped":
        out = np.zeros(shape, dtype.newbyteorder())
    elif kind == "strided":
        out = np.zeros(tuple(shape[:-1]) + (2 * shape[-1],), dtype)[..., ::2]
    elif kind == "misaligned":
        n = int(np.prod(shape)) * dtype.itemsize
        out = np.zeros(n + 1, np.uint8)[1:].view(dtype).reshape(shape)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    out[...] = fill
    if kind == "read_only":
        out.flags.writeable = False
    return out


# The end of a script for run_on_two_ranks: each of two processes joins a gloo
# group on a free loopback port, calls the script's work(rank, world), and
# gathers both results on rank 0, which writes them to the file `out`; each
# then exits without the exit-time teardown of PyTorch's distributed threads.
_TWO_RANKS_MAIN = """

def run(rank, world, port, out):
    import json, os, sys
    import torch, torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = [None] * world
    dist.all_gather_object(results, work(rank, world))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    import socket, sys, torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = sys.argv[1]
    mp.spawn(run, args=(2, port, out), nprocs=2, join=True)
    print(open(out).read())
"""


def run_on_two_ranks(script, tmp_path):
    """`script` (which defines ``work(rank, world)``, returning the rank's
    result as JSON takes it) on two spawned processes in a child Python, in
    one gloo group: the list of both ranks' results."""
    path = tmp_path / "two_ranks.py"
    path.write_text(script + _TWO_RANKS_MAIN)
    proc = run_python([str(path), str(tmp_path / "out.json")], timeout=300)
    assert_clean_exit(proc)
    return last_json(proc)
