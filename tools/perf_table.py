"""The README's performance table, made from bench runs so that it cannot drift.

    python -m cposembed bench --json r1.json            # one run (repeat for more)
    python tools/perf_table.py r1.json r2.json r3.json  # print the table
    python tools/perf_table.py --write r1.json r2.json r3.json
    python tools/perf_table.py --check                  # what CI's docs stage runs

Every ratio is the bench's, ``ours/this = time(cposembed) / time(other)``: below 1,
cposembed is faster. A row's ratio is the median over the runs that have it (PyTorch
rows only come from runs with torch installed). ``--write`` keeps the rows the table
needs, with each run's machine line, in docs/readme_perf.json and rewrites the
README's table between its markers; ``--check`` fails when the README's table is
not the one docs/readme_perf.json gives.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DATA = ROOT / "docs" / "readme_perf.json"
BEGIN = "<!-- performance table: made by tools/perf_table.py from docs/readme_perf.json -->"
END = "<!-- end of the performance table -->"

# (bench op, bench contender) -> (the README's operation, what it is compared with)
ROWS: dict[tuple[str, str], tuple[str, str]] = {
    ("pe(pos)", "reference r(pos) [float64]"): (
        "`pe(positions)`",
        "the handbook's class (float64)",
    ),
    ("pe(pos)", "numpy P[pos]"): ("`pe(positions)`", "NumPy `P[positions]`"),
    ("lookup(out=)", "limit: streaming fill"): (
        "`lookup(P, positions, out=)`",
        "the machine's limit: a streaming fill of the same bytes",
    ),
    ("pe.add_to(tok)", "numpy tok + P[pos]"): ("`pe.add_to(tok)`", "NumPy `tok + P[positions]`"),
    ("scatter_add random", "numpy np.add.at"): (
        "`pe.backward(g)`'s `scatter_add`, random positions",
        "`np.add.at`",
    ),
    ("lookup(out=) bfloat16", "limit: streaming fill"): (
        "`lookup(P, positions, out=)`, bfloat16 table",
        "the machine's limit: a streaming fill of the same bytes",
    ),
    ("scatter_add bfloat16 into float32", "limit: read once"): (
        "`scatter_add` of a bfloat16 gradient into float32",
        "the machine's limit: one read of the gradient",
    ),
    ("embed(out=) bfloat16", "cposembed, float32 tables"): (
        "`embed(ids, wte, wpe, out=)`, bfloat16 tables, GPT-2 sizes",
        "the same call with float32 tables",
    ),
    ("embed", "numpy wte[ids] + wpe[:T]"): (
        "`embed(ids, wte, wpe)`, GPT-2 vocabulary",
        "NumPy `wte[ids] + wpe[:T]`",
    ),
    ("embed_backward", "torch index_add_ + batch sum"): (
        "`embed_backward`, GPT-2 vocabulary",
        "PyTorch `index_add_` + batch sum",
    ),
    ("pe(pos, out=) + pe.backward", "torch F.embedding fwd+bwd"): (
        "forward + backward",
        "PyTorch `F.embedding`",
    ),
    ("torch layer fwd+bwd", "torch 2 x nn.Embedding fwd+bwd"): (
        "`ct.TokenPositionEmbedding` fwd + bwd, GPT-2 sizes",
        "two `nn.Embedding`",
    ),
    ("torch converted nn.Embedding fwd+bwd", "torch nn.Embedding fwd+bwd"): (
        "`convert_embeddings`: GPT-2's `wte` fwd + bwd",
        "the unconverted `nn.Embedding`",
    ),
}


def reduce_run(run: dict[str, Any]) -> dict[str, Any]:
    """The part of a ``bench --json`` file the table needs."""
    m = run["machine"]
    rows = [
        {k: r[k] for k in ("op", "contender", "ratio_ours_to_this", "target")}
        for r in run["results"]
        if (r["op"], r["contender"]) in ROWS
    ]
    keys = ("cpu", "cpus_available", "threads", "table", "batch", "dtype", "numpy", "torch")
    keys += ("load_average_1min",)
    return {"machine": {k: m.get(k) for k in keys}, "results": rows}


def _runs(n: int) -> str:
    return "one run" if n == 1 else f"{n} runs"


def _speed(ratio: float) -> str:
    """``ours/this`` as a reader says it: "10.3 x faster", "1.06 x slower"."""
    if ratio < 1:
        return f"{1 / ratio:.1f} x faster" if ratio < 0.5 else f"{1 / ratio:.2f} x faster"
    return f"{ratio:.2f} x slower"


def render(runs: list[dict[str, Any]]) -> str:
    """The table, with the sentence that says where its numbers come from."""
    if not runs:
        raise ValueError("no bench runs given")
    machines = [r["machine"] for r in runs]
    m = machines[0]
    for other in machines[1:]:
        for k in ("cpus_available", "threads", "table", "batch", "dtype"):
            if other[k] != m[k]:
                raise ValueError(f"the runs differ in {k}: {m[k]} vs {other[k]}")
    ratios: dict[tuple[str, str], list[float]] = {key: [] for key in ROWS}
    targets: dict[tuple[str, str], float | None] = {}
    for run in runs:
        for r in run["results"]:
            key = (r["op"], r["contender"])
            if key in ROWS:
                ratios[key].append(r["ratio_ours_to_this"])
                targets[key] = r["target"]
    with_torch = sum(1 for x in machines if x.get("torch"))
    loads = sorted(x["load_average_1min"] for x in machines if x.get("load_average_1min"))
    load = ""
    if loads:
        span = f"{loads[0]:g}" if loads[0] == loads[-1] else f"{loads[0]:g}-{loads[-1]:g}"
        load = f", load average {span} (a shared machine)"
    L, d = m["table"]
    B, T = m["batch"]
    intro = (
        f"{m['cpus_available']}-core {m['cpu']} VM, {m['threads']} threads, {m['dtype']} "
        f"table {L} x {d}, positions ({B}, {T}): median of {_runs(len(runs))} of "
        f"`python -m cposembed bench` (PyTorch rows: {_runs(with_torch)}){load}. "
        "`ours/this = time(cposembed) / time(other)`: below 1, cposembed is faster "
        "(`speed` says by how much); the target is the largest ratio the bench accepts, "
        "and a **missed** one is marked."
    )
    lines = [
        *textwrap.wrap(intro, 88, break_on_hyphens=False),
        "",
        "| Operation | Compared with | ours/this | speed | Target |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for key, (op, other) in ROWS.items():
        if not ratios[key]:
            continue  # e.g. the PyTorch rows of runs without torch
        ratio = statistics.median(ratios[key])
        target = targets.get(key)
        ratio_s, target_s = f"{ratio:.3f}", ""
        if target is not None and ratio > target:
            ratio_s, target_s = f"**{ratio_s}**", f"<= {target:g}: **missed**"
        elif target is not None:
            target_s = f"<= {target:g}: met"
        lines.append(f"| {op} | {other} | {ratio_s} | {_speed(ratio)} | {target_s} |")
    return "\n".join(lines) + "\n"


def readme_table(text: str) -> str:
    """The README's table: the text between the markers."""
    try:
        start = text.index(BEGIN) + len(BEGIN) + 1
        end = text.index(END)
    except ValueError:
        raise AssertionError(f"README.md has no performance table markers ({BEGIN!r})") from None
    return text[start:end]


