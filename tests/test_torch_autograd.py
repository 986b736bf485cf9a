"""cposembed.torch under autograd's features, and the gradient memory.

Each case runs the same computation on cposembed's modules and on
``torch.nn.Embedding`` with the same weights, and compares. The gradient
memory cases are the ways real clients (``torch.compile``, collectives, users
keeping storages) touch a gradient after it is handed out; hangs and crashes
are possible there, so those run in child interpreters.
"""

from __future__ import annotations

import os
import pathlib
import textwrap

import pytest
from helpers import assert_clean_exit, last_json, run_on_two_ranks, run_python

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.func import functional_call, grad, jacfwd, jacrev, jvp, vmap  # noqa: E402

import cposembed.torch as ct  # noqa: E402

PACKAGE_DIR = pathlib.Path(ct.__file__).parent


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _twins(n_rows: int = 20, d: int = 4, dtype=torch.float64, **kw):
    ours = ct.Embedding(n_rows, d, dtype=dtype, **kw)
    ref = nn.Embedding(n_rows, d, dtype=dtype, **kw)
    with torch.no_grad():
        ref.weight.copy_(ours.weight)
    return ours, ref


def _run(code: str, timeout: float = 240):
    return run_python(["-c", textwrap.dedent(code)], timeout)


# ---- autograd features ----------------------------------------------------------


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_double_backward_equals_nn_embedding(padding_idx) -> None:
    ours, ref = _twins(padding_idx=padding_idx)
    ids = torch.tensor([[2, 5, 5], [1, 2, 0]])
    v = torch.randn(20, 4, dtype=torch.float64)
    results = []
    for e in (ours, ref):
        g_out = torch.randn(
            2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
        )
        g_out.requires_grad_(True)
        (g_w,) = torch.autograd.grad(e(ids), e.weight, g_out, create_graph=True)
        (gg,) = torch.autograd.grad((g_w * v).sum(), g_out)
        results.append((g_w.detach(), gg))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_gradcheck_and_gradgradcheck_through_the_modules() -> None:
    m = ct.TokenPositionEmbedding(7, 5, 3, dtype=torch.float64)
    ids = torch.tensor([[1, 1, 6, 0], [2, 6, 6, 3]])

    def f(wte, wpe):
        return functional_call(m, {"tokens.weight": wte, "positions.weight": wpe}, (ids,))

    inputs = (
        m.tokens.weight.detach().clone().requires_grad_(),
        m.positions.weight.detach().clone().requires_grad_(),
    )
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


def _loss_of(module: nn.Module, name: str, ids: torch.Tensor):
    def loss(w: torch.Tensor) -> torch.Tensor:
        return (functional_call(module, {name: w}, (ids,)) ** 2).sum()

    return loss


def test_torch_func_grad_jacrev_jacfwd_vmap_equal_nn_embedding() -> None:
    ours, ref = _twins(12, 3)
    ids = torch.tensor([[3, 3, 11], [0, 4, 3]])
    w = ours.weight.detach().clone()
    a, b = _loss_of(ours, "weight", ids), _loss_of(ref, "weight", ids)
    assert torch.equal(grad(a)(w), grad(b)(w))
    assert torch.equal(jacrev(a)(w), jacrev(b)(w))
    assert torch.allclose(jacfwd(a)(w), jacfwd(b)(w))
    lookups = (lambda m: lambda i: m(i))(ours), (lambda m: lambda i: m(i))(ref)
    assert torch.equal(vmap(lookups[0])(ids), vmap(lookups[1])(ids))
    # Per-example gradients: vmap over grad, one batch entry each.
    per = [vmap(grad(_loss_of(e, "weight", ids[:1])), in_dims=0) for e in (ours, ref)]
    ws = torch.stack([w, w * 2])
    assert torch.equal(per[0](ws), per[1](ws))
    # Jacobians of the output itself (jacrev of a vector function).
    f = [
        lambda w, e=e: functional_call(e, {"weight": w}, (ids,)).sum(0).ravel() for e in (ours, ref)
    ]
    assert torch.equal(jacrev(f[0])(w), jacrev(f[1])(w))
    assert torch.equal(jacfwd(f[0])(w), jacfwd(f[1])(w))


