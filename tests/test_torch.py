"""cposembed.torch: the operators, the modules, the gradient buffers, DDP.

Skipped as a whole without PyTorch (the ImportError test runs without it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import PACKAGE_ROOT, run_python

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_python(["-c", textwrap.dedent(code)], timeout)


def test_core_package_never_imports_torch() -> None:
    proc = _run(
        """
        import sys, cposembed, cposembed.functional, cposembed.plot
        assert "torch" not in sys.modules, "the core package imported torch"
        print("ok")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_import_error_names_the_extra_without_torch() -> None:
    proc = _run(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, Block())
        try:
            import cposembed.torch
        except ImportError as e:
            print(type(e).__name__, e)
            print("cause:", type(e.__cause__).__name__)
        else:
            print("imported")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        'ImportError cposembed.torch needs PyTorch: pip install "cposembed[torch]"' in proc.stdout
    )
    assert "cause: ModuleNotFoundError" in proc.stdout


torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import cposembed.torch as ct  # noqa: E402

ops = torch.ops.cposembed


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _embedding(weight: torch.Tensor, padding_idx: int | None = None) -> nn.Embedding:
    e = nn.Embedding(*weight.shape, padding_idx=padding_idx, dtype=weight.dtype)
    with torch.no_grad():
        e.weight.copy_(weight)
    return e


# ---- values and gradients against nn.Embedding ------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_token_position_equals_two_nn_embeddings(dtype, index_dtype) -> None:
    m = ct.TokenPositionEmbedding(50, 12, 6, dtype=dtype)
    e_tok, e_pos = _embedding(m.tokens.weight), _embedding(m.positions.weight)
    ids = torch.randint(0, 50, (3, 10), dtype=index_dtype)
    ids[:, :4] = 7  # repeated ids: several terms per gradient row
    pos = torch.arange(2, 12).expand(3, 10)  # offset 2, as a (B, T) index
    ours = m(ids, offset=2)
    theirs = e_tok(ids) + e_pos(pos)
    assert ours.dtype == dtype and torch.equal(ours, theirs)
    g = torch.randn_like(ours)
    ours.backward(g)
    theirs.backward(g)
    # nn.Embedding's CPU backward sums each row's terms in index order, as ours does.
    assert torch.equal(m.tokens.weight.grad, e_tok.weight.grad)
    assert torch.equal(m.positions.weight.grad, e_pos.weight.grad)


