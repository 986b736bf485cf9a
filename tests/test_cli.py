"""The command line: demo, info, train, usage errors and closed pipes."""

from __future__ import annotations

import os
import pathlib

import pytest
from helpers import run_module, run_python

import cposembed
import cposembed.train
from cposembed import LearnedPositionEmbedding
from cposembed import __main__ as cli

HANDBOOK_OUT5 = """\
Position embedding table shape: (128, 64)
  - 128 positions
  - 64 dimensions per position

Sample position embeddings (first 5 dimensions):
  Position 0: [ 0.062 -0.017  0.081  0.19  -0.029] ...
  Position 1: [ 0.102  0.17  -0.009  0.125  0.045] ...
  Position 2: [ 0.012 -0.063 -0.194  0.009 -0.133] ...
  Position 3: [ 0.027 -0.156  0.022  0.048 -0.11 ] ...
  Position 4: [ 0.158 -0.088  0.055  0.097 -0.116] ...
"""


def _run(*args, env=None, cwd=None):
    return run_python(["-m", "cposembed", *args], timeout=300, env=env, cwd=cwd, check=True)


def test_demo_prints_the_handbook_lines(tmp_path):
    out = _run("demo", cwd=tmp_path).stdout
    assert out.startswith(HANDBOOK_OUT5)


def test_info_shows_config():
    out = _run("info").stdout
    assert cposembed.__version__ in out
    assert "openmp" in out.lower() and "num_threads" in out


def test_show_config_mentions_version_and_openmp(capsys):
    cposembed.show_config()
    text = capsys.readouterr().out
    assert cposembed.__version__ in text
    assert str(cposembed.openmp_enabled()) in text


SUBCOMMANDS = ("demo", "info", "bench", "train")


# -- no subcommand ------------------------------------------------------------------
def test_no_subcommand_prints_the_usage_to_stderr_and_exits_2(tmp_path):
    """argparse's convention for a missing argument: usage and error on stderr, 2."""
    proc = run_module(cwd=str(tmp_path))
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert proc.stderr.startswith("usage: python -m cposembed"), proc.stderr
    for name in SUBCOMMANDS:
        assert name in proc.stderr, f"{name!r} missing from the usage:\n{proc.stderr}"
    assert "error: a subcommand is required" in proc.stderr
    assert os.listdir(tmp_path) == []  # nothing ran


