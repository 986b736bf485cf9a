"""cposembed.torch under hostile input and real clients, against torch.nn.Embedding.

Sparse gradients, scripting, tracing and export, max_norm, resizing, index forms
and their errors, autograd's features, memory reuse, optimizers, threads and DDP.
Every value and gradient is compared bitwise with ``torch.nn.Embedding`` /
``F.embedding`` on the same weights.
"""

from __future__ import annotations

import copy
import functools
import io
import os
import pickle
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import run_on_two_ranks

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import cposembed.torch as ct  # noqa: E402

# Above _torch_arrays.FRESH_MIN_BYTES (2 MiB), so gradients are kept storages.
BIG = 300_000
IDS = torch.tensor([[1, 2, 2], [0, 9, 1]])


# torch.jit is deprecated in torch 2.13 but still works for nn.Embedding.
jit_ok = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _twins(n: int = 10, d: int = 3, dtype=torch.float32, **kw):
    """A ct.Embedding and an nn.Embedding with the same weight."""
    w = torch.randn(n, d, dtype=dtype)
    ours = ct.Embedding(n, d, dtype=dtype, **kw)
    ref = nn.Embedding(n, d, dtype=dtype, **kw)
    with torch.no_grad():
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    return ours, ref


def _same_sparse(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.is_sparse
        and b.is_sparse
        and a.is_coalesced() == b.is_coalesced()
        and torch.equal(a._indices(), b._indices())
        and torch.equal(a._values(), b._values())
    )


def _error_type(fn) -> type[BaseException] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e)
    return None


# ---- defects found (each failed before its fix) -------------------------------------


@pytest.mark.parametrize("pad", [None, 1])
def test_sparse_gradient_is_nn_embeddings_entry_for_entry(pad) -> None:
    ours, ref = _twins(padding_idx=pad, sparse=True)
    ids = torch.tensor([[3, 1, 3], [4, 4, 1]])
    g = torch.randn(2, 3, 3)
    ours(ids).backward(g)
    ref(ids).backward(g)
    assert _same_sparse(ours.weight.grad, ref.weight.grad)
    assert ours.weight.grad._values().data_ptr() != g.data_ptr()


def test_sparse_gradient_accumulated_over_backward_calls_is_nn_embeddings() -> None:
    # Per-call coalesced sums added up differ from nn.Embedding's (one
    # sequential sum of every entry) in the last bits.
    w = torch.randn(50, 4)
    i1, i2 = torch.randint(0, 5, (200,)), torch.randint(0, 5, (200,))
    g1, g2 = torch.randn(200, 4), torch.randn(200, 4)
    results = []
    for cls in (ct.Embedding, nn.Embedding):
        e = cls.from_pretrained(w.clone(), freeze=False, sparse=True)
        opt = torch.optim.SGD(e.parameters(), lr=0.1)
        e(i1).backward(g1)
        e(i2).backward(g2)
        dense = e.weight.grad.to_dense()
        opt.step()
        results.append((dense, e.weight.detach().clone()))
    (ours_g, ours_w), (ref_g, ref_w) = results
    assert torch.equal(ours_g, ref_g)
    assert torch.equal(ours_w, ref_w)


def test_sparse_table_shared_with_a_dense_lookup_is_nn_embeddings() -> None:
    results = []
    for cls in (ct.Embedding, nn.Embedding):
        torch.manual_seed(0)
        a = cls(10, 3)
        b = cls(10, 3, sparse=True)
        b.weight = a.weight
        a(IDS).sum().backward()
        b(IDS).pow(2).sum().backward()
        results.append(a.weight.grad)
    assert torch.equal(*results)


@jit_ok
def test_torch_jit_script_as_nn_embedding() -> None:
    ours, ref = _twins(padding_idx=2)
    ct_model = torch.jit.script(nn.Sequential(ours, nn.Linear(3, 2)))
    assert ct_model[0].weight is ours.weight  # the module's own parameter
    out = ct_model[0](IDS)
    assert torch.equal(out, torch.jit.script(ref)(IDS))
    out.pow(2).sum().backward()
    ref(IDS).pow(2).sum().backward()
    assert torch.equal(ours.weight.grad, ref.weight.grad)
    assert type(ours) is ct.Embedding  # scripting left the module as it was


