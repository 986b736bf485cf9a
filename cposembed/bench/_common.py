"""What every comparison shares: the contenders and groups, the run's arrays, the checks."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _threads
from ..embedding import LearnedPositionEmbedding
from ..reference import LearnedPositionEmbedding as ReferenceEmbedding

OURS = "cposembed"

# (B, T) of the small calls: decode steps of 4 and 32 rows, a short prefill.
SMALL_SIZES = ((4, 1), (32, 1), (4, 100))


@dataclass
class Contender:
    """One row of a comparison: a call, the bytes it moves and, for a peer, its target."""

    name: str
    fn: Callable[[], Any]
    nbytes: int  # bytes this contender must move through memory at least
    times: list[float] = field(default_factory=list)
    check: str = ""
    # The largest acceptable time(cposembed) / time(this contender); reported
    # as ok/MISS, never asserted. None: no target.
    target: float | None = None
    # Filled in by the timing: the warm-up call's seconds, and how many calls
    # one batch of a tiny group times.
    warm_s: float = 0.0
    number: int = 1

    @property
    def median(self) -> float:
        return float(np.median(self.times)) if self.times else float("nan")


@dataclass
class Group:
    """One comparison: cposembed (first) against its peers on the same work."""

    op: str
    contenders: list[Contender]
    note: str = ""
    # Microsecond calls: timed in batches of calls (time_tiny), not one by one.
    tiny: bool = False
    # Timed with a CPU-bound process of the bench's own running beside (busy_process).
    busy: bool = False
    # Each timed run a batch of back-to-back calls of at least this many seconds
    # (time_batched), its mean per call; 0: one call per run.
    batch_s: float = 0.0
    # Times the group itself (it may time other groups with it), instead of
    # the timing its kind says; called with the group and the rounds asked for.
    timer: Callable[[Group, int], None] | None = None


def same(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-6) -> str:
    """How ``a`` compares with ``b``. Sums of many terms in another order (a
    peer's) need a looser tolerance: pass one scaled to the number of terms."""
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape:
        return f"MISMATCH shape {a.shape} vs {b.shape}"
    if np.array_equal(a, b):
        return "equal"
    if np.allclose(a, b, rtol=rtol, atol=atol):
        diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
        return f"close (max |diff| {diff:.1e})"
    return "MISMATCH"


def max_terms(ids: np.ndarray) -> int:
    """The most terms any one gradient row sums: the scale of a peer's rounding."""
    return int(np.bincount(ids.ravel()).max())


def _reference(max_seq_len: int, embed_dim: int, seed: int) -> ReferenceEmbedding:
    """The handbook's class (which seeds the global RNG), the global RNG left as it was."""
    state = np.random.get_state()
    ref = ReferenceEmbedding(max_seq_len, embed_dim, seed=seed)
    np.random.set_state(state)
    return ref


@dataclass
class LayerArrays:
    """The whole input layer: GPT-2's vocabulary (--vocab), a position table
    of at least T rows, token ids drawn Zipf-like (exponent 1.2: about 7,400
    distinct ids in 32 x 1024, the most frequent thousands of times)."""

    wte: np.ndarray
    wpe: np.ndarray
    ids: np.ndarray


class Fixture:
    """The arrays of one run, shared by every comparison (the larger ones made on first use).

    ``rng`` is shared too: the comparisons that draw their own arrays draw
    them from it in the order they run.
    """

    def __init__(self, args: argparse.Namespace, torch: Any) -> None:
        self.L, self.d = args.table
        self.B, self.T = args.batch
        self.nt: int = args.threads
        # --quick: the comparisons whose sizes are not the run's options shrink too.
        self.quick: bool = args.quick
        self.vocab: int = args.vocab
        self.dt = np.dtype(args.dtype)
        self.rng = np.random.default_rng(0)
        L, d, B, T, dt = self.L, self.d, self.B, self.T, self.dt
        self.pe = LearnedPositionEmbedding(L, d, seed=0, dtype=dt)
        self.P = self.pe.embeddings
        self.pos_ar = np.broadcast_to(np.arange(T, dtype=np.int64), (B, T)).copy()
        self.pos_rand = self.rng.integers(0, L, size=(B, T), dtype=np.int64)
        self.tok = self.rng.standard_normal((B, T, d)).astype(dt)
        self.gout = self.rng.standard_normal((B, T, d)).astype(dt)
        self.out = np.empty((B, T, d), dt)
        self.isz = dt.itemsize
        self.rows_bytes = B * T * d * self.isz
        # The limit probes work on float32 buffers of the same byte count.
        self.probe_dst = self.out.view(np.float32).reshape(-1)
        self.probe_src = self.tok.view(np.float32).reshape(-1)
        self.probe_grad = self.gout.view(np.float32).reshape(-1)
        # The probes follow the kernels' thread rule (small work runs serially).
        self.probe_nt = _threads.effective_num_threads(self.nt, self.probe_dst.size, B * T)
        # PyTorch's views of the same arrays (None without torch).
        self.torch = torch
        self.tdt: Any = None
        self.Pt: Any = None
        self.pos_ar_t: Any = None
        self.pos_rand_t: Any = None
        self.tok_t: Any = None
        self.gout_t: Any = None
        self.out_t: Any = None
        if torch is not None:
            self.tdt = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}[
                dt
            ]
            self.Pt = torch.from_numpy(self.P)
            self.pos_ar_t = torch.from_numpy(self.pos_ar)
            self.pos_rand_t = torch.from_numpy(self.pos_rand)
            self.tok_t = torch.from_numpy(self.tok)
            self.gout_t = torch.from_numpy(self.gout)
            self.out_t = torch.from_numpy(self.out)

    @functools.cached_property
    def ref(self) -> ReferenceEmbedding:
        """The handbook's class on the run's table size (the global RNG left as it was)."""
        return _reference(self.L, self.d, seed=0)

    @functools.cached_property
    def layer(self) -> LayerArrays:
        n_pos = max(self.T, min(self.L, 1024))
        zipf = np.random.default_rng(2).zipf(1.2, size=(self.B, self.T))
        return LayerArrays(
            wte=np.random.default_rng(1).standard_normal((self.vocab, self.d)).astype(self.dt),
            wpe=np.ascontiguousarray(np.resize(self.P, (n_pos, self.d))),
            ids=(zipf - 1) % self.vocab,
        )

    def tiny_table(self) -> tuple[LearnedPositionEmbedding, ReferenceEmbedding]:
        """The handbook's 128 x 64 table, ours and the reference's."""
        tp = LearnedPositionEmbedding(128, 64, seed=42, dtype=self.dt)
        return tp, _reference(128, 64, seed=42)

    def small_pair(
        self,
        op: str,
        mine: Callable[[], Any],
        theirs: Callable[[], Any],
        name: str,
        note: str,
        target: float,
    ) -> Group:
        """A per-call comparison whose outputs must be equal (in the table's dtype)."""
        peer = Contender(name, theirs, 0, target=target)
        peer.check = same(mine(), np.asarray(theirs()).astype(self.dt))
        return Group(op, [Contender(OURS, mine, 0), peer], note, tiny=True)