def test_torch_func_through_the_position_modules() -> None:
    m = ct.TokenPositionEmbedding(9, 6, 3, dtype=torch.float64)
    e_tok, e_pos = nn.Embedding(9, 3, dtype=torch.float64), nn.Embedding(6, 3, dtype=torch.float64)
    ids = torch.tensor([[1, 8, 8, 2]])
    params = {k: v.detach().clone() for k, v in m.named_parameters()}

    def ours(p):
        return (functional_call(m, p, (ids,), {"offset": 1}) ** 2).sum()

    def ref(p):
        x = functional_call(e_tok, {"weight": p["tokens.weight"]}, (ids,))
        x = x + functional_call(
            e_pos, {"weight": p["positions.weight"]}, (torch.arange(1, 5).expand(1, 4),)
        )
        return (x**2).sum()

    g_ours, g_ref = grad(ours)(params), grad(ref)(params)
    assert all(torch.equal(g_ours[k], g_ref[k]) for k in params)
    t_ours = jvp(ours, (params,), ({k: torch.ones_like(v) for k, v in params.items()},))
    t_ref = jvp(ref, (params,), ({k: torch.ones_like(v) for k, v in params.items()},))
    assert torch.allclose(t_ours[1], t_ref[1]) and t_ours[1] != 0

    class AddTo(nn.Module):
        def __init__(self, pe: nn.Module) -> None:
            super().__init__()
            self.pe = pe

        def forward(self, tok: torch.Tensor) -> torch.Tensor:
            return (
                self.pe.add_to(tok, offset=1)
                if isinstance(self.pe, ct.LearnedPositionEmbedding)
                else tok + self.pe(torch.arange(1, 5))
            )

    tok = torch.randn(2, 4, 3, dtype=torch.float64)
    w = m.positions.weight.detach().clone()
    mods = [AddTo(e) for e in (m.positions, e_pos)]
    fns = [lambda w, mod=mod: functional_call(mod, {"pe.weight": w}, (tok,)) for mod in mods]
    assert torch.equal(jacrev(fns[0])(w), jacrev(fns[1])(w))
    assert torch.equal(jacfwd(fns[0])(w), jacfwd(fns[1])(w))


def test_forward_mode_ad_gives_nn_embedding_tangents() -> None:
    import torch.autograd.forward_ad as fwAD

    ours, ref = _twins(10, 3)
    ids = torch.tensor([[1, 1, 9]])
    tangent = torch.randn(10, 3, dtype=torch.float64)
    outs = []
    for e in (ours, ref):
        with fwAD.dual_level():
            w = fwAD.make_dual(e.weight.detach(), tangent)
            out = functional_call(e, {"weight": w}, (ids,))
            outs.append(fwAD.unpack_dual(out).tangent)
    assert outs[0] is not None and outs[0].abs().sum() > 0
    assert torch.equal(outs[0], outs[1])
    pe = ct.LearnedPositionEmbedding(8, 3, dtype=torch.float64)
    tok = torch.randn(1, 3, 3, dtype=torch.float64)
    tok_t = torch.randn_like(tok)
    with fwAD.dual_level():
        out = pe.add_to(fwAD.make_dual(tok, tok_t), offset=2)
        t = fwAD.unpack_dual(out).tangent
    assert torch.equal(t, tok_t)


def test_activation_checkpointing_equals_nn_embedding() -> None:
    from torch.utils.checkpoint import checkpoint

    ours, ref = _twins(30, 4, dtype=torch.float32)
    ids = torch.randint(0, 30, (3, 7))
    for e in (ours, ref):
        checkpoint(lambda i, e=e: torch.tanh(e(i)), ids, use_reentrant=False).sum().backward()
    assert torch.equal(ours.weight.grad, ref.weight.grad)


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


