"""Pictures of a position table: the handbook's heatmap and a similarity map.

matplotlib (the ``plot`` extra) is imported only when a picture is drawn:
:func:`heatmap` and :func:`similarity` raise ``ImportError`` without it. The
figures use the Agg renderer, without pyplot or a change of backend.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from . import _state
from . import _validation as v

__all__ = ["adjacent_similarity", "cosine_similarity", "heatmap", "similarity"]


def has_matplotlib() -> bool:
    """Whether matplotlib can be imported (the pictures need it)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _as_table(pe_or_table: Any) -> np.ndarray:
    table = getattr(pe_or_table, "embeddings", pe_or_table)
    arr = np.asarray(table)
    if not v.is_real(arr.dtype):
        raise TypeError(
            "expected a LearnedPositionEmbedding or a real (max_seq_len, embed_dim) "
            f"array; got {v.describe(pe_or_table)}"
        )
    if arr.ndim != 2 or 0 in arr.shape:
        raise ValueError(
            f"the table must be 2-D (max_seq_len, embed_dim) and non-empty; got shape {arr.shape}"
        )
    return arr.astype(np.float64)


def cosine_similarity(pe_or_table: Any) -> np.ndarray:
    """``(L, L)`` cosine similarity between the rows (positions) of a table.

    A zero row (e.g. a ``padding_idx`` row) has similarity 0 with everything.
    """
    table = _as_table(pe_or_table)
    norms = np.linalg.norm(table, axis=1)
    unit = table / np.where(norms > 0, norms, 1.0)[:, None]
    return np.clip(unit @ unit.T, -1.0, 1.0)


def adjacent_similarity(pe_or_table: Any) -> float:
    """Mean cosine similarity of neighbouring positions ``t`` and ``t + 1``.

    About 0 for a random table; near 1 for a smooth one. ``nan`` for one row.
    """
    table = _as_table(pe_or_table)
    if table.shape[0] < 2:
        return float("nan")
    a, b = table[:-1], table[1:]
    denom = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    cos = np.einsum("ij,ij->i", a, b) / np.where(denom > 0, denom, 1.0)
    return float(cos.mean())


def _draw(
    image: np.ndarray, size: Any, labels: tuple[str, str, str], path: Any, dpi: int, **imshow: Any
) -> Any:
    """A figure of ``image``, labelled (y axis, colour bar, title), saved to ``path`` if given."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            'cposembed.plot needs matplotlib, an optional extra: python -m pip install ".[plot]" '
            "from a checkout of cposembed, or matplotlib itself"
        ) from exc
    fig = Figure(figsize=size, constrained_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im = ax.imshow(image, origin="lower", interpolation="nearest", **imshow)
    ax.set_xlabel("Position")
    ax.set_ylabel(labels[0])
    ax.set_title(labels[2])
    fig.colorbar(im, ax=ax, label=labels[1])
    if path is not None:
        # Exactly `path`, whatever its suffix, written atomically.
        with _state.atomic_write(path) as f:
            fig.savefig(f, format="png", dpi=dpi)
    return fig


def heatmap(
    pe_or_table: Any,
    path: str | os.PathLike[str] | None = None,
    *,
    title: str | None = None,
    cmap: str = "RdBu_r",
    dpi: int = 100,
    vmin: float | None = None,
    vmax: float | None = None,
) -> Any:
    """The handbook's picture: the table as dimensions (rows) x positions (columns).

    Parameters
    ----------
    pe_or_table : LearnedPositionEmbedding or array_like of shape (L, d)
    path : str or path-like, optional
        Where to write a PNG (exactly this file name, written atomically:
        a failed write leaves an existing file as it was).
    title : str, optional
        Defaults to a description of the table's size.
    cmap : str, default "RdBu_r"
        A diverging colour map, centred on 0.
    dpi : int, default 100
    vmin, vmax : float, optional
        The ends of the colour scale; ``vmax`` defaults to the table's largest
        absolute value (1 for zeros), ``vmin`` to ``-vmax``.

    Returns
    -------
    matplotlib.figure.Figure
    """
    table = _as_table(pe_or_table)
    if vmax is None:
        vmax = float(np.abs(table).max()) or 1.0
    if title is None:
        title = "Position embeddings ({} x {})".format(*table.shape)
    vmin = -vmax if vmin is None else vmin
    labels = ("Dimension", "Value", title)
    return _draw(table.T, (8, 4), labels, path, dpi, cmap=cmap, aspect="auto", vmin=vmin, vmax=vmax)


def similarity(
    pe_or_table: Any,
    path: str | os.PathLike[str] | None = None,
    *,
    title: str | None = None,
    cmap: str = "RdBu_r",
    dpi: int = 100,
    vmin: float = -1.0,
    vmax: float = 1.0,
) -> Any:
    """Cosine similarity between every pair of positions, as an ``(L, L)`` image.

    Parameters
    ----------
    pe_or_table, path : as in :func:`heatmap`
    title : str, optional
        Defaults to "Cosine similarity between positions".
    cmap, dpi : as in :func:`heatmap`
    vmin, vmax : float, default -1.0 and 1.0
        The ends of the colour scale.

    Returns
    -------
    matplotlib.figure.Figure
    """
    title = title if title is not None else "Cosine similarity between positions"
    labels = ("Position", "Cosine similarity", title)
    sim = cosine_similarity(pe_or_table)
    return _draw(sim, (5.5, 4.5), labels, path, dpi, cmap=cmap, vmin=vmin, vmax=vmax)