@jit_ok
def test_torch_jit_trace_save_and_load_as_nn_embedding() -> None:
    ours, ref = _twins()
    buf = io.BytesIO()
    torch.jit.save(torch.jit.trace(ours, IDS), buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    out = loaded(IDS)
    assert torch.equal(out, ref(IDS))
    out.sum().backward()
    ref(IDS).sum().backward()
    assert torch.equal(loaded.weight.grad, ref.weight.grad)


@jit_ok
def test_traced_position_modules_record_torch_operators() -> None:
    m = ct.TokenPositionEmbedding(20, 8, 4)
    ids = torch.tensor([[1, 2, 3]])
    traced = torch.jit.trace(m, ids)
    assert torch.equal(traced(ids), m(ids))
    assert "cposembed::" not in str(traced.inlined_graph)  # aten::embedding, portable


@pytest.mark.parametrize("shape", [(10,), (2, 10, 3), ()])
def test_a_weight_not_2d_raises_torchs_error(shape) -> None:
    w = torch.randn(shape)
    assert _error_type(lambda: ct.embedding(IDS, w)) is RuntimeError
    ours, ref = _twins()
    ours.weight = ref.weight = nn.Parameter(w)
    assert _error_type(lambda: ours(IDS)) is _error_type(lambda: ref(IDS)) is not None


@pytest.mark.parametrize("pad", [10, -11, 12])
def test_functional_padding_idx_out_of_range_raises_as_f_embedding(pad) -> None:
    w = torch.randn(10, 3, requires_grad=True)
    assert _error_type(lambda: F.embedding(IDS, w, padding_idx=pad)) is AssertionError
    # -11 was taken as -1 (row 9) without a word
    assert _error_type(lambda: ct.embedding(IDS, w, padding_idx=pad)) is AssertionError


@pytest.mark.parametrize(
    "dtype", [torch.int8, torch.uint8, torch.int16, torch.uint16, torch.uint32, torch.uint64]
)
def test_max_norm_takes_every_integer_index_dtype(dtype) -> None:
    w = torch.randn(10, 3) * 5
    ours = ct.Embedding.from_pretrained(w.clone(), max_norm=1.0, freeze=False)
    ref = nn.Embedding.from_pretrained(w.clone(), max_norm=1.0, freeze=False)
    ids = torch.tensor([1, 3, 3, 7], dtype=dtype)
    out = ours(ids)
    assert torch.equal(out, ref(ids.long()))
    assert torch.equal(ours.weight, ref.weight)
    out.sum().backward()
    ref(ids.long()).sum().backward()
    assert torch.equal(ours.weight.grad, ref.weight.grad)


def test_max_norm_refuses_uint64_ids_past_int64_before_touching_a_row() -> None:
    w = torch.randn(10, 3) * 5
    e = ct.Embedding.from_pretrained(w.clone(), max_norm=1.0)
    for v in (2**64 - 1, 2**63):  # -1 and int64's minimum as int64
        with pytest.raises(IndexError):
            e(torch.tensor([1, v], dtype=torch.uint64))
    assert torch.equal(e.weight, w)


def test_a_large_gradient_can_be_resized_as_nn_embeddings() -> None:
    e = ct.Embedding(BIG, 8)
    ref = nn.Embedding(BIG, 8)
    for m in (e, ref):
        m(IDS).sum().backward()
        m.weight.grad.resize_(BIG + 1, 8)
        assert m.weight.grad.untyped_storage().nbytes() == (BIG + 1) * 8 * 4
    assert torch.equal(e.weight.grad[:BIG], ref.weight.grad[:BIG])
    for m in (e, ref):  # the resized gradient is dropped; the next one is whole
        m.zero_grad(set_to_none=True)
        m(IDS[:1]).sum().backward()
    assert torch.equal(e.weight.grad, ref.weight.grad)
    assert e.weight.grad.untyped_storage().nbytes() == BIG * 8 * 4


def test_a_storage_resized_under_its_tensor_is_torchs_error_not_a_read_past_it() -> None:
    # Storages stay resizable (FSDP2 frees one with resize_(0)): a tensor whose
    # storage no longer holds it is refused before the kernels read it.
    for nbytes in (64, 0):
        w = torch.randn(1000, 64)
        w.untyped_storage().resize_(nbytes)
        with pytest.raises(RuntimeError, match="out of bounds of its storage"):
            torch.ops.cposembed.lookup(w, torch.tensor([999]))
        with pytest.raises(RuntimeError, match="out of bounds"):
            F.embedding(torch.tensor([999]), w)  # torch's own refusal


def test_negative_views_are_read_as_their_values() -> None:
    # A negative view's values are resolved into a copy that only the kernels'
    # view of it holds: that copy must live through the call (AddressSanitizer
    # reports a read of freed memory otherwise).
    w = torch.randn(10, 3)
    tok = torch.randn(2, 3, 3)
    for _ in range(3):
        assert torch.equal(torch.ops.cposembed.lookup(torch._neg_view(w), IDS), -w[IDS])
        got = torch.ops.cposembed.add_positions(torch._neg_view(tok), torch._neg_view(w), None, 0)
        assert torch.equal(got, -tok + -w[:3])


def test_a_small_gradient_is_torchs_memory_zeroed_whatever_the_allocator_left() -> None:
    # Below 2 MiB a gradient is torch.empty zeroed on the calling thread: memory
    # torch's allocator may hand out dirty, which must not show through, and a
    # storage torch can resize, as nn.Embedding's.
    for _ in range(20):  # freed dirty blocks of the gradient's size
        torch.full((300, 16), float("nan"))
    e, ref = ct.Embedding(300, 16), torch.nn.Embedding(300, 16)
    with torch.no_grad():
        ref.weight.copy_(e.weight)
    ids = torch.tensor([[3, 5, 3], [7, 299, 0]])
    e(ids).sum().backward()
    ref(ids).sum().backward()
    assert torch.equal(e.weight.grad, ref.weight.grad)
    assert not e.weight.grad[[1, 2, 4, 298]].any()
    e.weight.grad.resize_(301, 16)


def test_a_forward_output_can_be_resized_as_nn_embeddings() -> None:
    # Outputs below the output pool's 4 MiB are torch's own memory.
    e = ct.Embedding(10, 3)
    layer = ct.TokenPositionEmbedding(10, 3, 3)
    with torch.no_grad():
        outs = [
            e(IDS),
            e(IDS.to(torch.int32)),
            layer(IDS),
            ct.LearnedPositionEmbedding(4, 3).add_to(torch.zeros(2, 3, 3)),
        ]
    for out in outs:
        torch.cat([torch.ones(7, 3), torch.ones(9, 3)], out=out)  # resizes out
        assert out.shape == (16, 3) and bool(out.eq(1).all())
        out.resize_(50, 3)


def test_a_large_forward_output_can_be_resized_as_nn_embeddings() -> None:
    e = ct.Embedding(10, 1024)
    with torch.no_grad():
        out = e(torch.zeros(1024, dtype=torch.long))
    out.resize_(1025, 1024)
    assert torch.equal(out[:1024], e.weight[0].expand(1024, 1024))


def test_a_large_output_takes_cat_out_and_resize_from_every_module() -> None:
    e = ct.Embedding(10, 1024)
    layer = ct.TokenPositionEmbedding(10, 1024, 1024)
    ids = torch.arange(1024).remainder(10).view(1, 1024)
    with torch.no_grad():
        outs = [
            e(ids),
            layer(ids),
            layer.positions.add_to(torch.zeros(1, 1024, 1024)),
            torch.ops.cposembed.lookup(e.weight, ids),
        ]
    for out in outs:
        assert out.untyped_storage().nbytes() >= 4 << 20  # kept storages, not torch.empty
        big = torch.full((2048, 1024), 3.0)
        torch.cat([big, big], out=out)  # resizes out
        assert out.shape == (4096, 1024) and bool(out.eq(3).all())
        out.resize_(5000, 1024)


def test_a_kept_output_is_never_one_a_live_tensor_holds() -> None:
    e = ct.Embedding(10, 1024)
    ids = torch.zeros(1024, dtype=torch.long)
    with torch.no_grad():
        first = e(ids)
        view = e(ids + 1)[::2]  # only a view of the second output stays alive
        storage = e(ids + 2).untyped_storage()  # only its storage
        for k in range(3, 9):
            e(ids + k)  # freed at once: its storage is handed out again
        last = e(ids + 9)
    assert torch.equal(first, e.weight[0].expand(1024, 1024))
    assert torch.equal(view, e.weight[1].expand(512, 1024))
    held = torch.empty(0).set_(storage).view(1024, 1024)
    assert torch.equal(held, e.weight[2].expand(1024, 1024))
    assert torch.equal(last, e.weight[9].expand(1024, 1024))
    ptrs = {first.data_ptr(), view.data_ptr(), storage.data_ptr(), last.data_ptr()}
    assert len(ptrs) == 4


@pytest.mark.parametrize("set_to_none", [True, False])
def test_kept_gradients_are_zero_where_not_written_and_equal_nn_embeddings(
    set_to_none: bool,
) -> None:
    e = ct.Embedding(BIG, 8)
    ref = nn.Embedding(BIG, 8)
    with torch.no_grad():
        ref.weight.copy_(e.weight)
    held: list[torch.Tensor] = []  # a user keeping every other step's gradient
    gen = torch.Generator().manual_seed(0)
    for step in range(8):
        ids = torch.randint(0, BIG, (4, 16), generator=gen)
        for m in (e, ref):
            m.zero_grad(set_to_none=set_to_none)
            m(ids).pow(2).sum().backward()
        assert torch.equal(e.weight.grad, ref.weight.grad)
        rows = torch.zeros(BIG, dtype=torch.bool)
        rows[ids.reshape(-1)] = True
        assert not e.weight.grad[~rows].any()
        if step % 2 and set_to_none:  # else .grad is one tensor, zeroed in place
            held.append(e.weight.grad.clone())
            held.append(e.weight.grad)
    for i in range(0, len(held), 2):
        assert torch.equal(held[i], held[i + 1])  # never written after it was handed out
    for _ in range(3):  # autograd adds into the kept .grad
        (e(IDS).sum() + e(IDS[:1]).sum()).backward()
        (ref(IDS).sum() + ref(IDS[:1]).sum()).backward()
    assert torch.equal(e.weight.grad, ref.weight.grad)


def test_a_kept_storage_resized_to_zero_and_back_is_not_handed_out_smaller() -> None:
    e = ct.Embedding(BIG, 8)
    e(IDS).sum().backward()
    storage = e.weight.grad.untyped_storage()
    e.weight.grad = None
    storage.resize_(0)
    storage.resize_(64)  # the same storage, too small for a gradient now
    del storage
    e(IDS).sum().backward()
    grad = e.weight.grad
    assert grad.untyped_storage().nbytes() == BIG * 8 * 4
    ref = nn.Embedding.from_pretrained(e.weight.detach().clone(), freeze=False)
    ref(IDS).sum().backward()
    assert torch.equal(grad, ref.weight.grad)


def test_zero_memory_zeroes_lazily_and_gives_the_pages_back() -> None:
    from cposembed import _blocks

    s = torch.UntypedStorage(64 << 20)
    t = torch.empty(0, dtype=torch.uint8).set_(s)
    for lazily in (True, False):
        t.fill_(7)
        start, n = s.data_ptr() + 3, (64 << 20) - 5  # unaligned edges
        _blocks.zero_memory(start, n, lazily)
        assert int(t[0]) == 7 and int(t[1]) == 7 and int(t[2]) == 7 and int(t[-2]) == 7
        assert int(t[-1]) == 7 and not t[3:-2].any()
    if sys.platform == "linux":  # the pages zeroed lazily are given back until written
        t.fill_(7)
        before = _resident_bytes()
        _blocks.zero_memory(s.data_ptr(), s.nbytes(), True)
        assert before - _resident_bytes() > 48 << 20
        assert not t.any()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- held up: errors, shapes and index forms ---------------------------------------


@pytest.mark.parametrize(
    "ids",
    [
        torch.tensor(3),
        torch.tensor([], dtype=torch.long),
        torch.empty(0, 5, dtype=torch.long),
        torch.tensor([1, 2, 3, 4]).view(2, 2).t(),
        torch.tensor([1]).expand(4, 3),
        torch.arange(10).flip(0),
        torch.arange(20)[::2] % 10,
        torch.tensor([[1, 2, 2]], dtype=torch.int32),
    ],
    ids=["0d", "empty", "empty2d", "transposed", "expanded", "flipped", "strided", "int32"],
)
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"padding_idx": -1},
        {"max_norm": 0.5},
        {"sparse": True},
        {"dtype": torch.float64},
        {"dtype": torch.bfloat16},
        {"dtype": torch.float16, "padding_idx": 2},
    ],
    ids=["plain", "pad", "max_norm", "sparse", "f64", "bf16", "f16"],
)
def test_index_forms_equal_nn_embedding(ids, kw) -> None:
    ours, ref = _twins(**kw)
    out, want = ours(ids), ref(ids)
    assert out.shape == want.shape and out.dtype == want.dtype and torch.equal(out, want)
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g)
    a, b = ours.weight.grad, ref.weight.grad
    assert _same_sparse(a, b) if b.is_sparse else torch.equal(a, b)
    assert torch.equal(ours.weight, ref.weight)  # max_norm renormalised the same rows


