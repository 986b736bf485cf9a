"""A model built on cposembed.torch, exported to ONNX and run in onnxruntime.

The model is GPT-2's input layer (``ct.TokenPositionEmbedding``: token rows plus
position rows) under a linear head. ``torch.onnx.export`` with its defaults
traces it through ``torch.export``, where the layer takes torch's own
``F.embedding`` and add, so the ONNX file holds standard operators only
(``Gather``, ``Add``, ``MatMul``) and runs wherever onnxruntime does, without
Python or cposembed. The example checks that onnxruntime gives the eager model's
values: the embedding layer bitwise, the head's matrix product within float
rounding (onnxruntime sums in its own order).

Needs PyTorch (its CPU build), onnx, onnxscript and onnxruntime (the ``test``
extra); without them the example says so and exits.
Run: ``python examples/onnx_export.py``.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

try:
    import onnx
    import onnxruntime
    import onnxscript  # noqa: F401  (what torch.onnx.export's default exporter needs)
    import torch
except ModuleNotFoundError as exc:
    print(f"skipped: this example needs torch, onnxscript and onnxruntime ({exc.name} is missing)")
    raise SystemExit(0) from None

import cposembed.torch as ct

VOCAB, MAX_LEN, DIM = 1000, 64, 32


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = ct.TokenPositionEmbedding(VOCAB, MAX_LEN, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(ids)
        return x, self.head(x)


def main() -> None:
    torch.manual_seed(0)
    model = Model().eval()
    ids = torch.randint(0, VOCAB, (4, 16))
    with torch.no_grad():
        want_x, want_logits = model(ids)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.onnx")
        torch.onnx.export(model, (ids,), path)
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        ops = sorted({node.op_type for node in onnx.load(path).graph.node})
        x, logits = session.run(None, {session.get_inputs()[0].name: ids.numpy()})
    print("ONNX operators:", ", ".join(ops))
    assert np.array_equal(x, want_x.numpy()), "the embedding layer differs"
    np.testing.assert_allclose(logits, want_logits.numpy(), rtol=1e-5, atol=1e-5)
    print(
        f"onnxruntime: embeddings {x.shape} bitwise equal to eager cposembed, "
        f"logits within {np.abs(logits - want_logits.numpy()).max():.1e}"
    )


if __name__ == "__main__":
    main()
