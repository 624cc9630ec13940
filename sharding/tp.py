"""Tensor (vocab) and context/data (row) parallel placement of `linear_logp`.

The vocabulary dimension of the lm_head weight [V_pad, D] (or of a [D, V_pad] Flax kernel,
`weight_layout="dv"`, read in place) is sharded over a mesh axis (`tp_axis`); rows of
hidden / targets may be sharded over other mesh axes (`row_axes`). Every rank runs the op
pipeline of one device (`detlogp_jax.pipeline.op`, the same config object and custom_vjp
as `linear_logp`) on its rows and its vocabulary shard, with a `sharding.merge.TPShards`
that gathers the ranks' split partials in rank order before the backend's own fold. The
result is bitwise identical for every TP degree in `split_bounds(V_pad).aligned_tp_degrees()`
and every row sharding, and equal to one-device `linear_logp` with the same backend,
because the split structure is a function of V_pad only, every TP shard edge is a split
edge, partials travel without arithmetic and the merge is the one-device fold
(`sharding.merge`).

Entry points:
* `linear_logp_tp(hidden, weight, targets, *, mesh, tp_axis, row_axes, **options)`: global
  arrays in and out; runs its own `jax.shard_map` (vma-typed, `check_vma=True`);
* `linear_logp_local(...)`: differentiable, inside the caller's shard_map
  (`check_vma=True` or `False`);
* `tp_partials_and_fold(...)`: the non-differentiable forward, inside the caller's shard_map.

Gradients (not frozen by the contract, but deterministic) run the pipeline's backward per
vocab shard with the globally folded lse: the hidden gradient is summed over the TP ranks in
ascending rank order after an all_gather; the weight / bias shards' gradients are summed over
the row axes they are replicated on (vma typing). With `residuals="logits"` each rank's
forward keeps its own FP32 logits shard and its backward forms dz from it.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from detlogp_jax import api, backends, inputs, pipeline
from detlogp_jax import contract as C
from detlogp_jax.api import LogpOutput
from detlogp_jax.layout import VD, WeightLayout, as_layout
from sharding.geometry import assemble_shards, check_tp_geometry
from sharding.merge import TPShards

__all__ = ["linear_logp_local", "linear_logp_tp", "tp_partials_and_fold"]


# --- inside the caller's shard_map ---------------------------------------------------


def _axis_size(axis_name) -> int:
    try:
        return int(lax.axis_size(axis_name))
    except Exception as e:  # not inside shard_map / unknown axis
        raise ValueError(
            f"axis {axis_name!r} is not bound: call inside jax.shard_map over a mesh with that axis"
        ) from e


def _local_config(
    hidden,
    weight,
    axis_name,
    *,
    vocab_size,
    padded_vocab_size,
    col_offset,
    return_logits,
    backend,
    tuning,
    weight_layout: WeightLayout = VD,
    return_entropy=False,
    residuals="recompute",
):
    """(OpConfig, this rank's first column as a traced int32) of a call inside shard_map."""
    C.check_no_overrides(tuning)
    inputs.check_residuals(residuals)
    layout = as_layout(weight_layout)
    if vocab_size is None or padded_vocab_size is None:
        raise ValueError("vocab_size and padded_vocab_size are required inside shard_map (the global geometry)")
    tp = _axis_size(axis_name)
    shard = check_tp_geometry(padded_vocab_size, tp, vocab_size)
    v_axis = layout.vocab_axis
    if weight.ndim != 2 or weight.shape[v_axis] != shard or weight.shape[1 - v_axis] != hidden.shape[-1]:
        want = f"[V_pad/tp = {padded_vocab_size}/{tp} = {shard}, D]" if v_axis == 0 else f"[D, V_pad/tp = {shard}]"
        raise ValueError(f"weight shard must have shape {want} (weight_layout={layout.name!r}), got {weight.shape}")
    be, fallback = backends.resolve(backend, hidden, weight, layout, entropy=bool(return_entropy))
    backends.guard_strict(be, fallback)
    if not be.contract_bearing:
        raise ValueError(f"backend {be.name!r} is not contract-bearing; tensor parallelism needs partials/fold")
    static_offset = None
    if isinstance(col_offset, numbers.Integral) and not isinstance(col_offset, bool):
        static_offset = int(col_offset)
        if static_offset % shard or not 0 <= static_offset < tp * shard:
            raise C.ContractError(
                f"col_offset {static_offset} is not a shard boundary (multiple of {shard} below {tp * shard})"
            )
    shards = TPShards(axis_name, tp, shard, static_offset)
    offset = shards.offset() if col_offset is None or static_offset is not None else jnp.asarray(col_offset)
    cfg = pipeline.OpConfig(
        backend=be.name,
        vocab_size=int(vocab_size),
        padded_vocab_size=int(padded_vocab_size),
        return_logits=bool(return_logits),
        layout=layout,
        return_entropy=bool(return_entropy),
        residuals=residuals,
        tuning=inputs.tuning_key(tuning),
        shards=shards,
    )
    return cfg, offset.astype(jnp.int32)


def tp_partials_and_fold(
    hidden,
    weight_shard,
    bias_shard,
    targets,
    inv_t,
    *,
    axis_name,
    vocab_size: int,
    padded_vocab_size: int,
    col_offset=None,
    return_logits: bool = False,
    backend: str = "auto",
    tuning: dict | None = None,
    weight_layout: str = "vd",
    return_entropy: bool = False,
):
    """Non-differentiable TP forward for use inside the caller's `jax.shard_map`.

    hidden [N, D] (this rank's rows, replicated over `axis_name`),
    weight_shard [V_pad/tp, D] (global rows [col_offset, col_offset + V_pad/tp);
    [D, V_pad/tp] with weight_layout="dv"),
    bias_shard [V_pad/tp] or None, targets [N] int32 global ids, inv_t [N] f32
    (= fl(1/T), e.g. `detlogp_jax.inputs.inv_temperature`). col_offset: None (derived from
    `lax.axis_index(axis_name)`), a traced int scalar, or a static int (only
    meaningful where the program is not shared by several TP ranks, e.g. TP=1).
    Returns (logp [N], lse [N], logits [N, V_pad/tp] | None); logp/lse are
    replicated over `axis_name`. With return_entropy=True a fourth element, the
    entropy [N] (replicated), follows.
    """
    cfg, offset = _local_config(
        hidden,
        weight_shard,
        axis_name,
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size,
        col_offset=col_offset,
        return_logits=return_logits,
        backend=backend,
        tuning=tuning,
        weight_layout=weight_layout,
        return_entropy=return_entropy,
    )
    out = pipeline.forward(
        hidden, weight_shard, bias_shard, targets.astype(jnp.int32), inv_t.astype(jnp.float32), offset, cfg
    )
    return out if cfg.return_entropy else out[:3]


def linear_logp_local(
    hidden,
    weight_shard,
    targets,
    *,
    axis_name="tp",
    bias=None,
    temperature=1.0,
    vocab_size: int,
    padded_vocab_size: int,
    col_offset=None,
    return_logits: bool = False,
    backend: str = "auto",
    tuning: dict | None = None,
    weight_layout: str = "vd",
    return_entropy: bool = False,
    residuals: str = "recompute",
) -> LogpOutput:
    """Differentiable per-rank `linear_logp` for use inside the caller's `jax.shard_map`.

    hidden [..., D]: this rank's rows (replicated over `axis_name`); targets
    [...] global ids; weight_shard [V_pad/tp, D] (or [D, V_pad/tp] with
    weight_layout="dv") and bias [V_pad/tp] hold global vocab rows
    [col_offset, col_offset + V_pad/tp); col_offset defaults to
    `lax.axis_index(axis_name) * V_pad/tp`. Returns LogpOutput(logp, lse,
    logits) with logp/lse [...] replicated over `axis_name` and logits
    [..., V_pad/tp] this rank's unscaled FP32 columns (-inf at columns >=
    vocab_size), and with return_entropy=True the entropy [...] (replicated over
    `axis_name`). Differentiable w.r.t. hidden, the weight and bias shards and the
    temperature. Call it inside `jax.shard_map` with jax's default
    `check_vma=True` (the loop carries and cotangents carry the mesh axes: the
    weight shard's gradient comes back summed over the axes it is replicated
    on) or with `check_vma=False` (then sum it over the row axes yourself), and
    take gradients inside the shard_map body. residuals: as for `linear_logp`
    ("logits": the forward keeps this rank's FP32 logits shard [N, V_pad/tp] for the
    backward, which then runs no recompute GEMM).
    """
    lead = hidden.shape[:-1]
    n = math.prod(lead)
    inputs.validate_temperature(temperature, targets.shape)
    if tuple(targets.shape) != tuple(lead):
        raise ValueError(f"targets shape {targets.shape} must equal hidden's leading shape {lead}")
    layout = as_layout(weight_layout)
    if bias is not None and tuple(bias.shape) != (layout.vocab_rows(weight_shard),):
        raise ValueError(f"bias shard must have shape ({layout.vocab_rows(weight_shard)},), got {bias.shape}")
    h2 = hidden.reshape(n, hidden.shape[-1])
    cfg, offset = _local_config(
        h2,
        weight_shard,
        axis_name,
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size,
        col_offset=col_offset,
        return_logits=return_logits,
        backend=backend,
        tuning=tuning,
        weight_layout=layout,
        return_entropy=return_entropy,
        residuals=residuals,
    )
    t2 = inputs.narrow_targets(targets.reshape(n), cfg.vocab_size)
    inv_t = inputs.inv_temperature(temperature, n)
    logp, lse, logits, entropy = pipeline.op(h2, weight_shard, bias, t2, inv_t, offset, cfg)
    return LogpOutput(
        logp.reshape(lead),
        lse.reshape(lead),
        None if logits is None else logits.reshape(lead + (cfg.shards.shard,)),
        entropy=None if entropy is None else entropy.reshape(lead),
    )


# --- global arrays: the op's own shard_map --------------------------------------------


def _row_spec_entries(row_axes, n_lead: int):
    row_axes = tuple(row_axes) if isinstance(row_axes, (tuple, list)) else (row_axes,)
    if len(row_axes) > n_lead:
        raise ValueError(f"row_axes {row_axes} has more entries than hidden's {n_lead} leading dims")
    return row_axes + (None,) * (n_lead - len(row_axes))


def _mesh_axes_of(entries):
    out = []
    for e in entries:
        if e is None:
            continue
        out.extend(e if isinstance(e, tuple) else (e,))
    return out


def _specs(cfg: pipeline.OpConfig, row_entries) -> dict:
    """The PartitionSpecs of a global TP call: rows over the row axes, the vocabulary over TP."""
    tp_axis = cfg.shards.axis_name
    return dict(
        rows=P(*row_entries),
        hidden=P(*row_entries, None),
        weight=cfg.layout.spec(tp_axis),
        bias=P(tp_axis),
        logits=P(*row_entries, tp_axis),
    )


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "row_entries"))
def _tp_impl(hidden, weight, bias, targets, inv_t, *, cfg, mesh, row_entries):
    """The op per rank, as one vma-typed shard_map: each rank's rows against its vocabulary
    shard (`pipeline.op`; differentiable through the shard_map)."""
    sp = _specs(cfg, row_entries)
    has_bias = bias is not None

    def body(h, w, t, it, *b):
        lead = h.shape[:-1]
        h2 = h.reshape((math.prod(lead), h.shape[-1]))
        out = pipeline.op(h2, w, b[0] if b else None, t.reshape(-1), it.reshape(-1), cfg.shards.offset(), cfg)
        logp, lse, logits, entropy = out
        if logits is not None:
            logits = logits.reshape(lead + (cfg.shards.shard,))
        if entropy is not None:
            entropy = entropy.reshape(lead)
        return logp.reshape(lead), lse.reshape(lead), logits, entropy

    in_specs = (sp["hidden"], sp["weight"], sp["rows"], sp["rows"]) + ((sp["bias"],) if has_bias else ())
    out_specs = (
        sp["rows"],
        sp["rows"],
        sp["logits"] if cfg.return_logits else None,
        sp["rows"] if cfg.return_entropy else None,
    )
    f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return f(hidden, weight, targets, inv_t, *((bias,) if has_bias else ()))