def test_learned_position_embedding_forward_and_add_to() -> None:
    pe = ct.LearnedPositionEmbedding(16, 4)
    e = _embedding(pe.weight)
    pos = torch.tensor([[0, 5, 5, 15], [3, 3, 3, 1]])
    out = pe(pos)
    ref = e(pos)
    assert torch.equal(out, ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(pe.weight.grad, e.weight.grad)

    tok = torch.randn(2, 4, 4, requires_grad=True)
    tok_ref = tok.detach().clone().requires_grad_(True)
    pe.weight.grad = e.weight.grad = None
    x = pe.add_to(tok, offset=3)
    y = tok_ref + e(torch.arange(3, 7))
    assert torch.equal(x, y)
    g = torch.randn_like(x)
    x.backward(g)
    y.backward(g)
    assert torch.equal(tok.grad, tok_ref.grad)
    torch.testing.assert_close(pe.weight.grad, e.weight.grad)  # torch sums the batch first
    assert torch.equal(pe.add_to(tok, pos), tok + e(pos))


def test_negative_and_list_positions_follow_numpy_indexing() -> None:
    pe = ct.LearnedPositionEmbedding(8, 3)
    w = pe.weight.detach()
    assert torch.equal(pe([-1, 0, -8]), w[[-1, 0, -8]])
    assert torch.equal(pe(torch.tensor(-2)), w[-2])  # 0-d: one row
    assert pe(torch.empty(0, dtype=torch.long)).shape == (0, 3)


@pytest.mark.parametrize("padding_idx", [0, 3, -1])
def test_padding_idx_as_in_nn_embedding(padding_idx) -> None:
    m = ct.TokenPositionEmbedding(10, 8, 4, padding_idx=padding_idx)
    ref = nn.Embedding(10, 4, padding_idx=padding_idx)
    assert m.padding_idx == ref.padding_idx
    pad = ref.padding_idx
    assert not m.tokens.weight[pad].any()  # starts at zero
    with torch.no_grad():
        m.tokens.weight[pad] = 1.5  # looked up as it is
        ref.weight.copy_(m.tokens.weight)
    ids = torch.tensor([[pad, 1, pad, 2]])
    x = m(ids)
    assert torch.equal(x[0, 0], 1.5 + m.positions.weight[0])
    x.sum().backward()
    ref(ids).sum().backward()
    assert not m.tokens.weight.grad[pad].any()
    assert torch.equal(m.tokens.weight.grad, ref.weight.grad)

    pe = ct.LearnedPositionEmbedding(6, 2, padding_idx=2)
    pe(torch.tensor([2, 2, 1])).sum().backward()
    assert pe.weight.grad[:, 0].tolist() == [0, 1, 0, 0, 0, 0]


def test_frozen_tables_get_no_gradient() -> None:
    m = ct.TokenPositionEmbedding(20, 8, 4)
    ids = torch.randint(0, 20, (2, 5))
    counts = torch.bincount(ids.ravel(), minlength=20).float()[:, None].expand(20, 4)
    m.positions.weight.requires_grad_(False)
    m(ids).sum().backward()
    assert m.positions.weight.grad is None
    assert torch.equal(m.tokens.weight.grad, counts)
    m.positions.weight.requires_grad_(True)
    m.tokens.weight.requires_grad_(False)
    m.tokens.weight.grad = None
    m(ids, offset=1).sum().backward()
    assert m.tokens.weight.grad is None
    expected = torch.zeros(8, 4)
    expected[1:6] = 2
    assert torch.equal(m.positions.weight.grad, expected)


def test_no_grad_builds_no_graph() -> None:
    m = ct.TokenPositionEmbedding(20, 8, 4)
    with torch.no_grad():
        x = m(torch.randint(0, 20, (2, 5)))
        y = m.positions.add_to(torch.randn(2, 5, 4))
    assert x.grad_fn is None and not x.requires_grad
    assert y.grad_fn is None and not y.requires_grad
    with torch.inference_mode():
        assert m(torch.tensor([[1, 2]])).shape == (1, 2, 4)


# ---- the operators: opcheck, gradcheck, layouts, errors ---------------------------


def _op_samples() -> list[tuple[object, tuple, dict]]:
    t32 = torch.randn(10, 4, requires_grad=True)
    t64 = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    wide = torch.randn(4, 20, requires_grad=True)  # wide.T: a non-contiguous table
    pos = torch.randint(-10, 10, (3, 2))
    tok = torch.randn(2, 5, 8, requires_grad=True)
    tok_nc = tok[:, :, ::2]  # non-contiguous tokens (2, 5, 4)
    ids = torch.randint(0, 20, (2, 5), dtype=torch.int32)
    wte = torch.randn(20, 4, requires_grad=True)
    return [
        (ops.lookup.default, (t32, pos), {}),
        (ops.lookup.default, (t64, pos.T), {"padding_idx": 3}),  # float64, strided positions
        (ops.lookup.default, (wide.T, torch.tensor(2)), {}),
        (ops.lookup.default, (t32, torch.empty(0, 3, dtype=torch.long)), {}),
        (ops.add_positions.default, (tok_nc, t32, None, 3), {}),
        (ops.add_positions.default, (tok_nc.double(), t32, torch.tensor([1, 2, 3, 4, 5]), 0), {}),
        (ops.add_positions.default, (tok_nc, t64, pos[:1, :1], 0), {"padding_idx": -1}),
        (ops.embed.default, (ids, wte, t32, None, 2), {}),
        (ops.embed.default, (ids.T.long(), wte, t64, torch.arange(2), 0), {"padding_idx": 0}),
        (ops.embed.default, (ids[:, ::2], wide.T, t32, None, 0), {}),
        (ops.table_grad.default, (torch.randn(3, 2, 4), pos, 0, 10, torch.float32, 1), {}),
        (
            ops.embed_backward.default,
            (torch.randn(2, 5, 4), ids, None, 1, 20, 10, torch.float32, torch.float64, None),
            {},
        ),
    ]


@pytest.mark.parametrize("sample", range(len(_op_samples())))
def test_opcheck(sample) -> None:
    op, args, kwargs = _op_samples()[sample]
    torch.library.opcheck(op, args, kwargs)


def test_gradcheck_float64() -> None:
    wte = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    wpe = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    tok = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[1, 1, 6, 0], [2, 6, 6, 3]])
    pos = torch.tensor([[0, 4, 4, 1]])
    assert torch.autograd.gradcheck(lambda t: ops.lookup(t, pos), (wpe,))
    assert torch.autograd.gradcheck(lambda a, t: ops.add_positions(a, t, None, 1), (tok, wpe))
    assert torch.autograd.gradcheck(lambda a, t: ops.add_positions(a, t, pos, 0), (tok, wpe))
    assert torch.autograd.gradcheck(lambda a, b: ops.embed(ids, a, b, None, 1), (wte, wpe))
    assert torch.autograd.gradcheck(lambda a, b: ops.embed(ids, a, b, pos, 0), (wte, wpe))
    # padding_idx: by design no gradient for that row (nn.Embedding's rule), so
    # gradcheck sees it through a table whose padding row is never looked up.
    assert torch.autograd.gradcheck(lambda a, b: ops.embed(ids, a, b, None, 0, 5), (wte, wpe))


