"""Checks of pickled states and saved files (whole, as the kernels trust their arrays;
a refusal is a ``ValueError`` naming the field or the file), and :func:`atomic_write`,
the one way the package writes a file."""

from __future__ import annotations

import ast
import contextlib
import errno
import math
import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Iterator
from typing import IO, Any, Literal, NamedTuple, TypeGuard, Union

import numpy as np

from . import _core
from ._grad import check_grad
from ._validation import (
    FLOAT_NAMES,
    bfloat16,
    describe,
    is_float,
    native_dtype,
    padding_index,
    work_dtype,
)

# The keys __getstate__ writes; those of an instance pickled before it existed (its __dict__).
_STATE_KEYS = frozenset({"version", "embeddings", "grad", "touched", "padding_idx"})
_LEGACY_STATE_KEYS = frozenset({"_embeddings", "grad"})
# What reading a damaged archive or member raises (zipfile, zlib, numpy.lib.format);
# RuntimeError: a member flagged as encrypted; MemoryError: a header's absurd size.
_CORRUPT = (
    ValueError,
    RuntimeError,
    OSError,
    EOFError,
    KeyError,
    zipfile.BadZipFile,
    zlib.error,
    struct.error,
    OverflowError,
    TypeError,
    MemoryError,
)


PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]
# What save() and load() take: a file name or an open binary file.
PathOrFile = Union[str, "os.PathLike[str]", IO[bytes]]


class State(NamedTuple):
    """A checked state, in the layout the class keeps."""

    embeddings: np.ndarray  # (L, d) of a table dtype (is_float), native, C-contiguous, writable
    grad: np.ndarray | None  # None or (L, d), real dtype (kept as given if it fits)
    touched: np.ndarray | None  # None or (L,) bool, a fresh array; only with a grad
    padding_idx: int | None  # normalised to [0, L)


def _table(value: Any, what: str, error: type[Exception] = ValueError) -> np.ndarray:
    """An ``(L, d)`` table of a table dtype, native and C-contiguous (a copy if needed)."""
    if (
        not isinstance(value, np.ndarray)
        or value.ndim != 2
        or min(value.shape) < 1
        or not is_float(native_dtype(value.dtype))
    ):
        raise error(
            f"{what} must be a 2-D {FLOAT_NAMES} array with both sizes >= 1; got {describe(value)}"
        )
    return _kept(value, native_dtype(value.dtype))