def _explicit_axes(mesh) -> bool:
    return jax.sharding.AxisType.Explicit in tuple(getattr(mesh, "axis_types", ()))


def linear_logp_tp(hidden, weight, targets, *, mesh, tp_axis: str = "tp", row_axes=(), **options) -> LogpOutput:
    """Tensor/context-parallel `linear_logp` over `mesh`.

    weight [V_pad, D]: a global array sharded by rows over `tp_axis` (or a list
    of TP per-rank shards [V_pad/TP, D] in rank order); with
    weight_layout="dv" a [D, V_pad] kernel sharded over its V axis (or a list
    of [D, V_pad/TP] shards), read in place; bias [V_pad] likewise
    (or a list). hidden [..., D] and targets [...] (global vocab ids) are
    sharded over `row_axes` (PartitionSpec entries for hidden's leading dims,
    e.g. ("dp",) or (("dp", "cp"),) or ("dp", "cp") for [B, S, D]) and
    replicated over `tp_axis`. `options`: the keywords of `linear_logp` (bias,
    temperature, vocab_size, padded_vocab_size, return_logits, backend, checked,
    tuning, weight_layout, return_entropy, residuals), with its meanings;
    padded_vocab_size defaults to, and must equal, the weight's rows.

    Returns LogpOutput(logp [...], lse [...], logits [..., V_pad] | None) as
    global arrays: logp/lse sharded like targets (replicated over tp), logits
    sharded over `tp_axis` on the last axis, unscaled FP32, with columns >=
    vocab_size set to -inf, and with return_entropy=True the entropy [...]
    (sharded like logp). logp/lse/entropy bytes equal one-device
    `linear_logp(..., padded_vocab_size=V_pad)` for every aligned TP degree and
    row sharding. Differentiable w.r.t. hidden, weight, bias and the temperature.
    residuals="logits": each rank's forward keeps its FP32 logits shard
    [N, V_pad/tp] for the backward, which then runs no recompute GEMM.
    """
    options = api.Options(**options)
    if tp_axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {tp_axis!r} (axes: {tuple(mesh.shape)})")
    layout = as_layout(options.weight_layout)
    bias = options.bias
    if isinstance(weight, (list, tuple)):
        weight = assemble_shards(weight, mesh, tp_axis, what="weight", axis=layout.vocab_axis)
    if isinstance(bias, (list, tuple)):
        bias = assemble_shards(bias, mesh, tp_axis, what="bias")
    hidden = jnp.asarray(hidden) if isinstance(hidden, np.ndarray) else hidden
    weight = jnp.asarray(weight) if isinstance(weight, np.ndarray) else weight
    bias = jnp.asarray(bias) if isinstance(bias, np.ndarray) else bias
    targets = jnp.asarray(targets) if isinstance(targets, (np.ndarray, list)) else targets
    tp = mesh.shape[tp_axis]
    lead = tuple(hidden.shape[:-1])
    row_entries = _row_spec_entries(row_axes, len(lead))
    used = _mesh_axes_of(row_entries)
    if tp_axis in used:
        raise ValueError(f"row_axes {row_axes} must not contain the TP axis {tp_axis!r}")
    for ax in used:
        if ax not in mesh.shape:
            raise ValueError(f"row axis {ax!r} is not a mesh axis (axes: {tuple(mesh.shape)})")

    def shards(vocab, padded):
        if padded != layout.vocab_rows(weight):
            raise ValueError(
                f"weight rows ({layout.vocab_rows(weight)}) must equal padded_vocab_size ({padded}) under TP: the "
                "weight must hold exactly V_pad rows (pad it to contract.canonical_padded_vocab)"
            )
        return TPShards(tp_axis, tp, check_tp_geometry(padded, tp, vocab))

    cfg, prov = api.configure(hidden, weight, targets, options._replace(bias=bias), shards=shards)
    n = math.prod(lead)
    if n == 0:
        return api.empty_output(lead, cfg, prov, cfg.padded_vocab_size)
    inv_t = inputs.inv_temperature(options.temperature, n).reshape(lead)
    t = inputs.narrow_targets(targets, cfg.vocab_size)
    if _explicit_axes(mesh):
        put = lambda x, spec: jax.reshard(x, NamedSharding(mesh, spec))
        sp = _specs(cfg, row_entries)
        hidden, weight, t, inv_t = (
            put(hidden, sp["hidden"]),
            put(weight, sp["weight"]),
            put(t, sp["rows"]),
            put(inv_t, sp["rows"]),
        )
        bias = None if bias is None else put(bias, sp["bias"])
    logp, lse, logits, entropy = _tp_impl(hidden, weight, bias, t, inv_t, cfg=cfg, mesh=mesh, row_entries=row_entries)
    return LogpOutput(logp, lse, logits, prov, entropy)
