"""A PyTorch position table (GPT-2's ``wpe``, say) in cposembed, checked against torch.

GPT-2 keeps its learned positions in ``wpe``, an ``nn.Embedding(1024, 768)``; a
checkpoint stores them as ``state_dict["wpe.weight"]``. This example builds a small
model with such a table, saves and reloads its state dict as a checkpoint would
be, and hands the weight to ``LearnedPositionEmbedding.from_pretrained``, which
copies it. Then it checks that cposembed and torch agree: the lookup and the fused
add bitwise, the table gradient to float32 rounding (the two may sum repeated
positions in a different order).

Needs PyTorch (its CPU build: ``pip install torch --index-url
https://download.pytorch.org/whl/cpu``); without it the example says so and exits.
Run: ``python examples/torch_pretrained.py``.
"""

from __future__ import annotations

import io

import numpy as np

from cposembed import LearnedPositionEmbedding

try:
    import torch
except ModuleNotFoundError:
    print(
        "skipped: this example needs torch "
        "(pip install torch --index-url https://download.pytorch.org/whl/cpu)"
    )
    raise SystemExit(0) from None

MAX_LEN, DIM = 1024, 64  # GPT-2 small: 1024 x 768
torch.manual_seed(0)


class TinyGPT2Input(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(100, DIM)
        self.wpe = torch.nn.Embedding(MAX_LEN, DIM)


model = TinyGPT2Input()

# 1. A live parameter (no .detach() needed: its values are copied).
pe = LearnedPositionEmbedding.from_pretrained(model.wpe.weight)
print(f"from a live weight: {pe}")

# 2. A checkpoint: the state dict, saved and loaded back (tensors without grad).
buffer = io.BytesIO()
torch.save(model.state_dict(), buffer)
buffer.seek(0)
state = torch.load(buffer)
pe = LearnedPositionEmbedding.from_pretrained(state["wpe.weight"])
print(f"from a checkpoint:  {pe}")
assert np.array_equal(pe.embeddings, model.wpe.weight.detach().numpy())

# Lookup: pe(positions) == wpe(positions), bitwise.
rng = np.random.default_rng(0)
positions = rng.integers(0, MAX_LEN, size=(4, 128))
ours = pe(positions)
theirs = model.wpe(torch.from_numpy(positions)).detach().numpy()
assert np.array_equal(ours, theirs)

# Fused add: pe.add_to(tok, positions) == tok + wpe(positions), bitwise.
tok = rng.standard_normal((4, 128, DIM), dtype=np.float32)
ours = pe.add_to(tok, positions)
x = torch.from_numpy(tok) + model.wpe(torch.from_numpy(positions))
assert np.array_equal(ours, x.detach().numpy())

# Backward: pe.backward(g, positions) == torch's gradient of wpe.weight.
grad_output = rng.standard_normal(x.shape, dtype=np.float32)
x.backward(torch.from_numpy(grad_output))
pe.backward(grad_output, positions)
torch_grad = model.wpe.weight.grad.numpy()
np.testing.assert_allclose(pe.grad, torch_grad, rtol=1e-5, atol=1e-5)
max_diff = float(np.abs(pe.grad - torch_grad).max())

# One SGD step on both sides: same table afterwards, to float32 rounding.
lr = 0.1
pe.sgd_step(lr)
with torch.no_grad():
    model.wpe.weight -= lr * model.wpe.weight.grad
np.testing.assert_allclose(pe.embeddings, model.wpe.weight.detach().numpy(), rtol=1e-5, atol=1e-6)

print(f"lookup and add_to equal torch bitwise; table gradient within {max_diff:.1e} of torch's")
print(f"torch {torch.__version__}")
