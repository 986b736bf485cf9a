"""What ``inspect.signature``, ``help()`` and ``repr`` say about the public API."""

from __future__ import annotations

import importlib.util
import inspect
import pydoc

import pytest

import cposembed
import cposembed.plot

HAS_TORCH = importlib.util.find_spec("torch") is not None


def _public_callables(module):
    """(name, object) for every public function, class and public method (and
    ``__call__``) of ``module``; exception classes aside (no signature, as for
    Python's own)."""
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.ismodule(obj) or not callable(obj):
            continue
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            continue
        yield f"{module.__name__}.{name}", obj
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                if attr.startswith("_") and attr != "__call__":
                    continue
                member = getattr(obj, attr)
                if callable(member) and not inspect.isclass(member):
                    yield f"{module.__name__}.{name}.{attr}", member


def _modules():
    mods = [cposembed, cposembed.plot]
    if HAS_TORCH:
        mods.append(importlib.import_module("cposembed.torch"))
    return mods


@pytest.mark.parametrize("module", _modules(), ids=lambda m: m.__name__)
def test_every_public_callable_has_a_signature(module):
    missing = []
    for name, obj in _public_callables(module):
        try:
            inspect.signature(obj)
        except (TypeError, ValueError) as exc:
            missing.append(f"{name}: {exc}")
    assert missing == []


def test_calling_a_table_has_the_real_signature_on_the_class_and_the_instance():
    pe = cposembed.LearnedPositionEmbedding(8, 4, seed=0)
    assert str(inspect.signature(pe)) == "(positions, *, out=None)"
    call = inspect.signature(cposembed.LearnedPositionEmbedding.__call__)
    assert list(call.parameters) == ["self", "positions", "out"]
    assert call.parameters["out"].kind is inspect.Parameter.KEYWORD_ONLY
    # the class's own signature stays its constructor's
    ctor = inspect.signature(cposembed.LearnedPositionEmbedding)
    assert list(ctor.parameters)[:3] == ["max_seq_len", "embed_dim", "seed"]
    text = pydoc.render_doc(cposembed.LearnedPositionEmbedding, renderer=pydoc.plaintext)
    assert "__call__(self, /, positions, *, out=None)" in text
    assert "Look up position embeddings" in text


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_a_converted_module_says_it_is_cposembeds():
    import torch

    import cposembed.torch as ct

    model = torch.nn.Sequential(torch.nn.Embedding(200, 32), torch.nn.Linear(32, 2))
    ct.convert_embeddings(model)
    text = repr(model)
    assert "(0): cposembed.Embedding(200, 32)" in text
    assert "(1): Linear(in_features=32" in text
    assert repr(ct.LearnedPositionEmbedding(8, 4)) == "cposembed.LearnedPositionEmbedding(8, 4)"
