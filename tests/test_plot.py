"""cposembed.plot: figures, PNG files, the numbers behind them, and the
ImportError that names the extra when matplotlib is missing."""

from __future__ import annotations

import os
import pathlib
import sys

import numpy as np
import pytest
from helpers import run_python

import cposembed
from cposembed import LearnedPositionEmbedding, plot

ROOT = pathlib.Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def mpl():
    # The inverse of the ImportError tests: these need matplotlib, which CI
    # installs through the `plot` extra.
    return pytest.importorskip("matplotlib")


def naive_cosine(table):
    t = np.asarray(table, dtype=np.float64)
    n = t.shape[0]
    out = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            ni, nj = np.linalg.norm(t[i]), np.linalg.norm(t[j])
            out[i, j] = 0.0 if ni == 0 or nj == 0 else t[i] @ t[j] / (ni * nj)
    return out


def test_plot_is_a_submodule_importable_without_drawing():
    assert cposembed.plot is plot
    assert "plot" in cposembed.__all__


def test_cosine_similarity_matches_a_loop():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((9, 5)).astype(np.float32)
    table[4] = 0  # a padding row: similarity 0
    np.testing.assert_allclose(plot.cosine_similarity(table), naive_cosine(table), atol=1e-12)
    pe = LearnedPositionEmbedding(7, 3, seed=0)
    np.testing.assert_allclose(plot.cosine_similarity(pe), naive_cosine(pe.embeddings), atol=1e-12)


def test_adjacent_similarity_matches_a_loop():
    rng = np.random.default_rng(1)
    table = rng.standard_normal((12, 4))
    expected = np.mean([naive_cosine(table[t : t + 2])[0, 1] for t in range(11)])
    assert plot.adjacent_similarity(table) == pytest.approx(expected, abs=1e-12)
    smooth = np.outer(np.ones(10), [1.0, 2.0]) + np.arange(10)[:, None] * 1e-3
    assert plot.adjacent_similarity(smooth) == pytest.approx(1.0, abs=1e-6)
    assert np.isnan(plot.adjacent_similarity(np.ones((1, 3))))


@pytest.mark.parametrize(
    "bad, exc",
    [
        (np.ones(5), ValueError),
        (np.ones((2, 3, 4)), ValueError),
        (np.ones((0, 3)), ValueError),
        (np.array([["a"]]), TypeError),
        (np.ones((2, 2), dtype=complex), TypeError),
    ],
)
def test_bad_tables_are_rejected(bad, exc):
    with pytest.raises(exc):
        plot.cosine_similarity(bad)


def test_heatmap_is_the_handbook_picture(mpl, tmp_path):
    from matplotlib.figure import Figure

    pe = LearnedPositionEmbedding(128, 64, seed=42)
    path = tmp_path / "heat"
    fig = plot.heatmap(pe, path)
    assert isinstance(fig, Figure)
    assert path.read_bytes()[:8] == PNG_MAGIC  # exactly `path`, a PNG
    assert os.listdir(tmp_path) == ["heat"]
    ax = fig.axes[0]
    image = ax.images[0].get_array()
    assert image.shape == (64, 128)  # dimensions on the y axis, positions on the x axis
    np.testing.assert_array_equal(np.asarray(image), pe.embeddings.T.astype(np.float64))
    assert ax.get_xlabel() == "Position" and ax.get_ylabel() == "Dimension"


def test_heatmap_accepts_a_plain_array_and_no_path(mpl, tmp_path):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        fig = plot.heatmap(np.arange(12.0).reshape(4, 3), title="t")
    finally:
        os.chdir(cwd)
    assert os.listdir(tmp_path) == []
    assert fig.axes[0].get_title() == "t"
    assert fig.axes[0].images[0].get_array().shape == (3, 4)


def test_similarity_figure(mpl, tmp_path):
    from matplotlib.figure import Figure

    pe = LearnedPositionEmbedding(20, 8, seed=1)
    path = tmp_path / "sim.png"
    fig = plot.similarity(pe, str(path))
    assert isinstance(fig, Figure)
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = np.asarray(fig.axes[0].images[0].get_array())
    np.testing.assert_allclose(image, naive_cosine(pe.embeddings), atol=1e-12)
    assert fig.axes[0].images[0].get_clim() == (-1.0, 1.0)