@pytest.mark.parametrize("ids", [torch.tensor([10]), torch.tensor([-11]), torch.tensor([2**40])])
def test_out_of_range_ids_raise_index_error(ids) -> None:
    ours, ref = _twins()
    assert _error_type(lambda: ours(ids)) is _error_type(lambda: ref(ids)) is IndexError


@pytest.mark.parametrize("ids", [torch.tensor([1.0]), torch.tensor([True])])
def test_non_integer_ids_raise_as_nn_embedding(ids) -> None:
    ours, ref = _twins()
    assert _error_type(lambda: ours(ids)) is _error_type(lambda: ref(ids)) is RuntimeError


def test_no_grad_inference_mode_and_frozen_weights() -> None:
    ours, ref = _twins()
    with torch.no_grad():
        assert not ours(IDS).requires_grad
    with torch.inference_mode():
        out = ours(IDS)
        inf_ids = IDS.clone()
    assert out.is_inference() and torch.equal(out, ref(IDS))
    # inference ids cannot be saved for backward outside the mode, in either
    assert _error_type(lambda: ours(inf_ids)) is _error_type(lambda: ref(inf_ids)) is RuntimeError
    with torch.no_grad():
        assert torch.equal(ours(inf_ids), ref(inf_ids))
    ours.weight.requires_grad_(False)
    assert ours(IDS).grad_fn is None


