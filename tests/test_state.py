"""Pickled states: round trips, and crafted states checked whole before they become an
instance."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
from helpers import (
    DTYPES,
    FLOAT_TABLE_DTYPES,
    assert_same,
    run_child,
    run_python,
    same_bits,
    trained,
)

from cposembed import LearnedPositionEmbedding


# -- crafted pickled state, then sgd_step -------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("touched", "np.ones(1 << 22, bool)"),
        ("touched", "np.ones(3, bool)"),
        ("grad", "np.ones((2, 4), np.float32)"),
        ("grad", "np.ones((1 << 16, 4), np.float32)"),
    ],
    ids=["touched-long", "touched-short", "grad-small", "grad-large"],
)
def test_crafted_state_then_sgd_step(field, value):
    """__setstate__ with a touched mask or grad of the wrong size, then sgd_step."""
    body = f"""
    pe = LearnedPositionEmbedding(8, 4, seed=0)
    state = pe.__getstate__()
    state["grad"] = np.ones((8, 4), np.float32)
    state["touched"] = np.ones(8, bool)
    state[{field!r}] = {value}
    table = pe.embeddings

    def run():
        pe.__setstate__(state)
        pe.sgd_step(0.1)
        return pe.embeddings

    outcome(run, None, [table])
    """
    result = run_child(body)
    assert result["raised"] == "ValueError", result
    assert result["unchanged"], result
    assert field in result["message"], result["message"]


def test_pickled_touched_mask_that_hides_gradient_rows():
    table = np.random.RandomState(3).randn(6, 3).astype(np.float32)
    grad = np.ones((6, 3), np.float32)
    state = {
        "version": 1,
        "embeddings": table.copy(),
        "grad": grad,
        "touched": np.zeros(6, bool),
        "padding_idx": None,
    }
    pe = LearnedPositionEmbedding.__new__(LearnedPositionEmbedding)
    try:
        pe.__setstate__(state)
    except ValueError:
        return  # refusing the inconsistent state is fine too
    pe.sgd_step(0.5)
    assert_same(pe.embeddings, table - np.float32(0.5) * grad)


# -- pickle ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOAT_TABLE_DTYPES)
def test_pickle_round_trip_keeps_grad_and_touched_rows(dtype):
    rng = np.random.default_rng(5)
    pe = LearnedPositionEmbedding(10, 4, seed=0, dtype=dtype, padding_idx=3)
    pe.backward(rng.standard_normal((2, 3, 4)), [[1, 3, 8]])
    back = pickle.loads(pickle.dumps(pe))
    assert same_bits(back.embeddings, pe.embeddings)
    assert same_bits(back.grad, pe.grad)
    assert back.padding_idx == 3 and back.dtype == pe.dtype
    assert back.embeddings is not pe.embeddings
    pe.grad[0] = 7.0  # an untouched row: ignored by both
    back.grad[0] = 7.0
    pe.sgd_step(0.2)
    back.sgd_step(0.2)
    assert same_bits(back.embeddings, pe.embeddings)
    # training continues on the copy
    back.backward(np.ones((1, 4)), [9])
    assert back.grad[9].any()


def test_pickle_and_copy_without_grad():
    pe = LearnedPositionEmbedding(4, 2, seed=0)
    for back in (pickle.loads(pickle.dumps(pe)), copy.deepcopy(pe)):
        assert back.grad is None and back.padding_idx is None
        assert same_bits(back.embeddings, pe.embeddings)
        back.backward(np.ones((4, 2)))
        back.sgd_step(0.5)
        assert not same_bits(back.embeddings, pe.embeddings)


def test_unpickles_an_instance_pickled_before_padding_idx_existed():
    pe = LearnedPositionEmbedding(4, 2, seed=0)
    old_state = {"_embeddings": pe.embeddings.copy(), "grad": np.ones((4, 2), np.float32)}
    back = LearnedPositionEmbedding.__new__(LearnedPositionEmbedding)
    back.__setstate__(old_state)
    assert back.padding_idx is None and same_bits(back.embeddings, pe.embeddings)
    back.sgd_step(1.0)  # no bookkeeping: every row is updated
    assert same_bits(back.embeddings, pe.embeddings - np.float32(1.0))


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
    ("embeddings", np.ones((9, 4), np.longdouble), "embeddings"),
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