def test_compiled_shared_table_and_l2_term_give_nn_embedding_gradients() -> None:
    """A table looked up twice (shared encoder/decoder embeddings) and an L2 term
    on the weight, compiled, over several steps, on a table whose gradient is
    large (8 MiB): Inductor may update the returned gradient in place."""
    ours, ref = _twins(8192, 256, dtype=torch.float32)

    def loss_fn(e, a, b):
        return (e(a) * e(b)).sum() + 0.01 * (e.weight**2).sum()

    step = torch.compile(loss_fn, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        a, b = (torch.randint(0, 8192, (4, 64), generator=g) for _ in range(2))
        for e in (ours, ref):
            e.zero_grad(set_to_none=False)
        step(ours, a, b).backward()
        loss_fn(ref, a, b).backward()
        torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)
        with torch.no_grad():
            for e in (ours, ref):
                e.weight -= 0.1 * e.weight.grad


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "sparse_adam"])
@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_training_matches_nn_embedding(optimizer, set_to_none, dtype) -> None:
    sparse = optimizer == "sparse_adam"
    vocab = (1 << 21) // (512 * dtype.itemsize)  # 2 MiB token table: its gradient is mmap'ed
    m = ct.TokenPositionEmbedding(vocab, 16, 512, dtype=dtype)
    m.tokens.sparse = sparse
    e_tok = nn.Embedding(vocab, 512, sparse=sparse, dtype=dtype)
    e_pos = nn.Embedding(16, 512, dtype=dtype)
    with torch.no_grad():
        e_tok.weight.copy_(m.tokens.weight)
        e_pos.weight.copy_(m.positions.weight)
    eps = 1e-8 if dtype == torch.float32 else 1e-4  # 1e-8 is 0 in float16
    make = {
        "sgd": lambda p: [torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)],
        "adam": lambda p: [torch.optim.Adam(p, lr=0.01, eps=eps)],
        "sparse_adam": lambda p: [
            torch.optim.SparseAdam(p[:1], lr=0.01, eps=eps),
            torch.optim.Adam(p[1:], eps=eps),
        ],
    }[optimizer]
    opt_ours = make([m.tokens.weight, m.positions.weight])
    opt_ref = make([e_tok.weight, e_pos.weight])
    target = torch.randn(16, 512).to(dtype)
    for _ in range(4):
        ids = torch.randint(0, vocab, (4, 16))
        for o in (*opt_ours, *opt_ref):
            o.zero_grad(set_to_none=set_to_none)
        ((m(ids) - target) ** 2).mean().backward()
        ((e_tok(ids) + e_pos(torch.arange(16).expand(4, 16)) - target) ** 2).mean().backward()
        for o in (*opt_ours, *opt_ref):
            o.step()
    assert torch.isfinite(m.tokens.weight).all()
    assert torch.equal(m.tokens.weight, e_tok.weight)
    assert torch.equal(m.positions.weight, e_pos.weight)


def test_gradients_accumulate_across_backward_calls() -> None:
    m = ct.TokenPositionEmbedding(4096, 8, 128)
    e_tok = nn.Embedding(4096, 128)
    with torch.no_grad():
        e_tok.weight.copy_(m.tokens.weight)
    ids_list = [torch.randint(0, 4096, (2, 5)) for _ in range(3)]
    for ids in ids_list:  # no zero_grad in between: autograd adds into .grad
        m(ids).sum().backward()
        e_tok(ids).sum().backward()
    assert torch.equal(m.tokens.weight.grad, e_tok.weight.grad)
    # Two uses of the module in one graph: the engine sums both gradients.
    m.zero_grad(set_to_none=True)
    e_tok.zero_grad(set_to_none=True)
    (m(ids_list[0]) * 2 + m(ids_list[1])).sum().backward()
    (e_tok(ids_list[0]) * 2 + e_tok(ids_list[1])).sum().backward()
    assert torch.equal(m.tokens.weight.grad, e_tok.weight.grad)


# ---- gradient memory: never written after it is handed out --------------------------