def _kept(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``arr`` if it has the layout the class keeps, else such a copy."""
    if _core.is_canonical(arr, dtype, writable=True):
        return arr
    return np.array(arr, dtype=dtype, order="C", copy=True, subok=False)


def check_version(
    version: Any, current_version: int, what: str, error: type[Exception] = ValueError
) -> None:
    """``error`` unless ``version`` is an integer from 1 to ``current_version``."""
    if isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer)):
        raise error(f"{what}: version must be an integer; got {describe(version)}")
    if not 1 <= version <= current_version:
        raise error(
            f"{what} version {int(version)}; this cposembed reads versions 1 to "
            f"{current_version} (a newer one needs a newer cposembed)"
        )


def from_pickle(state: Any, current_version: int) -> State:
    """A checked state from ``__getstate__`` (or a legacy ``__dict__``)."""
    if not isinstance(state, dict):
        raise ValueError(
            f"pickled state must be a dict; got {type(state).__name__} "
            "(not a LearnedPositionEmbedding)"
        )
    keys = set(state)
    legacy = "_embeddings" in keys
    unknown = keys - (_LEGACY_STATE_KEYS if legacy else _STATE_KEYS)
    if unknown:
        raise ValueError(
            f"pickled state has unknown keys {sorted(map(str, unknown))}; expected "
            f"{sorted(_STATE_KEYS)} (or {sorted(_LEGACY_STATE_KEYS)} from an old version)"
        )
    missing = set() if legacy else {"version", "embeddings"} - keys
    if missing:
        raise ValueError(f"pickled state is missing {sorted(missing)}; got keys {sorted(keys)}")
    if not legacy:
        check_version(state["version"], current_version, "pickled state")

    what = "pickled state: embeddings"
    table = _table(state["_embeddings"] if legacy else state["embeddings"], what)
    n_rows = table.shape[0]
    pad = padding_index(state.get("padding_idx"), n_rows, "pickled state: padding_idx")

    grad = state.get("grad")
    if grad is not None:
        try:
            check_grad(grad, table, step=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"pickled state: {exc}") from None
        grad = _kept(grad, work_dtype(table.dtype))  # the dtype a backward gives

    touched = state.get("touched")
    if touched is not None:
        is_bool = isinstance(touched, np.ndarray) and touched.dtype == np.bool_
        if not is_bool or touched.shape != (n_rows,):
            raise ValueError(
                f"pickled state: touched must be None or a bool array of shape ({n_rows},) "
                f"(one flag per table row); got {describe(touched)}"
            )
        # No mask without a gradient; its non-zero rows marked, as sgd_step skips the others.
        touched = None if grad is None else touched | (grad != 0).any(axis=1)
    return State(table, grad, touched, pad)


class _Refused(Exception):
    """A member of the archive is not what save() writes (message without the file name)."""


def _read_member(
    archive: zipfile.ZipFile, key: str, kinds: str, ndim: int, what: str
) -> np.ndarray:
    """Member ``key`` (dtype kind in ``kinds``, ``ndim`` axes), its header checked first."""
    info = archive.getinfo(key + ".npy")
    with archive.open(info) as fp:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(fp)
        else:
            raise _Refused(f"member {key!r} has .npy format version {version}")
        if dtype.hasobject or dtype.kind not in kinds or len(shape) != ndim:
            raise _Refused(f"member {key!r} must be {what}; got shape {shape} and dtype {dtype}")
        if math.prod(shape) * dtype.itemsize > info.file_size:
            raise _Refused(
                f"member {key!r} claims shape {shape} of {dtype} but holds only "
                f"{info.file_size} bytes (truncated or damaged)"
            )
    with archive.open(info) as fp:
        arr = np.lib.format.read_array(fp, allow_pickle=False)
        if fp.read(1):  # also reaches the end, where zipfile checks the CRC
            raise _Refused(f"member {key!r} has bytes after its array data")
    return arr


def _bfloat16_member(
    archive: zipfile.ZipFile, raw: np.ndarray, dtype_name: str | None, key: str
) -> np.ndarray:
    """A 2-byte void member as bfloat16, in its header's byte order (NumPy reads ``'>V2'``
    back as ``'|V2'``)."""
    if dtype_name != "bfloat16" or raw.dtype.itemsize != 2 or raw.dtype.fields is not None:
        raise _Refused(
            f"member {key!r} must be a 2-D {FLOAT_NAMES} array; got shape {raw.shape} "
            f"and dtype {raw.dtype} (2-byte void is bfloat16 only where the member "
            f"'dtype' says 'bfloat16'; it says {dtype_name!r})"
        )
    with archive.open(key + ".npy") as fp:
        major, _ = np.lib.format.read_magic(fp)
        size_format = "<H" if major == 1 else "<I"
        (length,) = struct.unpack(size_format, fp.read(struct.calcsize(size_format)))
        header = ast.literal_eval(fp.read(length).decode("latin1"))
    descr = str(header.get("descr")) if isinstance(header, dict) else ""
    order: Literal["<", ">", "="] = ">" if descr[:1] == ">" else "<" if descr[:1] == "<" else "="
    return raw.view(bfloat16().newbyteorder(order))


def _is_name(path: PathOrFile) -> TypeGuard[PathLike]:
    return isinstance(path, (str, bytes, os.PathLike))


def save_npz(
    path: PathOrFile,
    kind: str,
    version: int,
    tables: dict[str, np.ndarray],
    padding_idx: int | None,
) -> None:
    """Write a class's ``save()`` archive."""
    arrays: dict[str, Any] = {
        "kind": np.array(kind),
        "format_version": np.array(version, dtype=np.int64),
        **tables,
        "dtype": np.array(next(iter(tables.values())).dtype.name),
        "padding_idx": np.array(-1 if padding_idx is None else padding_idx, dtype=np.int64),
    }
    # Given a file object, np.savez adds no ".npz".
    with atomic_write(path) if _is_name(path) else contextlib.nullcontext(path) as f:
        np.savez(f, **arrays)


def load_npz(
    path: PathOrFile, kind: str, current_version: int, keys: tuple[str, ...]
) -> tuple[list[np.ndarray], int | None, str]:
    """The checked tables ``keys``, ``padding_idx`` and the file's name from :func:`save_npz`."""
    name = repr(os.fspath(path) if _is_name(path) else path)
    with open(path, "rb") if _is_name(path) else contextlib.nullcontext(path) as f:
        try:
            with zipfile.ZipFile(f) as archive:
                return (*_from_archive(archive, kind, current_version, keys), name)
        except _Refused as exc:
            raise ValueError(f"{name} is not a valid file written by save(): {exc}") from None
        except _CORRUPT as exc:
            raise ValueError(
                f"{name} is not a file written by save(), or is damaged or truncated "
                f"({type(exc).__name__}: {exc})"
            ) from None


