"""Hugging Face transformers as a real client of cposembed.torch.

Tiny random GPT-2 and BERT configurations (nothing is downloaded): a model
whose embeddings went through ``convert_embeddings`` gives the unconverted
model's logits and gradients bitwise, keeps its tied weights tied, and
takes ``resize_token_embeddings`` and ``tie_weights``.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import cposembed.torch as ct  # noqa: E402

VOCAB = 120


def _model(model_class: Any, config_class: Any, **settings: Any) -> torch.nn.Module:
    config = config_class(vocab_size=VOCAB, **settings)
    torch.manual_seed(0)
    return model_class(config)


# Tiny configurations without dropout: the model class, its config class, its settings.
MODELS = {
    "gpt2": functools.partial(
        _model, transformers.GPT2LMHeadModel, transformers.GPT2Config,
        n_positions=32, n_embd=24, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ),
    "bert": functools.partial(
        _model, transformers.BertForMaskedLM, transformers.BertConfig,
        hidden_size=24, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    ),
}  # fmt: skip


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 12), generator=g)
    ids[:, :3] = 7  # repeated tokens
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def _embeddings(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]


@pytest.mark.parametrize("name", MODELS)
def test_converted_model_gives_the_same_logits_and_gradients(name) -> None:
    plain = MODELS[name]()
    converted = ct.convert_embeddings(copy.deepcopy(plain))
    assert all(type(e) is ct.Embedding for e in _embeddings(converted))
    assert len(_embeddings(converted)) >= 2
    batch = _batch()
    out_plain, out_conv = plain(**batch), converted(**batch)
    assert torch.equal(out_plain.logits, out_conv.logits)
    out_plain.loss.backward()
    out_conv.loss.backward()
    grads = dict(converted.named_parameters())
    for pname, p in plain.named_parameters():
        q = grads[pname]
        assert (p.grad is None) == (q.grad is None), pname
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), pname


@pytest.mark.parametrize("name", MODELS)
def test_tied_weights_stay_tied_and_training_matches(name) -> None:
    plain = MODELS[name]()
    converted = ct.convert_embeddings(copy.deepcopy(plain))
    out_emb = converted.get_output_embeddings()
    assert out_emb.weight is converted.get_input_embeddings().weight  # still one Parameter
    assert len(list(converted.parameters())) == len(list(plain.parameters()))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, converted)]
    for _ in range(3):
        batch = _batch()
        for model, opt in zip((plain, converted), opts):
            opt.zero_grad()
            model(**batch).loss.backward()
            opt.step()
    for (pname, p), q in zip(plain.named_parameters(), converted.parameters()):
        assert torch.equal(p, q), pname


@pytest.mark.parametrize("name", MODELS)
def test_resize_token_embeddings_and_tie_weights(name) -> None:
    model = ct.convert_embeddings(MODELS[name]())
    before = model.get_input_embeddings()
    old = before.weight.detach().clone()
    model.resize_token_embeddings(VOCAB + 9)
    emb = model.get_input_embeddings()
    assert isinstance(emb, ct.Embedding) and emb.num_embeddings == VOCAB + 9
    assert torch.equal(emb.weight[:VOCAB], old)
    model.tie_weights()
    assert model.get_output_embeddings().weight is emb.weight
    batch = _batch()
    batch["input_ids"][0, 0] = VOCAB + 8  # a new token
    out = model(**batch)
    assert out.logits.shape[-1] == VOCAB + 9
    out.loss.backward()
    assert emb.weight.grad.shape == (VOCAB + 9, emb.embedding_dim)
    assert emb.weight.grad[VOCAB + 8].abs().sum() > 0


def test_a_model_built_on_the_meta_device_converts() -> None:
    with torch.device("meta"):
        model = MODELS["gpt2"]()
    ct.convert_embeddings(model)
    out = model(input_ids=torch.zeros(2, 5, dtype=torch.long, device="meta"))
    assert out.logits.is_meta and out.logits.shape == (2, 5, VOCAB)


@pytest.mark.parametrize("name", list(MODELS))
def test_a_converted_model_refuses_the_ids_the_original_refuses(name) -> None:
    # -100 is Hugging Face's label-ignore value, easily passed as input by mistake.
    for bad in (-100, VOCAB):
        ids = torch.tensor([[5, 7, bad, bad]])
        original = MODELS[name]()
        with pytest.raises(IndexError, match="index out of range in self"):
            original(input_ids=ids)
        with pytest.raises(IndexError, match="index out of range in self"):
            ct.convert_embeddings(original)(input_ids=ids)
