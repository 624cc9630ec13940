"""Vocab-parallel geometry: which TP degrees shard a padded vocabulary on the contract's
split edges, and how per-rank shards become one global array.

* `check_tp_geometry(V_pad, tp, vocab_size)`: the shard width, or an error saying why this
  TP degree cannot reproduce the one-device partials bit for bit (and which V_pad would).
* `assemble_shards(shards, mesh, tp_axis, axis=)`: a global array sharded over `tp_axis`
  from the ranks' shards in rank order (one canonical V_pad for every rank, or an error).
"""

from __future__ import annotations

import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from detlogp_jax import contract as C

__all__ = ["assemble_shards", "check_tp_geometry"]


def check_tp_geometry(padded_vocab_size: int, tp: int, vocab_size: int | None = None) -> int:
    """Validates that `tp` shards V_pad on split boundaries; returns the shard width.

    Raises ValueError when V_pad is not divisible by `tp` (or arguments are out
    of range) and ContractError when the shard edges are not split edges of
    `split_bounds(V_pad)` (then TP>1 could not reproduce the single-device
    partials bit for bit). The canonical padded vocab
    `contract.canonical_padded_vocab(vocab_size)` (a multiple of 64 * TP_MAX =
    512) is aligned for every TP degree in {1, 2, 4, 8}.
    """
    if not isinstance(tp, numbers.Integral) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"TP degree must be a positive int, got {tp!r}")
    if not isinstance(padded_vocab_size, numbers.Integral) or isinstance(padded_vocab_size, bool):
        raise TypeError(f"padded_vocab_size must be a static int, got {type(padded_vocab_size).__name__}")
    v_pad, tp = int(padded_vocab_size), int(tp)
    if v_pad < 1:
        raise ValueError(f"padded_vocab_size must be >= 1, got {v_pad}")
    if vocab_size is not None and not 1 <= int(vocab_size) <= v_pad:
        raise ValueError(f"vocab_size must be in [1, padded_vocab_size={v_pad}], got {vocab_size}")
    hint = ""
    if vocab_size is not None:
        hint = f"; pad to the canonical V_pad = contract.canonical_padded_vocab({int(vocab_size)}) = {C.canonical_padded_vocab(int(vocab_size))}"
    if v_pad % tp:
        raise ValueError(f"padded_vocab_size {v_pad} is not divisible by the TP degree {tp}{hint}")
    shard = v_pad // tp
    if tp == 1:
        return shard
    plan = C.split_bounds(v_pad)
    if shard % C.TILE_V or tp not in plan.aligned_tp_degrees():
        raise C.ContractError(
            f"TP={tp} shards of V_pad={v_pad} ({shard} columns each) do not fall on the contract's split "
            f"boundaries (aligned TP degrees for this V_pad: {plan.aligned_tp_degrees()}){hint}"
        )
    return shard


def assemble_shards(shards: Sequence, mesh, tp_axis: str = "tp", *, what: str = "weight", axis: int = 0):
    """Builds the global TP-sharded array from a list of per-rank shards (rank order),
    concatenated along `axis` (the vocabulary axis: 0 for [V, D] shards, 1 for [D, V]).

    All shards must have one shape (one canonical V_pad = rows * TP for every
    rank) and dtype; a mismatch raises ContractError. Entries for ranks whose
    devices are not addressable by this process may be None.
    """
    tp = mesh.shape[tp_axis]
    shards = list(shards)
    if len(shards) != tp:
        raise ValueError(f"got {len(shards)} {what} shards for a TP degree of {tp} (mesh axis {tp_axis!r})")
    present = [(r, s) for r, s in enumerate(shards) if s is not None]
    if not present:
        raise ValueError(f"no {what} shard given")
    r0, s0 = present[0]
    other = lambda shape: tuple(d for i, d in enumerate(shape) if i != axis)
    for r, s in present:
        if other(s.shape) != other(s0.shape) or jnp.dtype(s.dtype) != jnp.dtype(s0.dtype):
            raise ValueError(
                f"{what} shard of rank {r} has shape {tuple(s.shape)} / {s.dtype}, rank {r0} has {tuple(s0.shape)} / {s0.dtype}"
            )
        if s.shape[axis] != s0.shape[axis]:
            raise C.ContractError(
                f"mismatched canonical vocab between ranks: {what} shard of rank {r} has {s.shape[axis]} rows "
                f"(V_pad = {s.shape[axis] * tp}) but rank {r0} has {s0.shape[axis]} (V_pad = {s0.shape[axis] * tp}); "
                "every rank must hold V_pad / TP rows of one canonical padded vocab"
            )
    rows = s0.shape[axis]
    shape = tuple(rows * tp if i == axis else d for i, d in enumerate(s0.shape))
    spec = P(*[tp_axis if i == axis else None for i in range(len(shape))])

    def cb(index):
        r = (index[axis].start or 0) // rows
        if shards[r] is None:
            raise ValueError(f"{what} shard of rank {r} is needed on this process but was given as None")
        return shards[r]

    return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), cb)