def test_each_gradient_is_new_memory_that_is_never_written_again() -> None:
    e = ct.Embedding(4096, 256)  # 4 MiB: from mmap
    e(torch.tensor([1, 2])).sum().backward()
    first = e.weight.grad
    kept_storage = first.untyped_storage()
    snapshot = first.clone()
    e.weight.grad = None
    del first
    for ids in ([3, 4], [1, 2], [2, 2, 2]):
        e.zero_grad(set_to_none=True)
        e(torch.tensor(ids)).sum().backward()
        assert e.weight.grad.untyped_storage().data_ptr() != kept_storage.data_ptr()
    held = torch.tensor([], dtype=torch.float32).set_(kept_storage).view(4096, 256)
    assert torch.equal(held, snapshot)  # the memory the user still holds is unchanged


def test_gradient_changed_in_place_and_zeroed_is_not_reused() -> None:
    e = ct.Embedding(4096, 256)
    ref = nn.Embedding(4096, 256)
    with torch.no_grad():
        ref.weight.copy_(e.weight)
    for change in (
        lambda g: g.add_(1.0),
        lambda g: g.detach().fill_(3.0),
        lambda g: g.numpy().fill(2),
    ):
        for m in (e, ref):
            m.zero_grad(set_to_none=True)
            m(torch.tensor([[1, 2]])).sum().backward()
            change(m.weight.grad)
            m.zero_grad(set_to_none=True)
            m(torch.tensor([[7, 8]])).sum().backward()
        assert torch.equal(e.weight.grad, ref.weight.grad)


def test_many_gradients_alive_at_once() -> None:
    """More gradients alive than any pool would keep, some dropped, all correct."""
    e = ct.Embedding(4096, 128)
    held = []
    for i in range(9):
        e.zero_grad(set_to_none=True)
        e(torch.tensor([i, i])).sum().backward()
        held.append(e.weight.grad)
        if i % 3 == 0:
            held.pop(0)
    for g in held:
        rows = torch.nonzero(g[:, 0]).ravel().tolist()
        assert len(rows) == 1 and g[rows[0], 0] == 2