def test_errors_are_numpy_api_errors() -> None:
    table = torch.randn(5, 3)
    with pytest.raises(IndexError, match="5"):
        ops.lookup(table, torch.tensor([5]))
    with pytest.raises(IndexError, match="integer tensor"):
        ops.lookup(table, torch.tensor([True, False]))
    with pytest.raises(IndexError, match="integer tensor"):
        ops.lookup(table, torch.tensor([1.0]))
    with pytest.raises(TypeError, match="float32 or float64"):
        ops.lookup(table.half(), torch.tensor([1]))
    with pytest.raises(ValueError, match="embed_dim"):
        ops.embed(torch.tensor([[1]]), table, torch.randn(4, 2), None, 0)
    with pytest.raises(IndexError):
        ops.add_positions(torch.randn(1, 4, 3), table, None, 2)  # offset + T > L
    with pytest.raises(ValueError):
        ct.TokenPositionEmbedding(0, 4, 4)
    with pytest.raises(TypeError):
        ct.LearnedPositionEmbedding(4, 4, dtype=torch.int64)


def test_outputs_share_no_memory_with_inputs() -> None:
    table = torch.randn(6, 3)
    out = ops.lookup(table, torch.tensor(1))
    out += 1
    assert not torch.equal(out, table[1])


# ---- state dicts ------------------------------------------------------------------


