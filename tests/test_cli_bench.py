"""The bench command: its comparisons, targets, verdicts, options and summary line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import (
    assert_clean_exit,
    run_module,
    run_python,
)

import cposembed
from cposembed import _threads, bench

QUICK_SUMMARY = "summary: quick run, targets not judged; 0 check mismatches"


SUMMARY = re.compile(
    r"^summary: (\d+) rows with targets, (\d+) ok, (\d+) miss; (\d+) check mismatches$"
)


# -- bench: verdicts and the summary line ------------------------------------------
def test_quick_bench_judges_no_target_and_ends_with_the_quick_summary(tmp_path):
    proc = run_module(
        "bench", "--quick", "--no-torch", "--repeats", "1", "--only", "lookup", "tiny",
        "--markdown", str(tmp_path / "b.md"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.rstrip("\n").splitlines()
    assert lines[-1] == QUICK_SUMMARY
    table = "\n".join(lines[:-1])
    assert "n/a (quick)" in table
    assert not re.search(r"\bok\b|\bMISS\b", table), table
    md = (tmp_path / "b.md").read_text()
    assert "n/a (quick)" in md and "miss" not in md and " ok " not in md
    assert bench.RATIO_LEGEND in md and "ours/this <= " in md


def test_full_bench_judges_every_target_and_the_summary_counts_them(capsys, tmp_path):
    path = tmp_path / "b.json"
    args = ["--no-torch", "--repeats", "1", "--table", "256", "64", "--batch", "2", "16"]
    code = bench.main([*args, "--only", "tiny", "decode_batched", "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out.rstrip("\n").splitlines()
    m = SUMMARY.match(out[-1])
    assert m, f"last line is not the summary: {out[-1]!r}"
    n, ok, miss, mismatches = map(int, m.groups())
    rows = json.loads(path.read_text())["results"]
    judged = [r for r in rows if r["target"] is not None]
    assert n == len(judged) > 0 and ok + miss == n and mismatches == 0
    assert ok == sum(r["met"] is True for r in judged)
    assert all(r["met"] in (True, False) for r in judged)
    table = "\n".join(out)
    assert len(re.findall(r": (ok|MISS)\b", table)) == n
    assert "n/a (quick)" not in table
    # Each verdict follows the rule that decided it, ratios in one direction.
    assert len(re.findall(r"ours/this <= [0-9.]+: (ok|MISS)\b", table)) == n
    assert bench.RATIO_LEGEND in table
    assert all(r["rule"] == f"ours/this <= {r['target']:g}" for r in judged)


def test_summary_counts_mismatches():
    rows = [
        {"target": 1.0, "met": True, "check": "equal"},
        {"target": 1.0, "met": False, "check": "MISMATCH"},
        {"target": None, "met": None, "check": "MISMATCH shape (1,) vs (2,)"},
        {"target": None, "met": None, "check": ""},
    ]
    assert bench.summary(rows, judged=True) == (
        "summary: 2 rows with targets, 1 ok, 1 miss; 2 check mismatches"
    )
    assert bench.summary(rows, judged=False) == (
        "summary: quick run, targets not judged; 2 check mismatches"
    )


# -- bench: the class comparisons (add_to with explicit positions, backward, tiny calls) --
CLASS_OPS = {
    "add_to_explicit": [f"add_to explicit ({b}, {t}, d)" for b, t in [(4, 1), (32, 1), (4, 100)]],
    "backward_vs_scatter": [
        f"backward vs scatter_add {s}"
        for s in ["(4, 1, d)", "(32, 1, d)", "(4, 100, d)", "(B, T, d)"]
    ],
    "decode_batched": ["decode batched: add_to((8,1,d), pos (8,1))"],
    "tiny": [
        "tiny: pe(np.int64(5))",
        "tiny: pe(positions[i])",
        "tiny: pe([np.int64(1), np.int64(2)])",
        "tiny: add_to((1,1,d), offset=np.int64(i))",
    ],
}


@pytest.mark.parametrize("name", sorted(CLASS_OPS))
def test_class_comparisons_run_check_equal_outputs_and_have_targets(tmp_path, name):
    path = tmp_path / "b.json"
    code = bench.main(
        ["--quick", "--no-torch", "--repeats", "1", "--only", name, "--json", str(path)]
    )
    assert code == 0
    rows = json.loads(path.read_text())["results"]
    by_op: dict[str, list[dict]] = {}
    for r in rows:
        by_op.setdefault(r["op"], []).append(r)
    for op in CLASS_OPS[name]:
        assert op in by_op, f"{op!r} not in the results: {sorted(by_op)}"
        peers = [r for r in by_op[op] if r["contender"] != bench.OURS]
        assert peers and all(r["check"] == "equal" for r in peers), peers
        assert any((op, r["contender"]) in bench.TARGETS for r in peers), f"no target for {op!r}"


def _quick_rows(tmp_path, *options: str) -> list[dict]:
    """The JSON rows of a --quick run of one round with ``options``."""
    path = tmp_path / "b.json"
    assert bench.main(["--quick", "--repeats", "1", *options, "--json", str(path)]) == 0
    return json.loads(path.read_text())["results"]


def _targets_of(rows: list[dict]) -> dict[tuple[str, str], float]:
    return {(r["op"], r["contender"]): r["target"] for r in rows if r["target"] is not None}


HALF_TARGETS = {
    **{(f"lookup(out=) {h}", "limit: streaming fill"): 1.15 for h in ("bfloat16", "float16")},
    **{(f"scatter_add {h} into float32", "limit: read once"): 1.5 for h in ("bfloat16", "float16")},
    ("embed(out=) bfloat16", "limit: streaming fill"): 1.15,
    ("embed(out=) bfloat16", "cposembed, float32 tables"): 0.7,
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_half_rows_have_the_issues_targets_and_equal_checks(tmp_path, dtype):
    """The half group runs in a float32 or float64 run alike: its peers' outputs
    are checked equal (the limits and the float32 layer have no output to check)."""
    rows = _quick_rows(tmp_path, "--no-torch", "--only", "half", "--dtype", dtype)
    assert _targets_of(rows) == HALF_TARGETS
    checked = [r for r in rows if r["contender"] != bench.OURS and r["check"]]
    assert len(checked) == 8 and all(r["check"] == "equal" for r in checked), checked
    assert {(op, c) for (op, c) in HALF_TARGETS} <= set(bench.TARGETS)


OPTIM_TARGETS = {
    ("optim: fused SGD step", "cposembed, embed_backward alone"): 1.15,
    ("optim: fused Adam step", "cposembed, embed_backward alone"): 1.8,
    ("optim: fwd + fused SGD step", "torch 2 x nn.Embedding(sparse=True) + SGD"): 0.15,
    ("huge table: scatter_add", "numpy np.add.at"): 1.0,
    ("huge table: fused SGD step", "numpy np.add.at"): 2.0,
    ("huge table: fused Adam, new rows", "cposembed, rows stepped before"): 1.5,
}


def test_the_optim_rows_have_the_issues_targets_and_pass_their_checks(tmp_path):
    """Fused against unfused and scatter_add against np.add.at are bitwise; the
    fused steps equal the optimizers' rules applied to embed_backward's gradient
    and np.add.at's; without torch the forward + step has no peer."""
    rows = _quick_rows(tmp_path, "--no-torch", "--only", "optim_steps", "optim_huge")
    no_torch = {k: t for k, t in OPTIM_TARGETS.items() if not k[1].startswith("torch")}
    assert _targets_of(rows) == no_torch
    assert no_torch.items() <= bench.TARGETS.items()
    checks = {(r["op"], r["contender"]): r["check"] for r in rows if r["contender"] != bench.OURS}
    assert checks[("optim: fused SGD step", "cposembed, unfused zero_grad + backward + step")] == (
        "equal"
    )
    assert checks[("huge table: scatter_add", "numpy np.add.at")] == "equal"
    assert all(c == "equal" or c.startswith("close") for c in checks.values()), checks
    assert "optim: fwd + fused SGD step" not in {r["op"] for r in rows}


