"""cposembed.torch: the modules against torch.nn.Embedding, the operators, state dicts.

Every value and gradient is compared bitwise with ``torch.nn.Embedding`` on the
same weights. Skipped as a whole without PyTorch (the ImportError test runs
without it).
"""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import pytest
from helpers import run_python
from hypothesis import given
from hypothesis import strategies as st


def _run(code: str, timeout: float = 120):
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


def test_import_error_gives_the_install_commands_without_torch() -> None:
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
    assert "ImportError cposembed.torch needs PyTorch" in proc.stdout
    assert "--index-url https://download.pytorch.org/whl/cpu" in proc.stdout
    assert 'pip install ".[torch]"' in proc.stdout
    assert "cause: ModuleNotFoundError" in proc.stdout


torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import cposembed.torch as ct  # noqa: E402

ops = torch.ops.cposembed
ALL_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (-0.0 is not 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = _BITS[a.element_size()]
    return torch.equal(a.detach().view(bits), b.detach().view(bits))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _twins(weight: torch.Tensor, **kw) -> tuple[ct.Embedding, nn.Embedding]:
    """A ct.Embedding and an nn.Embedding with copies of ``weight``."""
    ours = ct.Embedding(*weight.shape, dtype=weight.dtype, **kw)
    ref = nn.Embedding(*weight.shape, dtype=weight.dtype, **kw)
    with torch.no_grad():
        ours.weight.copy_(weight)
        ref.weight.copy_(weight)
    return ours, ref


def _grad_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.is_sparse or b.is_sparse:
        a, b = a.to_dense(), b.to_dense()
    return _same_bits(a, b)


def _backward_same(x: torch.Tensor, y: torch.Tensor, *pairs: tuple[Any, Any]) -> None:
    """``x`` and ``y`` back-propagated with one random gradient; each pair of
    tensors then has the same gradient, bit for bit."""
    g = torch.randn_like(x)
    x.backward(g)
    y.backward(g)
    for a, b in pairs:
        assert _grad_equal(a.grad, b.grad)


def _embedding(weight: torch.Tensor, padding_idx: int | None = None) -> nn.Embedding:
    e = nn.Embedding(*weight.shape, padding_idx=padding_idx, dtype=weight.dtype)
    with torch.no_grad():
        e.weight.copy_(weight)
    return e


# ---- ct.Embedding is nn.Embedding ---------------------------------------------------


ARGUMENTS = [
    {},
    {"padding_idx": 3},
    {"padding_idx": -1},
    {"max_norm": 1.0},
    {"max_norm": 0.5, "norm_type": 1.0},
    {"scale_grad_by_freq": True},
    {"sparse": True},
    {"sparse": True, "padding_idx": 0},
]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("kw", ARGUMENTS, ids=lambda kw: ",".join(map(str, kw.items())) or "plain")
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_values_and_gradients_equal_nn_embedding(dtype, kw, index_dtype) -> None:
    ours, ref = _twins(torch.randn(40, 6).to(dtype), **kw)
    ids = torch.randint(0, 40, (4, 9), dtype=index_dtype)
    ids[:, :3] = 3  # repeated ids (several terms in a row's gradient), the padding row
    ids[0, 5] = 39
    x, y = ours(ids), ref(ids)
    assert x.dtype == y.dtype and torch.equal(x, y)
    assert torch.equal(ours.weight, ref.weight)  # max_norm renormalised both alike
    _backward_same(x, y, (ours.weight, ref.weight))
    assert ours.weight.grad.is_sparse == ref.weight.grad.is_sparse


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_sparse_gradient_is_nn_embeddings_and_its_dense_form_is_the_dense_gradient(dtype) -> None:
    ours, dense = _twins(torch.randn(30, 4).to(dtype), sparse=True, padding_idx=2)
    ref = _twins(torch.randn(30, 4).to(dtype), sparse=True, padding_idx=2)[1]
    dense.sparse = False
    ids = torch.tensor([[2, 5, 5, 29], [5, 1, 2, 0]])
    g = torch.randn(2, 4, 4).to(dtype)
    (grad,) = torch.autograd.grad(ours(ids), ours.weight, g)
    (want,) = torch.autograd.grad(ref(ids), ref.weight, g)
    dense(ids).backward(g)
    # nn.Embedding's: one entry per id, in order, no padding row, uncoalesced
    assert grad.is_sparse and not grad.is_coalesced()
    assert grad._indices().tolist() == want._indices().tolist() == [[5, 5, 29, 5, 1, 0]]
    assert _same_bits(grad._values(), want._values())
    assert _same_bits(grad.to_dense(), dense.weight.grad)
    # Sparse gradients feed torch's sparse optimizers as nn.Embedding's do.
    ours.weight.grad = grad
    torch.optim.SparseAdam([ours.weight], lr=0.1).step()


@given(
    n_rows=st.integers(1, 70),
    d=st.integers(1, 9),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    pad=st.one_of(st.none(), st.integers(0, 69)),
    dtype=st.sampled_from(ALL_DTYPES),
    seed=st.integers(0, 2**16),
)
def test_property_values_and_gradients_equal_nn_embedding(n_rows, d, shape, pad, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    pad = None if pad is None else pad % n_rows
    ours, ref = _twins(torch.randn(n_rows, d, generator=gen).to(dtype), padding_idx=pad)
    ids = torch.randint(0, n_rows, tuple(shape), generator=gen)
    x, y = ours(ids), ref(ids)
    assert _same_bits(x, y)
    g = torch.randn(x.shape, generator=gen).to(dtype)
    x.backward(g)
    y.backward(g)
    assert _grad_equal(ours.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("n_tokens", [3, 20_000])  # both sides of the serial threshold
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_large_tables_equal_nn_embedding_for_any_thread_count(n_tokens, threads, dtype) -> None:
    import cposembed

    # float32: 1.25 MiB .. the gradient from mmap; half: 0.6 MiB .. 2.25 MiB from mmap
    ours, ref = _twins(torch.randn(5000, 64).to(dtype))
    big_ours, big_ref = _twins(torch.randn(12_288, 96).to(dtype))
    ids = (torch.randint(1, 90, (n_tokens,)) ** 2) % 5000
    old = cposembed.get_num_threads()
    cposembed.set_num_threads(threads)
    try:
        for a, b in ((ours, ref), (big_ours, big_ref)):
            x, y = a(ids), b(ids)
            assert _same_bits(x, y)
            _backward_same(x, y, (a.weight, b.weight))
    finally:
        cposembed.set_num_threads(old)


def test_attributes_constructor_and_repr_are_nn_embeddings() -> None:
    e = ct.Embedding(12, 5, padding_idx=-2, max_norm=2.0, norm_type=3.0, sparse=True)
    ref = nn.Embedding(12, 5, padding_idx=-2, max_norm=2.0, norm_type=3.0, sparse=True)
    assert isinstance(e, nn.Embedding)
    for name in (
        "num_embeddings",
        "embedding_dim",
        "padding_idx",
        "max_norm",
        "norm_type",
        "scale_grad_by_freq",
        "sparse",
    ):
        assert getattr(e, name) == getattr(ref, name), name
    # nn.Embedding's repr, named as cposembed's (print(model) says what was converted)
    assert repr(ref) == "Embedding(12, 5, padding_idx=10, max_norm=2.0, norm_type=3.0, sparse=True)"
    assert repr(e) == "cposembed." + repr(ref)
    assert not e.weight[10].any()
    w = torch.randn(4, 3)
    shared = ct.Embedding(4, 3, _weight=w, _freeze=True)
    assert shared.weight.data_ptr() == w.data_ptr() and not shared.weight.requires_grad
    assert ct.Embedding(4, 3, device="cpu", dtype=torch.float64).weight.dtype == torch.float64
    e.reset_parameters()
    assert not e.weight[10].any()
    for name in ("LearnedPositionEmbedding", "TokenPositionEmbedding"):
        assert "_Table" not in repr(
            getattr(ct, name)(8, 4) if name[0] == "L" else ct.TokenPositionEmbedding(8, 4, 2)
        )


@pytest.mark.parametrize("freeze", [True, False])
def test_from_pretrained_as_nn_embedding(freeze) -> None:
    w = torch.randn(7, 3)
    ours = ct.Embedding.from_pretrained(w, freeze=freeze, padding_idx=1, max_norm=5.0)
    ref = nn.Embedding.from_pretrained(w, freeze=freeze, padding_idx=1, max_norm=5.0)
    assert type(ours) is ct.Embedding
    assert ours.weight.requires_grad == ref.weight.requires_grad == (not freeze)
    assert ours.weight.data_ptr() == w.data_ptr()  # used, not copied, as nn.Embedding
    assert (ours.padding_idx, ours.max_norm) == (ref.padding_idx, ref.max_norm)
    pe = ct.LearnedPositionEmbedding.from_pretrained(w, freeze=freeze)
    assert type(pe) is ct.LearnedPositionEmbedding and pe.max_seq_len == 7 and pe.embed_dim == 3
    assert pe.weight.requires_grad == (not freeze)
    with pytest.raises(ValueError, match="2-D"):
        ct.LearnedPositionEmbedding.from_pretrained(torch.randn(3))


def test_other_devices_and_meta_tensors_go_to_torch() -> None:
    with torch.device("meta"):
        e = ct.Embedding(50257, 768)
        ids = torch.zeros(2, 5, dtype=torch.long)
        out = e(ids)
    assert out.is_meta and out.shape == (2, 5, 768)
    m = ct.TokenPositionEmbedding(100, 16, 8, device="meta")
    x = m(torch.zeros(3, 4, dtype=torch.long, device="meta"))
    assert x.is_meta and x.shape == (3, 4, 8)


def test_numpy_and_list_indices_are_copied_at_the_forward() -> None:
    m = ct.TokenPositionEmbedding(20, 8, 4)
    ref_tok = _embedding(m.tokens.weight)
    ids = np.array([[1, 2, 3]])
    x = m(ids)
    ids[:] = 7  # the batch array refilled before backward
    x.sum().backward()
    ref_tok(torch.tensor([[1, 2, 3]])).sum().backward()
    assert torch.equal(m.tokens.weight.grad, ref_tok.weight.grad)
    pe = ct.LearnedPositionEmbedding(8, 2)
    pos = [0, 1, 1]
    y = pe(pos)
    pos[0] = 5
    y.sum().backward()
    assert pe.weight.grad[:, 0].tolist() == [1, 2, 0, 0, 0, 0, 0, 0]


def test_index_tensors_changed_in_place_fail_the_backward_as_in_nn_embedding() -> None:
    e = ct.Embedding(10, 3)
    ids = torch.tensor([1, 2])
    x = e(ids)
    ids.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        x.sum().backward()


def test_convert_embeddings_in_place_keeps_parameters_and_ties() -> None:
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = nn.Embedding(30, 4), nn.Embedding(16, 4)
            self.head = nn.Linear(4, 30, bias=False)
            self.head.weight = self.wte.weight  # tied, as GPT-2's lm_head
            self.custom = _Scaled(10, 4)

    class _Scaled(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2

    model = LM()
    weights = dict(model.named_parameters())
    wte = model.wte
    assert ct.convert_embeddings(model) is model
    assert model.wte is wte and type(model.wte) is ct.Embedding
    assert type(model.wpe) is ct.Embedding
    assert type(model.custom) is _Scaled  # subclasses keep their own forward
    assert model.head.weight is model.wte.weight
    assert dict(model.named_parameters()) == weights
    single = nn.Embedding(3, 2)
    assert ct.convert_embeddings(single) is single and type(single) is ct.Embedding
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ct.convert_embeddings("not a module")


# ---- the position modules -------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_token_position_equals_two_nn_embeddings(dtype, index_dtype) -> None:
    m = ct.TokenPositionEmbedding(50, 12, 6, dtype=dtype)
    e_tok, e_pos = _embedding(m.tokens.weight), _embedding(m.positions.weight)
    ids = torch.randint(0, 50, (3, 10), dtype=index_dtype)
    ids[:, :4] = 7  # repeated ids: several terms per gradient row
    pos = torch.arange(2, 12).expand(3, 10)  # offset 2, as a (B, T) index
    ours = m(ids, offset=2)
    theirs = e_tok(ids) + e_pos(pos)
    assert ours.dtype == dtype and _same_bits(ours, theirs)
    assert type(ours.grad_fn).__name__ == "EmbedFnBackward"  # on the kernels
    # nn.Embedding's CPU backward sums each row's terms in index order, as ours does
    # (float16, bfloat16: each add in float32, rounded to the table's dtype).
    _backward_same(
        ours, theirs, (m.tokens.weight, e_tok.weight), (m.positions.weight, e_pos.weight)
    )


def test_token_position_attributes_and_from_pretrained() -> None:
    m = ct.TokenPositionEmbedding(30, 16, 4, padding_idx=-1)
    assert (m.vocab_size, m.max_seq_len, m.embed_dim, m.padding_idx) == (30, 16, 4, 29)
    assert type(m.tokens) is ct.Embedding and type(m.positions) is ct.LearnedPositionEmbedding
    wte, wpe = torch.randn(30, 4), torch.randn(16, 4)
    # Frozen by default, as nn.Embedding.from_pretrained.
    default = ct.TokenPositionEmbedding.from_pretrained(wte, wpe)
    assert not default.tokens.weight.requires_grad and not default.positions.weight.requires_grad
    p = ct.TokenPositionEmbedding.from_pretrained(wte, wpe, freeze=False, padding_idx=0)
    assert p.tokens.weight.requires_grad and p.padding_idx == 0
    assert p.tokens.weight.data_ptr() == wte.data_ptr()
    assert torch.equal(p(torch.tensor([[3, 0]])), wte[torch.tensor([[3, 0]])] + wpe[:2])
    frozen = ct.TokenPositionEmbedding.from_pretrained(wte, wpe, freeze=True)
    assert not frozen.tokens.weight.requires_grad and not frozen.positions.weight.requires_grad
    with pytest.raises(ValueError, match="embed_dim"):
        ct.TokenPositionEmbedding.from_pretrained(wte, torch.randn(16, 5))


def test_token_position_with_renormalised_or_sparse_tables_equals_nn_embeddings() -> None:
    m = ct.TokenPositionEmbedding(40, 12, 6)
    m.tokens.max_norm = 1.0
    m.positions.sparse = True
    e_tok, e_pos = _embedding(m.tokens.weight), _embedding(m.positions.weight)
    e_tok.max_norm, e_pos.sparse = 1.0, True
    ids = torch.randint(0, 40, (2, 8))
    x, y = m(ids, offset=3), e_tok(ids) + e_pos(torch.arange(3, 11).expand(2, 8))
    assert torch.equal(x, y) and torch.equal(m.tokens.weight, e_tok.weight)
    _backward_same(x, y, (m.tokens.weight, e_tok.weight), (m.positions.weight, e_pos.weight))


def test_learned_position_embedding_forward_and_add_to() -> None:
    pe = ct.LearnedPositionEmbedding(16, 4)
    assert isinstance(pe, ct.Embedding) and isinstance(pe, nn.Embedding)
    e = _embedding(pe.weight)
    pos = torch.tensor([[0, 5, 5, 15], [3, 3, 3, 1]])
    out = pe(pos)
    ref = e(pos)
    assert torch.equal(out, ref)
    _backward_same(out, ref, (pe.weight, e.weight))

    tok = torch.randn(2, 4, 4, requires_grad=True)
    tok_ref = tok.detach().clone().requires_grad_(True)
    pe.weight.grad = e.weight.grad = None
    x = pe.add_to(tok, offset=3)
    y = tok_ref + e(torch.arange(3, 7).expand(2, 4))
    assert torch.equal(x, y)
    _backward_same(x, y, (tok, tok_ref), (pe.weight, e.weight))  # summed over every token
    assert torch.equal(pe.add_to(tok, pos), tok + e(pos))
    pe.max_norm = e.max_norm = 0.5  # add_to renormalises the rows it adds, as forward
    assert torch.equal(pe.add_to(tok, offset=1), tok + e(torch.arange(1, 5)))
    assert torch.equal(pe.weight, e.weight)


def test_add_to_takes_numpy_arrays_and_lists_as_tensors() -> None:
    pe = ct.LearnedPositionEmbedding(8, 3)
    tok = np.random.default_rng(0).standard_normal((2, 4, 3)).astype(np.float32)
    want = torch.from_numpy(tok) + pe(torch.arange(4))
    assert torch.equal(pe.add_to(tok), want)
    assert torch.equal(pe.add_to(tok.tolist()), torch.tensor(tok.tolist()) + pe(torch.arange(4)))
    assert torch.equal(pe.add_to(tok.astype(">f4")), want)  # big-endian: its values
    ml_dtypes = pytest.importorskip("ml_dtypes")
    half = ct.LearnedPositionEmbedding(8, 3, dtype=torch.bfloat16)
    bf = tok.astype(ml_dtypes.bfloat16)  # NumPy's bfloat16, as cposembed uses it
    got = half.add_to(bf)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.from_numpy(tok).to(torch.bfloat16) + half(torch.arange(4)))


def test_ids_are_taken_as_nn_embedding_takes_them() -> None:
    # In [0, num_embeddings): negatives are refused, as nn.Embedding refuses
    # them, by every module and operator (a NumPy meaning torch does not give).
    pe = ct.LearnedPositionEmbedding(8, 3)
    w = pe.weight.detach()
    assert torch.equal(pe([7, 0, 2]), w[[7, 0, 2]])  # lists
    assert torch.equal(pe(torch.tensor(2)), w[2])  # 0-d: one row
    assert pe(torch.empty(0, dtype=torch.long)).shape == (0, 3)
    layer = ct.TokenPositionEmbedding(10, 8, 3)
    tok = torch.zeros(1, 2, 3)
    ops = torch.ops.cposembed
    refusals = {
        "Embedding, -1": lambda: pe(torch.tensor([1, -1])),
        "Embedding, 8": lambda: pe([8]),
        "layer ids": lambda: layer(torch.tensor([[5, -100]])),
        "layer positions": lambda: layer(torch.tensor([[5, 6]]), torch.tensor([[0, -1]])),
        "add_to": lambda: pe.add_to(tok, torch.tensor([[0, -2]])),
        "lookup": lambda: ops.lookup(w, torch.tensor([-3])),
        "table_grad": lambda: ops.table_grad(tok, torch.tensor([[0, -1]]), 0, 8, w.dtype),
        "embed_backward": lambda: ops.embed_backward(
            tok, torch.tensor([[1, 10]]), None, 0, 10, 8, w.dtype, w.dtype
        ),
    }
    for name, call in refusals.items():
        with pytest.raises(IndexError, match=r"index out of range in self: got id -?\d+ for a"):
            call()
            pytest.fail(f"{name}: no error")
    with pytest.raises(IndexError, match="index out of range in self"):  # nn.Embedding's words
        nn.Embedding(8, 3)(torch.tensor([1, -1]))


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
        z = m.tokens(torch.tensor([1, 2]))
    for t in (x, y, z):
        assert t.grad_fn is None and not t.requires_grad
    with torch.inference_mode():
        assert m(torch.tensor([[1, 2]])).shape == (1, 2, 4)


def test_wrong_sizes_and_dtypes_of_the_position_modules() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        ct.TokenPositionEmbedding(0, 4, 4)
    with pytest.raises(ValueError, match="max_seq_len"):
        ct.LearnedPositionEmbedding(-1, 4)
    with pytest.raises(TypeError, match="floating-point"):
        ct.LearnedPositionEmbedding(4, 4, dtype=torch.int64)
    with pytest.raises(IndexError, match="5"):
        ct.LearnedPositionEmbedding(5, 2)(torch.tensor([5]))


# ---- the operators: opcheck, gradcheck, layouts, errors ---------------------------


def _op_samples() -> list[tuple[object, tuple, dict]]:
    t32 = torch.randn(10, 4, requires_grad=True)
    t64 = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    wide = torch.randn(4, 20, requires_grad=True)  # wide.T: a non-contiguous table
    pos = torch.randint(0, 10, (3, 2))
    tok = torch.randn(2, 5, 8, requires_grad=True)
    tok_nc = tok[:, :, ::2]  # non-contiguous tokens (2, 5, 4)
    ids = torch.randint(0, 20, (2, 5), dtype=torch.int32)
    wte = torch.randn(20, 4, requires_grad=True)
    bf, f16 = t32.detach().bfloat16().requires_grad_(), t32.detach().half().requires_grad_()
    wte_bf = wte.detach().bfloat16().requires_grad_()
    half = [
        (ops.lookup.default, (bf, pos), {"padding_idx": 2}),
        (ops.lookup.default, (f16[:, ::2], pos.T), {}),  # strided half table
        (ops.add_positions.default, (tok_nc.bfloat16(), bf, None, 3), {}),
        (ops.add_positions.default, (tok_nc.bfloat16(), f16, None, 1), {}),  # to float32
        (ops.add_positions.default, (tok_nc, bf, pos[:1, :1], 0), {"padding_idx": -1}),
        (ops.embed.default, (ids, wte_bf, bf, None, 2), {"padding_idx": 0}),
        (ops.embed.default, (ids, wte_bf, f16, torch.arange(5), 0), {}),  # to float32
        (ops.embed.default, (ids, wte.detach().half(), t64, None, 0), {}),
        (ops.table_grad.default, (torch.randn(3, 2, 4).bfloat16(), pos, 0, 10, torch.bfloat16), {}),
        (ops.table_grad.default, (torch.randn(3, 2, 4), pos, 0, 10, torch.float16, 1), {}),
        (
            ops.embed_backward.default,
            (torch.randn(2, 5, 4).half(), ids, None, 1, 20, 10, torch.float16, torch.bfloat16),
            {},
        ),
    ]
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
        *half,
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
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64; got torch.int32"):
        ops.lookup(table.int(), torch.tensor([1]))
    with pytest.raises(ValueError, match="embed_dim"):
        ops.embed(torch.tensor([[1]]), table, torch.randn(4, 2), None, 0)
    with pytest.raises(IndexError):
        ops.add_positions(torch.randn(1, 4, 3), table, None, 2)  # offset + T > L
    with pytest.raises(ValueError):
        ct.TokenPositionEmbedding(0, 4, 4)
    with pytest.raises(TypeError):
        ct.LearnedPositionEmbedding(4, 4, dtype=torch.int64)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_outputs_share_no_memory_with_inputs(dtype) -> None:
    table = torch.randn(6, 3).to(dtype)
    out = ops.lookup(table, torch.tensor(1))
    assert out.dtype == dtype
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
