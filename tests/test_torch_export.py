"""Leaving eager PyTorch: torch.export to ATen, the default ONNX exporter run in
onnxruntime, torch.jit.script, and forward-mode AD through the operators.

Exported and scripted programs hold torch's own operators (``F.embedding`` and
an add), with the kernels' values bitwise; eager calls keep the kernels.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.autograd import forward_ad as fwAD  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import cposembed.torch as ct  # noqa: E402

IDS = torch.tensor([[3, 1, 5, 7], [0, 2, 2, 19]])
# torch 2.13 deprecates TorchScript, which the ONNX exporter also touches.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


class _AddTo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pe = ct.LearnedPositionEmbedding(8, 4)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        return self.pe.add_to(tok, offset=2)


class _Model(nn.Module):
    """Every module, one of them inside another's computation."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = ct.Embedding(20, 4, padding_idx=1)
        self.pe = ct.LearnedPositionEmbedding(8, 4)
        self.layer = ct.TokenPositionEmbedding(20, 8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids) + self.pe(torch.arange(ids.shape[-1])) + self.layer(ids)


def _modules() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    return {
        "Embedding": (ct.Embedding(20, 4, padding_idx=1), (IDS,)),
        "LearnedPositionEmbedding": (ct.LearnedPositionEmbedding(8, 4), (torch.tensor([0, 3, 7]),)),
        "add_to": (_AddTo(), (torch.randn(2, 3, 4),)),
        "TokenPositionEmbedding": (ct.TokenPositionEmbedding(20, 8, 4), (IDS,)),
        "bfloat16 TokenPositionEmbedding": (
            ct.TokenPositionEmbedding(20, 8, 4, dtype=torch.bfloat16),
            (IDS,),
        ),
    }