def test_state_dicts_load_from_nn_embedding_and_gpt2() -> None:
    pe = ct.LearnedPositionEmbedding(16, 4)
    src = nn.Embedding(16, 4)
    pe.load_state_dict(src.state_dict())
    assert torch.equal(pe.weight, src.weight)
    back = nn.Embedding(16, 4)
    back.load_state_dict(pe.state_dict())  # and the other way
    assert torch.equal(back.weight, src.weight)

    class GPT2Input(nn.Module):  # GPT-2 keeps wte and wpe as nn.Embedding
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(30, 4), nn.Embedding(16, 4)

    gpt2 = GPT2Input().state_dict()
    m = ct.TokenPositionEmbedding(30, 16, 4)
    assert set(m.state_dict()) == {"tokens.weight", "positions.weight"}
    m.load_state_dict({"tokens.weight": gpt2["wte.weight"], "positions.weight": gpt2["wpe.weight"]})
    ids = torch.tensor([[3, 29, 0]])
    assert torch.equal(m(ids), gpt2["wte.weight"][ids] + gpt2["wpe.weight"][:3])
    pe.load_state_dict({"weight": gpt2["wpe.weight"]})
    assert torch.equal(pe.weight, gpt2["wpe.weight"])
    assert "16, 4" in repr(pe)


# ---- dense gradients: taken over by autograd, reused safely -----------------------


@pytest.fixture
def recycled(monkeypatch):
    """Every table gradient goes through the reused buffers, however small."""
    monkeypatch.setattr(ct, "_RECYCLE_MIN_BYTES", 0)
    ct._grads.clear()
    assert ct._grads.reuse
    yield
    ct._grads.clear()


def _reference_grads(m, ids_list, offset=0):
    e_tok, e_pos = _embedding(m.tokens.weight), _embedding(m.positions.weight)
    for ids in ids_list:
        (
            e_tok(ids) + e_pos(torch.arange(offset, offset + ids.shape[-1]).expand(ids.shape))
        ).sum().backward()
    return e_tok.weight.grad, e_pos.weight.grad


def test_gradient_buffer_is_taken_over_not_copied(recycled) -> None:
    m = ct.TokenPositionEmbedding(40, 8, 4)
    m(torch.tensor([[1, 2]])).sum().backward()
    (slot_tok, slot_pos) = ct._grads._slots[-2:]
    assert m.tokens.weight.grad.data_ptr() == slot_tok.array.ctypes.data
    assert m.positions.weight.grad.data_ptr() == slot_pos.array.ctypes.data
    first = m.tokens.weight.grad.data_ptr()
    m.zero_grad(set_to_none=True)
    m(torch.tensor([[5, 5]])).sum().backward()
    assert m.tokens.weight.grad.data_ptr() == first  # reused
    assert m.tokens.weight.grad[:, 0].tolist() == [0] * 5 + [2] + [0] * 34


def test_reused_gradient_is_zero_outside_the_new_rows(recycled) -> None:
    m = ct.TokenPositionEmbedding(40, 8, 4)
    batches = [torch.randint(0, 40, (2, 6)) for _ in range(4)]
    for ids in batches:
        m.zero_grad(set_to_none=True)
        m(ids).sum().backward()
        ref_tok, ref_pos = _reference_grads(m, [ids])
        assert torch.equal(m.tokens.weight.grad, ref_tok)
        assert torch.equal(m.positions.weight.grad, ref_pos)


@pytest.mark.parametrize(
    "change",
    [
        lambda g: g.add_(1.0),  # in place: the version counter moves
        lambda g: g.detach().fill_(3.0),  # through a detached alias: same counter
        lambda g: torch.nn.utils.clip_grad_norm_([g], 0.5),  # scales: zeros stay zero
    ],
)
def test_gradient_changed_in_place_is_zeroed_whole_before_reuse(recycled, change) -> None:
    m = ct.TokenPositionEmbedding(40, 8, 4)
    m(torch.tensor([[1, 2]])).sum().backward()
    change(m.tokens.weight.grad)
    m.zero_grad(set_to_none=True)
    ids = torch.tensor([[7, 8]])
    m(ids).sum().backward()
    assert torch.equal(m.tokens.weight.grad, _reference_grads(m, [ids])[0])


