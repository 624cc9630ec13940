"""Tensor (vocab) and context/data (row) parallel `linear_logp`.

The vocabulary dimension of the lm_head weight [V_pad, D] (or of a [D, V_pad]
Flax kernel, `weight_layout="dv"`, read in place) is sharded over a mesh axis
(`tp_axis`); rows of hidden/targets may be sharded over other
mesh axes (`row_axes`). The result is bitwise identical for every TP degree in
`split_bounds(V_pad).aligned_tp_degrees()` and every row sharding, and equal to
single-device `linear_logp` with the same backend, because:

* the split structure is a function of V_pad only and every TP shard edge is a
  split edge, so rank r computes exactly splits [r*n_loc, (r+1)*n_loc) of the
  single-device [N, n_split] partials, with the same backend `partials`
  (called with `col_offset = r * shard`, `shard_cols = shard`);
* the per-split (m, S) partials travel by a tiled `all_gather` in rank order:
  no arithmetic happens in transit, and every rank then holds exactly the
  single-device [N, n_split] arrays;
* the merge is the backend's `fold`, the very function single-device uses;
* z_t is all-gathered with its ownership flag and the owner's value is
  *selected*, never summed;
* with `return_entropy=True` the entropy statistic A of every split travels
  the same way (a tiled all_gather in rank order next to m and S) and the same
  fold merges it, so the entropy bytes are TP-invariant too.

No vocab statistic is ever reduced with psum / logsumexp / sum across ranks,
and none is reduced across a row axis (rows are owned, not reduced).

Gradients (not frozen by the contract, but deterministic) reuse
`detlogp_jax.grad.backward` per vocab shard with the globally folded lse; the
hidden gradient is summed over TP ranks in ascending rank order after an
all_gather, the weight/bias shard gradients are psum-ed over row axes. The
entropy's cotangent needs only the globally folded entropy; the temperature's
needs per-row sums over the vocabulary, which are added over TP ranks in
ascending rank order too. With `residuals="logits"` each rank's forward keeps
its own FP32 logits shard and its backward forms dz from it (no recompute GEMM).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from detlogp_jax import backends, inputs, vma
from detlogp_jax import contract as C
from detlogp_jax import grad as grad_lib
from detlogp_jax.api import LogpOutput, nonzero_cotangents, unwrap_primals

__all__ = [
    "TPConfig",
    "assemble_shards",
    "check_tp_geometry",
    "linear_logp_local",
    "linear_logp_tp",
    "tp_partials_and_fold",
]


# --- geometry / validation --------------------------------------------------------


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


@dataclasses.dataclass(frozen=True)
class TPConfig:
    """Static configuration of one TP call (hashable; a jit static argument)."""

    backend: str
    axis_name: Any
    tp: int
    shard: int
    vocab_size: int
    padded_vocab_size: int
    return_logits: bool
    static_offset: int | None = None  # this rank's first column when known statically
    tuning: tuple = ()
    weight_layout: str = "vd"  # "dv": the shards are [D, V_pad/tp] column blocks of a [D, V_pad] kernel
    return_entropy: bool = False  # also the entropy statistic (partials, gather, fold)
    residuals: str = "recompute"  # "logits": the forward keeps its FP32 logits shard for the backward

    @property
    def v_axis(self) -> int:
        """The weight axis that indexes the vocabulary (the one sharded over TP)."""
        return inputs.vocab_axis(self.weight_layout)

    def layout_kwargs(self) -> dict:
        return {} if self.weight_layout == "vd" else {"weight_layout": self.weight_layout}

    def entropy_kwargs(self) -> dict:
        return {"return_entropy": True} if self.return_entropy else {}


# --- per-rank forward ---------------------------------------------------------------


def _rank_partials(be, cfg: TPConfig, hidden, weight, bias, targets, inv_t, offset, return_logits=None):
    """The backend's partials for this rank's shard, with a static col_offset
    (`return_logits`: None for `cfg.return_logits`).

    A traced offset (the usual case: axis_index * shard) dispatches through
    `lax.switch` to one branch per rank; each branch calls `partials` with its
    own static `col_offset = r * shard`, so backends may specialise on it.
    """
    kw = be.tuning_kwargs(cfg.tuning)
    return_logits = cfg.return_logits if return_logits is None else return_logits

    def call(col_offset, h, w, b, t, it):
        return be.partials(
            h,
            w,
            b,
            t,
            it,
            vocab_size=cfg.vocab_size,
            padded_vocab_size=cfg.padded_vocab_size,
            col_offset=col_offset,
            shard_cols=cfg.shard,
            return_logits=return_logits,
            **cfg.layout_kwargs(),
            **cfg.entropy_kwargs(),
            **kw,
        )

    ops = (hidden, weight, bias, targets, inv_t)
    try:
        if cfg.static_offset is not None:
            return call(cfg.static_offset, *ops)
        if cfg.tp == 1:
            return call(0, *ops)
        rank = jnp.clip(offset // cfg.shard, 0, cfg.tp - 1).astype(jnp.int32)
        branches = [functools.partial(call, r * cfg.shard) for r in range(cfg.tp)]
        return lax.switch(rank, branches, *ops)
    except TypeError as e:
        if "manual axis types" not in str(e):
            raise
        raise TypeError(
            f"backend {cfg.backend!r} is not written for manual-axis (vma) typing: call the TP functions inside "
            "jax.shard_map(..., check_vma=False), or use linear_logp_tp, which does so"
        ) from e


def _gather_invariant(x, axis_name, *, axis, tiled):
    """all_gather in rank order, output typed as replicated over `axis_name`."""
    try:
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to="invarying")
    except (TypeError, ValueError):  # no manual-axis typing (check_vma=False)
        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)


def _serve_local(hidden, weight, bias, targets, inv_t, offset, cfg: TPConfig, keep_logits: bool = False):
    """One rank: local partials -> all_gather (rank order) -> the backend's fold.
    Returns (logp, lse, logits | None, entropy | None). keep_logits (the residual
    mode's forward): the shard's logits come back without `cfg.return_logits` too, from
    the same partials call (as the backend returns them; with return_logits, the
    returned array itself, -inf at columns >= vocab_size)."""
    be = backends.get(cfg.backend)
    parts = _rank_partials(be, cfg, hidden, weight, bias, targets, inv_t, offset, cfg.return_logits or keep_logits)
    m, s, z_t, owned, logits = parts[:5]
    # Tiled all_gather along the split axis: rank r's n_loc splits land at
    # [r*n_loc, (r+1)*n_loc): exactly the single-device [N, n_split] sequence.
    m_all = _gather_invariant(m, cfg.axis_name, axis=1, tiled=True)
    s_all = _gather_invariant(s, cfg.axis_name, axis=1, tiled=True)
    # z_t: select the owner's value (exactly one rank holds a real target's column).
    zt_all = _gather_invariant(z_t, cfg.axis_name, axis=0, tiled=False)  # [tp, N]
    own_all = _gather_invariant(owned, cfg.axis_name, axis=0, tiled=False)
    z_sel = jnp.zeros_like(zt_all[0])
    for r in range(cfg.tp):
        z_sel = jnp.where(own_all[r], zt_all[r], z_sel)
    entropy = None
    if cfg.return_entropy:  # the statistic travels like S: rank order, no arithmetic in transit
        a_all = _gather_invariant(parts[5], cfg.axis_name, axis=1, tiled=True)
        logp, lse, entropy = be.fold(m_all, s_all, z_sel, targets, inv_t, cfg.vocab_size, a=a_all)
    else:
        logp, lse = be.fold(m_all, s_all, z_sel, targets, inv_t, cfg.vocab_size)
    if logits is not None and cfg.return_logits:
        cols = offset + jnp.arange(cfg.shard, dtype=jnp.int32)
        logits = jnp.where((cols < cfg.vocab_size)[None, :], logits, -jnp.inf)
    return logp, lse, logits, entropy


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
    out = _serve_local(
        hidden, weight_shard, bias_shard, targets.astype(jnp.int32), inv_t.astype(jnp.float32), offset, cfg
    )
    return out if cfg.return_entropy else out[:3]


# --- differentiable core (custom_vjp, evaluated inside shard_map) ------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _local_core(hidden, weight, bias, targets, inv_t, offset, cfg):
    return _serve_local(hidden, weight, bias, targets, inv_t, offset, cfg)


def _local_core_fwd(hidden, weight, bias, targets, inv_t, offset, cfg):
    (hidden, weight, bias, targets, inv_t, offset), perturbed = unwrap_primals(
        hidden, weight, bias, targets, inv_t, offset
    )
    keep = cfg.residuals == "logits"
    out = _serve_local(hidden, weight, bias, targets, inv_t, offset, cfg, keep_logits=keep)
    logp, lse, logits, entropy = out
    if keep and not cfg.return_logits:  # kept for the backward only
        out = (logp, lse, None, entropy)
    want_t = perturbed[4]  # the temperature gradient: keep logp (its presence says it is wanted)
    saved = logits if keep else None
    return out, (hidden, weight, bias, targets, inv_t, offset, lse, entropy, logp if want_t else None, saved)


def _local_backward(
    cfg: TPConfig,
    hidden,
    weight,
    bias,
    targets,
    inv_t,
    offset,
    lse,
    g_logp,
    g_lse,
    g_logits,
    entropy=None,
    g_entropy=None,
    row_sums=False,
    logits=None,
):
    """This rank's (dh contribution, d weight shard, d bias shard) from the global lse
    (and the global entropy); with row_sums, also this shard's (plp, var) row sums
    (`grad.backward`), to be added over the TP ranks. logits: the residual mode's saved
    logits of this shard [rows, V_pad/tp] (then no recompute GEMM)."""
    off = offset
    # grad.backward works on one weight in local column coordinates. The
    # target's onehot belongs to its owner shard only; every shard carries the
    # softmax term. With dz = inv_t*(g_lse*p + g_logp*(onehot - p)), a
    # non-owner shard uses g_lse' = g_lse - g_logp and no target (onehot = 0).
    live = (targets >= 0) & (targets < cfg.vocab_size)
    g_logp = jnp.where(live, g_logp.astype(jnp.float32), 0.0)
    g_lse = g_lse.astype(jnp.float32)
    local_t = targets - off
    mine = live & (local_t >= 0) & (local_t < cfg.shard)
    t_loc = jnp.where(mine, local_t, -1).astype(jnp.int32)
    g_lse_eff = jnp.where(mine, g_lse, g_lse - g_logp)
    g_logp_eff = jnp.where(mine, g_logp, 0.0)
    vocab_loc = jnp.clip(cfg.vocab_size - off, 0, cfg.shard)
    return grad_lib.backward(
        hidden,
        weight,
        bias,
        t_loc,
        inv_t,
        lse,
        g_logp_eff,
        g_lse_eff,
        g_logits,
        vocab_size=vocab_loc,
        weight_layout=cfg.weight_layout,
        entropy=entropy,
        g_entropy=g_entropy,
        row_sums=row_sums,
        logits=logits,
    )


def _tp_inv_t_cotangent(cfg: TPConfig, sums, inv_t, lse, logp, targets, g_logp, g_lse, entropy, g_entropy):
    """The temperature's cotangent from the shards' row sums, added over TP in rank order."""
    plp, var = (None if x is None else vma.ordered_sum(x, cfg.axis_name) for x in sums)
    return grad_lib.inv_t_cotangent(
        inv_t, lse, logp, targets, cfg.vocab_size, g_logp, g_lse, entropy, g_entropy, plp, var
    )


def _zeros_if_none(g, like):
    return jnp.zeros_like(like) if g is None else g


def _local_core_bwd(cfg, res, cts):
    hidden, weight, bias, targets, inv_t, offset, lse, entropy, logp, saved = res
    g_logp, g_lse, g_logits, g_entropy = nonzero_cotangents(*cts)
    want_t = logp is not None
    out = _local_backward(
        cfg,
        hidden,
        weight,
        bias,
        targets,
        inv_t,
        offset,
        lse,
        _zeros_if_none(g_logp, lse),
        _zeros_if_none(g_lse, lse),
        g_logits,
        entropy,
        g_entropy,
        want_t,
        saved,
    )
    dh, dw, db = out[:3]
    # hidden is replicated over the TP axis: its gradient is the sum of every
    # shard's contribution, added in ascending rank order on every rank.
    dh = vma.match_cotangent(vma.ordered_sum(dh, cfg.axis_name), hidden)
    # Weight/bias shards: this rank's rows' contribution. Under check_vma=True
    # (autodiff through the shard_map boundary) they are reduced over the axes
    # the weight is replicated on; otherwise they are left row-local.
    dw = vma.match_cotangent(dw, weight)
    db = vma.match_cotangent(db, bias)
    g_inv_t = None
    if want_t:
        g_inv_t = _tp_inv_t_cotangent(cfg, out[3], inv_t, lse, logp, targets, g_logp, g_lse, entropy, g_entropy)
        g_inv_t = vma.match_cotangent(g_inv_t, inv_t)
    return dh, dw, db, None, g_inv_t, None


_local_core.defvjp(_local_core_fwd, _local_core_bwd, symbolic_zeros=True)


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
    weight_layout="vd",
    return_entropy=False,
    residuals="recompute",
):
    C.check_no_overrides(tuning)
    inputs.check_residuals(residuals)
    v_axis = inputs.vocab_axis(weight_layout)
    if vocab_size is None or padded_vocab_size is None:
        raise ValueError("vocab_size and padded_vocab_size are required inside shard_map (the global geometry)")
    tp = _axis_size(axis_name)
    shard = check_tp_geometry(padded_vocab_size, tp, vocab_size)
    if weight.ndim != 2 or weight.shape[v_axis] != shard or weight.shape[1 - v_axis] != hidden.shape[-1]:
        want = f"[V_pad/tp = {padded_vocab_size}/{tp} = {shard}, D]" if v_axis == 0 else f"[D, V_pad/tp = {shard}]"
        raise ValueError(f"weight shard must have shape {want} (weight_layout={weight_layout!r}), got {weight.shape}")
    be, fallback = backends.resolve(backend, hidden, weight, weight_layout, entropy=bool(return_entropy))
    backends.guard_strict(be, fallback)
    if not be.contract_bearing:
        raise ValueError(f"backend {be.name!r} is not contract-bearing; tensor parallelism needs partials/fold")
    static_offset, offset = None, None
    if col_offset is None:
        offset = (lax.axis_index(axis_name) * shard).astype(jnp.int32)
    elif isinstance(col_offset, numbers.Integral) and not isinstance(col_offset, bool):
        static_offset = int(col_offset)
        if static_offset % shard or not 0 <= static_offset < tp * shard:
            raise C.ContractError(
                f"col_offset {static_offset} is not a shard boundary (multiple of {shard} below {tp * shard})"
            )
        offset = jnp.int32(static_offset)
    else:
        offset = jnp.asarray(col_offset).astype(jnp.int32)
    cfg = TPConfig(
        backend=be.name,
        axis_name=axis_name,
        tp=tp,
        shard=shard,
        vocab_size=int(vocab_size),
        padded_vocab_size=int(padded_vocab_size),
        return_logits=bool(return_logits),
        static_offset=static_offset,
        tuning=inputs.tuning_key(tuning),
        weight_layout=weight_layout,
        return_entropy=bool(return_entropy),
        residuals=residuals,
    )
    return cfg, offset


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
    v_axis = inputs.vocab_axis(weight_layout)
    if bias is not None and tuple(bias.shape) != (weight_shard.shape[v_axis],):
        raise ValueError(f"bias shard must have shape ({weight_shard.shape[v_axis]},), got {bias.shape}")
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
        weight_layout=weight_layout,
        return_entropy=return_entropy,
        residuals=residuals,
    )
    t2 = inputs.narrow_targets(targets.reshape(n), cfg.vocab_size)
    inv_t = inputs.inv_temperature(temperature, n)
    logp, lse, logits, entropy = _local_core(h2, weight_shard, bias, t2, inv_t, offset, cfg)
    return LogpOutput(
        logp.reshape(lead),
        lse.reshape(lead),
        None if logits is None else logits.reshape(lead + (cfg.shard,)),
        entropy=None if entropy is None else entropy.reshape(lead),
    )


# --- global entry point --------------------------------------------------------------


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


def _specs(cfg: TPConfig, row_entries):
    tp_axis = cfg.axis_name
    return dict(
        rows=P(*row_entries),
        hidden=P(*row_entries, None),
        weight=P(tp_axis, None) if cfg.v_axis == 0 else P(None, tp_axis),
        bias=P(tp_axis),
        logits=P(*row_entries, tp_axis),
    )


def _flat_rows(x, n_lead):
    lead = x.shape[:n_lead]
    return x.reshape((math.prod(lead),) + x.shape[n_lead:])


def _tp_forward(hidden, weight, bias, targets, inv_t, cfg: TPConfig, mesh, row_entries, keep_logits=False):
    """Forward as one shard_map: per-rank partials, all_gather, fold (no reductions).
    keep_logits: the logits come back without `cfg.return_logits` too (`_serve_local`)."""
    sp = _specs(cfg, row_entries)
    has_bias = bias is not None
    with_logits = cfg.return_logits or keep_logits

    def body(h, w, t, it, *b):
        lead = h.shape[:-1]
        offset = (lax.axis_index(cfg.axis_name) * cfg.shard).astype(jnp.int32)
        logp, lse, logits, entropy = _serve_local(
            _flat_rows(h, len(lead)), w, b[0] if b else None, t.reshape(-1), it.reshape(-1), offset, cfg, keep_logits
        )
        if logits is not None:
            logits = logits.reshape(lead + (cfg.shard,))
        if entropy is not None:
            entropy = entropy.reshape(lead)
        return logp.reshape(lead), lse.reshape(lead), logits, entropy

    in_specs = (sp["hidden"], sp["weight"], sp["rows"], sp["rows"]) + ((sp["bias"],) if has_bias else ())
    out_specs = (
        sp["rows"],
        sp["rows"],
        sp["logits"] if with_logits else None,
        sp["rows"] if cfg.return_entropy else None,
    )
    # check_vma=False: backends need not carry manual-axis types; logp/lse are
    # replicated over the TP axis by construction (same gathered partials, same fold).
    f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return f(hidden, weight, targets, inv_t, *((bias,) if has_bias else ()))


def _tp_backward(cfg: TPConfig, mesh, row_entries, res, cts):
    """(dh, dW, db, d inv_t | None) of the global TP entry, one shard_map."""
    hidden, weight, bias, targets, inv_t, lse, entropy, logp, saved = res
    g_logp, g_lse, g_logits, g_entropy = nonzero_cotangents(*cts)
    g_logp_nz, g_lse_nz = g_logp, g_lse
    g_logp, g_lse = _zeros_if_none(g_logp, lse), _zeros_if_none(g_lse, lse)
    sp = _specs(cfg, row_entries)
    has_bias = bias is not None
    has_gl = g_logits is not None
    has_saved = saved is not None
    want_t = logp is not None
    # Optional row vectors, in this order: the forward's entropy, its cotangent, logp.
    opt = [("entropy", entropy), ("g_entropy", g_entropy), ("logp", logp if want_t else None)]
    opt = [(k, v) for k, v in opt if v is not None]
    row_mesh_axes = tuple(_mesh_axes_of(row_entries))

    def body(h, w, t, it, lse_rows, gp, gs, *rest):
        rest = list(rest)
        gl = rest.pop(0) if has_gl else None
        z = rest.pop(0) if has_saved else None
        b = rest.pop(0) if has_bias else None
        rows = {k: rest.pop(0).reshape(-1) for k, _ in opt}
        lead = h.shape[:-1]
        n_lead = len(lead)
        offset = (lax.axis_index(cfg.axis_name) * cfg.shard).astype(jnp.int32)
        t_flat, it_flat, lse_flat = t.reshape(-1), it.reshape(-1), lse_rows.reshape(-1)
        out = _local_backward(
            cfg,
            _flat_rows(h, n_lead),
            w,
            b,
            t_flat,
            it_flat,
            offset,
            lse_flat,
            gp.reshape(-1),
            gs.reshape(-1),
            None if gl is None else _flat_rows(gl, n_lead),
            rows.get("entropy"),
            rows.get("g_entropy"),
            want_t,
            None if z is None else _flat_rows(z, n_lead),
        )
        dh, dw, db = out[:3]
        # hidden is replicated over TP: add the shards' contributions in
        # ascending rank order (identical bytes on every rank).
        dh = vma.ordered_sum(dh, cfg.axis_name).reshape(h.shape)
        # Weight/bias shards are replicated over the row axes: the usual
        # data-parallel gradient sum (gradients are not frozen by the contract).
        if row_mesh_axes:
            dw = lax.psum(dw, row_mesh_axes)
            db = None if db is None else lax.psum(db, row_mesh_axes)
        outs = (dh, dw) + ((db,) if has_bias else ())
        if want_t:
            g_it = _tp_inv_t_cotangent(
                cfg,
                out[3],
                it_flat,
                lse_flat,
                rows["logp"],
                t_flat,
                None if g_logp_nz is None else gp.reshape(-1),
                None if g_lse_nz is None else gs.reshape(-1),
                rows.get("entropy"),
                rows.get("g_entropy"),
            )
            outs += (g_it.reshape(lead),)
        return outs

    in_specs = (sp["hidden"], sp["weight"], sp["rows"], sp["rows"], sp["rows"], sp["rows"], sp["rows"])
    args = [hidden, weight, targets, inv_t, lse, g_logp, g_lse]
    if has_gl:
        in_specs += (sp["logits"],)
        args.append(g_logits)
    if has_saved:  # the residual mode's logits, sharded like the returned ones
        in_specs += (sp["logits"],)
        args.append(saved)
    if has_bias:
        in_specs += (sp["bias"],)
        args.append(bias)
    for _, v in opt:
        in_specs += (sp["rows"],)
        args.append(v)
    out_specs = (sp["hidden"], sp["weight"]) + ((sp["bias"],) if has_bias else ()) + ((sp["rows"],) if want_t else ())
    f = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    outs = list(f(*args))
    dh, dw = outs.pop(0), outs.pop(0)
    db = outs.pop(0) if has_bias else None
    g_inv_t = outs.pop(0) if want_t else None
    return dh, dw, db, g_inv_t


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _tp_core(hidden, weight, bias, targets, inv_t, cfg, mesh, row_entries):
    return _tp_forward(hidden, weight, bias, targets, inv_t, cfg, mesh, row_entries)


def _tp_core_fwd(hidden, weight, bias, targets, inv_t, cfg, mesh, row_entries):
    (hidden, weight, bias, targets, inv_t), perturbed = unwrap_primals(hidden, weight, bias, targets, inv_t)
    keep = cfg.residuals == "logits"
    out = _tp_forward(hidden, weight, bias, targets, inv_t, cfg, mesh, row_entries, keep_logits=keep)
    logp, lse, logits, entropy = out
    if keep and not cfg.return_logits:  # kept for the backward only
        out = (logp, lse, None, entropy)
    want_t = perturbed[4]
    saved = logits if keep else None
    return out, (hidden, weight, bias, targets, inv_t, lse, entropy, logp if want_t else None, saved)


def _tp_core_bwd(cfg, mesh, row_entries, res, cts):
    dh, dw, db, g_inv_t = _tp_backward(cfg, mesh, row_entries, res, cts)
    return dh, dw, db, None, g_inv_t


_tp_core.defvjp(_tp_core_fwd, _tp_core_bwd, symbolic_zeros=True)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "row_entries"))
def _tp_impl(hidden, weight, bias, targets, inv_t, *, cfg, mesh, row_entries):
    return _tp_core(hidden, weight, bias, targets, inv_t, cfg, mesh, row_entries)


def _explicit_axes(mesh) -> bool:
    return jax.sharding.AxisType.Explicit in tuple(getattr(mesh, "axis_types", ()))


def linear_logp_tp(
    hidden,
    weight,
    targets,
    *,
    mesh,
    tp_axis: str = "tp",
    row_axes=(),
    bias=None,
    temperature=1.0,
    vocab_size: int | None = None,
    padded_vocab_size: int | None = None,
    return_logits: bool = False,
    backend: str = "auto",
    checked: bool | None = None,
    tuning: dict | None = None,
    weight_layout: str = "vd",
    return_entropy: bool = False,
    residuals: str = "recompute",
) -> LogpOutput:
    """Tensor/context-parallel `linear_logp` over `mesh`.

    weight [V_pad, D]: a global array sharded by rows over `tp_axis` (or a list
    of TP per-rank shards [V_pad/TP, D] in rank order); with
    weight_layout="dv" a [D, V_pad] kernel sharded over its V axis (or a list
    of [D, V_pad/TP] shards), read in place; bias [V_pad] likewise
    (or a list). hidden [..., D] and targets [...] (global vocab ids) are
    sharded over `row_axes` (PartitionSpec entries for hidden's leading dims,
    e.g. ("dp",) or (("dp", "cp"),) or ("dp", "cp") for [B, S, D]) and
    replicated over `tp_axis`. padded_vocab_size defaults to, and must equal,
    the weight's rows; vocab_size (real vocab) defaults to V_pad.

    Returns LogpOutput(logp [...], lse [...], logits [..., V_pad] | None) as
    global arrays: logp/lse sharded like targets (replicated over tp), logits
    sharded over `tp_axis` on the last axis, unscaled FP32, with columns >=
    vocab_size set to -inf, and with return_entropy=True the entropy [...]
    (sharded like logp). logp/lse/entropy bytes equal single-device
    `linear_logp(..., padded_vocab_size=V_pad)` for every aligned TP degree and
    row sharding. Differentiable w.r.t. hidden, weight, bias and the temperature.
    residuals: as for `linear_logp` ("logits": each rank's forward keeps its FP32 logits
    shard [N, V_pad/tp] for the backward, which then runs no recompute GEMM; with
    return_logits=True the returned shards themselves).
    """
    C.check_no_overrides(tuning)
    inputs.check_residuals(residuals)
    if tp_axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {tp_axis!r} (axes: {tuple(mesh.shape)})")
    v_axis = inputs.vocab_axis(weight_layout)
    if isinstance(weight, (list, tuple)):
        weight = assemble_shards(weight, mesh, tp_axis, what="weight", axis=v_axis)
    if isinstance(bias, (list, tuple)):
        bias = assemble_shards(bias, mesh, tp_axis, what="bias")
    hidden = jnp.asarray(hidden) if isinstance(hidden, np.ndarray) else hidden
    weight = jnp.asarray(weight) if isinstance(weight, np.ndarray) else weight
    bias = jnp.asarray(bias) if isinstance(bias, np.ndarray) else bias
    targets = jnp.asarray(targets) if isinstance(targets, (np.ndarray, list)) else targets
    vocab, padded = inputs.validate(
        hidden, weight, targets, bias, temperature, vocab_size, padded_vocab_size, weight_layout
    )
    if padded != weight.shape[v_axis]:
        raise ValueError(
            f"weight rows ({weight.shape[v_axis]}) must equal padded_vocab_size ({padded}) under TP: the weight must "
            "hold exactly V_pad rows (pad it to contract.canonical_padded_vocab)"
        )
    tp = mesh.shape[tp_axis]
    shard = check_tp_geometry(padded, tp, vocab)
    lead = tuple(hidden.shape[:-1])
    row_entries = _row_spec_entries(row_axes, len(lead))
    used = _mesh_axes_of(row_entries)
    if tp_axis in used:
        raise ValueError(f"row_axes {row_axes} must not contain the TP axis {tp_axis!r}")
    for ax in used:
        if ax not in mesh.shape:
            raise ValueError(f"row axis {ax!r} is not a mesh axis (axes: {tuple(mesh.shape)})")
    if inputs.checked_mode(checked):
        inputs.check_targets(targets, vocab)

    n = math.prod(lead)
    h_spec = jax.ShapeDtypeStruct((n, hidden.shape[-1]), hidden.dtype)
    return_entropy = bool(return_entropy)
    be, fallback = backends.resolve(backend, h_spec, weight, weight_layout, entropy=return_entropy)
    if not be.contract_bearing:
        raise ValueError(f"backend {be.name!r} is not contract-bearing; tensor parallelism needs its partials/fold")
    backends.guard_strict(be, fallback)
    prov = inputs.record_provenance(be, fallback, vocab, padded, backend, weight_layout, return_entropy)
    if n == 0:
        empty = jnp.zeros(lead, jnp.float32)
        logits = jnp.zeros(lead + (padded,), jnp.float32) if return_logits else None
        return LogpOutput(empty, empty, logits, prov, empty if return_entropy else None)
    cfg = TPConfig(
        backend=be.name,
        axis_name=tp_axis,
        tp=tp,
        shard=shard,
        vocab_size=vocab,
        padded_vocab_size=padded,
        return_logits=bool(return_logits),
        tuning=inputs.tuning_key(tuning),
        weight_layout=weight_layout,
        return_entropy=return_entropy,
        residuals=residuals,
    )
    inv_t = inputs.inv_temperature(temperature, n).reshape(lead)
    t = inputs.narrow_targets(targets, vocab)
    if _explicit_axes(mesh):
        put = lambda x, spec: jax.reshard(x, NamedSharding(mesh, spec))
        hidden = put(hidden, P(*row_entries, None))
        weight = put(weight, _specs(cfg, row_entries)["weight"])
        bias = None if bias is None else put(bias, P(tp_axis))
        t = put(t, P(*row_entries))
        inv_t = put(inv_t, P(*row_entries))
    logp, lse, logits, entropy = _tp_impl(hidden, weight, bias, t, inv_t, cfg=cfg, mesh=mesh, row_entries=row_entries)
    return LogpOutput(logp, lse, logits, prov, entropy)
