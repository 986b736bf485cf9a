"""Shared test helpers: the NumPy answers the package must reproduce, and child
interpreters for what might crash."""

import contextlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np

import cposembed
from cposembed import _core

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
    """np.add.at: the unbuffered, in-order accumulation the kernel must equal bitwise."""
    grad = grad.copy()
    g = np.asarray(grad_output, dtype=grad.dtype)
    idx = np.broadcast_to(positions, g.shape[:-1])
    np.add.at(grad, idx, g)
    return grad


def default_positions(tokens_shape, offset=0):
    return offset + np.arange(tokens_shape[-2])


def run_python(args, timeout=120, env=None, cwd=None):
    """``python *args`` in a fresh interpreter on this cposembed (``["-c", code]``,
    ``["-m", "cposembed", ...]``): a crash there is a return code here, not the
    end of the test run."""
    full_env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd or PACKAGE_ROOT,
        timeout=timeout,
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
