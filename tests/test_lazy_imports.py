"""What ``import cposembed`` leaves out, and the half paths that import it later.

ml_dtypes (NumPy's bfloat16) takes ten times NumPy's import time, so
cposembed imports it only when a bfloat16 is asked for by name or an array
(or scalar, tensor, saved table) of one arrives. Each case runs in a fresh
interpreter, where nothing has imported ml_dtypes yet.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from helpers import run_json

HAS_TORCH = importlib.util.find_spec("torch") is not None


def test_import_leaves_ml_dtypes_and_numpy_ma_out():
    # numpy.ma: not imported by cposembed (NumPy 1.x imports it itself).
    got = run_json(
        """
        import json, sys
        import numpy as np
        ma_with_numpy = "numpy.ma" in sys.modules
        import cposembed, cposembed.__main__
        pe = cposembed.LearnedPositionEmbedding(8, 4, seed=0)
        pe.backward(pe(np.arange(3)))
        print(json.dumps({
            "ml_dtypes": "ml_dtypes" in sys.modules,
            "numpy.ma": ("numpy.ma" in sys.modules) and not ma_with_numpy,
        }))
        """
    )
    assert got == {"ml_dtypes": False, "numpy.ma": False}


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_import_of_the_torch_bridge_leaves_ml_dtypes_out():
    got = run_json(
        """
        import json, sys
        import torch
        import cposembed.torch as ct
        m = ct.LearnedPositionEmbedding(8, 4)
        m(torch.arange(3)).sum().backward()
        print(json.dumps({"ml_dtypes": "ml_dtypes" in sys.modules}))
        """
    )
    assert got == {"ml_dtypes": False}


def test_a_bfloat16_asked_for_by_name_imports_it():
    got = run_json(
        """
        import json, sys
        import numpy as np
        import cposembed
        before = "ml_dtypes" in sys.modules
        pe = cposembed.LearnedPositionEmbedding(8, 4, seed=0, dtype="bfloat16")
        y = pe(np.array([3, 1, 3]))
        rows = pe.embeddings[[3, 1, 3]].copy()
        import ml_dtypes
        bf = np.dtype(ml_dtypes.bfloat16)
        pe.backward(np.ones((3, 4), np.float32), np.array([3, 1, 3]))
        pe.sgd_step(0.5)
        print(json.dumps({
            "before": before,
            "dtype": str(y.dtype),
            "is_bf16": y.dtype == bf and pe.embeddings.dtype == bf,
            "forward": y.tobytes() == rows.tobytes(),
            "grad": pe.grad[[3, 1, 0]].tolist(),
        }))
        """
    )
    assert got["before"] is False and got["is_bf16"] and got["dtype"] == "bfloat16"
    assert got["forward"]
    assert got["grad"] == [[2.0] * 4, [1.0] * 4, [0.0] * 4]


def test_bfloat16_arrays_made_after_import_take_the_kernels():
    # The user imports ml_dtypes after cposembed: the first bfloat16 array the
    # entries see is looked up there, and the results are NumPy's (with
    # ml_dtypes: a float32 add rounded once to bfloat16).
    got = run_json(
        """
        import json
        import numpy as np
        import cposembed
        from cposembed import _core
        import ml_dtypes
        bf = np.dtype(ml_dtypes.bfloat16)
        rng = np.random.default_rng(0)
        table = rng.standard_normal((16, 8)).astype(bf)
        pos = np.array([[0, 5, 5], [15, 2, 0]])
        tokens = rng.standard_normal((2, 3, 8)).astype(bf)
        direct = _core.lookup(table, pos, None, None)
        looked = cposembed.lookup(table, pos)
        added = cposembed.add_positions(tokens, table, pos)
        want_add = (tokens.astype(np.float32) + table[pos].astype(np.float32)).astype(bf)
        grad = np.zeros((16, 8), np.float32)
        g = rng.standard_normal((2, 3, 8)).astype(bf)
        cposembed.scatter_add(grad, g, pos)
        want_grad = np.zeros((16, 8), np.float32)
        np.add.at(want_grad, pos, g.astype(np.float32))
        pe = cposembed.LearnedPositionEmbedding(16, 8, seed=1)
        pe.backward(np.ones((3, 8), np.float32), np.array([1, 1, 2]))
        before = pe.embeddings.copy()
        pe.sgd_step(ml_dtypes.bfloat16(0.5))  # a bfloat16 scalar lr
        print(json.dumps({
            "direct": direct is not None and direct.tobytes() == table[pos].tobytes(),
            "lookup": looked.dtype == bf and looked.tobytes() == table[pos].tobytes(),
            "add": added.dtype == bf and added.tobytes() == want_add.tobytes(),
            "scatter": grad.tobytes() == want_grad.tobytes(),
            "step": pe.embeddings[1].tobytes()
            == (before[1] - np.float32(0.5) * np.float32(2)).tobytes(),
        }))
        """
    )
    assert got == dict.fromkeys(("direct", "lookup", "add", "scatter", "step"), True)


def test_a_saved_bfloat16_table_loads_in_a_process_without_ml_dtypes(tmp_path):
    path = tmp_path / "pe.npz"
    saved = run_json(
        f"""
        import json
        import cposembed
        pe = cposembed.LearnedPositionEmbedding(8, 4, seed=3, dtype="bfloat16")
        pe.save({str(path)!r})
        print(json.dumps({{"bits": pe.embeddings.view("u2").tolist()}}))
        """
    )
    got = run_json(
        f"""
        import json, sys
        import cposembed
        before = "ml_dtypes" in sys.modules
        pe = cposembed.LearnedPositionEmbedding.load({str(path)!r})
        print(json.dumps({{"before": before, "dtype": str(pe.embeddings.dtype),
                          "bits": pe.embeddings.view("u2").tolist()}}))
        """
    )
    assert got["before"] is False and got["dtype"] == "bfloat16"
    assert got["bits"] == saved["bits"]
    assert np.array(got["bits"]).any()


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_a_bfloat16_tensor_takes_the_kernels_in_a_fresh_process():
    got = run_json(
        """
        import json
        import torch
        import torch.nn.functional as F
        import cposembed.torch as ct
        torch.manual_seed(0)
        m = ct.LearnedPositionEmbedding(16, 8).to(torch.bfloat16)
        pos = torch.tensor([[0, 5, 5], [15, 2, 0]])
        import sys
        before = "ml_dtypes" in sys.modules
        y = m(pos)
        on_kernels = not before and "ml_dtypes" in sys.modules  # the kernels' bfloat16 view
        want = F.embedding(pos, m.weight)
        y.float().sum().backward()
        w = m.weight.detach().clone().requires_grad_()
        F.embedding(pos, w).float().sum().backward()
        print(json.dumps({
            "forward": on_kernels and y.dtype == torch.bfloat16 and torch.equal(y, want),
            "grad": torch.equal(m.weight.grad, w.grad),
        }))
        """
    )
    assert got == {"forward": True, "grad": True}