def check() -> None:
    """The README's table is what docs/readme_perf.json gives (AssertionError if not)."""
    runs = json.loads(DATA.read_text(encoding="utf-8"))["runs"]
    want = render(runs)
    got = readme_table(README.read_text(encoding="utf-8"))
    if got.strip() != want.strip():
        raise AssertionError(
            "README.md's performance table is not tools/perf_table.py's output for "
            f"docs/readme_perf.json; run python tools/perf_table.py --write RUN.json ...\n"
            f"--- README\n{got}--- expected\n{want}"
        )


def write(runs: list[dict[str, Any]]) -> None:
    DATA.write_text(json.dumps({"runs": runs}, indent=1) + "\n", encoding="utf-8")
    text = README.read_text(encoding="utf-8")
    old = readme_table(text)
    README.write_text(text.replace(BEGIN + "\n" + old, BEGIN + "\n" + render(runs)), "utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", type=Path, help="JSON files of python -m cposembed bench")
    p.add_argument(
        "--write",
        action="store_true",
        help="keep the runs in docs/readme_perf.json and rewrite README.md's table",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="fail if README.md's table is not the one docs/readme_perf.json gives",
    )
    args = p.parse_args(argv)
    if args.check:
        try:
            check()
        except AssertionError as exc:
            print(exc, file=sys.stderr)
            return 1
        print("README.md's performance table matches docs/readme_perf.json")
        return 0
    if not args.runs:
        p.error("give the JSON files of one or more bench runs (python -m cposembed bench --json)")
    runs = [reduce_run(json.loads(path.read_text(encoding="utf-8"))) for path in args.runs]
    if args.write:
        write(runs)
    print(render(runs), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
