"""Shared test helpers: the NumPy answers the package must reproduce."""

import numpy as np

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


def reference_scatter(grad, grad_output, positions):
    """np.add.at: the unbuffered, in-order accumulation the kernel must equal bitwise."""
    grad = grad.copy()
    g = np.asarray(grad_output, dtype=grad.dtype)
    idx = np.broadcast_to(positions, g.shape[:-1])
    np.add.at(grad, idx, g)
    return grad


def default_positions(tokens_shape, offset=0):
    return offset + np.arange(tokens_shape[-2])
