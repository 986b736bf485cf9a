"""save / load: round trips, and damaged or crafted files refused before they become
an instance."""

from __future__ import annotations

import io
import os
import pathlib
import zipfile

import numpy as np
import pytest
from helpers import FLOAT_TABLE_DTYPES, same_bits, trained

from cposembed import LearnedPositionEmbedding

# -- save / load -----------------------------------------------------------------
ODD_NAMES = ["table", "table.npz", "table.npy", "with space.bin", "tabellé.npz.txt", ".hidden"]


@pytest.mark.parametrize("dtype", FLOAT_TABLE_DTYPES)
@pytest.mark.parametrize("name", ODD_NAMES)
def test_save_load_round_trip_is_bitwise_for_any_name(tmp_path, dtype, name):
    pe = LearnedPositionEmbedding(11, 7, seed=9, dtype=dtype, padding_idx=-2)
    pe.embeddings[3, 1] = -0.0
    pe.embeddings[4, 2] = np.nan
    path = tmp_path / name
    pe.save(str(path))
    assert os.listdir(tmp_path) == [name]  # exactly that file, no ".npz" added
    back = LearnedPositionEmbedding.load(str(path))
    assert type(back) is LearnedPositionEmbedding
    assert same_bits(back.embeddings, pe.embeddings)
    assert back.dtype == pe.dtype and back.padding_idx == 9
    assert back.grad is None
    back2 = LearnedPositionEmbedding.load(path)  # a pathlib.Path works too
    assert same_bits(back2.embeddings, pe.embeddings)


def test_save_load_through_file_objects():
    pe = LearnedPositionEmbedding(5, 2, seed=0)
    buf = io.BytesIO()
    pe.save(buf)
    buf.seek(0)
    back = LearnedPositionEmbedding.load(buf)
    assert same_bits(back.embeddings, pe.embeddings) and back.padding_idx is None


def test_save_does_not_store_grad_and_load_is_trainable(tmp_path):
    pe = LearnedPositionEmbedding(5, 2, seed=0)
    pe.backward(np.ones((5, 2)))
    pe.save(tmp_path / "t")
    back = LearnedPositionEmbedding.load(tmp_path / "t")
    assert back.grad is None
    assert back.embeddings.flags.writeable and back.embeddings.flags.c_contiguous
    back.backward(np.ones((5, 2)))
    back.sgd_step(1.0)


def test_load_rejects_other_files(tmp_path):
    (tmp_path / "text").write_text("not an archive")
    with pytest.raises(ValueError, match="save"):
        LearnedPositionEmbedding.load(tmp_path / "text")
    np.save(tmp_path / "plain.npy", np.ones((3, 2)))
    with pytest.raises(ValueError, match="save"):
        LearnedPositionEmbedding.load(tmp_path / "plain.npy")
    with open(tmp_path / "other", "wb") as f:
        np.savez(f, weights=np.ones((3, 2)))
    with pytest.raises(ValueError, match="save"):
        LearnedPositionEmbedding.load(tmp_path / "other")
    with pytest.raises(FileNotFoundError):
        LearnedPositionEmbedding.load(tmp_path / "missing")


def test_load_rejects_a_newer_format(tmp_path):
    pe = LearnedPositionEmbedding(3, 2, seed=0)
    buf = io.BytesIO()
    pe.save(buf)
    buf.seek(0)
    with np.load(buf) as z:
        arrays = dict(z)
    arrays["format_version"] = np.array(99)
    with open(tmp_path / "future", "wb") as f:
        np.savez(f, **arrays)
    with pytest.raises(ValueError, match="version 99"):
        LearnedPositionEmbedding.load(tmp_path / "future")


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
@pytest.mark.parametrize("dtype", FLOAT_TABLE_DTYPES)
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


@pytest.mark.parametrize("dtype", FLOAT_TABLE_DTYPES)
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
    ("embeddings", np.ones((3, 2), np.longdouble), "embeddings"),
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


@pytest.mark.parametrize("dtype", FLOAT_TABLE_DTYPES)
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
