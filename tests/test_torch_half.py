"""cposembed.torch with float16 and bfloat16 weights, bitwise against torch.nn.Embedding.

The half dtypes run on cposembed's kernels (never on ``F.embedding``): a
bfloat16 tensor reaches them as an ``ml_dtypes.bfloat16`` array through its
int16 view. On CPU, ``nn.Embedding``'s gradient of a half weight is
``np.add.at`` in the weight's dtype (each add in float32, rounded), and
``bf16 + bf16`` is added in float32 and rounded once; both are checked here
against NumPy with ml_dtypes too, independently of torch.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import cposembed.torch as ct  # noqa: E402

HALF = [torch.bfloat16, torch.float16]
ALL_DTYPES = [torch.float32, torch.float64, *HALF]
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Same dtype, shape and bits (-0.0 is not 0.0; sparse compared dense)."""
    if a is None or b is None:
        return a is b
    if a.is_sparse or b.is_sparse:
        a, b = a.to_dense(), b.to_dense()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = _BITS[a.element_size()]
    return torch.equal(a.detach().view(bits), b.detach().view(bits))


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A copy of ``t`` as NumPy (bfloat16 as ``ml_dtypes.bfloat16``)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


def _embedding(weight: torch.Tensor, **kw) -> nn.Embedding:
    e = nn.Embedding(*weight.shape, dtype=weight.dtype, **kw)
    with torch.no_grad():
        e.weight.copy_(weight)
    return e


