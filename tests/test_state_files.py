"""Pickled states and saved files are checked whole before they become an instance.

Round trips (save/load, pickle) are bitwise; every damaged, truncated or
crafted input is a ``ValueError`` naming what is wrong (the field, or the
file), never another exception, a wrong table or a crash.
"""

from __future__ import annotations

import copy
import io
import pathlib
import pickle
import zipfile

import numpy as np
import pytest
from helpers import run_python

from cposembed import LearnedPositionEmbedding

DTYPES = [np.float32, np.float64]
KIND = "cposembed.LearnedPositionEmbedding"


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def trained(dtype=np.float32, padding_idx=None) -> LearnedPositionEmbedding:
    pe = LearnedPositionEmbedding(9, 4, seed=3, dtype=dtype, padding_idx=padding_idx)
    pe.backward(np.random.default_rng(0).standard_normal((2, 3, 4)), [[1, 4, 7]])
    return pe


def saved_bytes(pe: LearnedPositionEmbedding) -> bytes:
    buf = io.BytesIO()
    pe.save(buf)
    return buf.getvalue()


def members(pe: LearnedPositionEmbedding) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(saved_bytes(pe))) as z:
        return {k: z[k] for k in z.files}


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


# -- round trips ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding_idx", [None, 0, 5, -1])
def test_save_load_round_trip(tmp_path, dtype, padding_idx):
    pe = trained(dtype, padding_idx)
    pe.embeddings[2, 1] = np.nan
    pe.embeddings[3, 0] = -0.0
    pe.save(tmp_path / "t")
    back = LearnedPositionEmbedding.load(tmp_path / "t")
    assert same_bits(back.embeddings, pe.embeddings)
    assert back.padding_idx == pe.padding_idx and back.grad is None
    assert back.embeddings.flags.c_contiguous and back.embeddings.flags.writeable


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding_idx", [None, 0, 5, -1])
@pytest.mark.parametrize("with_grad", [False, True])
def test_pickle_round_trip(dtype, padding_idx, with_grad):
    pe = (
        trained(dtype, padding_idx)
        if with_grad
        else LearnedPositionEmbedding(9, 4, seed=3, dtype=dtype, padding_idx=padding_idx)
    )
    copies = [
        pickle.loads(pickle.dumps(pe, protocol=p)) for p in range(pickle.HIGHEST_PROTOCOL + 1)
    ]
    for back in [*copies, copy.deepcopy(pe)]:
        assert type(back) is LearnedPositionEmbedding
        assert same_bits(back.embeddings, pe.embeddings)
        assert back.padding_idx == pe.padding_idx and back.dtype == pe.dtype
        if with_grad:
            assert same_bits(back.grad, pe.grad)
            assert back.grad is not pe.grad
        else:
            assert back.grad is None
        # the copy trains exactly as the original does
        want = pe.embeddings.copy()
        if with_grad:
            want[[1, 4, 7]] -= pe.dtype.type(0.5) * pe.grad[[1, 4, 7]]
            if pe.padding_idx is not None:
                want[pe.padding_idx] = pe.embeddings[pe.padding_idx]
        back.sgd_step(0.5)
        assert same_bits(back.embeddings, want)


def test_pickle_keeps_the_touched_rows_mask():
    pe = trained()
    back = pickle.loads(pickle.dumps(pe))
    back.grad[0] = 1.0  # an untouched row: sgd_step skips it, as on the original
    before = back.embeddings[0].copy()
    back.sgd_step(1.0)
    assert same_bits(back.embeddings[0], before)


# -- __setstate__: every field checked --------------------------------------------
def good_state(dtype=np.float32) -> dict:
    pe = trained(dtype, padding_idx=2)
    state = pe.__getstate__()
    assert set(state) == {"version", "embeddings", "grad", "touched", "padding_idx"}
    return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in state.items()}


