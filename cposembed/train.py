"""``python -m cposembed train``: a tiny model predicts each random token's position
(Gaussian soft targets of width ``sigma``), so the position table learns order
(docs/guide.md)::

    x      = pe.add_to(E[tokens])           # token + position embeddings (B, T, d)
    logits = x @ W + b                      # linear head over positions (B, T, L)
    loss   = cross_entropy(logits, soft_targets)

The backward is written out by hand.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from . import _state, plot
from .embedding import LearnedPositionEmbedding
from .functional import scatter_add
from .optim import Adam

__all__ = ["TrainResult", "train"]

OPTIMIZERS = ("sgd", "adam")
# Learning rates that suit the task (measured over the default 300 steps).
DEFAULT_LR = {"sgd": 5.0, "adam": 0.01}

PICTURES = (
    "heatmap_before.png",
    "heatmap_after.png",
    "similarity_before.png",
    "similarity_after.png",
)


@dataclass
class TrainResult:
    """What :func:`train` measured and wrote."""

    pe: LearnedPositionEmbedding
    similarity_before: float
    similarity_after: float
    loss_first: float
    loss_last: float
    accuracy: float  # share of tokens whose most likely position is exactly right
    seconds: float
    initial_table: np.ndarray  # the table before training (a copy)
    pictures: list[str] = field(default_factory=list)


def soft_targets(n_positions: int, sigma: float) -> np.ndarray:
    """``(L, L)`` rows of Gaussian weights around each position, each summing to 1."""
    pos = np.arange(n_positions, dtype=np.float64)
    w = np.exp(-0.5 * ((pos[None, :] - pos[:, None]) / sigma) ** 2)
    return w / w.sum(axis=1, keepdims=True)


def _one_blas_thread() -> contextlib.AbstractContextManager[Any]:
    """BLAS on one thread: the matrices are tiny, and its threads would fight the kernels'."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