def test_dash_dash_help_still_prints_the_help_and_exits_0():
    proc = run_module("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith("usage: python -m cposembed")
    assert all(name in proc.stdout for name in SUBCOMMANDS)


def test_main_without_arguments_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage:")


def test_an_unknown_subcommand_is_still_an_error():
    proc = run_module("nonsense")
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr and "nonsense" in proc.stderr
    assert proc.stdout == ""


# -- output into a closed pipe (`python -m cposembed info | head -1`) ---------------
def run_into_a_closed_pipe(args, cwd):
    """``python -m cposembed *args`` with stdout a pipe whose reader is gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return run_python(["-m", "cposembed", *args], timeout=300, cwd=cwd, stdout=write_end)
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["info"],
        ["demo"],
        ["train", "--steps", "2", "--max-seq-len", "8", "--embed-dim", "4", "--no-progress"],
        ["bench", "--quick", "--no-torch", "--repeats", "1", "--only", "tiny"],
    ],
    ids=["no subcommand", "info", "demo", "train", "bench"],
)
def test_output_into_a_closed_pipe_ends_quietly(tmp_path, args):
    proc = run_into_a_closed_pipe(args, cwd=str(tmp_path))
    # 1 as in the Python docs' recipe; no subcommand is a usage error (2, on stderr)
    assert proc.returncode == (2 if args == [] else 1), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    if args == []:
        assert proc.stderr.startswith("usage:")
    elif args[:1] != ["bench"]:  # the bench's progress goes to stderr
        assert proc.stderr == ""


ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_train_command_takes_an_optimizer(tmp_path):
    args = ["train", "--steps", "20", "--max-seq-len", "16", "--embed-dim", "8", "--no-progress"]
    sgd = run_cli([*args, "--optimizer", "sgd", "--out", str(tmp_path)], cwd=tmp_path)
    assert sgd.returncode == 0, sgd.stderr
    assert "SGD lr 5, seed 0" in sgd.stdout
    adam = run_cli([*args, "--out", str(tmp_path)], cwd=tmp_path)
    assert adam.returncode == 0, adam.stderr
    assert "Adam lr 0.01, seed 0" in adam.stdout
    adjacent_line(adam.stdout)
    bad = run_cli([*args, "--optimizer", "adam", "--lr", "-1"], cwd=tmp_path)
    assert bad.returncode == 2 and "--lr" in bad.stderr


def run_cli(args, cwd, block_matplotlib=False):
    code = "import sys\n"
    if block_matplotlib:
        code += "sys.modules['matplotlib'] = None\n"
    code += "from cposembed.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"
    return run_python(["-c", code, *args], timeout=300, cwd=cwd)


def adjacent_line(stdout):
    line = next(s for s in stdout.splitlines() if "adjacent positions" in s)
    before = float(line.split("before ")[1].split(",")[0])
    after = float(line.split("after ")[1])
    return before, after


def test_train_command(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "pics"
    proc = run_cli(
        [
            "train",
            "--steps",
            "60",
            "--max-seq-len",
            "32",
            "--embed-dim",
            "16",
            "--seed",
            "3",
            "--out",
            str(out),
            "--save",
            str(tmp_path / "trained"),
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    before, after = adjacent_line(proc.stdout)
    assert after > before + 0.3
    assert "training [" in proc.stderr or "training:" in proc.stderr  # the progress bar
    names = sorted(os.listdir(out))
    assert names == sorted(cposembed.train.PICTURES)
    for name in names:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pe = LearnedPositionEmbedding.load(tmp_path / "trained")
    assert pe.embeddings.shape == (32, 16)


def test_train_command_without_matplotlib(tmp_path):
    proc = run_cli(
        ["train", "--steps", "20", "--max-seq-len", "16", "--embed-dim", "8", "--no-progress"],
        cwd=tmp_path,
        block_matplotlib=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "skipped the pictures" in proc.stdout
    assert 'pip install ".[plot]"' in proc.stdout
    assert os.listdir(tmp_path) == []
    adjacent_line(proc.stdout)


def test_train_command_rejects_bad_options(tmp_path):
    proc = run_cli(["train", "--steps", "0"], cwd=tmp_path)
    assert proc.returncode == 2 and "--steps" in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seed", "-1"], "error: --seed must be in [0, 4294967295]; got -1"),
        (["--seed", "4294967296"], "error: --seed must be in [0, 4294967295]; got 4294967296"),
        (["--save", ""], "error: --save: expected a file name; got an empty path"),
        (["--lr", "nan"], "error: --lr must be a finite number (>= 0 for adam)"),
        (["--batch-size", "-3"], "error: --batch-size must be a positive integer"),
    ],
)
def test_train_refuses_each_bad_option_in_one_line_before_any_work(tmp_path, args, message):
    proc = run_cli(["train", "--steps", "1", *args], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.splitlines() == [message]
    assert os.listdir(tmp_path) == []


def test_train_takes_the_largest_seed(tmp_path):
    proc = run_cli(["train", "--steps", "1", "--seed", "4294967295", "--no-progress"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "seed 4294967295" in proc.stdout


def test_an_unknown_option_shows_its_subcommands_usage(tmp_path):
    for command in ("train", "demo", "info"):
        proc = run_cli([command, "--bogus"], cwd=tmp_path)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.startswith(f"usage: python -m cposembed {command}"), proc.stderr
        assert f"python -m cposembed {command}: error: unrecognized arguments: --bogus" in (
            proc.stderr
        )
    assert os.listdir(tmp_path) == []


def test_train_with_impossible_sizes_is_a_one_line_error_before_any_work(tmp_path):
    args = ["train", "--max-seq-len", "100000000000", "--embed-dim", "100000"]
    proc = run_cli(args, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --max-seq-len 100000000000"), lines
    assert "of memory; this machine has" in lines[0]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "argv0, prog",
    [
        ("/venv/bin/cposembed", "cposembed"),
        ("/src/cposembed/__main__.py", "python -m cposembed"),
        ("", "python -m cposembed"),
    ],
)
def test_the_usage_names_the_command_as_it_was_run(monkeypatch, argv0, prog):
    from cposembed import __main__ as cli

    monkeypatch.setattr(cli.sys, "argv", [argv0])
    assert cli._prog() == prog


def test_demo_writes_its_heatmap_where_out_says(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "cwd").mkdir()
    target = tmp_path / "heat.png"
    proc = run_cli(["demo", "--out", str(target)], cwd=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(HANDBOOK_OUT5)
    assert target.stat().st_size > 0 and os.listdir(tmp_path / "cwd") == []
    assert f"wrote heatmap to {target}" in proc.stdout
    # A path that cannot be written: the error, before any output.
    (tmp_path / "afile").write_text("")
    bad = run_cli(["demo", "--out", str(tmp_path / "afile" / "h.png")], cwd=tmp_path / "cwd")
    assert bad.returncode == 2 and bad.stdout == ""
    assert "is a file, not a folder" in bad.stderr


def test_a_path_through_a_file_says_which_part_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("")
    proc = run_cli(["train", "--steps", "1", "--save", "afile/x.npz"], cwd=tmp_path)
    assert proc.returncode == 2
    assert f"--save 'afile/x.npz': {str(tmp_path / 'afile')!r} is a file, not a folder" in (
        proc.stderr
    )
    pytest.importorskip("matplotlib")  # without it, train writes no pictures: --out unused
    proc = run_cli(["train", "--steps", "1", "--out", "afile/pics"], cwd=tmp_path)
    assert proc.returncode == 2 and "is a file, not a folder" in proc.stderr, proc.stderr


def test_the_progress_into_a_pipe_has_no_carriage_returns(tmp_path):
    proc = run_cli(["train", "--steps", "20", "--max-seq-len", "16"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "training" in proc.stderr and "\r" not in proc.stderr