BAD_STATES = [
    # (what to change, value, words the message must contain)
    ("version", 2, "version 2"),
    ("version", 10**30, "newer"),
    ("version", 0, "version 0"),
    ("version", -1, "version -1"),
    ("version", 1.0, "version must be an integer"),
    ("version", True, "version must be an integer"),
    ("version", "1", "version must be an integer"),
    ("version", None, "version must be an integer"),
    ("embeddings", [[1.0, 2.0]], "embeddings"),
    ("embeddings", np.ones(4, np.float32), "embeddings"),
    ("embeddings", np.ones((9, 4, 1), np.float32), "embeddings"),
    ("embeddings", np.ones((0, 4), np.float32), "embeddings"),
    ("embeddings", np.ones((9, 0), np.float32), "embeddings"),
    ("embeddings", np.ones((9, 4), np.int64), "embeddings"),
    ("embeddings", np.ones((9, 4), np.float16), "embeddings"),
    ("embeddings", np.ones((9, 4), np.complex64), "embeddings"),
    ("embeddings", np.ones((9, 4), object), "embeddings"),
    ("embeddings", None, "embeddings"),
    ("grad", np.ones((100, 4), np.float32), "grad must have the table's shape"),
    ("grad", np.ones((9, 5), np.float32), "grad must have the table's shape"),
    ("grad", np.ones(36, np.float32), "grad must have the table's shape"),
    ("grad", np.ones((9, 4), np.complex64), "grad"),
    ("grad", np.ones((9, 4), object), "grad"),
    ("grad", [[0.0] * 4] * 9, "grad"),
    ("grad", "zeros", "grad"),
    ("touched", np.ones(1 << 20, bool), "touched"),
    ("touched", np.ones(8, bool), "touched"),
    ("touched", np.ones(10, bool), "touched"),
    ("touched", np.ones((9, 1), bool), "touched"),
    ("touched", np.ones(9, np.int8), "touched"),
    ("touched", [True] * 9, "touched"),
    ("padding_idx", 1.0, "padding_idx"),
    ("padding_idx", np.float64(1.0), "padding_idx"),
    ("padding_idx", True, "padding_idx"),
    ("padding_idx", "1", "padding_idx"),
    ("padding_idx", 9, "padding_idx"),
    ("padding_idx", -10, "padding_idx"),
    ("padding_idx", 2**70, "padding_idx"),
    ("padding_idx", np.array([1]), "padding_idx"),
    ("surprise", 1, "unknown keys"),
    ("_touched_grad", None, "unknown keys"),
]


@pytest.mark.parametrize(
    "key,value,words", BAD_STATES, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD_STATES)]
)
def test_setstate_refuses_a_bad_field_and_keeps_the_instance(key, value, words):
    state = good_state()
    state[key] = value
    pe = LearnedPositionEmbedding(3, 2, seed=0)
    table_before = pe.embeddings
    values_before = pe.embeddings.copy()
    with pytest.raises(ValueError, match=words):
        pe.__setstate__(state)
    # nothing kept from the refused state
    assert pe.embeddings is table_before and same_bits(pe.embeddings, values_before)
    assert pe.grad is None and pe.padding_idx is None


@pytest.mark.parametrize("missing", ["version", "embeddings"])
def test_setstate_refuses_a_missing_key(missing):
    state = good_state()
    del state[missing]
    with pytest.raises(ValueError, match=missing):
        LearnedPositionEmbedding.__new__(LearnedPositionEmbedding).__setstate__(state)


@pytest.mark.parametrize("state", [None, [1, 2], (np.ones((2, 2)),), "state"])
def test_setstate_refuses_what_is_not_a_dict(state):
    with pytest.raises(ValueError, match="dict"):
        LearnedPositionEmbedding.__new__(LearnedPositionEmbedding).__setstate__(state)


