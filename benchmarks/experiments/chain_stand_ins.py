"""Timing stand-ins for the forward kernel's chain (`tile_math.chain_tile_sliced`): what the
chain costs the kernel, measured by building the same kernel with less epilogue work.

Experiments only (`probe_kernel --groups chain18`, `power_probe --stand_ins`): each stand-in
gives other bytes than the contract's chain and is installed only while one lane's kernel
is built (`replaced_chain`), in that process.
"""

from __future__ import annotations

import contextlib

from pallas_kernels import tile_math


def pass1_only(m, s, load_slice, tcol0, tgt, inv_t, m_limit, full, ops, **kw):
    """Timing stand-in for tile_math.chain_tile_sliced (other bytes): pass 1 only
    (the slices read, the masked row max, the target capture: the chain's own
    `tile_math._sliced_setup`), no exp pass."""
    _, _, (_, _, m_new, _, _, z_hit) = tile_math._sliced_setup(
        m, load_slice, kw["load_step"], kw["slices_per_step"], tcol0, tgt, inv_t, m_limit, full, ops, kw["tile_cast"]
    )
    return m_new, s, z_hit


def one_slice(m, s, load_slice, tcol0, tgt, inv_t, m_limit, full, ops, **kw):
    """Timing stand-in for tile_math.chain_tile_sliced (other bytes): one [BM, 8]
    slice of the tile read and summed into S, nothing else (the hand-off consumed, no chain)."""
    x = kw["load_step"](0)[0]() if kw["load_step"] is not None else load_slice(0)
    return m, ops.add(s, tile_math.slice_sum8(x, ops, interpret=kw["interpret"])), s


class _SubForExp:
    """The kernel's ops with e = pexp(y - m') replaced by the one rounded subtraction y - m'."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def exp_diff(self, a, b):
        return self._ops.sub(a, b)


_CHAIN = tile_math.chain_tile_sliced  # the real chain, whatever is installed later


def no_exp(m, s, load_slice, tcol0, tgt, inv_t, m_limit, full, ops, **kw):
    """Timing stand-in for tile_math.chain_tile_sliced (other bytes): both passes, every read,
    multiply, mask and tree add of the chain, with the contract's exp (35 PTX instructions per
    element) replaced by one subtraction: what the exp's instructions cost."""
    return _CHAIN(m, s, load_slice, tcol0, tgt, inv_t, m_limit, full, _SubForExp(ops), **kw)


STAND_INS = {"pass 1 only": pass1_only, "one slice, no chain": one_slice, "no exp": no_exp}


@contextlib.contextmanager
def replaced_chain(stand_in):
    """tile_math.chain_tile_sliced is `stand_in` inside the block (the kernel built there
    traces it), the real chain after it."""
    real = tile_math.chain_tile_sliced
    tile_math.chain_tile_sliced = stand_in
    try:
        yield
    finally:
        tile_math.chain_tile_sliced = real