class _Progress:
    """A progress bar on ``stream`` (stderr): on a terminal, redrawn in place; elsewhere
    a line every 10 %."""

    def __init__(self, total: int, stream: IO[str] | None, enabled: bool) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._every = max(1, total // (50 if self._tty else 10))
        self._start = time.perf_counter()

    def update(self, step: int, loss: float) -> None:
        if not self.enabled or (step % self._every and step != self.total):
            return
        filled = 30 * step // self.total
        bar = "#" * filled + "." * (30 - filled)
        elapsed = time.perf_counter() - self._start
        text = f"training [{bar}] {step}/{self.total} loss {loss:.3f} {elapsed:.1f}s"
        self.stream.write(f"\r{text}" if self._tty else f"{text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\n")
            self.stream.flush()


def train(
    *,
    steps: int = 300,
    max_seq_len: int = 128,
    embed_dim: int = 64,
    seed: int = 0,
    lr: float | None = None,
    batch_size: int = 16,
    vocab_size: int = 100,
    sigma: float | None = None,
    out: str | os.PathLike[str] | None = None,
    progress: bool = True,
    stream: IO[str] | None = None,
    optimizer: str = "adam",
) -> TrainResult:
    """Train a position table on the position-prediction task (see the module doc).

    Parameters
    ----------
    steps : int
        Training steps, one batch of ``batch_size`` random sequences each.
    max_seq_len, embed_dim : int
        Size of the position table (default: the handbook's 128 x 64).
    seed : int
        Seeds the table (as ``LearnedPositionEmbedding(..., seed=seed)``), the rest and the data.
    lr : float, optional
        Learning rate for every parameter (default 0.01 for Adam; 5.0 for SGD, as a
        position row gets only ``1 / max_seq_len`` of the mean loss's gradient).
    batch_size, vocab_size : int
        Sequences per step, and the number of distinct random tokens.
    sigma : float, optional
        Width of the soft targets in positions (default ``max_seq_len / 16``).
    out : path, optional
        Folder for the four pictures (created if needed); ``None`` writes none.
    progress : bool
        Show a progress bar on ``stream``.
    stream : file, optional
        Where the progress bar goes (default stderr).
    optimizer : {"adam", "sgd"}
        :class:`cposembed.Adam` (the default: it learns faster here) or plain SGD.

    Returns
    -------
    TrainResult
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}; got {optimizer!r}")
    lr = DEFAULT_LR[optimizer] if lr is None else lr
    rng = np.random.default_rng(seed)
    n_pos, d, n_tok, batch = max_seq_len, embed_dim, vocab_size, batch_size
    pe = LearnedPositionEmbedding(n_pos, d, seed=seed)
    before = pe.embeddings.copy()
    dtype = pe.dtype
    token_table = (rng.standard_normal((n_tok, d)) / np.sqrt(d)).astype(dtype)
    head = np.zeros((d + 1, n_pos), dtype=dtype)  # the head's weight, then its bias
    head[:d] = rng.standard_normal((d, n_pos)) * (0.1 / np.sqrt(d))
    sigma = max(1.0, n_pos / 16) if sigma is None else sigma
    targets = soft_targets(n_pos, sigma).astype(dtype)
    if optimizer == "adam":
        tokens_layer = LearnedPositionEmbedding.from_pretrained(token_table, dtype=dtype)
        head_layer = LearnedPositionEmbedding.from_pretrained(head, dtype=dtype)
        token_table, head = tokens_layer.embeddings, head_layer.embeddings  # the live tables
        pe_adam, tokens_adam, head_adam = (Adam(t, lr) for t in (pe, tokens_layer, head_layer))
    bar = _Progress(steps, stream, progress)
    loss_first = loss = float("nan")
    correct = 0.0
    start = time.perf_counter()
    with _one_blas_thread():
        for step in range(1, steps + 1):
            tokens = rng.integers(0, n_tok, size=(batch, n_pos))
            x = pe.add_to(token_table[tokens])  # (B, T, d)
            p, loss, grad_head, dx = _head(x, head, targets)
            if step == 1:
                loss_first = loss
            if optimizer == "adam":
                # A fused backward and step on the tables' rows of the batch; every row of the head.
                pe.backward(dx, optimizer=pe_adam)  # positions 0..T-1
                tokens_layer.backward(dx, tokens, optimizer=tokens_adam)
                head_layer.grad = grad_head
                head_adam.step()
            else:
                _sgd_update(pe, token_table, head, grad_head, dx, tokens, lr)
            bar.update(step, loss)
            if step == steps:
                correct = float((p.argmax(axis=2) == np.arange(n_pos)).mean())
    bar.close()
    result = TrainResult(
        pe=pe,
        similarity_before=plot.adjacent_similarity(before),
        similarity_after=plot.adjacent_similarity(pe),
        loss_first=loss_first,
        loss_last=loss,
        accuracy=correct,
        seconds=time.perf_counter() - start,
        initial_table=before,
    )
    if out is not None:
        result.pictures = write_pictures(before, pe.embeddings, out)
    return result


def _sgd_update(
    pe: LearnedPositionEmbedding,
    token_table: np.ndarray,
    head: np.ndarray,
    grad_head: np.ndarray,
    dx: np.ndarray,
    tokens: np.ndarray,
    lr: float,
) -> None:
    """Plain SGD: ``pe`` through its backward and sgd_step, the token table and the head."""
    pe.zero_grad()
    pe.backward(dx)
    pe.sgd_step(lr)
    grad_tokens = scatter_add(np.zeros_like(token_table), dx, tokens)
    for param, grad in ((token_table, grad_tokens), (head, grad_head)):
        param -= param.dtype.type(lr) * grad


def _head(
    x: np.ndarray, head: np.ndarray, targets: np.ndarray
) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    """The head (weight rows, a bias row) on ``x`` (B, T, d): softmax over positions,
    mean cross-entropy with ``targets``, and the gradients of the head and of ``x``."""
    batch, n_pos, d = x.shape
    n_rows = batch * n_pos
    x2 = x.reshape(n_rows, d)
    z = x2 @ head[:d] + head[d]  # (B*T, L)
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    sum_p = p.sum(axis=1, keepdims=True)
    p /= sum_p
    z -= np.log(sum_p)  # log-softmax
    q = np.broadcast_to(targets, (batch, n_pos, n_pos)).reshape(n_rows, n_pos)
    loss = float(-(q * z).sum() / n_rows)
    dz = (p - q) / x.dtype.type(n_rows)
    grad_head = np.vstack([x2.T @ dz, dz.sum(axis=0)])
    return p.reshape(batch, n_pos, -1), loss, grad_head, (dz @ head[:d].T).reshape(batch, n_pos, d)


def write_pictures(before: np.ndarray, after: np.ndarray, out: str | os.PathLike[str]) -> list[str]:
    """Write the four pictures into ``out``; returns their paths. Needs matplotlib."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(os.fspath(out), name) for name in PICTURES]
    n_pos, d = after.shape
    # One colour scale for before and after, to compare by eye.
    lim = float(max(np.abs(before).max(), np.abs(after).max())) or 1.0
    plot.heatmap(
        before, paths[0], title=f"Before training: random ({n_pos} x {d})", vmin=-lim, vmax=lim
    )
    plot.heatmap(after, paths[1], title=f"After training ({n_pos} x {d})", vmin=-lim, vmax=lim)
    plot.similarity(before, paths[2], title="Before training: cosine similarity", vmin=-1, vmax=1)
    plot.similarity(after, paths[3], title="After training: cosine similarity", vmin=-1, vmax=1)
    return paths


# Seeds NumPy's RandomState takes (the table's draw, LearnedPositionEmbedding's seed=).
MAX_SEED = 2**32 - 1


def add_arguments(parser: Any) -> None:
    for flag, default, text in (
        ("--steps", 300, "training steps"),
        ("--max-seq-len", 128, "positions in the table"),
        ("--embed-dim", 64, "dimensions per position"),
        ("--seed", 0, f"random seed in [0, {MAX_SEED}]"),
    ):
        parser.add_argument(flag, type=int, default=default, help=f"{text} (default {default})")
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adam",
        help="cposembed.Adam (fused into the backward) or plain SGD (default adam)",
    )
    parser.add_argument(
        "--lr", type=float, help="learning rate (default 0.01 for adam, 5.0 for sgd)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=16, help="sequences per step (default 16)"
    )
    parser.add_argument(
        "--out", default=".", help="folder for the pictures (default: the current folder)"
    )
    parser.add_argument(
        "--save",
        metavar="PATH",
        help="also save the trained table with LearnedPositionEmbedding.save",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


_NAMES = {"sgd": "SGD", "adam": "Adam"}
_SIZES = ("steps", "max_seq_len", "embed_dim", "batch_size")


def run(args: Any) -> int:
    """The ``train`` subcommand."""
    lr = DEFAULT_LR[args.optimizer] if args.lr is None else args.lr
    plots = plot.has_matplotlib()
    problem = _option_problem(args, lr, args.out if plots else None)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    sigma = max(1.0, args.max_seq_len / 16)
    print(
        "task: predict each token's position from token + position embeddings "
        f"(random tokens; Gaussian soft targets, sigma {sigma:g})"
    )
    print(
        f"table: {args.max_seq_len} positions x {args.embed_dim} dimensions; "
        f"{args.steps} steps of {args.batch_size} sequences, {_NAMES[args.optimizer]} "
        f"lr {lr:g}, seed {args.seed}"
    )
    sizes = {name: getattr(args, name) for name in (*_SIZES, "seed", "optimizer")}
    result = train(**sizes, lr=lr, progress=not args.no_progress)
    print(
        f"loss: {result.loss_first:.3f} -> {result.loss_last:.3f}; "
        f"exact position predicted for {100 * result.accuracy:.1f}% of tokens "
        f"({result.seconds:.1f} s)"
    )
    print(
        f"mean cosine similarity of adjacent positions: "
        f"before {result.similarity_before:.3f}, after {result.similarity_after:.3f}"
    )
    status = 0
    if plots:
        try:
            result.pictures = write_pictures(result.initial_table, result.pe.embeddings, args.out)
        except OSError as exc:
            print(f"error: could not write the pictures to {args.out}: {exc}", file=sys.stderr)
            status = 1  # the table is still saved
        for path in result.pictures:
            print(f"wrote {path}")
    else:
        print('matplotlib is not installed: skipped the pictures (pip install ".[plot]")')
    if args.save is not None:
        try:
            result.pe.save(args.save)
        except OSError as exc:
            print(f"error: could not save the trained table: {exc}", file=sys.stderr)
            return 1
        print(f"saved the trained table to {args.save}")
    return status


def _memory_problem(max_seq_len: int, embed_dim: int, batch_size: int) -> str | None:
    """Why a run of these sizes cannot fit in memory (about five float32 (batch, T, T)
    arrays and 12 bytes per table entry), or None."""
    need = 4 * 5 * batch_size * max_seq_len**2 + 12 * max_seq_len * embed_dim
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # not reported here (Windows)
        return None
    if have <= 0 or need <= have:
        return None
    return (
        f"--max-seq-len {max_seq_len} with --embed-dim {embed_dim} and --batch-size "
        f"{batch_size} needs about {_bytes(need)} of memory; this machine has {_bytes(have)}"
    )


def _bytes(n: int) -> str:
    exp = min((n.bit_length() - 1) // 10, 6) if n > 0 else 0
    return f"{n} bytes" if exp == 0 else f"{n / 1024**exp:.1f} {'KMGTPE'[exp - 1]}iB"


def _option_problem(args: Any, lr: float, out: str | None) -> str | None:
    """The first bad option or output path (``out`` None: no pictures), before any work."""
    for name in _SIZES:
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be a positive integer"
    if not 0 <= args.seed <= MAX_SEED:
        return f"--seed must be in [0, {MAX_SEED}]; got {args.seed}"
    problem = _memory_problem(args.max_seq_len, args.embed_dim, args.batch_size)
    if problem:
        return problem
    if not np.isfinite(lr) or (args.optimizer == "adam" and lr < 0):
        return "--lr must be a finite number (>= 0 for adam)"
    problems = []
    if out is not None:
        problems.append(_state.output_problem(out, "--out", folder=True))
        if os.path.isdir(out):  # else created, empty
            problems += [_state.output_problem(os.path.join(out, n), "--out") for n in PICTURES]
    if args.save is not None:
        problems.append(_state.output_problem(args.save, "--save"))
    return next((p for p in problems if p), None)