class _Crafted:
    """Pickles as a LearnedPositionEmbedding carrying ``state``: a crafted pickle."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def __reduce__(self):
        return (LearnedPositionEmbedding.__new__, (LearnedPositionEmbedding,), self.state)


def test_unpickling_a_crafted_state_raises_value_error():
    good = good_state()
    assert pickle.loads(pickle.dumps(_Crafted(good))).grad is not None
    crafted = dict(good, touched=np.ones(10, bool))
    with pytest.raises(ValueError, match="touched"):
        pickle.loads(pickle.dumps(_Crafted(crafted)))


def test_setstate_accepts_and_converts_other_layouts():
    state = good_state(np.float32)
    table = state["embeddings"]
    state["embeddings"] = np.asfortranarray(table.astype(">f4"))
    grad = state["grad"]
    state["grad"] = grad.astype(np.float64)  # converted to the table's dtype
    state["padding_idx"] = np.int64(-7)
    pe = LearnedPositionEmbedding.__new__(LearnedPositionEmbedding)
    pe.__setstate__(state)
    assert pe.embeddings.dtype == np.dtype(np.float32) and pe.embeddings.dtype.isnative
    assert pe.embeddings.flags.c_contiguous and pe.embeddings.flags.writeable
    assert np.array_equal(pe.embeddings, table)
    assert pe.grad.dtype == np.float32 and pe.grad.flags.c_contiguous
    assert np.array_equal(pe.grad, grad)
    assert pe.padding_idx == 2 and type(pe.padding_idx) is int


def test_setstate_keeps_a_grad_of_the_right_layout_as_given():
    state = good_state(np.float64)
    pe = LearnedPositionEmbedding.__new__(LearnedPositionEmbedding)
    pe.__setstate__(state)
    assert pe.grad is state["grad"]


@pytest.mark.parametrize(
    "grad",
    [
        lambda g: g.astype(">f4"),
        lambda g: np.asfortranarray(g),
        lambda g: g.astype(np.int32),
        lambda g: g[::-1].copy()[::-1],
    ],
    ids=["big-endian", "fortran", "int32", "reversed-view"],
)
def test_setstate_grad_is_usable_whatever_its_layout(grad):
    state = good_state(np.float32)
    given = grad(state["grad"])
    state["grad"] = given
    given_copy = given.copy()
    pe = LearnedPositionEmbedding.__new__(LearnedPositionEmbedding)
    pe.__setstate__(state)
    assert pe.grad.dtype == np.float32 and pe.grad.dtype.isnative
    assert pe.grad.flags.c_contiguous and pe.grad.flags.writeable
    pe.backward(np.ones((1, 4)), [3])
    assert pe.grad is not given and same_bits(given, given_copy)  # a converted copy
    want = given_copy.astype(np.float32)
    want[3] += 1
    assert np.array_equal(pe.grad, want)


def test_setstate_read_only_arrays_are_copied():
    state = good_state()
    for key in ("embeddings", "grad"):
        state[key].flags.writeable = False
    pe = LearnedPositionEmbedding.__new__(LearnedPositionEmbedding)
    pe.__setstate__(state)
    assert pe.embeddings.flags.writeable and pe.grad.flags.writeable
    pe.backward(np.ones((1, 4)), [3])
    pe.sgd_step(0.1)


def test_setstate_accepts_the_state_of_an_old_version():
    pe = LearnedPositionEmbedding(4, 2, seed=0)
    back = LearnedPositionEmbedding.__new__(LearnedPositionEmbedding)
    back.__setstate__({"_embeddings": pe.embeddings.copy()})
    assert same_bits(back.embeddings, pe.embeddings) and back.grad is None
    with pytest.raises(ValueError, match="unknown keys"):
        back.__setstate__({"_embeddings": pe.embeddings.copy(), "padding_idx": 1})
    with pytest.raises(ValueError, match="grad"):
        back.__setstate__({"_embeddings": pe.embeddings.copy(), "grad": np.ones((5, 2))})


def test_touched_without_grad_is_ignored():
    state = good_state()
    state["grad"] = None
    pe = LearnedPositionEmbedding.__new__(LearnedPositionEmbedding)
    pe.__setstate__(state)
    assert pe.grad is None
    pe.backward(np.ones((1, 4)), [0])  # a fresh gradient, a fresh mask
    assert np.flatnonzero(pe.grad.any(axis=1)).tolist() == [0]


def test_crafted_touched_mask_then_sgd_step_does_not_crash():
    """A touched mask longer than the table used to make sgd_step write out of bounds."""
    code = """
import numpy as np
from cposembed import LearnedPositionEmbedding
pe = LearnedPositionEmbedding(8, 4, seed=0)
state = pe.__getstate__()
state["grad"] = np.ones((8, 4), np.float32)
state["touched"] = np.ones(1 << 22, bool)
before = pe.embeddings.copy()
try:
    pe.__setstate__(state)
    pe.sgd_step(0.1)
except ValueError as exc:
    print("ValueError:", exc)
assert np.array_equal(pe.embeddings, before), "the table changed"
"""
    proc = run_python(["-c", code])
    assert proc.returncode == 0, (
        f"the child exited with {proc.returncode} (negative: killed by signal)\n{proc.stderr}"
    )
    assert "ValueError: pickled state: touched" in proc.stdout, proc.stdout + proc.stderr


def test_crafted_grad_then_sgd_step_does_not_crash():
    """A grad smaller than the table (with a matching touched mask) reaching sgd_step."""
    code = """
