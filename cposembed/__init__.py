"""cposembed: learned position embeddings on fast, multithreaded C kernels.

The handbook's ``LearnedPositionEmbedding`` (see :mod:`cposembed.reference`)
with the same API and numbers, plus fused token+position addition and a
deterministic gradient scatter-add, as Cython/OpenMP kernels.
"""

from . import plot  # matplotlib itself is imported only when drawing
from ._config import openmp_enabled, show_config
from ._threads import get_num_threads, set_num_threads
from ._validation import NotAnIntegerError
from ._version import __version__
from .embedding import LearnedPositionEmbedding
from .functional import add_positions, lookup, scatter_add
from .layer import embed, embed_backward
from .masks import positions_from_mask
from .optim import SGD, Adam, AdamW
from .token_position import TokenPositionEmbedding

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "LearnedPositionEmbedding",
    "NotAnIntegerError",
    "TokenPositionEmbedding",
    "__version__",
    "add_positions",
    "embed",
    "embed_backward",
    "get_num_threads",
    "lookup",
    "openmp_enabled",
    "plot",
    "positions_from_mask",
    "scatter_add",
    "set_num_threads",
    "show_config",
]
