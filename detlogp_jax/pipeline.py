"""The op pipeline: one config and one custom_vjp behind every entry point.

`linear_logp` (one device, its rows sharded or not), the tensor-parallel entries of the
`sharding` package (each rank of a vocab-parallel call) and the integrations all run
`op(hidden, weight, bias, targets, inv_t, offset, cfg)` on the rows and vocabulary
columns that one device holds:

  forward   the backend's split partials of this device's columns -> with vocab shards,
            their rank-ordered merge -> the backend's fold (the contract's bytes; one
            device with a fused forward: both in one call, the same bytes)
  backward  `grad.backward` on this device's columns, the target's one-hot on its owner
            shard only -> with vocab shards, d_hidden and the temperature's row sums added
            over the ranks in ascending rank order -> cotangents typed like their primals
            (`vma.match_cotangent`: inside a vma-typed shard_map a replicated operand's
            gradient is summed over the axes its rows vary over)

`OpConfig.shards` is None when this device holds the whole vocabulary (TP = 1 without a
mesh axis), or a `VocabShards`: where this device's columns sit among the ranks and how
the ranks' partials travel. The tensor-parallel package supplies it (it holds the mesh,
the specs and the merge); nothing here knows a mesh. Rows never interact, so a row's
bytes do not depend on the other rows, the batch size or the row sharding.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from detlogp_jax import backends, vma
from detlogp_jax import grad as grad_lib
from detlogp_jax.layout import VD, WeightLayout

__all__ = ["OpConfig", "VocabShards", "forward", "op"]


class VocabShards:
    """This device's part of a vocabulary split over `tp` ranks of `shard` columns each,
    and how the ranks' per-split partials travel (implemented by the tensor-parallel
    package; instances are frozen and hashable: they ride in the jit-static `OpConfig`).

    Contract of the methods, all called inside the caller's shard_map over the ranks:
    * `gather_splits(x)`: [N, n_local] -> [N, tp * n_local], every rank's splits in rank
      order, no arithmetic in transit (so the result is the one-device [N, n_split] array);
    * `select_owner(z_t, owned)`: the raw target logit of the rank that owns the row's
      target (selected, never summed);
    * `rank_sum(x)`: the sum over the ranks in ascending rank order, the same bytes on
      every rank;
    * `offset()`: this rank's first global column, a traced int32 scalar.
    `static_offset`: the first column when it is known statically (then no per-rank
    dispatch is traced).
    """

    tp: int
    shard: int
    static_offset: int | None

    def offset(self):
        raise NotImplementedError

    def gather_splits(self, x):
        raise NotImplementedError

    def select_owner(self, z_t, owned):
        raise NotImplementedError

    def rank_sum(self, x):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class OpConfig:
    """Everything static about one call of the op (hashable: a jit static argument).

    backend: the registered backend's name; vocab_size / padded_vocab_size: the real and
    the canonical padded vocabulary (the split structure is a function of the latter);
    return_logits: also return the FP32 logits; layout: the weight's `WeightLayout`;
    return_entropy: also the entropy (`linear-logp-entropy-v1`); residuals: "recompute" or
    "logits" (what the forward keeps for the backward, `detlogp_jax.grad`); tuning: the
    bit-neutral knobs as a sorted tuple; shards: None (this device holds every column) or
    this rank's `VocabShards`.
    """

    backend: str
    vocab_size: int
    padded_vocab_size: int
    return_logits: bool = False
    layout: WeightLayout = VD
    return_entropy: bool = False
    residuals: str = "recompute"
    tuning: tuple = ()
    shards: VocabShards | None = None

    @property
    def columns(self) -> int:
        """The vocabulary columns this device holds."""
        return self.padded_vocab_size if self.shards is None else self.shards.shard

    def backend_kwargs(self, be: backends.Backend) -> dict:
        """The keywords every backend call of this config takes (the layout and the entropy
        flag are omitted at their defaults: older backends lack them)."""
        kw = dict(vocab_size=self.vocab_size, padded_vocab_size=self.padded_vocab_size)
        if self.layout is not VD:
            kw["weight_layout"] = self.layout
        if self.return_entropy:
            kw["return_entropy"] = True
        return kw | be.tuning_kwargs(self.tuning)


def forward(hidden, weight, bias, targets, inv_t, offset, cfg: OpConfig, keep_logits: bool = False):
    """(logp [N], lse [N], logits | None, entropy [N] | None) of this device's rows.

    hidden [N, D], targets [N] int32 global ids, inv_t [N] f32 = fl(1/T); weight (and bias)
    hold this device's columns (`cfg.columns` of them, in `cfg.layout`); offset: this
    rank's first column (traced int32) with vocab shards, else None.
    logits: with `cfg.return_logits`, one device's [N, vocab_size] (the real vocabulary),
    a rank's [N, shard] with -inf at columns >= vocab_size. keep_logits (the residual
    mode's forward, contract backends): the logits come back without `return_logits` too,
    from the same launch (logp/lse bytes never depend on it), as [N, columns]: the
    backward slices its chunks in place."""
    be = backends.get(cfg.backend)
    if not be.contract_bearing:
        return _lane_forward(be, hidden, weight, bias, targets, inv_t, cfg)
    kw = cfg.backend_kwargs(be) | dict(return_logits=cfg.return_logits or keep_logits)
    if cfg.shards is None:
        # logits_cols: the backend writes the real vocabulary's columns only, so the serving
        # entry never copies an [N, V_rows] array to drop the padding columns.
        kw["logits_cols"] = cfg.vocab_size if cfg.return_logits else None
        if be.fused_forward is not None:  # the bytes of the partials + fold below, in one call
            return be.fused_forward(hidden, weight, bias, targets, inv_t, **kw)
        parts = be.partials(hidden, weight, bias, targets, inv_t, **kw)
    else:
        parts = _shard_partials(be, cfg, (hidden, weight, bias, targets, inv_t), offset, kw)
    m, s, z_t, owned, logits = parts[:5]
    a = parts[5] if cfg.return_entropy else None
    if cfg.shards is not None:
        # Rank r's splits land at [r * n_local, (r + 1) * n_local): the one-device arrays.
        m, s = cfg.shards.gather_splits(m), cfg.shards.gather_splits(s)
        z_t = cfg.shards.select_owner(z_t, owned)
        a = None if a is None else cfg.shards.gather_splits(a)
        if logits is not None and cfg.return_logits:
            cols = offset + jnp.arange(cfg.shards.shard, dtype=jnp.int32)
            logits = jnp.where((cols < cfg.vocab_size)[None, :], logits, -jnp.inf)
    entropy = None
    if a is not None:
        logp, lse, entropy = be.fold(m, s, z_t, targets, inv_t, cfg.vocab_size, a=a)
    else:
        logp, lse = be.fold(m, s, z_t, targets, inv_t, cfg.vocab_size)
    return logp, lse, logits, entropy


def _lane_forward(be, hidden, weight, bias, targets, inv_t, cfg: OpConfig):
    """A non-contract lane (the XLA baseline): the backend's own forward, one device."""
    kw = cfg.backend_kwargs(be) | dict(return_logits=cfg.return_logits)
    kw.pop("padded_vocab_size")
    out = be.forward(hidden, weight, bias, targets, inv_t, **kw)
    logp, lse, logits = out[:3]
    entropy = out[3] if cfg.return_entropy else None
    if logits is not None:
        logits = logits[:, : cfg.vocab_size]
    return logp, lse, logits, entropy