def _from_archive(
    archive: zipfile.ZipFile, kind: str, current_version: int, keys: tuple[str, ...]
) -> tuple[list[np.ndarray], int | None]:
    names = set(archive.namelist())
    missing = [
        k for k in ("kind", "format_version", *keys, "padding_idx") if k + ".npy" not in names
    ]
    if missing:
        raise _Refused(f"not written by {kind.split('.')[-1]}.save() (missing {missing})")
    found_kind = _read_member(archive, "kind", "U", 0, "a 0-d string array")
    if str(found_kind) != kind:
        raise _Refused(f"kind is {str(found_kind)!r}, expected {kind!r}")
    version = int(_read_member(archive, "format_version", "iu", 0, "a 0-d integer array"))
    check_version(version, current_version, "format", _Refused)
    dtype_name = None
    if "dtype.npy" in names:
        dtype_name = str(_read_member(archive, "dtype", "U", 0, "a 0-d string array"))
    tables = []
    for key in keys:
        raw = _read_member(archive, key, "fV", 2, f"a 2-D {FLOAT_NAMES} array")
        if raw.dtype.kind == "V":
            raw = _bfloat16_member(archive, raw, dtype_name, key)
        tables.append(_table(raw, f"member {key!r}", _Refused))
    dtypes = {t.dtype.name for t in tables}
    if len(dtypes) != 1:
        raise _Refused(f"the tables {list(keys)} differ in dtype: {sorted(dtypes)}")
    if dtype_name is not None and dtype_name != tables[0].dtype.name:
        raise _Refused(
            f"member 'dtype' says {dtype_name!r} but the table is {tables[0].dtype.name}"
        )
    # save() writes -1 for "no padding row", else the row normalised to [0, L).
    stored = int(_read_member(archive, "padding_idx", "iu", 0, "a 0-d integer array"))
    n_rows = tables[0].shape[0]
    if not -1 <= stored < n_rows:
        raise _Refused(
            f"padding_idx must be -1 (none) or in [0, {n_rows}) for a table of {n_rows} "
            f"rows; got {stored}"
        )
    return tables, None if stored == -1 else stored


def _target(name: str) -> str:
    # A symbolic link is written through, as open() does: the link stays.
    return os.path.realpath(name) if os.path.islink(name) else name


def _create_beside(target: str) -> tuple[int, str]:
    """A new empty file beside ``target``: descriptor, name."""
    folder, base = os.path.split(target)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):  # tries at a fresh name of 64 random bits
        temp = os.path.join(folder, f".{base}.{os.urandom(8).hex()}.tmp")
        try:
            return os.open(temp, flags, 0o666), temp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", os.path.join(folder, base))


def _remove(temp: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(temp)


def _naming(exc: OSError, name: str) -> OSError:
    """``exc`` as the same kind of OSError, with the file the caller asked for."""
    if exc.errno is None:
        return OSError(f"cannot write {name!r}: {exc}")
    # OSError(errno, strerror, filename) picks the subclass (PermissionError, ...).
    return OSError(exc.errno, exc.strerror, name)


@contextlib.contextmanager
def atomic_write(path: PathLike) -> Iterator[IO[bytes]]:
    """A binary file whose contents replace ``path`` once the block completes; on an
    error ``path`` is left as it was (an ``OSError`` names it). The permission bits
    are those ``open(path, "wb")`` gives; ``/dev/null`` or a pipe is written in place."""
    name = os.fsdecode(path)
    target = _target(name)
    in_place = None
    try:
        try:
            st: os.stat_result | None = os.stat(target)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), name)
        if st is not None and not stat.S_ISREG(st.st_mode):
            in_place = open(target, "wb")
        else:
            fd, temp = _create_beside(target)
    except OSError as exc:
        raise _naming(exc, name) from exc
    if in_place is not None:
        with in_place:
            yield in_place
        return
    try:
        with os.fdopen(fd, "wb") as f:
            if st is not None:
                os.chmod(temp, stat.S_IMODE(st.st_mode) & 0o777)
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, target)
    except OSError as exc:
        _remove(temp)
        raise _naming(exc, name) from exc
    except BaseException:
        _remove(temp)
        raise


def output_problem(path: PathLike, what: str, folder: bool = False) -> str | None:
    """Why a file cannot be written at ``path`` (``what``, as ``"--save"``), or into the
    ``folder`` ``path`` (created if missing), or None; a file is created and removed to tell."""
    name = os.fsdecode(path)
    if not name:
        return f"{what}: expected a {'folder' if folder else 'file name'}; got an empty path"
    target = name if folder else _target(name)
    if not folder and os.path.isdir(target):
        return f"{what} {name!r} is a directory; expected a file name"
    if not folder and os.path.exists(target) and not os.path.isfile(target):
        return None  # a device or a pipe: written in place
    try:
        parent = os.path.abspath(target)
    except OSError as exc:  # no current folder (it was removed)
        return f"{what} {name!r}: {exc.strerror or exc}"
    if folder:  # its nearest existing folder
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        target = os.path.join(parent, "check")
    else:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        if os.path.exists(parent):  # a file where the path needs a folder
            return f"{what} {name!r}: {parent!r} is a file, not a folder"
        return f"{what} {name!r}: the folder {parent!r} does not exist"
    try:
        fd, temp = _create_beside(target)
    except OSError as exc:
        return f"{what} {name!r}: cannot create a file in {parent!r} ({exc.strerror or exc})"
    os.close(fd)
    _remove(temp)
    return None