def test_the_optim_rows_against_pytorch_check_the_tables_after_one_step(tmp_path):
    pytest.importorskip("torch")
    rows = _quick_rows(tmp_path, "--only", "optim_steps")
    peer = next(
        r for r in rows if r["op"] == "optim: fwd + fused SGD step" and r["contender"] != bench.OURS
    )
    key = (peer["op"], peer["contender"])
    assert peer["target"] == OPTIM_TARGETS[key] == bench.TARGETS[key]
    assert peer["check"].startswith(("equal", "close")), peer


def test_every_target_names_a_comparison_that_exists(tmp_path):
    path = tmp_path / "b.json"
    code = bench.main(
        ["--quick", "--no-torch", "--repeats", "1", "--threads", "2", "--json", str(path)]
    )
    assert code == 0
    seen = {(r["op"], r["contender"]) for r in json.loads(path.read_text())["results"]}
    # Without torch: no torch contender, and no pools row with PyTorch's ops.
    left_out = {k for k in bench.TARGETS if k[1].startswith("torch") or "PyTorch" in k[0]}
    if not cposembed.openmp_enabled():  # --threads 2 runs on one: no threads rows
        left_out |= {k for k in bench.TARGETS if k[0].startswith("threads:")}
    assert set(bench.TARGETS) - left_out <= seen, sorted(set(bench.TARGETS) - left_out - seen)