@pytest.mark.parametrize("release", ["clear_pool", "set_pool(False)"])
def test_clear_pool_frees_the_kept_storages_at_once(release: str) -> None:
    """Large outputs and gradients, once dropped, are kept for reuse; clearing
    the pool (or turning keeping off) frees them at once, not at the next call."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from cposembed import _blocks

    _, _, limit, enabled = _blocks.pool_info()
    try:
        _blocks.set_pool(True)
        e = ct.Embedding(4096, 256)  # a 4 MiB gradient
        y = e(torch.randint(0, 4096, (8, 1024)))  # an 8 MiB output
        e(torch.tensor([1, 2])).sum().backward()
        refs = [StorageWeakRef(t.untyped_storage()) for t in (y, e.weight.grad)]
        del y
        e.weight.grad = None
        assert not any(r.expired() for r in refs)  # kept
        if release == "clear_pool":
            _blocks.clear_pool()
        else:
            _blocks.set_pool(False)
        assert all(r.expired() for r in refs)
    finally:
        _blocks.set_pool(enabled, limit)


def test_no_private_torch_api_and_no_lock_in_the_bridge() -> None:
    # One exception, in the one module that keeps gradient and output memory:
    # a storage's use count (torch._C._storage_Use_Count), read only if torch
    # has it, and a lock that the calls only ever try (clear_pool waits for it).
    for name in (
        "torch.py",
        "_torch_ops.py",
        "_torch_kernels.py",
        "_torch_arrays.py",
        "_torch_sharding.py",
    ):
        source = (PACKAGE_DIR / name).read_text()
        if name == "_torch_arrays.py":
            assert source.count("torch._C") == 1
            assert 'getattr(torch._C, "_storage_Use_Count", None)' in source
            assert source.count("Lock(") == 2 and source.count(".acquire(") == 1
            assert ".acquire(blocking=False)" in source
            continue
        for private in ("torch._C", "_storage_Use_Count", "threading", "Lock("):
            assert private not in source, f"{name} uses {private}"


def test_import_and_first_call_do_not_load_the_compiler() -> None:
    """The first forward took about 2 s when it imported torch._dynamo."""
    proc = _run(
        """
        import sys, json, torch, cposembed.torch as ct
        m = ct.TokenPositionEmbedding(100, 16, 8)
        m(torch.tensor([[1, 2, 3]])).sum().backward()
        ct.Embedding(10, 2, sparse=True)(torch.tensor([1])).sum().backward()
        print(json.dumps({"dynamo": "torch._dynamo" in sys.modules}))
        """
    )
    assert_clean_exit(proc)
    assert last_json(proc) == {"dynamo": False}


@pytest.mark.skipif(
    "asan" in os.environ.get("LD_PRELOAD", ""),
    reason="under AddressSanitizer the 60 forked children, each a full torch backward, "
    "did not finish within the 300 s limit (the uninstrumented run takes about 8 s)",
)
def test_fork_while_another_thread_computes_gradients_does_not_hang_the_child() -> None:
    """Another thread makes gradients (the backward operators and the forward,
    outside autograd's engine: forking while that engine runs Python autograd
    nodes can hang a child in torch itself) while the main thread forks; each
    child runs a whole forward and backward."""
    proc = _run(
        """
        import json, os, sys, threading, torch, cposembed.torch as ct
        ops = torch.ops.cposembed
        m = ct.TokenPositionEmbedding(4096, 16, 256)  # 4 MiB gradients
        stop = threading.Event()
        def loop():
            g = torch.randn(2, 16, 256)
            while not stop.is_set():
                ids = torch.randint(0, 4096, (2, 16))
                ops.table_grad(g, ids, 0, 4096, torch.float32)
                ops.embed_backward(g, ids, None, 0, 4096, 16, torch.float32, torch.float32)
                with torch.no_grad():
                    m(ids)
        t = threading.Thread(target=loop)
        t.start()
        ok = 0
        for _ in range(60):
            pid = os.fork()
            if pid == 0:
                import faulthandler  # a hang: its traceback, and exit status 1
                faulthandler.dump_traceback_later(60, exit=True)
                m.zero_grad(set_to_none=True)
                m(torch.tensor([[5, 5]])).sum().backward()
                os._exit(0 if m.tokens.weight.grad[5, 0] == 2 else 3)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            ok += code == 0
            if code:
                print("child exit status", code, file=sys.stderr)
        stop.set()
        t.join()
        print(json.dumps({"ok": ok}))
        """,
        timeout=300,
    )
    assert_clean_exit(proc)
    assert last_json(proc) == {"ok": 60}, proc.stderr[-3000:]


# ---- collectives ------------------------------------------------------------------


_ALL_REDUCE = """
import torch, torch.distributed as dist
from torch import nn
import cposembed.torch as ct

def work(rank, world):
    torch.manual_seed(0)
    ours = ct.TokenPositionEmbedding(4096, 32, 256)  # 4 MiB token gradient
    ref_tok, ref_pos = nn.Embedding(4096, 256), nn.Embedding(32, 256)
    with torch.no_grad():
        ref_tok.weight.copy_(ours.tokens.weight)
        ref_pos.weight.copy_(ours.positions.weight)
    ours_p, ref_p = list(ours.parameters()), [ref_tok.weight, ref_pos.weight]
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own rows
    worst = 0.0
    for step in range(3):
        ids = torch.randint(0, 4096, (2, 32), generator=g)
        for p in ours_p + ref_p:
            p.grad = None if step == 0 else p.grad.zero_()
        ours(ids).pow(2).sum().backward()
        (ref_tok(ids) + ref_pos(torch.arange(32).expand(2, 32))).pow(2).sum().backward()
        for p in ours_p + ref_p:  # hand-written data parallel: sum the ranks' gradients
            dist.all_reduce(p.grad)
        for a, b in zip(ours_p, ref_p):
            worst = max(worst, float((a.grad - b.grad).abs().max()))
        with torch.no_grad():
            for p in ours_p + ref_p:
                p -= 0.01 * p.grad
    return worst

"""


def test_hand_written_all_reduce_of_grad_equals_nn_embedding(tmp_path) -> None:
    assert run_on_two_ranks(_ALL_REDUCE, tmp_path) == [0.0, 0.0]