def test_gradients_accumulate_across_backward_calls(recycled) -> None:
    m = ct.TokenPositionEmbedding(40, 8, 4)
    ids_list = [torch.randint(0, 40, (2, 5)) for _ in range(3)]
    for _ in range(2):
        m.zero_grad(set_to_none=True)
        for ids in ids_list:  # no zero_grad in between: autograd adds into .grad
            m(ids).sum().backward()
        ref_tok, ref_pos = _reference_grads(m, ids_list)
        torch.testing.assert_close(m.tokens.weight.grad, ref_tok, rtol=0, atol=1e-6)
        torch.testing.assert_close(m.positions.weight.grad, ref_pos, rtol=0, atol=1e-6)
    # Two uses of the module in one graph: the engine sums both gradients.
    m.zero_grad(set_to_none=True)
    (m(ids_list[0]) * 2 + m(ids_list[1])).sum().backward()
    e_tok = _embedding(m.tokens.weight)
    (e_tok(ids_list[0]) * 2 + e_tok(ids_list[1])).sum().backward()
    torch.testing.assert_close(m.tokens.weight.grad, e_tok.weight.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_training_matches_nn_embedding(recycled, optimizer, set_to_none) -> None:
    m = ct.TokenPositionEmbedding(64, 16, 8)
    e_tok, e_pos = _embedding(m.tokens.weight), _embedding(m.positions.weight)
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
        "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    }[optimizer]
    opt_ours, opt_ref = make(m.parameters()), make([e_tok.weight, e_pos.weight])
    target = torch.randn(16, 8)
    for _ in range(5):
        ids = torch.randint(0, 64, (4, 16))
        opt_ours.zero_grad(set_to_none=set_to_none)
        opt_ref.zero_grad(set_to_none=set_to_none)
        ((m(ids) - target) ** 2).mean().backward()
        ((e_tok(ids) + e_pos(torch.arange(16)) - target) ** 2).mean().backward()
        opt_ours.step()
        opt_ref.step()
    torch.testing.assert_close(m.tokens.weight, e_tok.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.positions.weight, e_pos.weight, rtol=1e-5, atol=1e-6)


def test_reuse_can_be_turned_off() -> None:
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT, CPOSEMBED_TORCH_REUSE_GRADS="0")
    proc = subprocess.run(
        [sys.executable, "-c", "import cposembed.torch as ct; print(ct._grads.reuse)"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


# ---- torch.compile ----------------------------------------------------------------


def test_compile_fullgraph_training_equals_eager() -> None:
    def run(compiled: bool) -> list[float]:
        torch.manual_seed(0)
        model = nn.Sequential()
        model.embed = ct.TokenPositionEmbedding(32, 8, 4, padding_idx=0)
        head = nn.Linear(4, 32)
        opt = torch.optim.SGD([*model.embed.parameters(), *head.parameters()], lr=0.5)

        def loss_fn(ids: torch.Tensor) -> torch.Tensor:
            x = model.embed(ids[:, :-1])
            x = model.embed.positions.add_to(x, offset=0) - model.embed.positions(torch.arange(7))
            logits = head(torch.tanh(x))
            return nn.functional.cross_entropy(logits.reshape(-1, 32), ids[:, 1:].reshape(-1))

        step = torch.compile(loss_fn, fullgraph=True, dynamic=False) if compiled else loss_fn
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            ids = torch.randint(0, 32, (4, 8), generator=g)
            opt.zero_grad(set_to_none=True)
            loss = step(ids)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    eager = run(False)
    compiled = run(True)
    assert compiled == pytest.approx(eager, rel=1e-6, abs=1e-6)
    assert eager[-1] < eager[0]


# ---- distributed ------------------------------------------------------------------


def test_ddp_two_processes_match_one_process() -> None:
    script = EXAMPLES / "ddp_train.py"
    if not script.exists():
        pytest.skip("examples/ not beside tests/ (an installed copy of the tests)")
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=PACKAGE_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 processes (DDP, gloo) vs one" in proc.stdout
    assert ": match" in proc.stdout
