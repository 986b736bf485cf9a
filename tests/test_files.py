"""Files the package writes: saves and the command line's outputs are atomic, and the
command line checks its output paths before the work starts.

A write that fails part way (simulated by a writer that writes some bytes and then
raises, as a full disk does) must leave the previous file loading as it was, and no
temporary file beside it.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import stat

import numpy as np
import pytest
from helpers import bits, run_python

import cposembed.train
from cposembed import LearnedPositionEmbedding, TokenPositionEmbedding

CLASSES = [LearnedPositionEmbedding, TokenPositionEmbedding]
ONE_LINE_ERROR = re.compile(r"^error: [^\n]+\n$")


def make(cls, seed):
    if cls is LearnedPositionEmbedding:
        return cls(8, 4, seed=seed)
    return cls(6, 8, 4, seed=seed)


def tables(obj):
    if isinstance(obj, LearnedPositionEmbedding):
        return [bits(obj.embeddings)]
    return [bits(obj.token_embeddings), bits(obj.position_embeddings)]


def same_tables(a, b):
    return all(np.array_equal(x, y) for x, y in zip(tables(a), tables(b)))


def failing_savez(after_bytes, error):
    """An np.savez that writes the first ``after_bytes`` bytes of the archive to
    its file (a name or a file object), then raises ``error``."""
    real = np.savez

    def savez(file, *args, **kwds):
        buf = io.BytesIO()
        real(buf, *args, **kwds)
        data = buf.getvalue()[:after_bytes]
        if isinstance(file, (str, bytes, os.PathLike)):
            with open(file, "wb") as f:
                f.write(data)
        else:
            file.write(data)
        raise error

    return savez


def run_cli(args, cwd, **kw):
    return run_python(["-m", "cposembed", *args], cwd=str(cwd), timeout=300, **kw)


def assert_one_line_error(proc, *words):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    assert ONE_LINE_ERROR.match(proc.stderr), repr(proc.stderr)
    for word in words:
        assert word in proc.stderr, (word, proc.stderr)


@contextlib.contextmanager
def umask(mask):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def unwritable_folder(tmp_path):
    """A folder in which this process cannot create a file (skips if there is none:
    root ignores permission bits, so then a folder of a read-only file system)."""
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        return folder
    for candidate in ("/sys", "/proc/sys"):
        probe = os.path.join(candidate, f"cposembed-probe-{os.getpid()}")
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        except OSError:
            return candidate
        os.unlink(probe)
    pytest.skip("no folder that this (root) process cannot write")


# -- save(path) --------------------------------------------------------------------
def _refuse(src, dst):
    raise PermissionError(errno.EACCES, "Permission denied")


def _no_space(after_bytes):
    error = OSError(errno.ENOSPC, "No space left on device")
    return pytest.param(
        np,
        "savez",
        failing_savez(after_bytes, error),
        errno.ENOSPC,
        id=f"no space after {after_bytes} bytes",
    )


# Where a save fails (the function replaced) and the errno of the OSError that
# names the file (None: the KeyboardInterrupt itself).
SAVE_FAILURES = [
    *(_no_space(n) for n in (0, 100, 1000)),
    pytest.param(np, "savez", failing_savez(500, KeyboardInterrupt()), None, id="interrupted"),
    pytest.param(os, "replace", _refuse, errno.EACCES, id="final rename refused"),
]


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(("module", "name", "failing", "errno_"), SAVE_FAILURES)
def test_a_failed_save_leaves_the_old_file_and_no_temporary_file(
    tmp_path, monkeypatch, cls, module, name, failing, errno_
):
    path = tmp_path / "model.ckpt"
    old = make(cls, seed=1)
    old.save(path)
    before = path.read_bytes()
    monkeypatch.setattr(module, name, failing)
    with pytest.raises(KeyboardInterrupt if errno_ is None else OSError) as info:
        make(cls, seed=2).save(path)
    if errno_ is not None:
        assert info.value.errno == errno_ and str(path) in str(info.value)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["model.ckpt"]
    assert path.read_bytes() == before
    assert same_tables(cls.load(path), old)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("name", ["plain", "with.npz", "other.suffix"])
def test_save_writes_exactly_the_name_given_with_the_umask_mode(tmp_path, cls, name):
    obj = make(cls, seed=3)
    with umask(0o027):
        obj.save(tmp_path / name)
        obj.save(os.fsencode(tmp_path / (name + "-bytes")))
    assert sorted(os.listdir(tmp_path)) == sorted([name, name + "-bytes"])
    for f in os.listdir(tmp_path):
        # as open(path, "wb") creates a file, not mkstemp's 0o600
        assert stat.S_IMODE(os.stat(tmp_path / f).st_mode) == 0o640
        assert same_tables(cls.load(tmp_path / f), obj)


@pytest.mark.parametrize("cls", CLASSES)
def test_save_over_a_file_keeps_its_permissions_and_a_symlink_stays_a_link(tmp_path, cls):
    target = tmp_path / "target"
    make(cls, seed=1).save(target)
    target.chmod(0o604)
    link = tmp_path / "link"
    link.symlink_to(target.name)
    new = make(cls, seed=2)
    new.save(link)
    assert link.is_symlink() and os.readlink(link) == target.name
    assert stat.S_IMODE(target.stat().st_mode) == 0o604
    assert same_tables(cls.load(target), new)
    assert sorted(os.listdir(tmp_path)) == ["link", "target"]


@pytest.mark.parametrize("cls", CLASSES)
def test_save_to_a_file_object_writes_into_it(cls):
    buf = io.BytesIO()
    obj = make(cls, seed=4)
    obj.save(buf)
    buf.seek(0)
    assert same_tables(cls.load(buf), obj)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    "where, error",
    [
        ("missing/model", FileNotFoundError),
        ("folder", IsADirectoryError),
        ("a-file/model", NotADirectoryError),
    ],
)
def test_a_save_that_cannot_start_names_the_path_and_writes_nothing(tmp_path, cls, where, error):
    (tmp_path / "folder").mkdir()
    (tmp_path / "a-file").write_bytes(b"keep")
    path = tmp_path / where
    with pytest.raises(error, match=re.escape(str(path))):
        make(cls, seed=1).save(path)
    assert sorted(os.listdir(tmp_path)) == ["a-file", "folder"]
    assert os.listdir(tmp_path / "folder") == []
    assert (tmp_path / "a-file").read_bytes() == b"keep"


def test_save_into_a_folder_it_cannot_write_names_the_path(tmp_path):
    folder = unwritable_folder(tmp_path)
    path = os.path.join(folder, "model")
    with pytest.raises(OSError, match=re.escape(path)):
        make(LearnedPositionEmbedding, seed=1).save(path)
    assert not os.path.exists(path)


# -- plots -------------------------------------------------------------------------
def test_a_picture_that_fails_part_way_leaves_the_old_png(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from cposembed import plot

    path = tmp_path / "map.png"
    table = np.random.default_rng(0).standard_normal((16, 8))
    plot.heatmap(table, path)
    before = path.read_bytes()

    def savefig(self, fname, **kw):
        data = b"\x89PNG\r\n\x1a\n" + b"\0" * 100
        if isinstance(fname, (str, os.PathLike)):
            with open(fname, "wb") as f:
                f.write(data)
        else:
            fname.write(data)
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(Figure, "savefig", savefig)
    with pytest.raises(OSError, match=re.escape(str(path))):
        plot.similarity(table, path)
    assert os.listdir(tmp_path) == ["map.png"]
    assert path.read_bytes() == before


# -- the command line checks its output paths first --------------------------------
TRAIN_SMALL = ["train", "--steps", "30", "--max-seq-len", "16", "--embed-dim", "8"]


@pytest.mark.parametrize("where", ["missing/trained", "folder", "a-file/trained"])
def test_train_save_to_an_impossible_path_fails_before_training(tmp_path, where):
    (tmp_path / "folder").mkdir()
    (tmp_path / "a-file").write_bytes(b"")
    save = str(tmp_path / where)
    proc = run_cli([*TRAIN_SMALL, "--out", str(tmp_path / "pics"), "--save", save], tmp_path)
    assert_one_line_error(proc, "--save", save)
    assert proc.stdout == ""  # nothing ran
    assert sorted(os.listdir(tmp_path)) == ["a-file", "folder"]


def test_train_save_into_an_unwritable_folder_fails_before_training(tmp_path):
    folder = unwritable_folder(tmp_path)
    save = os.path.join(folder, "trained")
    proc = run_cli([*TRAIN_SMALL, "--no-progress", "--save", save], tmp_path)
    assert_one_line_error(proc, "--save", save)
    assert proc.stdout == ""


@pytest.mark.parametrize("where", ["a-file", "a-file/pics", "pics-with-a-folder"])
def test_train_out_that_cannot_take_the_pictures_fails_before_training(tmp_path, where):
    pytest.importorskip("matplotlib")
    (tmp_path / "a-file").write_bytes(b"")
    (tmp_path / "pics-with-a-folder" / cposembed.train.PICTURES[2]).mkdir(parents=True)
    proc = run_cli([*TRAIN_SMALL, "--out", str(tmp_path / where)], tmp_path)
    assert_one_line_error(proc, "--out")
    assert proc.stdout == ""


def test_train_writes_its_files_and_leaves_no_temporary_file(tmp_path):
    pytest.importorskip("matplotlib")
    proc = run_cli([*TRAIN_SMALL, "--no-progress", "--out", "pics", "--save", "trained"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["pics", "trained"]
    assert sorted(os.listdir(tmp_path / "pics")) == sorted(cposembed.train.PICTURES)
    assert LearnedPositionEmbedding.load(tmp_path / "trained").embeddings.shape == (16, 8)


def test_demo_with_its_heatmap_path_taken_by_a_folder_fails_first(tmp_path):
    pytest.importorskip("matplotlib")
    from cposembed.__main__ import DEMO_HEATMAP

    (tmp_path / DEMO_HEATMAP).mkdir()
    proc = run_cli(["demo"], tmp_path)
    assert_one_line_error(proc, DEMO_HEATMAP)
    assert proc.stdout == ""


def test_demo_in_an_unwritable_folder_fails_first(tmp_path):
    pytest.importorskip("matplotlib")
    folder = unwritable_folder(tmp_path)
    proc = run_cli(["demo"], folder)
    assert_one_line_error(proc, "heatmap")
    assert proc.stdout == ""


@pytest.mark.parametrize("option", ["--json", "--markdown"])
def test_bench_output_to_an_impossible_path_fails_before_the_work(tmp_path, option):
    path = str(tmp_path / "missing" / "out")
    proc = run_cli(
        ["bench", "--quick", "--no-torch", "--repeats", "1", "--only", "tiny", option, path],
        tmp_path,
    )
    assert_one_line_error(proc, option, path)
    assert proc.stdout == ""
    assert os.listdir(tmp_path) == []


def test_bench_writes_its_files_and_leaves_no_temporary_file(tmp_path):
    proc = run_cli(
        ["bench", "--quick", "--no-torch", "--repeats", "1", "--only", "tiny"]
        + ["--json", "b.json", "--markdown", "b.md"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["b.json", "b.md"]


def test_train_saves_the_table_when_the_pictures_fail(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from cposembed import plot
    from cposembed.__main__ import main

    def similarity(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "pics"))

    monkeypatch.setattr(plot, "similarity", similarity)
    save = tmp_path / "trained"
    args = [*TRAIN_SMALL, "--no-progress", "--out", str(tmp_path / "pics"), "--save", str(save)]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: could not write the pictures") and "Traceback" not in err
    assert LearnedPositionEmbedding.load(save).embeddings.shape == (16, 8)