def _shard_partials(be, cfg: OpConfig, ops, offset, kw):
    """The backend's partials of this rank's columns, with a static col_offset.

    A traced offset (the usual case: axis_index * shard) dispatches through `lax.switch`
    to one branch per rank; each branch calls `partials` with its own static
    `col_offset = r * shard`, so backends may specialise on it."""
    shards = cfg.shards

    def call(col_offset, *args):
        return be.partials(*args, col_offset=col_offset, shard_cols=shards.shard, **kw)

    try:
        if shards.static_offset is not None:
            return call(shards.static_offset, *ops)
        if shards.tp == 1:
            return call(0, *ops)
        rank = jnp.clip(offset // shards.shard, 0, shards.tp - 1).astype(jnp.int32)
        return lax.switch(rank, [functools.partial(call, r * shards.shard) for r in range(shards.tp)], *ops)
    except TypeError as e:
        if "manual axis types" not in str(e):
            raise
        raise TypeError(
            f"backend {cfg.backend!r} is not written for manual-axis (vma) typing: call the tensor-parallel "
            "functions inside jax.shard_map(..., check_vma=False), or use sharding.linear_logp_tp"
        ) from e


def _unwrap_primals(*primals):
    """(values, perturbed flags) of a custom_vjp fwd's primals under symbolic zeros."""
    is_p = lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal)
    values = jax.tree.map(lambda x: x.value if is_p(x) else x, primals, is_leaf=is_p)
    flags = [any(getattr(x, "perturbed", False) for x in jax.tree.leaves(p, is_leaf=is_p)) for p in primals]
    return values, flags


