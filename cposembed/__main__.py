"""Command line: ``python -m cposembed {demo,info,bench,train}``."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import numpy as np

from . import LearnedPositionEmbedding, _state, plot, show_config
from .train import add_arguments as add_train_arguments
from .train import run as run_train

DEMO_HEATMAP = "position_embeddings_heatmap.png"


def demo(args: argparse.Namespace) -> int:
    """The handbook's example (its In[4]/Out[5]), on the package's class."""
    heatmap_path = None  # none without matplotlib
    if plot.has_matplotlib():
        heatmap_path = DEMO_HEATMAP if args.out is None else args.out
        with contextlib.suppress(OSError):  # no current folder: the check says so
            heatmap_path = os.path.abspath(heatmap_path)
        problem = _state.output_problem(heatmap_path, "the heatmap")
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    max_seq_len = 128
    embed_dim = 64
    pos_embed = LearnedPositionEmbedding(max_seq_len, embed_dim, seed=42)
    positions = np.arange(10)
    pos_vectors = pos_embed(positions)

    print(f"Position embedding table shape: {pos_embed.embeddings.shape}")
    print(f"  - {max_seq_len} positions")
    print(f"  - {embed_dim} dimensions per position")
    print()
    print("Sample position embeddings (first 5 dimensions):")
    for i in range(5):
        print(f"  Position {i}: {np.round(pos_vectors[i, :5], 3)} ...")
    if heatmap_path is None:
        return 0
    try:  # the handbook's Out[6]
        plot.heatmap(pos_embed, heatmap_path, title="Random position embeddings at initialization")
    except OSError as exc:
        print(f"error: could not write the heatmap: {exc}", file=sys.stderr)
        return 1
    print(f"wrote heatmap to {heatmap_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # The bench's own parser gets its arguments (argparse's REMAINDER misses "--quick").
        from .bench import main as bench_main

        return int(bench_main(argv[1:]) or 0)
    parser = argparse.ArgumentParser(
        prog=_prog(), description="Learned position embeddings on C kernels."
    )
    sub = parser.add_subparsers(dest="command")
    p_demo = sub.add_parser("demo", help="the handbook's example output")
    p_demo.add_argument(
        "--out",
        metavar="PATH",
        help=f"where the heatmap goes (default: {DEMO_HEATMAP} in the current folder)",
    )
    sub.add_parser("info", help="show_config(): version, OpenMP, threads, flags")
    # Listed for the help only: "bench" is dispatched above, before parsing.
    sub.add_parser(
        "bench",
        help="benchmark against the NumPy reference (and PyTorch if installed)",
        add_help=False,
    )
    p_train = sub.add_parser(
        "train",
        help="train a table on a task where order matters; before/after pictures",
        description="Train a position table on a small task where order matters (predict "
        "each token's position), print the mean cosine similarity of adjacent positions "
        "before and after, and write before/after heatmaps and similarity maps.",
    )
    add_train_arguments(p_train)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # The subcommand's own usage, with its options, rather than the top level's.
        sub.choices.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.error("a subcommand is required: demo, info, bench or train")
    commands = {"demo": demo, "info": lambda args: show_config(), "train": run_train}
    return int(commands[args.command](args) or 0)


def _prog() -> str:
    """The command as it was run: ``python -m cposembed`` or the installed script's name."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if name in ("", "-c") or name.endswith(".py"):
        return "python -m cposembed"
    return name


def _run_script() -> int:
    """``main()``, ending quietly when the reader of its output goes away (``| head -1``)."""
    try:
        status = main()
        sys.stdout.flush()  # the last output, here rather than at exit
    except BrokenPipeError:
        # As the signal module's "Note on SIGPIPE": devnull, so the flush at exit passes.
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # not a real file: nothing to flush
                os.dup2(devnull, stream.fileno())
        return 1
    return status


if __name__ == "__main__":
    sys.exit(_run_script())