def _kernel_ops(fn) -> set[str]:
    """The cposembed operators a call runs (the profiler's names)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("cposembed::")}


def _namespaces(gm: torch.fx.GraphModule) -> set[str]:
    return {
        n.target.namespace
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
    }


@pytest.mark.parametrize("name", list(_modules()))
def test_export_decomposes_to_aten_with_the_kernels_values(name):
    module, args = _modules()[name]
    eager = module(*args)
    ep = torch.export.export(module, args).run_decompositions()
    assert _namespaces(ep.graph_module) == {"aten"}
    assert torch.equal(ep.module()(*args), eager)
    # Eager calls after the export still run on the kernels.
    assert _kernel_ops(lambda: module(*args))


def test_export_with_dynamic_shapes_takes_other_lengths():
    m = ct.TokenPositionEmbedding(20, 8, 4)
    dims = ({0: torch.export.Dim("b"), 1: torch.export.Dim("t", max=8)},)
    ep = torch.export.export(m, (IDS,), dynamic_shapes=dims).run_decompositions()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]] * 3)
    assert torch.equal(ep.module()(ids), m(ids))


def test_torch_compile_keeps_the_kernels():
    m = ct.TokenPositionEmbedding(20, 8, 4)
    compiled = torch.compile(m, fullgraph=True)
    assert torch.equal(compiled(IDS), m(IDS))
    assert _kernel_ops(lambda: compiled(IDS))


def _onnx_run(module: nn.Module, args: tuple[torch.Tensor, ...], path) -> list[np.ndarray]:
    pytest.importorskip("onnxscript")  # what torch.onnx.export's default exporter needs
    onnxruntime = pytest.importorskip("onnxruntime")
    torch.onnx.export(module.eval(), args, str(path))  # its defaults: the dynamo exporter
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    return session.run(None, feeds)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the exporter's own
@pytest.mark.parametrize(
    "name", [n for n in _modules() if not n.startswith("bfloat16")]
)  # onnxruntime's CPU Gather takes no bfloat16
def test_onnx_export_runs_in_onnxruntime_bitwise(name, tmp_path):
    module, args = _modules()[name]
    (out,) = _onnx_run(module, args, tmp_path / "m.onnx")
    assert np.array_equal(out, module(*args).detach().numpy())


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the exporter's own
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_onnx_export_of_other_dtypes_is_bitwise(dtype, tmp_path):
    torch.manual_seed(0)
    m = ct.TokenPositionEmbedding(20, 8, 4, dtype=dtype)
    (out,) = _onnx_run(m, (IDS,), tmp_path / "m.onnx")
    assert out.dtype == m(IDS).detach().numpy().dtype
    assert np.array_equal(out, m(IDS).detach().numpy())


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the exporter's own
def test_onnx_export_of_a_converted_gpt2_matches_within_float_tolerance(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=120, n_positions=32, n_embd=24, n_layer=2, n_head=2, use_cache=False
    )
    torch.manual_seed(0)
    model = ct.convert_embeddings(transformers.GPT2LMHeadModel(config).eval())
    assert type(model.transformer.wte) is ct.Embedding
    ids = torch.randint(0, 120, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits.numpy()
    outs = _onnx_run(model, (ids,), tmp_path / "gpt2.onnx")
    np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=1e-5)


def test_jit_script_leaves_the_eager_model_as_it_was(tmp_path):
    torch.manual_seed(0)
    model = _Model()
    twin = copy.deepcopy(model)
    modules = [(n, type(m), id(m)) for n, m in model.named_modules()]
    ids = torch.tensor([[3, 1, 5, 7]])
    eager = model(ids)
    scripted = torch.jit.script(model)
    assert [(n, type(m), id(m)) for n, m in model.named_modules()] == modules
    assert torch.equal(model(ids), eager)
    assert model.pe.max_seq_len == 8 and model.pe.add_to(torch.zeros(1, 4, 4)).shape == (1, 4, 4)
    assert _kernel_ops(lambda: model(ids))
    # The scripted copy: torch's operators, the same values and gradients,
    # saved and loaded.
    plain = torch.tensor([[3, 1, 5, 7]])
    path = tmp_path / "m.pt"
    scripted.save(str(path))
    loaded = torch.jit.load(str(path))
    assert not _kernel_ops(lambda: loaded(plain))
    assert torch.equal(loaded(plain), twin(plain))
    scripted(plain).pow(2).sum().backward()
    twin(plain).pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_jit_script_of_the_layer_with_positions_and_offset():
    m = ct.TokenPositionEmbedding(20, 8, 4)
    s = torch.jit.script(m)
    pos = torch.tensor([[0, 0, 1, 1]])
    assert torch.equal(s(IDS, pos), m(IDS, pos))
    assert torch.equal(s(IDS[:, :2], None, 3), m(IDS[:, :2], None, 3))


def test_an_offset_with_explicit_positions_is_refused_on_every_path():
    m = ct.TokenPositionEmbedding(20, 8, 4)
    pos = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])

    class WithOffset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return self.m(ids, pos, 3)

    calls = {
        "eager": lambda: m(IDS, pos, 3),
        "add_to": lambda: m.positions.add_to(torch.zeros(2, 4, 4), pos, 3),
        "export": lambda: torch.export.export(WithOffset(), (IDS, pos)),
        "script": lambda: torch.jit.script(m)(IDS, pos, 3),
    }
    for name, call in calls.items():
        with pytest.raises(Exception, match="offset.*only applies with positions=None") as info:
            call()
        assert isinstance(info.value, ValueError) or "ValueError" in str(info.value), name


def test_a_single_id_without_positions_is_refused_on_every_path():
    def with_max_norm():
        m = ct.TokenPositionEmbedding(20, 8, 4)
        m.tokens.max_norm = 1.0
        return m

    calls = {
        "eager": lambda: ct.TokenPositionEmbedding(20, 8, 4)(torch.tensor(3)),
        "max_norm": lambda: with_max_norm()(torch.tensor(3)),
        "offset": lambda: ct.TokenPositionEmbedding(20, 8, 4)(torch.tensor(3), None, 1),
        "script": lambda: torch.jit.script(ct.TokenPositionEmbedding(20, 8, 4))(torch.tensor(3)),
    }
    for name, call in calls.items():
        with pytest.raises(Exception, match=r"shape \(\.\.\., T\) when positions is None") as info:
            call()
        assert isinstance(info.value, ValueError) or "ValueError" in str(info.value), name


def _dual_calls(d: torch.Tensor, t: torch.Tensor, pos: torch.Tensor):
    tok = torch.zeros(3, 3, dtype=d.dtype)
    ops = torch.ops.cposembed
    return {
        "lookup": lambda: ops.lookup(d, pos),
        "add_positions": lambda: ops.add_positions(tok, d, None, 0),
        "add_positions (dual tokens)": lambda: ops.add_positions(
            fwAD.make_dual(tok, torch.ones_like(tok)), t, None, 0
        ),
        "embed": lambda: ops.embed(pos, d, t, None, 0),
        "table_grad": lambda: ops.table_grad(
            fwAD.make_dual(tok, torch.ones_like(tok)), pos, 0, 5, d.dtype
        ),
        "embed_backward": lambda: ops.embed_backward(
            fwAD.make_dual(tok, torch.ones_like(tok)), pos, None, 0, 5, 5, d.dtype, d.dtype
        ),
    }


@pytest.mark.parametrize("op", list(_dual_calls(torch.zeros(1), torch.zeros(1), IDS)))
def test_forward_ad_through_an_operator_is_a_clear_error(op):
    t = torch.randn(5, 3, dtype=torch.float64)
    pos = torch.tensor([1, 2, 2])
    with fwAD.dual_level():
        d = fwAD.make_dual(t, torch.randn(5, 3, dtype=torch.float64))
        with pytest.raises(RuntimeError, match="no forward-mode AD.*cposembed.torch"):
            _dual_calls(d, t, pos)[op]()


@pytest.mark.parametrize("op", list(_dual_calls(torch.zeros(1), torch.zeros(1), IDS)))
@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
def test_an_operator_under_torch_func_forward_ad_is_a_clear_error(op, transform):
    # torch.func unwraps its tensors before the kernels see them: without the
    # refusal the output's tangent came back as zeros.
    t = torch.randn(5, 3, dtype=torch.float64)
    pos = torch.tensor([1, 2, 2])

    def f(d):
        return _dual_calls(d, t, pos)[op]()  # inside torch.func's own dual level

    with pytest.raises(RuntimeError, match="no forward-mode AD.*cposembed.torch"):
        if transform == "jvp":
            torch.func.jvp(f, (t,), (torch.ones_like(t),))
        else:
            torch.func.jacfwd(f)(t)


def test_the_functions_under_torch_func_jvp_give_f_embeddings_tangent():
    t = torch.randn(5, 3, dtype=torch.float64)
    v = torch.randn(5, 3, dtype=torch.float64)
    pos = torch.tensor([[1, 2, 2]])
    layer = ct.TokenPositionEmbedding(5, 5, 3, dtype=torch.float64)

    def ours(w):
        return torch.func.functional_call(layer, {"tokens.weight": w}, (pos,))

    def ref(w):
        return F.embedding(pos, w) + layer.positions.weight[:3]

    assert torch.equal(torch.func.jvp(ours, (t,), (v,))[1], torch.func.jvp(ref, (t,), (v,))[1])
    assert torch.equal(torch.func.jvp(lambda w: ct.embedding(pos, w), (t,), (v,))[1], v[pos])
    assert torch.equal(torch.func.jacfwd(ours)(t), torch.func.jacfwd(ref)(t))


def test_forward_ad_through_the_functions_and_modules_is_f_embeddings():
    t = torch.randn(5, 3, dtype=torch.float64)
    v = torch.randn(5, 3, dtype=torch.float64)
    pos = torch.tensor([1, 2, 2])
    layer = ct.TokenPositionEmbedding(5, 5, 3, dtype=torch.float64)
    with fwAD.dual_level():
        d = fwAD.make_dual(t, v)
        ours = fwAD.unpack_dual(ct.embedding(pos, d)).tangent
        assert torch.equal(ours, fwAD.unpack_dual(F.embedding(pos, d)).tangent)
        out = torch.func.functional_call(layer, {"tokens.weight": d}, (pos[None],))
        want = F.embedding(pos[None], d) + layer.positions.weight[:3]
        assert torch.equal(fwAD.unpack_dual(out).tangent, fwAD.unpack_dual(want).tangent)
    # No dual level open: the operators run as always.
    assert torch.equal(torch.ops.cposembed.lookup(t, pos), t[pos])