def _values(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Normal values with a spread of exponents, zeros of both signs and
    repeated values (ties in the sums), in ``dtype``."""
    x = torch.randn(shape, generator=gen) * 2.0 ** torch.randint(-6, 7, shape, generator=gen)
    pick = torch.randint(0, 8, shape, generator=gen)
    x = torch.where(pick == 0, torch.zeros(()), x)
    x = torch.where(pick == 1, -torch.zeros(()), x)
    x = torch.where(pick == 2, torch.ones(()), x)
    return x.to(dtype)


# ---- on the kernels ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_half_weights_run_on_the_kernels_not_f_embedding(dtype, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("F.embedding called")

    monkeypatch.setattr(ct.F, "embedding", refuse)
    e = ct.Embedding(10, 4, dtype=dtype)
    m = ct.TokenPositionEmbedding(10, 6, 4, dtype=dtype)
    ids = torch.tensor([[1, 2, 2]])
    assert type(e(ids).grad_fn).__name__ == "LookupFnBackward"
    assert type(m(ids).grad_fn).__name__ == "EmbedFnBackward"
    assert (
        type(m.positions.add_to(torch.randn(1, 3, 4)).grad_fn).__name__ == "AddPositionsFnBackward"
    )
    x = m(ids)
    x.sum().backward()
    assert m.tokens.weight.grad.dtype == dtype and m.positions.weight.grad.dtype == dtype


# ---- properties: values and gradients ------------------------------------------------


@given(
    n_rows=st.integers(1, 40),
    d=st.integers(1, 9),
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=3),
    pad=st.one_of(st.none(), st.integers(-40, 39)),
    dtype=st.sampled_from(HALF),
    seed=st.integers(0, 2**16),
)
def test_property_half_embedding_values_and_gradients_equal_nn_embedding(
    n_rows, d, shape, pad, dtype, seed
) -> None:
    gen = torch.Generator().manual_seed(seed)
    pad = None if pad is None else pad % n_rows
    w = _values((n_rows, d), dtype, gen)
    ours, ref = (
        ct.Embedding(n_rows, d, padding_idx=pad, dtype=dtype),
        _embedding(w, padding_idx=pad),
    )
    with torch.no_grad():
        ours.weight.copy_(w)
    ids = torch.randint(0, n_rows, tuple(shape), generator=gen)
    x, y = ours(ids), ref(ids)
    assert _same_bits(x, y)
    g = _values(tuple(x.shape), dtype, gen)
    x.backward(g)
    y.backward(g)
    assert _same_bits(ours.weight.grad, ref.weight.grad)
    # and NumPy's np.add.at in the weight's dtype, independently of torch
    want = np.zeros((n_rows, d), _numpy(w).dtype)
    np.add.at(want, ids.numpy(), _numpy(g))
    if pad is not None:
        want[pad] = 0
    assert np.array_equal(want.view(np.uint16), _numpy(ours.weight.grad).view(np.uint16))


@given(
    vocab=st.integers(1, 30),
    n_pos=st.integers(1, 12),
    d=st.integers(1, 8),
    batch=st.integers(0, 4),
    data=st.data(),
    dtype=st.sampled_from(HALF),
    seed=st.integers(0, 2**16),
)
def test_property_half_token_position_equals_two_nn_embeddings(
    vocab, n_pos, d, batch, data, dtype, seed
) -> None:
    gen = torch.Generator().manual_seed(seed)
    T = data.draw(st.integers(0, n_pos), label="T")
    offset = data.draw(st.integers(0, n_pos - T), label="offset")
    explicit = data.draw(st.booleans(), label="explicit positions")
    pad = data.draw(st.one_of(st.none(), st.integers(0, vocab - 1)), label="padding_idx")
    m = ct.TokenPositionEmbedding.from_pretrained(
        _values((vocab, d), dtype, gen),
        _values((n_pos, d), dtype, gen),
        freeze=False,
        padding_idx=pad,
    )
    e_tok = _embedding(m.tokens.weight, padding_idx=pad)
    e_pos = _embedding(m.positions.weight)
    ids = torch.randint(0, vocab, (batch, T), generator=gen)
    pos = torch.randint(0, n_pos, (batch, T), generator=gen) if explicit else None
    full = pos if explicit else torch.arange(offset, offset + T).expand(batch, T)
    x = m(ids, pos) if explicit else m(ids, offset=offset)
    y = e_tok(ids) + e_pos(full)
    assert _same_bits(x, y)
    # tokens + positions added in float32 and rounded once (NumPy + ml_dtypes)
    np_dtype = _numpy(m.tokens.weight).dtype
    sum32 = _numpy(m.tokens.weight)[ids.numpy()].astype(np.float32) + _numpy(m.positions.weight)[
        full.numpy()
    ].astype(np.float32)
    assert np.array_equal(sum32.astype(np_dtype).view(np.uint16), _numpy(x).view(np.uint16))
    g = _values(tuple(x.shape), dtype, gen)
    x.backward(g)
    y.backward(g)
    assert _same_bits(m.tokens.weight.grad, e_tok.weight.grad)
    assert _same_bits(m.positions.weight.grad, e_pos.weight.grad)


@given(
    tok_dtype=st.sampled_from(ALL_DTYPES),
    table_dtype=st.sampled_from(ALL_DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    d=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_property_add_to_of_every_dtype_pair_equals_tok_plus_nn_embedding(
    tok_dtype, table_dtype, shape, d, seed
) -> None:
    """Mixed dtypes included: float16 with bfloat16 gives torch's float32."""
    gen = torch.Generator().manual_seed(seed)
    L = shape[-1] + 2
    pe = ct.LearnedPositionEmbedding(L, d, dtype=table_dtype)
    with torch.no_grad():
        pe.weight.copy_(_values((L, d), table_dtype, gen))
    e = _embedding(pe.weight)
    tok = _values((*shape, d), tok_dtype, gen).requires_grad_()
    tok_ref = tok.detach().clone().requires_grad_()
    x = pe.add_to(tok, offset=2)
    y = tok_ref + e(torch.arange(2, L).expand(shape))
    assert x.dtype == torch.promote_types(tok_dtype, table_dtype)
    assert _same_bits(x, y)
    g = _values(tuple(x.shape), x.dtype, gen)
    x.backward(g)
    y.backward(g)
    assert _same_bits(tok.grad, tok_ref.grad)
    assert _same_bits(pe.weight.grad, e.weight.grad)


@pytest.mark.parametrize("token_dtype", ALL_DTYPES)
@pytest.mark.parametrize("position_dtype", ALL_DTYPES)
def test_tables_of_two_dtypes_equal_two_nn_embeddings(token_dtype, position_dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    m = ct.TokenPositionEmbedding.from_pretrained(
        _values((30, 5), token_dtype, gen),
        _values((9, 5), position_dtype, gen),
        freeze=False,
        padding_idx=1,
    )
    e_tok, e_pos = _embedding(m.tokens.weight, padding_idx=1), _embedding(m.positions.weight)
    ids = torch.randint(0, 30, (3, 7), generator=gen)
    ids[:, :3] = 4
    x, y = m(ids, offset=1), e_tok(ids) + e_pos(torch.arange(1, 8).expand(3, 7))
    assert x.dtype == torch.promote_types(token_dtype, position_dtype) and _same_bits(x, y)
    g = _values(tuple(x.shape), x.dtype, gen)
    x.backward(g)
    y.backward(g)
    # each table gets the gradient in its own dtype, as autograd hands it to nn.Embedding
    assert _same_bits(m.tokens.weight.grad, e_tok.weight.grad)
    assert _same_bits(m.positions.weight.grad, e_pos.weight.grad)


def test_float16_with_bfloat16_tables_raise_embeds_errors() -> None:
    ops = torch.ops.cposembed
    t = torch.randn(10, 4)
    for ids, pos in (
        (torch.tensor(3), None),
        (torch.tensor([[10]]), None),
        (torch.tensor([[1, 2]]), torch.tensor([10])),
        (torch.tensor([[1, 2]]), torch.tensor([1, 2, 3])),
    ):
        errors = []
        for tt, pt in ((t, t), (t.bfloat16(), t.half())):
            with pytest.raises((IndexError, ValueError)) as info:
                ops.embed(ids, tt, pt, pos, 0)
            errors.append((info.type, str(info.value)))
        assert errors[0] == errors[1]
    x = ops.embed(torch.tensor(3), t.bfloat16(), t.half(), torch.tensor(2), 0)
    assert _same_bits(x, t.bfloat16()[3].float() + t.half()[2].float())


# ---- rounding facts ----------------------------------------------------------------


def test_a_float16_gradient_rounds_after_each_add_as_nn_embedding() -> None:
    """2048 + 1 is a tie in float16 (to even: 2048): a hundred adds of 1.0 into
    a row that holds 2048 leave it there, in nn.Embedding and here."""
    ids = torch.zeros(101, dtype=torch.long)
    g = torch.ones(101, 3, dtype=torch.float16)
    g[0] = 2048
    grads = []
    for e in (ct.Embedding(2, 3, dtype=torch.float16), nn.Embedding(2, 3, dtype=torch.float16)):
        e(ids).backward(g)
        grads.append(e.weight.grad)
    assert grads[0][0].tolist() == [2048.0] * 3
    assert _same_bits(grads[0], grads[1])


def test_bfloat16_sums_round_once_from_float32() -> None:
    """1 + 2**-8 is a tie in bfloat16; 1 + (2**-8 + 2**-16) rounds up: the sum is
    made in float32 and rounded once."""
    m = ct.TokenPositionEmbedding(2, 2, 1, dtype=torch.bfloat16)
    with torch.no_grad():
        m.tokens.weight.fill_(1.0)
        m.positions.weight[0] = 2.0**-8
        m.positions.weight[1] = 2.0**-8 + 2.0**-15
    x = m(torch.tensor([[0, 1]]))
    assert x.ravel().tolist() == [1.0, 1.0 + 2.0**-7]
    y = m.tokens.weight[:1] + m.positions.weight
    assert _same_bits(x.reshape(2, 1), y)


# ---- large gradients: storages the bridge keeps, any thread count -------------------


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("d", [96, 97])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_large_half_gradients_equal_nn_embedding(dtype, d, threads) -> None:
    import cposembed

    m = ct.TokenPositionEmbedding(12_000, 64, d, dtype=dtype)  # 2.2 MiB token gradient
    e_tok, e_pos = _embedding(m.tokens.weight), _embedding(m.positions.weight)
    ids = (torch.randint(1, 110, (8, 64)) ** 2) % 12_000
    old = cposembed.get_num_threads()
    cposembed.set_num_threads(threads)
    try:
        x, y = m(ids), e_tok(ids) + e_pos(torch.arange(64).expand(8, 64))
        g = torch.randn_like(x)
        x.backward(g)
        y.backward(g)
    finally:
        cposembed.set_num_threads(old)
    assert _same_bits(x, y)
    grad = m.tokens.weight.grad
    assert _same_bits(grad, e_tok.weight.grad)
    assert _same_bits(m.positions.weight.grad, e_pos.weight.grad)
    assert grad.is_contiguous() and grad.untyped_storage().nbytes() == grad.numel() * 2
    assert grad._base is None  # the storage itself, not a view of one


@pytest.mark.parametrize("dtype", HALF)
def test_a_half_gradient_is_never_written_again_once_handed_out(dtype) -> None:
    e = ct.Embedding(8192, 256, dtype=dtype)  # 4 MiB: a storage the bridge keeps
    e(torch.tensor([1, 2])).sum().backward()
    first = e.weight.grad
    held = first.view(torch.int16).numpy()  # a NumPy view keeps the memory alive
    snapshot = first.clone()
    e.weight.grad = None
    del first
    for ids in ([3, 4], [1, 2], [2, 2, 2]):
        e.weight.grad = None
        e(torch.tensor(ids)).sum().backward()
        assert e.weight.grad.data_ptr() != held.ctypes.data
    assert np.array_equal(held, snapshot.view(torch.int16).numpy())


# ---- autograd features ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_half_no_grad_and_inference_mode(dtype) -> None:
    m = ct.TokenPositionEmbedding(20, 8, 4, dtype=dtype)
    e_tok, e_pos = _embedding(m.tokens.weight), _embedding(m.positions.weight)
    ids = torch.randint(0, 20, (2, 5))
    with torch.no_grad():
        x = m(ids)
        y = e_tok(ids) + e_pos(torch.arange(5))
    assert x.grad_fn is None and _same_bits(x, y)
    with torch.inference_mode():
        assert _same_bits(m(ids), e_tok(ids) + e_pos(torch.arange(5)))


@pytest.mark.parametrize("dtype", HALF)
def test_half_compile_fullgraph_equals_eager_and_nn_embedding(dtype) -> None:
    m = ct.TokenPositionEmbedding(64, 16, 8, dtype=dtype, padding_idx=0)
    e_tok, e_pos = _embedding(m.tokens.weight, padding_idx=0), _embedding(m.positions.weight)
    ids = torch.randint(0, 64, (3, 16))
    ids[:, :4] = 5

    def loss(layer, i):
        return (layer(i).float() ** 2).sum()

    step = torch.compile(loss, fullgraph=True, dynamic=False)
    step(m, ids).backward()
    (e_tok(ids) + e_pos(torch.arange(16).expand(3, 16))).float().pow(2).sum().backward()
    assert _same_bits(m.tokens.weight.grad, e_tok.weight.grad)
    assert _same_bits(m.positions.weight.grad, e_pos.weight.grad)
    m.zero_grad(set_to_none=True)
    loss(m, ids).backward()  # eager
    grads = [m.tokens.weight.grad, m.positions.weight.grad]
    m.zero_grad(set_to_none=True)
    step(m, ids).backward()
    assert _same_bits(grads[0], m.tokens.weight.grad)
    assert _same_bits(grads[1], m.positions.weight.grad)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_half_double_backward_equals_nn_embedding(dtype, padding_idx) -> None:
    ours = ct.Embedding(20, 4, padding_idx=padding_idx, dtype=dtype)
    ref = _embedding(ours.weight, padding_idx=padding_idx)
    ids = torch.tensor([[2, 5, 5], [1, 2, 0]])
    v = torch.randn(20, 4).to(dtype)
    results = []
    for e in (ours, ref):
        g_out = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(3)).to(dtype)
        g_out.requires_grad_(True)
        (g_w,) = torch.autograd.grad(e(ids), e.weight, g_out, create_graph=True)
        (gg,) = torch.autograd.grad((g_w * v).sum(), g_out)
        results.append((g_w.detach(), gg))
    assert _same_bits(results[0][0], results[1][0])
    assert _same_bits(results[0][1], results[1][1])


@pytest.mark.parametrize("dtype", HALF)
def test_half_torch_func_and_forward_ad_equal_nn_embedding(dtype) -> None:
    import torch.autograd.forward_ad as fwAD
    from torch.func import functional_call, grad, jacrev, vmap

    ours = ct.Embedding(12, 3, dtype=dtype)
    ref = _embedding(ours.weight)
    ids = torch.tensor([[3, 3, 11], [0, 4, 3]])
    w = ours.weight.detach().clone()

    def loss_of(e):
        return lambda w: (functional_call(e, {"weight": w}, (ids,)) * 3).sum()

    assert _same_bits(grad(loss_of(ours))(w), grad(loss_of(ref))(w))
    assert _same_bits(jacrev(loss_of(ours))(w), jacrev(loss_of(ref))(w))
    assert _same_bits(vmap(ours)(ids), vmap(ref)(ids))
    tangent = torch.randn(12, 3).to(dtype)
    outs = []
    for e in (ours, ref):
        with fwAD.dual_level():
            out = functional_call(e, {"weight": fwAD.make_dual(w, tangent)}, (ids,))
            outs.append(fwAD.unpack_dual(out).tangent)
    assert _same_bits(outs[0], outs[1])
    # the layer's tangent: both tables' tangents added in float32, rounded once
    m = ct.TokenPositionEmbedding(12, 4, 3, dtype=dtype)
    t_tok, t_pos = torch.randn(12, 3).to(dtype), torch.randn(4, 3).to(dtype)
    with fwAD.dual_level():
        p = {
            "tokens.weight": fwAD.make_dual(m.tokens.weight.detach(), t_tok),
            "positions.weight": fwAD.make_dual(m.positions.weight.detach(), t_pos),
        }
        t = fwAD.unpack_dual(functional_call(m, p, (ids[:, :3],))).tangent
    assert _same_bits(t, t_tok[ids[:, :3]] + t_pos[:3])
