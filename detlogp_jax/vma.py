"""Manual-axis (vma) typing: what lets the op run inside `jax.shard_map(..., check_vma=True)`.

Inside a shard_map with `check_vma=True` every value carries the set of mesh axes
it varies over (`jax.typeof(x).vma`). A loop carry created by `jnp.zeros` is
unvarying; a body that mixes it with varying operands makes it varying, and
the loop refuses the changed type. `like(init, *operands)` gives a carry the
operands' axes up front. A custom VJP must return, for each primal, a cotangent
with the primal's axes: `match_cotangent` sums a cotangent over the axes its
primal is replicated on (a replicated weight's gradient is the sum of every
shard's contribution) and marks missing axes as varying. Outside shard_map, or
with `check_vma=False`, every value has no axes and these are identities.
"""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(x) -> frozenset:
    """The mesh axes `x` varies over (empty outside shard_map or without vma typing)."""
    if x is None:
        return frozenset()
    aval = jax.typeof(x)
    axes = getattr(aval, "vma", None)  # the attribute's name in older jax versions
    if axes is None:
        axes = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(axes or ())


def like(init, *operands):
    """`init` (a pytree) made varying over every axis that any of `operands` varies over."""
    axes = frozenset().union(*(varying_axes(o) for o in jax.tree.leaves(operands)))
    if not axes:
        return init

    def cast(x):
        missing = axes - varying_axes(x)
        return lax.pcast(x, tuple(sorted(missing, key=str)), to="varying") if missing else x

    return jax.tree.map(cast, init)


def ordered_sum(x, axis_name):
    """Deterministic sum over a mesh axis: all_gather, then ascending rank order."""
    try:
        g = lax.all_gather(x, axis_name, axis=0, tiled=False, to="invarying")
    except (TypeError, ValueError):  # no manual-axis typing (check_vma=False)
        g = lax.all_gather(x, axis_name, axis=0, tiled=False)
    acc = g[0]
    for r in range(1, g.shape[0]):
        acc = acc + g[r]
    return acc


def match_cotangent(ct, primal, ordered_axes=()):
    """`ct` reduced to the axes of `primal`: summed over the axes it varies over and the
    primal does not (ascending rank order for `ordered_axes`, psum otherwise), and
    made varying over the primal's axes it lacks."""
    if ct is None:
        return None
    want = varying_axes(primal)
    for ax in sorted(varying_axes(ct) - want, key=str):
        ct = ordered_sum(ct, ax) if ax in ordered_axes else lax.psum(ct, ax)
    missing = want - varying_axes(ct)
    if missing:
        ct = lax.pcast(ct, tuple(sorted(missing, key=str)), to="varying")
    return ct
