"""A GPT-2-style input layer in NumPy, trained for 100 steps.

GPT-2 feeds its first block ``x = wte[token_ids] + wpe[positions]``: a token table
and a learned position table, summed. Here ``wpe`` is a
``cposembed.LearnedPositionEmbedding`` and ``wte`` a plain NumPy array, and the
rest of the "model" is one linear head with a softmax cross-entropy loss. The task
forces the position table to learn: the tokens are random, and at every token the
model predicts the token's position in its sequence, which only the position
embedding can tell it.

Each step checks cposembed against plain NumPy: the forward pass against
``wte[ids] + P[arange(T)]``, the table gradient against ``np.add.at`` and the SGD
step against ``P -= lr * grad`` (all bitwise). Run: ``python examples/gpt2_input_layer.py``.
"""

from __future__ import annotations

import numpy as np

import cposembed
from cposembed import LearnedPositionEmbedding

VOCAB, MAX_LEN, DIM = 50, 32, 32  # GPT-2 small: 50257, 1024, 768
BATCH, T = 16, 32
STEPS, LR = 100, 1.0

rng = np.random.default_rng(0)
wte = (rng.standard_normal((VOCAB, DIM)) / np.sqrt(DIM)).astype(np.float32)
wpe = LearnedPositionEmbedding(MAX_LEN, DIM, seed=0)  # float32, the handbook's init
head = np.zeros((DIM, MAX_LEN), dtype=np.float32)  # logits over positions


def loss_and_grad(x: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Softmax cross-entropy of ``x @ head``; gradients w.r.t. ``x`` and ``head``."""
    logits = x @ head  # (B, T, MAX_LEN)
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    n = targets.size
    loss = float(-np.log(np.take_along_axis(p, targets[..., None], -1)).mean())
    p[np.arange(BATCH)[:, None], np.arange(T)[None, :], targets] -= 1.0
    grad_logits = p / n
    grad_x = (grad_logits @ head.T).astype(np.float32)
    grad_head = np.einsum("btd,btl->dl", x, grad_logits).astype(np.float32)
    return loss, grad_x, grad_head


targets = np.broadcast_to(np.arange(T), (BATCH, T))
for step in range(STEPS):
    ids = rng.integers(0, VOCAB, size=(BATCH, T))

    # Forward: token + position embeddings, fused (positions=None: 0..T-1).
    tok = wte[ids]  # (B, T, d)
    x = wpe.add_to(tok)
    loss, grad_x, grad_head = loss_and_grad(x, targets)

    # Backward: the table gradient, summed over the batch, into wpe.grad.
    wpe.zero_grad()
    wpe.backward(grad_x)
    grad_wte = cposembed.scatter_add(np.zeros_like(wte), grad_x, ids)  # the token table's

    if step == 0:
        table = wpe.embeddings.copy()
        assert np.array_equal(x, tok + table[np.arange(T)])
        expected = np.zeros_like(table)
        np.add.at(expected, np.broadcast_to(np.arange(T), (BATCH, T)), grad_x)
        assert np.array_equal(wpe.grad, expected)
        expected_wte = np.zeros_like(wte)
        np.add.at(expected_wte, ids, grad_x)
        assert np.array_equal(grad_wte, expected_wte)

    # SGD on all three parameters.
    wpe.sgd_step(LR)
    wte -= np.float32(LR) * grad_wte
    head -= np.float32(LR) * grad_head

    if step == 0:
        assert np.array_equal(wpe.embeddings, table - np.float32(LR) * wpe.grad)
        first_loss = loss
    if step % 20 == 0 or step == STEPS - 1:
        print(f"step {step:3d}  loss {loss:.3f}")

print(f"loss {first_loss:.3f} -> {loss:.3f} (uniform guess: {np.log(MAX_LEN):.3f})")
assert loss < 0.1 * first_loss, "the model did not learn the positions"
print("forward, gradients and SGD step equal plain NumPy's; the table learned the positions")
