"""The command line: options, the machine's description, the run of the chosen groups."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

from .. import _core, _state, _threads
from .._config import config
from ._common import OURS, Group
from ._groups import GROUP_NAMES, build_groups
from ._report import RATIO, fmt_ms, markdown, mismatched, missed, report, summary
from ._timing import measure


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _try_torch(enabled: bool, n_threads: int) -> Any:
    if not enabled:
        return None
    try:
        import torch
    except Exception:  # not installed or broken: the torch rows are skipped
        return None
    torch.set_num_threads(n_threads)
    return torch


def machine_info(args: argparse.Namespace, torch: Any) -> dict[str, Any]:
    cfg = config()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus_available": cfg["cpus_available"],
        "platform": cfg["platform"],
        "python": cfg["python"],
        "numpy": cfg["numpy"],
        "torch": getattr(torch, "__version__", None),
        "cposembed": cfg["cposembed"],
        "openmp": cfg["openmp_enabled"],
        "compile_args": cfg["compile_args"],
        "streaming_stores": _core.streaming_stores_available(),
        "threads": args.threads,
        "table": list(args.table),
        "batch": list(args.batch),
        "dtype": args.dtype,
        "repeats": args.repeats,
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "openblas_env": {
            k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ
        },
    }


def make_parser() -> argparse.ArgumentParser:
    """The bench's command line: every option with its help."""
    p = argparse.ArgumentParser(
        prog="python -m cposembed bench",
        description="cposembed against the machine's memory limits, NumPy and PyTorch "
        "(one process, alternating runs, medians). Every ratio is ours/this = "
        "time(cposembed) / time(contender): below 1, cposembed is faster; a target is "
        "the largest ratio that meets it. The run ends with a summary of the targets.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes and few repeats: a smoke test of a few seconds",
    )
    for flag, names, what in [
        ("--table", ("L", "D"), "table shape (default 2048 768)"),
        ("--batch", ("B", "T"), "positions shape (default 32 1024)"),
    ]:
        p.add_argument(flag, nargs=2, type=int, metavar=names, default=None, help=what)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for cposembed, the limits and torch (default: all)",
    )
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="token table rows for the embed rows (default 50257, GPT-2's vocabulary)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 21)")
    p.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default="float32",
        help="dtype of the tables, token embeddings and gradients (default float32)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="also write the results as JSON (tools/perf_table.py makes the README's "
        "performance table from such files)",
    )
    p.add_argument("--markdown", metavar="FILE", help="also write the whole table as Markdown")
    p.add_argument("--no-torch", action="store_true", help="leave out the PyTorch rows")
    p.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="run only these comparisons: " + " ".join(GROUP_NAMES),
    )
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = make_parser()
    args = p.parse_args(argv)
    if args.quick:
        args.table = args.table or [256, 64]
        args.batch = args.batch or [4, 128]
        args.repeats = args.repeats or 3
        args.vocab = args.vocab or 1000
    args.vocab = args.vocab or 50257
    args.table = args.table or [2048, 768]
    args.batch = args.batch or [32, 1024]
    args.repeats = args.repeats or 21
    if args.threads is None:
        args.threads = _threads.get_num_threads()
    else:
        # num_threads='s rules: the same check and the same cap as every call's.
        try:
            requested = _threads.check_num_threads(args.threads)
        except ValueError as exc:
            p.error(f"--threads: {exc}")
        args.threads = _threads.effective_num_threads(requested, sys.maxsize, sys.maxsize)
        if args.threads < requested:
            _progress(
                f"--threads {requested}: capped at {args.threads}, the most that "
                "num_threads= runs on here"
            )
    for name, vals in (("--table", args.table), ("--batch", args.batch)):
        if min(vals) < 1:
            p.error(f"{name} sizes must be positive; got {vals}")
    if args.table[0] < args.batch[1]:
        p.error(f"--table L ({args.table[0]}) must be >= T ({args.batch[1]})")
    if args.repeats < 1 or args.vocab < 1:
        p.error("--repeats and --vocab must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    for option, path in (("--json", args.json), ("--markdown", args.markdown)):
        problem = path and _state.output_problem(path, option)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    torch = _try_torch(not args.no_torch, args.threads)
    info = machine_info(args, torch)
    no_torch = "--no-torch" if args.no_torch else "torch not installed"
    _progress(
        f"cposembed bench: table {args.table[0]}x{args.table[1]} {args.dtype}, "
        f"positions {args.batch[0]}x{args.batch[1]}, {args.threads} threads, "
        f"{args.repeats} rounds, torch {info['torch'] or no_torch + ': its rows are left out'}"
    )
    factories = build_groups(args, torch)
    if args.only:
        known = {name for name, _ in factories}
        unknown = set(args.only) - known
        if unknown:
            print(
                f"unknown --only names: {sorted(unknown)}; known: {sorted(known)}", file=sys.stderr
            )
            return 2
        factories = [(n, f) for n, f in factories if n in args.only]
    done: list[Group] = []
    t_start = time.perf_counter()
    for i, (name, factory) in enumerate(factories, 1):
        _progress(f"[{i}/{len(factories)}] {name} ...")
        for g in factory():
            if len(g.contenders) < 2:
                # Its only peers are PyTorch's: nothing to compare with.
                _progress(f"      {g.op}: not compared ({no_torch})")
                done.append(g)
                continue
            measure(g, args.repeats)
            ours = next(c for c in g.contenders if c.name == OURS)
            others = ", ".join(
                f"{c.name} {ours.median / c.median:.3f}" for c in g.contenders if c is not ours
            )
            _progress(f"      {g.op}: {fmt_ms(ours.median).strip()}; {RATIO}: {others}")
            done.append(g)
    _progress(f"done in {time.perf_counter() - t_start:.1f} s")
    print()
    print(
        "cposembed bench: "
        + ", ".join(f"{k}={v}" for k, v in info.items() if k not in ("compile_args",))
    )
    rows = report(done, judge=not args.quick, why_no_peer=no_torch)
    bad = mismatched(rows)
    outputs = []
    if args.json:
        outputs.append((args.json, json.dumps({"machine": info, "results": rows}, indent=1)))
    if args.markdown:
        outputs.append((args.markdown, markdown(rows)))
    for path, text in outputs:
        try:
            with _state.atomic_write(path) as f:
                f.write(text.encode())
        except OSError as exc:
            print(f"error: could not write {path}: {exc}", file=sys.stderr)
            return 1
        _progress(f"wrote {path}")
    for line in missed(rows):
        print(line)
    print(summary(rows, judged=not args.quick))
    if bad:
        print(f"{len(bad)} output check(s) failed", file=sys.stderr)
        return 1
    return 0
