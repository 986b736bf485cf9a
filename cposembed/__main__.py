"""Command line: ``python -m cposembed {demo,info,bench}``."""

from __future__ import annotations

import argparse
import sys

import numpy as np


def demo(args: argparse.Namespace) -> int:
    """The handbook's example (its In[4]/Out[5]), on the package's class."""
    from . import LearnedPositionEmbedding

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
    return 0


def info(args: argparse.Namespace) -> int:
    from . import show_config

    show_config()
    return 0


def bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args.bench_args)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # argparse's REMAINDER does not capture options ("--quick") that come
        # first, so the bench's own parser gets its arguments directly.
        from .bench import main as bench_main

        return int(bench_main(argv[1:]) or 0)
    parser = argparse.ArgumentParser(
        prog="python -m cposembed", description="Learned position embeddings on C kernels."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="the handbook's example output").set_defaults(func=demo)
    sub.add_parser("info", help="show_config(): version, OpenMP, threads, flags").set_defaults(
        func=info
    )
    p_bench = sub.add_parser(
        "bench",
        help="benchmark against the NumPy reference (and PyTorch if installed)",
        add_help=False,
    )
    p_bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    p_bench.set_defaults(func=bench)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