def test_group_names_are_what_only_accepts():
    args = bench.parse_args(["--quick", "--no-torch", "--threads", "2"])
    names = [name for name, _ in bench.build_groups(args, None)]
    if not cposembed.openmp_enabled():  # --threads 2 runs on one, as num_threads=2 does
        names += [n for n in bench.GROUP_NAMES if n.startswith("threads_")]
    assert sorted(names) == sorted(bench.GROUP_NAMES)
    one = bench.parse_args(["--quick", "--no-torch", "--threads", "1"])
    assert [n for n, _ in bench.build_groups(one, None)] == [
        n for n in bench.GROUP_NAMES if not n.startswith("threads_")
    ]


def test_only_with_an_unknown_name_lists_the_known_ones(capsys):
    assert bench.main(["--quick", "--no-torch", "--only", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "backward_vs_scatter" in err and "decode_batched" in err


# -- bench --threads: num_threads='s rules -------------------------------------------
@pytest.mark.parametrize("value", [0, -3])
def test_bench_threads_is_checked_as_num_threads_is(value):
    with pytest.raises(ValueError) as info:
        cposembed.lookup(np.zeros((4, 2), np.float32), [0], num_threads=value)
    proc = run_module("bench", "--quick", "--no-torch", "--threads", str(value))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert f"--threads: {info.value}" in proc.stderr, proc.stderr


def test_bench_threads_beyond_the_cap_is_capped_as_num_threads_is(tmp_path):
    # torch.set_num_threads(100000) segfaults: the bench hands torch the capped count.
    cap = _threads.effective_num_threads(100000, sys.maxsize, sys.maxsize)
    proc = run_module(
        "bench", "--quick", "--repeats", "1", "--only", "tiny", "--threads", "100000",
        "--json", str(tmp_path / "b.json"),
    )  # fmt: skip
    assert_clean_exit(proc)
    assert json.loads((tmp_path / "b.json").read_text())["machine"]["threads"] == cap
    assert f"capped at {cap}" in proc.stderr


def test_without_torch_no_comparison_is_empty(capsys, tmp_path):
    path = tmp_path / "b.json"
    code = bench.main(
        ["--quick", "--no-torch", "--repeats", "1", "--only", "fwd_bwd", "lookup",
         "--json", str(path)]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    # fwd_bwd's only peer is PyTorch's: it is named as not compared, not printed alone.
    assert "not compared (--no-torch): pe(pos, out=) + pe.backward" in out
    table = out[out.index("op / contender") :]
    assert "\npe(pos, out=) + pe.backward" not in table
    rows = json.loads(path.read_text())["results"]
    assert {r["op"] for r in rows} == {"lookup(out=)"}
    for op in {r["op"] for r in rows}:
        assert sum(r["contender"] != bench.OURS for r in rows if r["op"] == op) >= 1


def _group(op: str, *medians: tuple[str, float]) -> bench.Group:
    """A timed group: (contender, median seconds) pairs, cposembed first."""
    return bench.Group(op, [bench.Contender(n, lambda: None, 0, [t]) for n, t in medians])


def test_the_threads_exception_is_printed_with_its_rule(capsys):
    # ratio 1.116 > 0.8, but cposembed runs within 1.1 x the streaming fill.
    op = "threads: lookup(out=)"
    within = _group(op, ("cposembed", 1.116), ("1 thread", 1.0), ("limit: streaming fill", 1.05))
    beyond = _group(op, ("cposembed", 1.116), ("1 thread", 1.0), ("limit: streaming fill", 0.5))
    for g in (within, beyond):
        g.contenders[1].target = 0.8  # the target sits on its contender
    assert bench._judge(within, 1.116, 0.8) == (True, "ok (ours/limit 1.06)")
    assert bench._judge(beyond, 1.116, 0.8) == (False, "MISS (ours/limit 2.23)")
    rows = bench.report([within, beyond])
    out = capsys.readouterr().out
    rule = "ours/this <= 0.8, or ours/limit <= 1.1"
    assert re.search(r"1 thread .*1\.116\s+" + re.escape(f"{rule}: ok (ours/limit 1.06)"), out)
    assert re.search(r"1 thread .*1\.116\s+" + re.escape(f"{rule}: MISS (ours/limit 2.23)"), out)
    assert [r["met"] for r in rows if r["target"] is not None] == [True, False]
    assert all(r["rule"] == rule for r in rows if r["target"] is not None)
    assert bench.missed(rows) == [f"missed: {op} vs 1 thread: ours/this 1.116, rule {rule}"]


def test_a_plain_target_is_judged_on_ours_over_this_alone():
    g = _group("pe(pos)", ("cposembed", 0.7), ("numpy P[pos]", 1.0))
    assert bench._rule(g, 0.65) == "ours/this <= 0.65"
    assert bench._judge(g, 0.7, 0.65) == (False, "MISS")
    assert bench._judge(g, 0.6, 0.65) == (True, "ok")


def test_bench_quick_runs_and_writes_json(tmp_path, capsys):
    from cposembed import bench

    path = tmp_path / "b.json"
    code = bench.main(
        [
            "--quick",
            "--no-torch",
            "--repeats",
            "1",
            "--json",
            str(path),
            "--only",
            "lookup",
            "scatter_random",
            "tiny",
        ]
    )
    assert code == 0
    data = json.loads(path.read_text())
    ops = {r["op"] for r in data["results"]}
    assert {"lookup(out=)", "scatter_add random", "tiny: pe(5)"} <= ops
    assert all(not r["check"].startswith("MISMATCH") for r in data["results"])
    assert "cposembed" in capsys.readouterr().out


# -- bench: one direction, the rule beside each target, no empty comparison ---------
def test_every_bench_option_has_help():
    actions = [a for a in bench.make_parser()._actions if a.option_strings]
    assert {"--dtype", "--json", "--markdown", "--no-torch"} <= {
        s for a in actions for s in a.option_strings
    }
    for action in actions:
        assert action.help and action.help.strip(), f"{action.option_strings} has no help"
    dtype = next(a for a in actions if "--dtype" in a.option_strings)
    assert "float32" in dtype.help


# -- bench: contention (default threads against one, idle and beside a busy process) --
CONTENTION_OPS = {
    f"contention {load}: {op} ({b}, {t}, d)"
    for load in ("idle", "busy")
    for op in ("add_positions", "scatter_add")
    for b, t in [(8, 16), (8, 128), (32, 1024)]
} | {"contention idle: train", "contention busy: train"}
POOLS_CALLS = (
    "embed(out=) GPT-2", "lookup(out=) (B, T, d)", "scatter_add random (B, T, d)",
    "embed_backward GPT-2",
)  # fmt: skip
# Without torch: the libgomp loop is the only other pool.
POOLS_OPS = {
    op
    for call in POOLS_CALLS
    for op in (
        f"pools: {call}, a libgomp loop before each call",
        f"pools: {call}, right after a libgomp loop",
    )
}


def _busy_processes() -> list[int]:
    """The pids of running (not zombie) busy processes of a bench on this machine."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # not a process, or gone meanwhile
        if bench.BUSY_CODE in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process list in /proc")
def test_contention_runs_idle_and_busy_and_leaves_no_busy_process(tmp_path):
    path = tmp_path / "b.json"
    proc = run_module(
        "bench", "--only", "contention", "--quick", "--no-torch", "--repeats", "1",
        "--json", str(path),
    )  # fmt: skip
    assert_clean_exit(proc)
    assert proc.stdout.rstrip("\n").splitlines()[-1] == QUICK_SUMMARY
    rows = json.loads(path.read_text())["results"]
    assert {r["op"] for r in rows} == CONTENTION_OPS | POOLS_OPS
    assert {r["contender"] for r in rows} == {bench.OURS, "1 thread", "alone, fresh process"}
    assert {r["op"] for r in rows if r["target"] is not None} == (CONTENTION_OPS | POOLS_OPS) - {
        "contention idle: train"
    }
    pools = [r for r in rows if r["op"] in POOLS_OPS]
    assert all(r["median_s"] > 0 and r["runs"] >= 1 for r in pools)
    assert _busy_processes() == []


def test_batched_groups_time_batches_and_judge_the_median_of_the_rounds_ratios():
    from cposembed.bench._report import _ratio
    from cposembed.bench._timing import measure

    calls = {"a": 0, "b": 0}

    def call(name):
        calls[name] += 1
        time.sleep(0.001)

    g = bench.Group(
        "g", [bench.Contender(n, lambda n=n: call(n), 0) for n in ("a", "b")], batch_s=0.02
    )
    measure(g, 4)
    for c in g.contenders:
        assert len(c.times) == 4  # one batch per round
        assert c.number >= 3 and calls[c.name] >= 4 * c.number  # of several calls each
        assert all(0.001 <= t < 0.05 for t in c.times)  # a batch's mean per call
    # Rounds (2, 1), (2, 4), (9, 10): the ratio of the medians is 2 / 4, the
    # median of the rounds' ratios 0.9; a group timed call by call keeps the former.
    ours, peer = (
        bench.Contender(n, lambda: None, 0, t) for n, t in (("a", [2, 2, 9]), ("b", [1, 4, 10]))
    )
    assert _ratio(bench.Group("g", [ours, peer], batch_s=0.004), ours, peer) == pytest.approx(0.9)
    assert _ratio(bench.Group("g", [ours, peer]), ours, peer) == pytest.approx(0.5)


def test_no_run_waits_for_another_pools_threads(monkeypatch):
    # Each run follows the one before with no pause, after a probe or
    # PyTorch's run too: a pause would hide what their threads cost the next call.
    from cposembed.bench import _timing

    runs, slept = [], []
    monkeypatch.setattr(_timing.time, "sleep", lambda s: slept.append(s))
    names = (bench.OURS, "limit: streaming fill", "torch index_select(out=)")
    g = bench.Group("g", [bench.Contender(n, lambda n=n: runs.append(n), 0) for n in names])
    _timing.time_group(g, 6)
    assert len(runs) == 3 + 18 and slept == []


def test_the_contention_rows_are_batched():
    import argparse

    from cposembed.bench.contention import CONTENTION_BATCH_S, contention

    args = argparse.Namespace(
        table=[16, 4], batch=[2, 8], threads=2, vocab=32, dtype="float32", quick=True
    )
    groups = contention(bench.Fixture(args, None))
    assert {g.op for g in groups} == CONTENTION_OPS | POOLS_OPS
    assert all(g.batch_s == CONTENTION_BATCH_S > 0 for g in groups if g.op in CONTENTION_OPS)


def test_the_busy_process_is_killed_when_the_block_fails():
    with pytest.raises(KeyboardInterrupt), bench.busy_process() as busy:
        assert busy.poll() is None  # running
        raise KeyboardInterrupt
    assert busy.returncode is not None


def test_the_busy_process_ends_when_its_parent_is_not_the_bench():
    # A bench that died before its busy process started: the child, reparented
    # already, must not take its new parent for the bench and spin forever.
    not_its_parent = os.getpid() + 1 if os.getpid() > 1 else 2
    subprocess.run([sys.executable, "-c", bench.BUSY_CODE, str(not_its_parent)], timeout=60)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process list in /proc")
def test_the_busy_process_ends_by_itself_when_the_bench_dies():
    # os._exit skips the block's cleanup, as a bench killed by a signal would.
    code = (
        "import os\n"
        "from cposembed.bench import busy_process\n"
        "with busy_process() as busy:\n"
        "    print(busy.pid, flush=True)\n"
        "    os._exit(0)\n"
    )
    proc = run_python(["-c", code], timeout=60)
    assert_clean_exit(proc)
    pid = int(proc.stdout)
    deadline = time.monotonic() + 10
    while pid in _busy_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pid not in _busy_processes()