def _nonzero_cotangents(*cts):
    """Cotangents with symbolic zeros as None."""
    return tuple(None if isinstance(c, jax.custom_derivatives.SymbolicZero) else c for c in cts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def op(hidden, weight, bias, targets, inv_t, offset, cfg: OpConfig):
    """The differentiable op on one device's rows and columns: `forward`'s outputs.

    Differentiable w.r.t. hidden, weight, bias and inv_t (the chunked backward of
    `detlogp_jax.grad`; the entropy's cotangent joins the logp / lse ones in the same
    pass); targets and offset get no cotangent. Contract backends only: a non-contract
    lane differentiates `forward` with JAX's autodiff instead."""
    return forward(hidden, weight, bias, targets, inv_t, offset, cfg)


def _op_fwd(hidden, weight, bias, targets, inv_t, offset, cfg: OpConfig):
    (hidden, weight, bias, targets, inv_t, offset), perturbed = _unwrap_primals(
        hidden, weight, bias, targets, inv_t, offset
    )
    keep = cfg.residuals == "logits"
    out = forward(hidden, weight, bias, targets, inv_t, offset, cfg, keep_logits=keep)
    logp, lse, logits, entropy = out
    if keep and not cfg.return_logits:  # kept for the backward only
        out = (logp, lse, None, entropy)
    # The temperature gradient needs the forward's logp; its presence says it is wanted.
    want_t = perturbed[4]
    saved = logits if keep else None
    return out, (hidden, weight, bias, targets, inv_t, offset, lse, entropy, logp if want_t else None, saved)


def _op_bwd(cfg: OpConfig, res, cts):
    hidden, weight, bias, targets, inv_t, offset, lse, entropy, logp, saved = res
    g_logp, g_lse, g_logits, g_entropy = _nonzero_cotangents(*cts)
    want_t = logp is not None
    zero_if_none = lambda g: jnp.zeros_like(lse) if g is None else g
    args = (hidden, weight, bias, targets, inv_t, lse, zero_if_none(g_logp), zero_if_none(g_lse), g_logits)
    kw = dict(entropy=entropy, g_entropy=g_entropy, row_sums=want_t, logits=saved, weight_layout=cfg.layout)
    if cfg.shards is None:
        out = grad_lib.backward(*args, vocab_size=cfg.vocab_size, dz=backends.get(cfg.backend).dz, **kw)
    else:
        out = _shard_backward(cfg, offset, *args, **kw)
    dh, dw, db = out[:3]
    if cfg.shards is not None:
        # hidden is replicated over the vocab ranks: its gradient is every shard's
        # contribution, added in ascending rank order (identical bytes on every rank).
        dh = cfg.shards.rank_sum(dh)
    g_inv_t = None
    if want_t:
        plp, var = out[3]
        if cfg.shards is not None:  # per-row sums over this shard's columns: added over the ranks
            plp, var = (None if x is None else cfg.shards.rank_sum(x) for x in (plp, var))
        g_inv_t = grad_lib.inv_t_cotangent(
            inv_t, lse, logp, targets, cfg.vocab_size, g_logp, g_lse, entropy, g_entropy, plp, var
        )
        g_inv_t = vma.match_cotangent(g_inv_t, inv_t)
    # Under vma typing (inside shard_map) a replicated weight's gradient is the sum over
    # the axes its rows' contributions vary over.
    dh, dw, db = vma.match_cotangent(dh, hidden), vma.match_cotangent(dw, weight), vma.match_cotangent(db, bias)
    return dh, dw, db, None, g_inv_t, None


def _shard_backward(cfg: OpConfig, offset, hidden, weight, bias, targets, inv_t, lse, g_logp, g_lse, g_logits, **kw):
    """This rank's (dh contribution, d weight shard, d bias shard[, row sums]) from the
    globally folded lse (and entropy), in the shard's own column coordinates.

    The target's one-hot belongs to its owner shard only; every shard carries the softmax
    term. With dz = inv_t * (g_lse * p + g_logp * (onehot - p)), a non-owner shard uses
    g_lse' = g_lse - g_logp and no target (onehot = 0). (The backend's fused dz kernel is
    not used: it takes one device's absolute targets and vocabulary.)"""
    shard = cfg.shards.shard
    live = (targets >= 0) & (targets < cfg.vocab_size)
    g_logp = jnp.where(live, g_logp.astype(jnp.float32), 0.0)
    g_lse = g_lse.astype(jnp.float32)
    local_t = targets - offset
    mine = live & (local_t >= 0) & (local_t < shard)
    t_loc = jnp.where(mine, local_t, -1).astype(jnp.int32)
    g_lse_eff = jnp.where(mine, g_lse, g_lse - g_logp)
    g_logp_eff = jnp.where(mine, g_logp, 0.0)
    vocab_loc = jnp.clip(cfg.vocab_size - offset, 0, shard)
    return grad_lib.backward(
        hidden, weight, bias, t_loc, inv_t, lse, g_logp_eff, g_lse_eff, g_logits, vocab_size=vocab_loc, **kw
    )


op.defvjp(_op_fwd, _op_bwd, symbolic_zeros=True)
