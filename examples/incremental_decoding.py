"""Incremental decoding of a left-padded batch: positions from the attention mask.

Prompts of different lengths are left-padded to one length, so that every row's
next token lands in the same (last) column. The padding must not count as
positions: each prompt starts at position 0 wherever its first token is, and
during decoding each row continues from its own length. ``positions_from_mask``
gives exactly that, for the prompt (prefill) and for each new token (with
``offset`` = the tokens each row has seen so far, one value per row).

The example checks every embedding against the same prompt run alone, without
padding: ``wte[ids] + P[0..n-1]``. Run: ``python examples/incremental_decoding.py``.
"""

from __future__ import annotations

import numpy as np

from cposembed import LearnedPositionEmbedding, positions_from_mask

VOCAB, MAX_LEN, DIM = 100, 64, 16
PAD = 0  # token id used for padding
rng = np.random.default_rng(0)
wte = rng.standard_normal((VOCAB, DIM)).astype(np.float32)
pe = LearnedPositionEmbedding(MAX_LEN, DIM, seed=0)
table = pe.embeddings

prompts = [[11, 12, 13, 14, 15], [21, 22, 23], [31]]
T = max(map(len, prompts))
ids = np.full((len(prompts), T), PAD)
mask = np.zeros((len(prompts), T), dtype=np.int64)
for row, prompt in enumerate(prompts):
    ids[row, T - len(prompt) :] = prompt  # left padding
    mask[row, T - len(prompt) :] = 1

# Prefill: the whole padded prompt at once.
positions = positions_from_mask(mask)
print("attention mask:\n", mask)
print("positions (padding gets 0, masked out later):\n", positions)
x = pe.add_to(wte[ids], positions)  # (B, T, d)
for row, prompt in enumerate(prompts):
    n = len(prompt)
    alone = wte[prompt] + table[:n]  # the same prompt, unpadded
    assert np.array_equal(x[row, T - n :], alone)

# Decode: one new token per row and step; each row continues at its own length.
seen = mask.sum(axis=-1)  # tokens each row has seen: [5, 3, 1]
sequences = [list(p) for p in prompts]
for step in range(4):
    new_ids = rng.integers(1, VOCAB, size=len(prompts))
    step_positions = positions_from_mask(np.ones((len(prompts), 1)), offset=seen)  # (B, 1)
    x_step = pe.add_to(wte[new_ids][:, None, :], step_positions)  # (B, 1, d)
    print(f"step {step}: positions {step_positions.ravel().tolist()}")
    for row in range(len(prompts)):
        sequences[row].append(int(new_ids[row]))
        n = len(sequences[row])
        alone = wte[sequences[row]] + table[:n]  # the whole sequence, unpadded
        assert np.array_equal(x_step[row, 0], alone[-1])
    seen += 1

# The positions of the whole padded batch, computed at once, agree with the steps.
full_mask = np.concatenate([mask, np.ones((len(prompts), 4), dtype=np.int64)], axis=1)
assert np.array_equal(positions_from_mask(full_mask)[:, T:], seen[:, None] - 4 + np.arange(4))

# Without padding every row has seen the same number of tokens, and add_to's
# scalar offset does the same job: positions offset, offset + 1, ...
tok = wte[rng.integers(1, VOCAB, size=(3, 1))]  # (B, 1, d), all rows at position 7
assert np.array_equal(pe.add_to(tok, offset=7), tok + table[7])
print("every embedding equals the unpadded prompt's")
