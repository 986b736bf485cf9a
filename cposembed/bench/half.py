"""Half precision: ``lookup(out=)`` of float16 and bfloat16 tables and ``scatter_add``
of a half ``grad_output`` into a float32 gradient, against the limits on their
(half) bytes; ``embed(out=)`` with bfloat16 tables against the limit and the same
call with float32 tables. Beside the scatter-add and the embed, a floor under each
is timed too: the same reads and adds into a table that stays in cache, and the
gather of the token rows alone."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .. import _membench, _threads
from ..functional import lookup, scatter_add
from ..layer import embed
from ._common import OURS, Contender, Fixture, Group, same

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
HALF_DTYPES = (BFLOAT16, np.dtype(np.float16))


def _as_float32(a: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous half array as float32s (N half elements: N // 2),
    for the limit probes, which work on float32 buffers."""
    flat = a.reshape(-1)
    return flat[: flat.size - flat.size % 2].view(np.float32)


def _probe_threads(f: Fixture, n_elements: int) -> int:
    """The threads of a kernel call of ``n_elements``: the probes run on as many."""
    return _threads.effective_num_threads(f.nt, n_elements, f.B * f.T)


def _float32(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == np.float32 else a.astype(np.float32)


def half_lookup(f: Fixture, dt: np.dtype) -> Group:
    # The half table is the float32 table rounded (also in a float64 run).
    P32, pos, nt = _float32(f.P), f.pos_rand, f.nt
    P, out = P32.astype(dt), np.empty((f.B, f.T, f.d), dt)
    out32 = np.empty((f.B, f.T, f.d), np.float32)
    probe, probe_nt = _as_float32(out), _probe_threads(f, out.size)
    cs = [
        Contender(OURS, lambda: lookup(P, pos, out=out, num_threads=nt), out.nbytes),
        Contender(
            "limit: streaming fill",
            lambda: _membench.fill(probe, probe_nt),
            out.nbytes,
            target=1.15,
        ),
        Contender("numpy np.take(out=)", lambda: np.take(P, pos, axis=0, out=out), out.nbytes),
        Contender(
            "cposembed, float32 table",
            lambda: lookup(P32, pos, out=out32, num_threads=nt),
            out32.nbytes,
        ),
    ]
    mine = lookup(P, pos, num_threads=nt)
    cs[2].check = same(mine, np.take(P, pos, axis=0))
    # Rounding commutes with indexing: the float32 rows rounded are ours.
    cs[3].check = same(mine, lookup(P32, pos).astype(dt))
    return Group(f"lookup(out=) {dt.name}", cs, f"positions {pos.shape} random, {dt.name} table")


def half_scatter(f: Fixture, dt: np.dtype) -> Group:
    """A half grad_output into a float32 gradient table (a half table's master gradient)."""
    pos, nt = f.pos_rand, f.nt
    gout = f.gout.astype(dt)
    gout32 = gout.astype(np.float32)
    G = np.zeros((f.L, f.d), np.float32)
    G32 = np.zeros((f.L, f.d), np.float32)
    # The same reads and adds into 16 rows, which stay in cache: the call's
    # cost without its table's traffic (a floor under the call).
    pos16, G16 = pos % 16, np.zeros((16, f.d), np.float32)
    probe, probe_nt = _as_float32(gout), _probe_threads(f, gout.size)
    cs = [
        Contender(OURS, lambda: scatter_add(G, gout, pos, num_threads=nt), gout.nbytes),
        Contender(
            "limit: read once",
            lambda: _membench.read_sum(probe, probe_nt),
            gout.nbytes,
            target=1.5,
        ),
        Contender(
            "cposembed, float32 grad_output",
            lambda: scatter_add(G32, gout32, pos, num_threads=nt),
            gout32.nbytes,
        ),
        Contender(
            "cposembed, the same into 16 rows (in cache)",
            lambda: scatter_add(G16, gout, pos16, num_threads=nt),
            gout.nbytes,
        ),
    ]
    a, b = np.zeros_like(G), np.zeros_like(G)
    scatter_add(a, gout, pos)
    scatter_add(b, gout32, pos)  # the half values converted exactly: the same sums
    cs[2].check = same(a, b)
    return Group(
        f"scatter_add {dt.name} into float32",
        cs,
        f"positions {pos.shape} random, {dt.name} grad_output, float32 gradient table",
    )


def half_embed(f: Fixture) -> Group:
    """The GPT-2 input layer in bfloat16, against the limit and the float32 layer."""
    wte32, wpe32, ids = _float32(f.layer.wte), _float32(f.layer.wpe), f.layer.ids
    wte, wpe = wte32.astype(BFLOAT16), wpe32.astype(BFLOAT16)
    nt, T = f.nt, f.T
    out = np.empty((f.B, f.T, f.d), BFLOAT16)
    out32 = np.empty((f.B, f.T, f.d), np.float32)
    probe, probe_nt = _as_float32(out), _probe_threads(f, out.size)
    cs = [
        Contender(OURS, lambda: embed(ids, wte, wpe, out=out, num_threads=nt), out.nbytes),
        Contender(
            "limit: streaming fill",
            lambda: _membench.fill(probe, probe_nt),
            out.nbytes,
            target=1.15,
        ),
        Contender(
            "cposembed, float32 tables",
            lambda: embed(ids, wte32, wpe32, out=out32, num_threads=nt),
            out32.nbytes,
            target=0.7,
        ),
        Contender("numpy wte[ids] + wpe[:T]", lambda: wte[ids] + wpe[:T], out.nbytes),
        # A floor under the call: its token rows' gather and the output's
        # writes, without the positions or the arithmetic.
        Contender(
            "cposembed lookup(wte, ids, out=) alone",
            lambda: lookup(wte, ids, out=out, num_threads=nt),
            out.nbytes,
        ),
    ]
    cs[3].check = same(embed(ids, wte, wpe), wte[ids] + wpe[:T])
    cs[4].check = same(lookup(wte, ids, num_threads=nt), wte[ids])
    note = f"vocab {f.vocab}, ids ({f.B}, {T}) Zipf 1.2, positions=None, bfloat16 tables"
    return Group("embed(out=) bfloat16", cs, note)


def half(f: Fixture) -> list[Group]:
    return [
        *(half_lookup(f, dt) for dt in HALF_DTYPES),
        *(half_scatter(f, dt) for dt in HALF_DTYPES),
        half_embed(f),
    ]