@pytest.mark.parametrize(
    "make",
    [
        lambda dt: torch.randn(4, 10, dtype=dt).t(),
        lambda dt: torch.randn(10, 8, dtype=dt)[:, 2:6],
        lambda dt: torch.randn(1, 4, dtype=dt).expand(10, 4),
        lambda dt: torch.randn(10, 4, dtype=dt)._neg_view(),
    ],
    ids=["transposed", "column-view", "expanded", "neg-view"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_strided_weights_equal_nn_embedding(make, dtype) -> None:
    w = make(dtype)
    ours = ct.Embedding.from_pretrained(w, freeze=False)
    ref = nn.Embedding.from_pretrained(w, freeze=False)
    assert torch.equal(ours(IDS), ref(IDS))
    g = torch.randn(2, 3, 4, dtype=dtype)
    ours(IDS).backward(g)
    ref(IDS).backward(g)
    assert torch.equal(ours.weight.grad, ref.weight.grad)
    assert ours.weight.grad.stride() == ref.weight.grad.stride()


def test_weight_view_of_a_bigger_leaf_and_replaced_weight() -> None:
    grads = []
    for cls in (ct.Embedding, nn.Embedding):
        torch.manual_seed(1)
        big = torch.randn(10, 8)
        e = cls.from_pretrained(big[:, 2:6], freeze=False)  # a Parameter viewing big
        (e(IDS) * torch.arange(4.0)).sum().backward()
        view_grad = e.weight.grad
        e.weight = nn.Parameter(torch.randn(20, 5, dtype=torch.float64))
        e(IDS + 10).pow(2).sum().backward()
        grads.append((view_grad, e.weight.grad, e.weight.grad.dtype == torch.float64))
    (a, b, f64), (c, d, _) = grads
    assert torch.equal(a, c) and torch.equal(b, d) and f64


# ---- held up: autograd features -----------------------------------------------------


def test_hooks_retain_graph_allow_unused_and_create_graph() -> None:
    results = []
    for cls in (ct.Embedding, nn.Embedding):
        torch.manual_seed(0)
        e = cls(10, 3)
        seen: list[torch.Tensor] = []
        e.weight.register_hook(lambda g: g * 2)
        e.weight.register_post_accumulate_grad_hook(
            lambda p, seen=seen: seen.append(p.grad.clone())
        )
        loss = e(IDS).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        x = torch.randn(3, requires_grad=True)
        unused = torch.autograd.grad(e(IDS).sum(), [e.weight, x], allow_unused=True)
        (g,) = torch.autograd.grad(e(IDS).pow(3).sum(), e.weight, create_graph=True)
        (gg,) = torch.autograd.grad(g.pow(2).sum(), e.weight)
        results.append([*seen, e.weight.grad, unused[0], gg])
        assert unused[1] is None
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_torch_func_vmap_over_weights_and_indices() -> None:
    import torch.func as tf

    ours, ref = _twins(dtype=torch.float64)
    ws = torch.randn(3, 10, 3, dtype=torch.float64)
    idss = torch.stack([IDS, IDS.flip(1), IDS % 3])
    for fn in (
        lambda m: tf.vmap(lambda w: tf.functional_call(m, {"weight": w}, (IDS,)))(ws),
        lambda m: tf.vmap(m)(idss),
        lambda m: tf.vmap(m, in_dims=1)(IDS),
        lambda m: tf.vmap(lambda w, i: tf.functional_call(m, {"weight": w}, (i,)))(ws, idss),
        lambda m: tf.vmap(
            tf.grad(lambda w, i: tf.functional_call(m, {"weight": w}, (i,)).pow(2).sum()),
            in_dims=(None, 0),
        )(m.weight.detach(), idss),
    ):
        assert torch.equal(fn(ours), fn(ref))


def test_gradcheck_with_forward_ad_and_batched_grad() -> None:
    e = ct.Embedding(5, 2, dtype=torch.float64)
    ids = torch.tensor([1, 1, 4, 3])
    w = e.weight.detach().clone().requires_grad_()
    f = lambda w: torch.func.functional_call(e, {"weight": w}, (ids,))  # noqa: E731
    assert torch.autograd.gradcheck(f, (w,), check_forward_ad=True, check_batched_grad=True)
    assert torch.autograd.gradgradcheck(f, (w,))


def test_torch_export_with_dynamic_shapes() -> None:
    ours, ref = _twins()
    dims = ({0: torch.export.Dim("b"), 1: torch.export.Dim("t")},)
    ep = torch.export.export(ours, (IDS,), dynamic_shapes=dims)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(ep.module()(ids), ref(ids))


def test_saved_tensor_hooks_batched_grads_and_parametrizations() -> None:
    import torch.nn.utils.parametrize as parametrize

    class Double(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 2

    results = []
    for cls in (ct.Embedding, nn.Embedding):
        torch.manual_seed(0)
        e = cls(BIG, 3)
        with torch.autograd.graph.save_on_cpu():
            e(IDS).pow(2).sum().backward()
        out = e(IDS)
        batched = torch.autograd.grad(
            out, e.weight, torch.randn(3, *out.shape), is_grads_batched=True
        )[0]
        p = cls(10, 3)
        parametrize.register_parametrization(p, "weight", Double())
        p(IDS).pow(2).sum().backward()
        results.append((e.weight.grad, batched, p.parametrizations.weight.original.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


# ---- held up: modules as objects, gradient memory, optimizers, threads --------------


def _copies(m: nn.Module) -> list[nn.Module]:
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return [copy.deepcopy(m), pickle.loads(pickle.dumps(m)), torch.load(buf, weights_only=False)]


def test_deepcopy_pickle_and_torch_save_with_gradients() -> None:
    ours, ref = _twins(n=BIG, d=4, padding_idx=2)
    ours(IDS).sum().backward()
    ref(IDS).sum().backward()
    for twin, ref_twin in zip(_copies(ours), _copies(ref)):
        assert type(twin) is ct.Embedding and twin.padding_idx == 2
        assert (twin.weight.grad is None) == (ref_twin.weight.grad is None)
        twin(IDS).pow(2).sum().backward()
        ref_twin(IDS).pow(2).sum().backward()
        assert torch.equal(twin.weight.grad, ref_twin.weight.grad)
    assert torch.equal(ours.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("kind", ["view", "storage", "numpy", "dlpack", "memoryview", "int-view"])
def test_memory_held_through_any_referent_is_never_written_again(kind) -> None:
    e = ct.Embedding(BIG, 4)
    e(IDS).sum().backward()
    referents = {
        "view": lambda g: g[1:3],
        "storage": lambda g: g.untyped_storage(),
        "numpy": lambda g: g.numpy(),
        "dlpack": lambda g: np.from_dlpack(g),
        "memoryview": lambda g: memoryview(g.numpy()),
        "int-view": lambda g: g.view(torch.int32),
    }
    ref = referents[kind](e.weight.grad)

    def snapshot() -> bytes:
        if kind == "storage":
            return torch.empty(0, dtype=torch.uint8).set_(ref).numpy().tobytes()
        return np.array(ref.numpy() if isinstance(ref, torch.Tensor) else ref, copy=True).tobytes()

    before = snapshot()
    for k in range(6):
        e.weight.grad = None
        e(IDS * 3 + k).pow(2).sum().backward()
    assert snapshot() == before


def _trained_alike(
    make: Callable[[type], nn.Module],
    optimizer: Callable[..., torch.optim.Optimizer],
    steps: int,
    backward: Callable[[Any, int], None],
    set_to_none: Callable[[int], bool] = lambda k: True,
) -> None:
    """``steps`` steps of ``optimizer`` on ``make(cls)`` (each: ``zero_grad``,
    ``backward(model, k)``, ``step``) from seed 0, with ct.Embedding and with
    nn.Embedding: the same parameters after."""
    results = []
    for cls in (ct.Embedding, nn.Embedding):
        torch.manual_seed(0)
        model = make(cls)
        opt = optimizer(model.parameters())
        for k in range(steps):
            opt.zero_grad(set_to_none=set_to_none(k))
            backward(model, k)
            opt.step()
        results.append([p.detach() for p in model.parameters()])
    assert all(map(torch.equal, *results))


def test_collective_like_writes_to_grad_between_steps() -> None:
    def backward(e: Any, k: int) -> None:
        e(IDS + k).pow(2).sum().backward()
        e.weight.grad.mul_(0.5).add_(1.0)  # every element written, as all_reduce does

    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    _trained_alike(lambda cls: cls(BIG, 4), sgd, 3, backward, lambda k: k % 2 == 0)


def _tied_head(cls: type) -> nn.Module:
    model = nn.Sequential(cls(BIG, 4), nn.Linear(4, BIG, bias=False))
    model[1].weight = model[0].weight  # tied, as GPT-2's lm_head
    return model


def _clipped_backward(model: Any, k: int) -> None:
    model(IDS + k).logsumexp(-1).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)


@pytest.mark.parametrize(
    "optimizer",
    [
        functools.partial(torch.optim.Adam, fused=True),
        functools.partial(torch.optim.AdamW, foreach=True),
        functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, foreach=True),
    ],
    ids=["adam_fused", "adamw_foreach", "sgd_foreach"],
)
def test_dense_optimizers_with_a_tied_head_and_clipping(optimizer) -> None:
    _trained_alike(_tied_head, optimizer, 2, _clipped_backward, lambda k: k == 0)


def _two_backward_calls(e: Any, k: int) -> None:
    e(IDS % 9 + k % 2).pow(2).sum().backward()
    e(IDS).sum().backward()


@pytest.mark.parametrize(
    "optimizer",
    [
        functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        functools.partial(torch.optim.SparseAdam, lr=0.1),
        functools.partial(torch.optim.Adagrad, lr=0.1),
    ],
    ids=["sgd_momentum", "sparse_adam", "adagrad"],
)
def test_sparse_optimizers_with_two_backward_calls_per_step(optimizer) -> None:
    sparse = lambda cls: cls(10, 3, sparse=True)  # noqa: E731
    _trained_alike(sparse, optimizer, 3, _two_backward_calls)


def test_threads_training_separate_modules() -> None:
    idss = [
        torch.randint(0, BIG, (4, 32), generator=torch.Generator().manual_seed(k)) for k in range(3)
    ]
    results = {}
    for cls in (ct.Embedding, nn.Embedding):
        torch.manual_seed(0)
        mods = [cls(BIG, 4) for _ in range(3)]
        out: list[torch.Tensor | None] = [None] * 3

        def work(k: int, mods=mods, out=out) -> None:
            for s in range(3):
                mods[k].weight.grad = None
                (mods[k](idss[k]) * (s + 1)).pow(2).sum().backward()
            out[k] = mods[k].weight.grad

        threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results[cls] = out
    assert all(torch.equal(a, b) for a, b in zip(results[ct.Embedding], results[nn.Embedding]))


_DDP = """
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
import cposembed.torch as ct

def work(rank, world):
    equal = {}
    # 2.1 MiB gradients: storages the bridge keeps. torch adds no sparse float16 tensors.
    for dtype, d in ((torch.float32, 8), (torch.bfloat16, 16), (torch.float16, 16)):
        for sparse, view in ((False, True), (True, False))[: 1 if dtype == torch.float16 else 2]:
            weights = []
            for cls in (ct.Embedding, nn.Embedding):
                torch.manual_seed(0)
                model = nn.Sequential(cls(70000, d, sparse=sparse), nn.Linear(d, 3)).to(dtype)
                ddp = DDP(model, gradient_as_bucket_view=view)
                opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
                g = torch.Generator().manual_seed(rank)  # each rank its own rows
                for step in range(3):
                    opt.zero_grad()
                    ddp(torch.randint(0, 70000, (4, 16), generator=g)).pow(2).sum().backward()
                    opt.step()
                weights.append([p.detach().clone() for p in model.parameters()])
            equal[f"{dtype} sparse={sparse} view={view}"] = all(map(torch.equal, *weights))
    return equal

"""


def test_distributed_data_parallel_trains_as_nn_embedding(tmp_path) -> None:
    for result in run_on_two_ranks(_DDP, tmp_path):
        assert result == dict.fromkeys(result, True) and len(result) == 5, result
