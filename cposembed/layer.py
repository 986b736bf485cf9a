"""The whole input layer: embed and embed_backward (token + position tables)."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _core, _routes

__all__ = ["embed", "embed_backward"]


def embed(
    token_ids: Any,
    token_table: Any,
    position_table: Any,
    positions: Any = None,
    *,
    offset: int = 0,
    out: np.ndarray | None = None,
    num_threads: int | None = None,
) -> np.ndarray:
    """The input layer in one pass: ``token_table[token_ids] + position_table[positions]``.

    Parameters
    ----------
    token_ids : int, array_like of int
        Shape ``(..., T)``; ``-V <= id < V`` (negatives wrap).
    token_table : array_like of shape (V, d), float16, bfloat16, float32 or float64
        Token embeddings (GPT-2's ``wte``).
    position_table : array_like of shape (L, d), float16, bfloat16, float32 or float64
        Position embeddings (GPT-2's ``wpe``); same ``d``. Mixed dtypes give
        NumPy's promotion, except float16 with bfloat16 (``TypeError``).
    positions, offset : as in :func:`cposembed.add_positions`
        With ``token_ids.shape`` in place of ``tokens.shape[:-1]``.
    out : ndarray, optional
        Destination of shape ``token_ids.shape + (d,)`` and the result dtype.
    num_threads : int, optional
        Threads for this call.

    Returns
    -------
    ndarray
        NumPy's ``token_table[token_ids] + position_table[positions]``:
        ``out`` if given, else a new array.

    Raises
    ------
    IndexError
        A token id outside ``[-V, V)`` or a position outside ``[-L, L)``.
    TypeError, ValueError
        Tables that are not 2-D float arrays of one ``embed_dim``, positions
        that do not broadcast, or an ``out`` that does not fit.

    Examples
    --------
    >>> import numpy as np
    >>> import cposembed
    >>> wte = np.arange(6, dtype=np.float32).reshape(3, 2)
    >>> wpe = np.full((4, 2), 10, dtype=np.float32)
    >>> cposembed.embed([[2, 0]], wte, wpe)
    array([[[14., 15.],
            [10., 11.]]], dtype=float32)
    """
    result = _core.embed(
        token_ids, token_table, position_table, positions, offset, out, num_threads
    )
    if result is None:
        result = _routes.embed(
            token_ids,
            token_table,
            position_table,
            positions,
            offset=offset,
            out=out,
            num_threads=num_threads,
        )
    return result


def embed_backward(
    grad_token_table: np.ndarray | None,
    grad_position_table: np.ndarray | None,
    grad_output: Any,
    token_ids: Any,
    positions: Any = None,
    *,
    offset: int = 0,
    num_threads: int | None = None,
) -> None:
    """The gradient of :func:`embed`: both tables from one read of ``grad_output``.

    ``np.add.at(grad_token_table, token_ids, grad_output)`` and
    ``np.add.at(grad_position_table, positions, grad_output)``, bitwise, for
    any thread count.

    Parameters
    ----------
    grad_token_table : ndarray of shape (V, d), writable, or None
        Of dtype float16, bfloat16, float32 or float64; accumulated into in place;
        ``None`` skips the token table.
    grad_position_table : ndarray of shape (L, d), writable, or None
        The same, for the position table.
    grad_output : array_like of shape token_ids.shape + (d,)
        Gradient of :func:`embed`'s output, dtypes as :func:`cposembed.scatter_add`'s.
    token_ids, positions, offset, num_threads : as in :func:`embed`
        The forward call's.

    Raises
    ------
    IndexError
        A token id or position out of range.
    TypeError, ValueError
        Tables that are not writable 2-D float arrays of one ``embed_dim``, or
        a ``grad_output`` whose shape is not ``token_ids.shape + (d,)``.
        Nothing is written when an error is raised.

    Examples
    --------
    >>> import numpy as np
    >>> import cposembed
    >>> g_wte = np.zeros((3, 2)); g_wpe = np.zeros((4, 2))
    >>> cposembed.embed_backward(g_wte, g_wpe, np.ones((1, 3, 2)), [[2, 0, 2]])
    >>> g_wte[:, 0], g_wpe[:, 0]
    (array([1., 0., 2.]), array([1., 1., 1., 0.]))
    """
    _routes.embed_backward(
        grad_token_table,
        grad_position_table,
        grad_output,
        token_ids,
        positions,
        offset=offset,
        num_threads=num_threads,
    )