def test_colour_limits_default_to_the_table_and_can_be_given(mpl):
    table = np.array([[0.5, -2.0], [1.0, 0.25]])
    clim = plot.heatmap(table).axes[0].images[0].get_clim()
    assert clim == (-2.0, 2.0)  # symmetric about 0: the largest absolute value
    assert plot.heatmap(table, vmax=3.0).axes[0].images[0].get_clim() == (-3.0, 3.0)
    assert plot.heatmap(table, vmin=-1.0, vmax=4.0).axes[0].images[0].get_clim() == (-1.0, 4.0)
    assert plot.heatmap(np.zeros((2, 2))).axes[0].images[0].get_clim() == (-1.0, 1.0)
    sim = plot.similarity(table, vmin=0.0, vmax=0.5)
    assert sim.axes[0].images[0].get_clim() == (0.0, 0.5)


def test_the_pictures_of_one_training_run_share_their_colour_scale(mpl, tmp_path, monkeypatch):
    """Before and after heatmaps (and similarity maps) of `train` use one scale each."""
    from cposembed import train as train_mod

    drawn: dict[str, tuple[float, float]] = {}
    for name in ("heatmap", "similarity"):
        draw = getattr(plot, name)

        def record(table, path, *args, _draw=draw, **kwargs):
            fig = _draw(table, path, *args, **kwargs)
            drawn[os.path.basename(path)] = fig.axes[0].images[0].get_clim()
            return fig

        monkeypatch.setattr(plot, name, record)
    result = train_mod.train(
        steps=20, max_seq_len=16, embed_dim=8, batch_size=4, out=tmp_path, progress=False
    )
    before, after = result.initial_table, result.pe.embeddings
    # Training changed how far the values reach: own scales would differ.
    assert np.abs(before).max() != np.abs(after).max()
    lim = max(np.abs(before).max(), np.abs(after).max())
    assert drawn["heatmap_before.png"] == drawn["heatmap_after.png"] == (-lim, lim)
    assert drawn["similarity_before.png"] == drawn["similarity_after.png"] == (-1.0, 1.0)
    assert sorted(drawn) == sorted(os.listdir(tmp_path))


def test_plotting_does_not_touch_pyplot_or_the_backend(mpl, tmp_path):
    backend = mpl.get_backend()
    plot.heatmap(np.ones((3, 2)), tmp_path / "a.png")
    assert mpl.get_backend() == backend
    import matplotlib.pyplot as plt

    assert plt.get_fignums() == []


def test_import_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    for draw in (plot.heatmap, plot.similarity):
        with pytest.raises(ImportError, match=r'pip install "\.\[plot\]" from a checkout'):
            draw(np.ones((3, 2)))
    # the numbers do not need matplotlib
    assert plot.cosine_similarity(np.eye(2)).shape == (2, 2)


def test_import_error_in_a_fresh_interpreter():
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "import numpy as np, cposembed\n"
        "from cposembed import plot\n"
        "try:\n"
        "    plot.heatmap(np.ones((3, 2)))\n"
        "except ImportError as e:\n"
        "    print('ImportError:', e)\n"
    )
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert "ImportError:" in proc.stdout and 'pip install ".[plot]" from a checkout' in proc.stdout


DEMO_LINES = [
    "Position embedding table shape: (128, 64)",
    "  - 128 positions",
    "  - 64 dimensions per position",
    "",
    "Sample position embeddings (first 5 dimensions):",
    "  Position 0: [ 0.062 -0.017  0.081  0.19  -0.029] ...",
    "  Position 1: [ 0.102  0.17  -0.009  0.125  0.045] ...",
    "  Position 2: [ 0.012 -0.063 -0.194  0.009 -0.133] ...",
    "  Position 3: [ 0.027 -0.156  0.022  0.048 -0.11 ] ...",
    "  Position 4: [ 0.158 -0.088  0.055  0.097 -0.116] ...",
]


def run_demo(cwd, block_matplotlib):
    code = "import sys\n"
    if block_matplotlib:
        code += "sys.modules['matplotlib'] = None\n"
    code += "from cposembed.__main__ import main\nsys.exit(main(['demo']))\n"
    return run_python(["-c", code], cwd=cwd)


def test_demo_writes_the_heatmap(mpl, tmp_path):
    proc = run_demo(tmp_path, block_matplotlib=False)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:-1] == DEMO_LINES  # the handbook's Out[5], unchanged
    path = tmp_path / "position_embeddings_heatmap.png"
    assert lines[-1] == f"wrote heatmap to {path}"
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_demo_without_matplotlib_prints_only_the_handbook_output(tmp_path):
    proc = run_demo(tmp_path, block_matplotlib=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == DEMO_LINES
    assert os.listdir(tmp_path) == []
