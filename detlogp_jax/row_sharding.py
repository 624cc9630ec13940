"""Rows sharded over Explicit mesh axes: `linear_logp` runs per shard in a `jax.shard_map`.

Under an Explicit-axis mesh (the default of `jax.make_mesh`) the sharding of an
operand is part of its type. Rows of the op never interact, so when hidden's
leading dims are sharded over Explicit axes the op runs inside its own
`shard_map` (check_vma=True) with the weight and bias replicated: each device
scores its own rows with the same per-row program, so the bytes equal the
unsharded call's, and the weight/bias gradients come back summed over the row
axes. Replicated operands under a mesh with Explicit axes (`jax.set_mesh`) take the same
path with no row axis (every device computes every row). A weight or bias sharded over an Explicit axis, or a hidden sharded on
its D axis, is refused with an error that points to `sharding.linear_logp_tp`
(vocab-parallel weights) or asks for a replicated D. Auto-axis meshes and
unsharded inputs take the plain path (XLA's partitioner sees ordinary ops).
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def _explicit_axes_in(x) -> tuple[object, list[tuple[int, tuple[str, ...]]]]:
    """(mesh, [(dim, explicit axis names)]) of x's type; ([]) when it has none."""
    if x is None or not hasattr(x, "shape"):
        return None, []
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    spec = getattr(sharding, "spec", None)
    if mesh is None or spec is None or not getattr(mesh, "axis_names", ()):
        return None, []
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
    out = []
    for dim, entry in enumerate(tuple(spec)):
        names = entry if isinstance(entry, tuple) else (() if entry is None else (entry,))
        explicit = tuple(a for a in names if types.get(a) == AxisType.Explicit)
        if explicit:
            out.append((dim, tuple(names)))
    return mesh, out


def explicit_rows(hidden, weight, bias):
    """(mesh, row spec entries) when hidden's leading dims are sharded over Explicit
    axes, else None. Raises for shardings the op cannot serve (trace time)."""
    for name, x in (("weight", weight), ("bias", bias)):
        _, dims = _explicit_axes_in(x)
        if dims:
            raise ValueError(
                f"linear_logp got a {name} sharded over Explicit mesh axes {[a for _, a in dims]}: a "
                f"vocab-sharded lm_head is served by sharding.linear_logp_tp(hidden, weight, targets, mesh=..., "
                f"tp_axis=...); a D-sharded one must be replicated first (jax.reshard(w, P()))"
            )
    mesh, dims = _explicit_axes_in(hidden)
    n_lead = hidden.ndim - 1
    if not dims:
        # Replicated operands under a mesh with Explicit axes (`jax.set_mesh`): the op's
        # internal arrays would be typed against that mesh (its backward's chunk walk mixes
        # them), so it runs in its own shard_map there too, each device on all the rows.
        ambient = jax.sharding.get_abstract_mesh()
        if AxisType.Explicit in tuple(getattr(ambient, "axis_types", ()) or ()):
            return ambient, (None,) * n_lead
        return None
    if any(d == n_lead for d, _ in dims):
        raise ValueError(
            "linear_logp got hidden sharded on its D axis over Explicit mesh axes; shard rows only "
            "(e.g. P('dp', None)) or replicate D (jax.reshard)"
        )
    spec = tuple(jax.typeof(hidden).sharding.spec) + (None,) * hidden.ndim
    return mesh, spec[:n_lead]


def run_per_shard(
    fn, mesh, row_entries, hidden, weight, bias, targets, temperature, *, logits: bool, entropy: bool = False
):
    """fn(hidden, weight, bias, targets, temperature) -> (logp, lse, logits | None, entropy | None),
    run per row shard: targets and a per-row temperature are resharded like hidden's rows."""
    rows = P(*row_entries)
    per_row_t = getattr(temperature, "ndim", 0) > 0
    targets = jax.reshard(targets, NamedSharding(mesh, rows))
    if per_row_t:
        temperature = jax.reshard(temperature, NamedSharding(mesh, rows))
    in_specs = (P(*row_entries, None), P(), P(), rows, rows if per_row_t else P())
    out_specs = (rows, rows, P(*row_entries, None) if logits else None, rows if entropy else None)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(
        hidden, weight, bias, targets, temperature
    )
