"""Microsecond calls on the handbook's 128 x 64 table: the scalar, list and array forms
NumPy users pass, against the handbook's class; batched decoding."""

from __future__ import annotations

import numpy as np

from ._common import Fixture, Group


def tiny(f: Fixture) -> list[Group]:
    tp, tr = f.tiny_table()
    table = tp.embeddings
    a10 = np.arange(10)
    a4 = np.random.default_rng(1).integers(0, 128, size=(4, 128))
    t1 = np.random.default_rng(2).standard_normal((1, 1, 64)).astype(f.dt)
    i5 = np.int64(5)
    pos_i64 = np.arange(128, dtype=np.int64)
    two = [np.int64(1), np.int64(2)]
    off17 = np.int64(17)
    return [
        f.small_pair(op, mine, theirs, name, "128 x 64 table, per call", target)
        for op, mine, theirs, name, target in [
            ("tiny: pe(5)", lambda: tp(5), lambda: tr(5), "reference", 1.3),
            ("tiny: pe(np.int64(5))", lambda: tp(i5), lambda: tr(i5), "reference", 1.3),
            (
                "tiny: pe(positions[i])",
                lambda: tp(pos_i64[7]),
                lambda: tr(pos_i64[7]),
                "reference",
                1.3,
            ),
            ("tiny: pe([0])", lambda: tp([0]), lambda: tr([0]), "reference", 0.6),
            (
                "tiny: pe([np.int64(1), np.int64(2)])",
                lambda: tp(two),
                lambda: tr(two),
                "reference",
                0.6,
            ),
            ("tiny: pe(arange(10))", lambda: tp(a10), lambda: tr(a10), "reference", 0.6),
            ("tiny: pe(4x128 array)", lambda: tp(a4), lambda: tr(a4), "reference", 0.3),
            (
                "tiny: add_to((1,1,d), offset=i)",
                lambda: tp.add_to(t1, offset=77),
                lambda: t1 + table[77],
                "numpy tok + table[i]",
                1.2,
            ),
            (
                "tiny: add_to((1,1,d), offset=np.int64(i))",
                lambda: tp.add_to(t1, offset=off17),
                lambda: t1 + table[17],
                "numpy tok + table[i]",
                1.2,
            ),
        ]
    ]


def decode_batched(f: Fixture) -> list[Group]:
    tp, _ = f.tiny_table()
    table = tp.embeddings
    rng8 = np.random.default_rng(3)
    tok8 = rng8.standard_normal((8, 1, 64)).astype(f.dt)
    pos8 = rng8.integers(0, 128, size=(8, 1), dtype=np.int64)
    return [
        f.small_pair(
            "decode batched: add_to((8,1,d), pos (8,1))",
            lambda: tp.add_to(tok8, pos8),
            lambda: tok8 + table[pos8],
            "numpy tok + table[pos]",
            "128 x 64 table, 8 rows at their own positions, per call",
            target=1.0,
        )
    ]