import numpy as np
from cposembed import LearnedPositionEmbedding
pe = LearnedPositionEmbedding(1 << 16, 4, seed=0)
state = pe.__getstate__()
state["grad"] = np.ones((2, 4), np.float32)
state["touched"] = np.ones(1 << 16, bool)
try:
    pe.__setstate__(state)
    pe.sgd_step(0.1)
except ValueError as exc:
    print("ValueError:", exc)
"""
    proc = run_python(["-c", code])
    assert proc.returncode == 0, f"the child exited with {proc.returncode}\n{proc.stderr}"
    assert "ValueError: pickled state: grad" in proc.stdout, proc.stdout + proc.stderr


# -- load(): damaged files --------------------------------------------------------
def load_or_refuse(path: pathlib.Path, pe: LearnedPositionEmbedding) -> str:
    """'loaded' (then equal to ``pe``) or 'refused' (a ValueError naming the file)."""
    try:
        back = LearnedPositionEmbedding.load(path)
    except ValueError as exc:
        assert str(path) in str(exc), f"the message does not name the file: {exc}"
        return "refused"
    assert same_bits(back.embeddings, pe.embeddings), "a damaged file loaded a different table"
    assert back.padding_idx == pe.padding_idx
    return "loaded"


@pytest.mark.parametrize("dtype", DTYPES)
def test_load_refuses_every_truncation(tmp_path, dtype):
    pe = LearnedPositionEmbedding(3, 2, seed=0, dtype=dtype, padding_idx=1)
    data = saved_bytes(pe)
    path = tmp_path / "cut"
    for n in range(len(data)):
        path.write_bytes(data[:n])
        assert load_or_refuse(path, pe) == "refused", f"a file cut at {n} bytes loaded"
    path.write_bytes(data)
    assert load_or_refuse(path, pe) == "loaded"


@pytest.mark.parametrize("mask", [0xFF, 0x01, 0x80])
def test_load_with_any_byte_flipped_refuses_or_loads_the_same_table(tmp_path, mask):
    pe = LearnedPositionEmbedding(3, 2, seed=0, padding_idx=1)
    data = saved_bytes(pe)
    path = tmp_path / "flipped"
    outcomes = set()
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= mask
        path.write_bytes(bytes(damaged))
        outcomes.add(load_or_refuse(path, pe))
    assert "refused" in outcomes


def test_load_survives_a_compressed_archive_with_flipped_bytes(tmp_path):
    pe = LearnedPositionEmbedding(3, 2, seed=0)
    buf = io.BytesIO()
    np.savez_compressed(buf, **members(pe))
    data = buf.getvalue()
    path = tmp_path / "z"
    path.write_bytes(data)
    assert load_or_refuse(path, pe) == "loaded"
    for i in range(len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0x55
        path.write_bytes(bytes(damaged))
        load_or_refuse(path, pe)


BAD_MEMBERS = [
    ("kind", np.array(7), "kind"),
    ("kind", np.array(["cposembed.LearnedPositionEmbedding"]), "kind"),
    ("kind", np.array("something.Else"), "kind"),
    ("format_version", np.array(1.0), "format_version"),
    ("format_version", np.array("1"), "format_version"),
    ("format_version", np.array([1]), "format_version"),
    ("format_version", np.array(2), "format version 2"),
    ("format_version", np.array(0), "format version 0"),
    ("padding_idx", np.array(1.0), "padding_idx"),
    ("padding_idx", np.array(3), "padding_idx"),
    ("padding_idx", np.array(-2), "padding_idx"),
    ("padding_idx", np.array(True), "padding_idx"),
    ("padding_idx", np.array([1]), "padding_idx"),
    ("embeddings", np.ones(6), "embeddings"),
    ("embeddings", np.ones((3, 2, 1)), "embeddings"),
    ("embeddings", np.ones((3, 2), np.int64), "embeddings"),
    ("embeddings", np.ones((3, 2), np.float16), "embeddings"),
    ("embeddings", np.ones((3, 2), np.complex128), "embeddings"),
    ("embeddings", np.ones((0, 2)), "embeddings"),
    ("embeddings", np.array("table"), "embeddings"),
    ("dtype", np.array("float64"), "dtype"),
    ("dtype", np.array(4), "dtype"),
]


@pytest.mark.parametrize(
    "key,value,words", BAD_MEMBERS, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD_MEMBERS)]
)
def test_load_refuses_a_wrong_member(tmp_path, key, value, words):
    arrays = members(LearnedPositionEmbedding(3, 2, seed=0, padding_idx=1))
    arrays[key] = value
    path = tmp_path / "bad"
    path.write_bytes(npz_bytes(arrays))
    with pytest.raises(ValueError, match=words) as info:
        LearnedPositionEmbedding.load(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("key", ["embeddings", "kind", "padding_idx"])
def test_load_refuses_a_pickle_inside(tmp_path, key):
    arrays = members(LearnedPositionEmbedding(3, 2, seed=0))
    arrays[key] = np.array([[{"a": 1}, None]], dtype=object)
    path = tmp_path / "pickled"
    path.write_bytes(npz_bytes(arrays))  # np.savez pickles object arrays
    with pytest.raises(ValueError, match=key) as info:
        LearnedPositionEmbedding.load(path)
    assert str(path) in str(info.value)


def test_load_refuses_a_header_claiming_a_huge_table_without_allocating_it(tmp_path):
    arrays = members(LearnedPositionEmbedding(3, 2, seed=0))
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (10**9, 10**9)}
    )
    path = tmp_path / "huge"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in arrays.items():
            if k == "embeddings":
                z.writestr(
                    "embeddings.npy", np.lib.format.magic(1, 0) + header.getvalue()[8:] + b"\0" * 24
                )
            else:
                with z.open(k + ".npy", "w") as m:
                    np.lib.format.write_array(m, v)
    with pytest.raises(ValueError, match="claims shape") as info:
        LearnedPositionEmbedding.load(path)
    assert str(path) in str(info.value)


def test_load_refuses_a_member_with_trailing_bytes(tmp_path):
    arrays = members(LearnedPositionEmbedding(3, 2, seed=0))
    path = tmp_path / "trailing"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in arrays.items():
            with z.open(k + ".npy", "w") as m:
                np.lib.format.write_array(m, v)
                if k == "embeddings":
                    m.write(b"\0" * 8)
    with pytest.raises(ValueError, match="after its array data"):
        LearnedPositionEmbedding.load(path)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["big-endian", "fortran", "big-endian fortran"])
def test_load_reads_a_table_in_any_byte_order_and_layout(tmp_path, dtype, layout):
    pe = LearnedPositionEmbedding(5, 3, seed=1, dtype=dtype, padding_idx=4)
    arrays = members(pe)
    table = pe.embeddings
    if "big-endian" in layout:
        table = table.astype(table.dtype.newbyteorder(">"))
    if "fortran" in layout:
        table = np.asfortranarray(table)
    arrays["embeddings"] = table
    path = tmp_path / "other-layout"
    path.write_bytes(npz_bytes(arrays))
    back = LearnedPositionEmbedding.load(path)
    assert back.dtype == np.dtype(dtype) and back.embeddings.dtype.isnative
    assert back.embeddings.flags.c_contiguous and back.padding_idx == 4
    assert np.array_equal(back.embeddings, pe.embeddings)


def test_load_without_the_optional_dtype_member(tmp_path):
    pe = LearnedPositionEmbedding(3, 2, seed=0)
    arrays = members(pe)
    del arrays["dtype"]
    path = tmp_path / "nodtype"
    path.write_bytes(npz_bytes(arrays))
    assert same_bits(LearnedPositionEmbedding.load(path).embeddings, pe.embeddings)


@pytest.mark.parametrize(
    "content",
    [b"", b"PK", b"PK\x05\x06" + b"\0" * 18, b"\x93NUMPY", b"\x80\x04K\x01.", b"not a file"],
    ids=["empty", "PK", "empty-zip", "npy-magic", "pickle", "text"],
)
def test_load_refuses_other_content_naming_the_file(tmp_path, content):
    path = tmp_path / "other"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="save") as info:
        LearnedPositionEmbedding.load(path)
    assert str(path) in str(info.value)


def test_load_refuses_a_file_object_of_damaged_bytes():
    data = saved_bytes(LearnedPositionEmbedding(3, 2, seed=0))
    with pytest.raises(ValueError, match="BytesIO"):
        LearnedPositionEmbedding.load(io.BytesIO(data[: len(data) // 2]))


def test_load_still_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        LearnedPositionEmbedding.load(tmp_path / "missing")
