"""The command line and the thread/build configuration API."""

import os
import subprocess
import sys

import numpy as np
import pytest

import cposembed

HANDBOOK_OUT5 = """\
Position embedding table shape: (128, 64)
  - 128 positions
  - 64 dimensions per position

Sample position embeddings (first 5 dimensions):
  Position 0: [ 0.062 -0.017  0.081  0.19  -0.029] ...
  Position 1: [ 0.102  0.17  -0.009  0.125  0.045] ...
  Position 2: [ 0.012 -0.063 -0.194  0.009 -0.133] ...
  Position 3: [ 0.027 -0.156  0.022  0.048 -0.11 ] ...
  Position 4: [ 0.158 -0.088  0.055  0.097 -0.116] ...
"""


def _run(*args, env=None, cwd=None):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "cposembed", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=300,
        check=True,
    )


def test_demo_prints_the_handbook_lines(tmp_path):
    out = _run("demo", cwd=tmp_path).stdout
    assert out.startswith(HANDBOOK_OUT5)


def test_info_shows_config():
    out = _run("info").stdout
    assert cposembed.__version__ in out
    assert "openmp" in out.lower() and "num_threads" in out


def test_show_config_mentions_version_and_openmp(capsys):
    cposembed.show_config()
    text = capsys.readouterr().out
    assert cposembed.__version__ in text
    assert str(cposembed.openmp_enabled()) in text


def test_set_and_get_num_threads():
    default = cposembed.get_num_threads()
    assert default >= 1
    try:
        cposembed.set_num_threads(1)
        assert cposembed.get_num_threads() == 1
        if cposembed.openmp_enabled():
            cposembed.set_num_threads(2)
            assert cposembed.get_num_threads() == min(2, len(os.sched_getaffinity(0)))
    finally:
        cposembed.set_num_threads(None)
    assert cposembed.get_num_threads() == default


@pytest.mark.skipif(not cposembed.openmp_enabled(), reason="serial build")
def test_env_var_sets_default_threads():
    code = "import cposembed; print(cposembed.get_num_threads())"
    for env, expected in (
        ({"CPOSEMBED_NUM_THREADS": "1"}, 1),
        ({"OMP_NUM_THREADS": "1"}, 1),
        ({"CPOSEMBED_NUM_THREADS": "1", "OMP_NUM_THREADS": "2"}, 1),
    ):
        res = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=dict(os.environ, **env),
            check=True,
        )
        assert int(res.stdout) == expected


def test_openmp_enabled_is_bool():
    assert isinstance(cposembed.openmp_enabled(), bool)


def test_kernels_release_the_gil_and_agree_across_python_threads():
    from concurrent.futures import ThreadPoolExecutor

    table = np.random.RandomState(0).randn(512, 64).astype(np.float32)
    positions = np.random.RandomState(1).randint(0, 512, size=(16, 256))
    expected = table[positions]

    def work(_):
        return cposembed.lookup(table, positions).tobytes() == expected.tobytes()

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(16)))
