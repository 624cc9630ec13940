"""The host side of the pallas_sm90 forward: `partials`, `forward` and `unsupported`.

`partials` (the per-split partials, for the fold and for tensor parallelism) and
`forward` (partials and fold of an unsharded head in one call, no re-layout
between the two kernels) share one launch (`_launch`). It checks the operands,
picks the launch config (`tuning.select_bucket`: an M bucket, or a forced
bucket / config), pads the rows (and the weight rows of a [V, D] weight to a
multiple of 8, the bias to whole tile groups; a [D, V] weight is read in place,
never copied), describes the launch as one frozen `ForwardLaunch` (every static
argument of the kernel build: one jit per value, so eager callers whose N pads
to the same row blocks share a compiled kernel), launches the kernel the
config's type names (`tuning.WgmmaForwardConfig` -> `sm90_forward_wgmma`,
`tuning.WsForwardConfig` -> `sm90_forward_ws`), and selects each row's z_t from
the capture of the local split that owns its target. None of these steps
changes a bit of the partials: the padding rows are independent of the real
ones and the selection is data movement.

Only `__init__` and `backend` import this module; the kernels import `common`
and `tuning`, and this module launches the fold (`sm90_fold.fold_transposed`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from detlogp_jax import contract as C
from detlogp_jax.layout import VD, WeightLayout, as_layout
from pallas_kernels import common, sm90_fold, sm90_forward_wgmma, sm90_forward_ws, tuning
from pallas_kernels.common import F32, TILE, TILE_K


@dataclasses.dataclass(frozen=True)
class ForwardLaunch:
    """The static arguments of one forward kernel launch (`ForwardLaunch.build`), as `_launch`
    derives them from the operands and the bit-neutral knobs. Frozen and hashable: it is the one
    jit-static argument of `_forward_core`.

    cfg: the launch config (its type picks the kernel); geom: the local shard's splits; n_pad:
    the kernel's padded rows; d: the hidden size; lg_rows / lg_cols: the logits array's shape;
    num_ctas: the persistent CTA count; weight_layout: the weight's layout; has_bias /
    return_logits / return_entropy: the kernel's optional operands and outputs; row_loads /
    h_box_rows: a decode call's rows passed unpadded (`sm90_forward_ws.build`; None: padded);
    interpret / interpret_params: the CPU interpreter."""

    cfg: tuning.ForwardConfig
    geom: common.ShardGeometry
    n_pad: int
    d: int
    lg_rows: int
    lg_cols: int
    num_ctas: int
    weight_layout: WeightLayout = VD
    has_bias: bool = False
    return_logits: bool = False
    return_entropy: bool = False
    row_loads: int | None = None
    h_box_rows: int | None = None
    interpret: bool = False
    interpret_params: object = None

    def build(self):
        """The kernel callable (`sm90_forward_ws.build` / `sm90_forward_wgmma.build` of these arguments)."""
        kw = dict(
            n_pad=self.n_pad,
            d=self.d,
            lg_cols=self.lg_cols,
            geom=self.geom,
            cfg=self.cfg,
            has_bias=self.has_bias,
            return_logits=self.return_logits,
            num_ctas=self.num_ctas,
            interpret=self.interpret,
            interpret_params=self.interpret_params,
            lg_rows=self.lg_rows,
            weight_layout=self.weight_layout,
            return_entropy=self.return_entropy,
        )
        if self.row_loads is not None or self.h_box_rows is not None:
            kw.update(row_loads=self.row_loads, h_box_rows=self.h_box_rows)
        return _kernel_module(self.cfg).build(**kw)


def _kernel_module(cfg: tuning.ForwardConfig):
    """The kernel module whose `build` takes this config."""
    if isinstance(cfg, tuning.WsForwardConfig):
        return sm90_forward_ws
    if isinstance(cfg, tuning.WgmmaForwardConfig):
        return sm90_forward_wgmma
    raise TypeError(f"not a forward kernel config: {cfg!r}")


@functools.partial(jax.jit, static_argnames=("launch",))
def _forward_core(*args, launch: ForwardLaunch):
    """The kernel launch, jitted on its static arguments: eager callers with different N that
    pad to the same row blocks share one compiled kernel."""
    return launch.build()(*args)


def unsupported(hidden, weight, weight_layout="vd") -> str | None:
    """Why these kernels cannot take these operands (shapes/dtypes only), or None.

    weight_layout ("vd" / "dv" or a `WeightLayout`): [V, D] or [D, V] (read in place; its V
    must be a multiple of `common.DV_COL_MULTIPLE`, since TMA tiles the vocab columns in
    64-column swizzle rows and a padded copy would be the very weight copy this layout avoids)."""
    layout = as_layout(weight_layout)
    shape_name = "[D, V]" if layout.transposed else "[V, D]"
    if getattr(hidden, "ndim", None) != 2 or getattr(weight, "ndim", None) != 2:
        return f"hidden must be [N, D] and weight {shape_name}, got {hidden.shape}, {weight.shape}"
    if hidden.dtype != jnp.bfloat16 or weight.dtype != jnp.bfloat16:
        return (
            f"pallas_sm90 supports bf16 hidden and weight only (got {hidden.dtype}, {weight.dtype}); "
            "route other dtypes to the reference backend"
        )
    d = hidden.shape[1]
    if layout.hidden_size(weight) != d:
        return f"hidden size mismatch: hidden {hidden.shape} vs weight {weight.shape} ({shape_name})"
    if d % TILE_K or d == 0:
        return f"pallas_sm90 needs the hidden size D to be a positive multiple of {TILE_K}, got {d}"
    if layout.transposed and layout.vocab_rows(weight) % common.DV_COL_MULTIPLE:
        return (
            f"pallas_sm90 reads a [D, V] weight in place only when V is a multiple of {common.DV_COL_MULTIPLE} "
            f"(TMA tiles the vocab columns), got V={layout.vocab_rows(weight)}; pad the kernel's columns once "
            "(e.g. to padded_vocab_size) or pass the [V, D] weight with weight_layout='vd'"
        )
    return None


def _check_inputs(hidden, weight, bias, targets, inv_t, layout: WeightLayout, geom: common.ShardGeometry):
    why = unsupported(hidden, weight, layout)
    if why:
        raise ValueError(why)
    n = hidden.shape[0]
    v_rows = layout.vocab_rows(weight)
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != v_rows):
        raise ValueError(f"bias must be [{v_rows}], got {bias.shape}")
    if targets.shape != (n,) or inv_t.shape != (n,):
        raise ValueError(f"targets and inv_t must be [{n}], got {targets.shape}, {inv_t.shape}")
    vocab_axis = "columns" if layout.transposed else "rows"
    if v_rows > geom.shard_cols:
        raise ValueError(f"weight has {v_rows} {vocab_axis} but the shard has only {geom.shard_cols} columns")
    if geom.col_offset + v_rows < min(geom.vocab_size, geom.col_offset + geom.shard_cols):
        raise ValueError(
            f"weight {vocab_axis} [{geom.col_offset}, {geom.col_offset + v_rows}) do not cover the real vocabulary "
            f"columns of the shard (vocab_size={geom.vocab_size})"
        )


def _pad_rows(x, rows, value=0):
    pad = rows - x.shape[0]
    if pad == 0:
        return x
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=value)


def _row_operands(hidden, targets, inv_t, cfg, n_pad: int, unpadded: bool, interpret: bool):
    """(hidden, targets, inv_t as the kernel reads them, row_loads, h_box_rows).

    Padded (the default of `partials`, and every call of several row blocks): all three padded
    to n_pad rows (hidden with zeros, targets with IGNORE_INDEX, inv_t with 1.0). Unpadded, where
    the config is a ws kernel and the N rows leave part of its one row block empty (a decode
    call): targets / inv_t as they are, read by scalar loads (`sm90_forward_ws.build(row_loads=N)`),
    hidden with N rows read with a box of N rounded up to 8 rows (`h_box_rows`; N rounded up to
    8 where N >= 8 is not a multiple of 8: Mosaic's tiled TMA takes no other row count; a 64-row
    box mostly past the array made the kernel 5% slower, docs/PERFORMANCE.md). Interpret mode pads
    hidden to the box (the interpreter's slices are bounded)."""
    n = hidden.shape[0]
    n8 = -(-n // 8) * 8
    if unpadded and isinstance(cfg, tuning.WsForwardConfig) and tuning.one_row_block(n, cfg):
        box = n8 if n8 < cfg.cta_rows else None
        h_rows = n_pad if box is None else (box if interpret or (n >= 8 and n % 8) else n)
        return _pad_rows(hidden, h_rows), targets, inv_t, n, box
    targets_p, inv_t_p = _pad_rows(targets, n_pad, C.IGNORE_INDEX), _pad_rows(inv_t, n_pad, 1.0)
    return _pad_rows(hidden, n_pad), targets_p, inv_t_p, None, None


def _owner_z_t(zt_t, targets_p, geom: common.ShardGeometry, v_rows: int, n_pad: int):
    """(z_t, owned) over the padded rows: each row's z_t from the capture of the local split
    holding its target's tile (a pure function of the target; data movement), +0 where the
    shard does not own the target. As in the reference backend, a target is owned by the shard
    if its column has a weight row here (targets >= vocab_size that do are captured too; the
    fold turns them into NaN either way); a padding row's target is IGNORE_INDEX, never owned."""
    local_tiles = -(-geom.shard_cols // TILE)
    tile_to_split = np.zeros((local_tiles,), np.int32)
    for js, (s0, e0) in enumerate(zip(geom.local_starts, geom.local_ends)):
        tile_to_split[s0 - geom.col_offset // TILE : e0 - geom.col_offset // TILE] = js
    tg = _pad_rows(targets_p, n_pad, C.IGNORE_INDEX)
    owned = (tg >= geom.col_offset) & (tg < geom.col_offset + v_rows)
    local_tile = jnp.clip((tg - geom.col_offset) // TILE, 0, local_tiles - 1)
    owner = jnp.asarray(tile_to_split)[local_tile]
    z_t = jnp.where(owned, zt_t[owner, jnp.arange(n_pad)], jnp.asarray(0.0, F32))
    return z_t, owned


def _launch(
    hidden,
    weight,
    bias,
    targets,
    inv_t,
    *,
    vocab_size: int,
    padded_vocab_size: int,
    col_offset: int = 0,
    shard_cols: int | None = None,
    return_logits: bool = False,
    logits_cols: int | None = None,
    bucket: "str | tuning.ForwardConfig | None" = None,
    num_ctas: int | None = None,
    interpret: bool = False,
    interpret_params=None,
    weight_layout="vd",
    return_entropy: bool = False,
    unpadded: bool = False,
):
    """One forward launch for the local shard (`partials` and `forward` present its result).

    Args:
      hidden: [N, D] bf16. weight: W [Vl, D] bf16 (weight_layout "vd"), row r is global
        column col_offset + r; or W.T [D, Vl] ("dv", a Flax/Tunix kernel, read in place: no
        transposed copy), column r is global column col_offset + r, Vl a multiple of 64. Vl
        may be smaller than the shard width (vocab columns past Vl read as zero through TMA
        out-of-bounds fill and are padding lanes anyway, since they must lie at or past
        vocab_size).
      bias: [Vl] f32 or None. targets: [N] int32 global vocab ids (-100 ignore).
      inv_t: [N] f32, fl(1/T) per row.
      vocab_size / padded_vocab_size: the real and the canonical padded vocab;
        the split plan is `contract.split_bounds(padded_vocab_size)`.
      col_offset, shard_cols: the local shard [col_offset, col_offset + shard_cols)
        (defaults to the whole padded vocab); its edges must be split edges
        (`ContractError` otherwise).
      return_logits: also return the FP32 unscaled, post-bias logits [N, Vl] from the same
        accumulator (the partials are bitwise the same).
      logits_cols: return only the first logits_cols logits columns ([N, logits_cols]; e.g.
        the real vocabulary of an unsharded head). When it is a multiple of the kernel's
        column multiple (`tuning.logits_width`) the kernel writes that width directly (no
        [N, Vl] buffer and no slicing copy of it); otherwise the full width is sliced.
      bucket: force a launch bucket of `tuning.BUCKETS` (bit-neutral; a
        `tuning.WgmmaForwardConfig` or `tuning.WsForwardConfig` is accepted for experiments).
      num_ctas: force the persistent CTA count (bit-neutral).
      interpret: run under `plgpu.InterpretGPUParams` on CPU.
      weight_layout: "vd" / "dv" or a `detlogp_jax.layout.WeightLayout` (a static kernel build
        argument). The kernel copies the same K slice of the same vocab columns into shared
        memory in either layout and runs the same wgmma sequence per accumulator (m64nNk16, k
        ascending, one FP32 accumulator) and the same epilogue; only how B reaches shared memory
        (and wgmma's B operand major-ness) differs, so the partials and logits are the same
        bytes in both layouts (tests/gpu/test_pallas_gpu.py, tests/gpu/h200_layout.sh).
      return_entropy: the kernels also carry the entropy statistic A of
        `linear-logp-entropy-v1` (docs/CONTRACT.md section 9) next to S through the same
        tiles, tree and chain; m, S, z_t and the logits are the same bytes either way. False
        launches exactly the kernels without the statistic.
      unpadded: a call whose rows leave part of an epilogue-warpgroup kernel's one row block
        empty passes them unpadded (`_row_operands`); `targets_p` / `inv_t_p` are then the [N]
        arrays themselves. The partials of the real rows are the same bytes.

    Returns:
      a `_Launched`: m, s (and A) split-major over the padded rows, z_t (the raw target logit
      captured by the one tile owning the target; 0 where `owned` is False), owned, the logits
      [N, logits_cols or Vl] f32 or None, and the targets / inv_t the kernel read.
    """
    hidden = jnp.asarray(hidden)
    weight = jnp.asarray(weight)
    targets = jnp.asarray(targets).astype(jnp.int32)
    inv_t = jnp.asarray(inv_t, F32)
    if bias is not None:
        bias = jnp.asarray(bias, F32)
    layout = as_layout(weight_layout)
    geom = common.shard_geometry(vocab_size, padded_vocab_size, col_offset, shard_cols)
    _check_inputs(hidden, weight, bias, targets, inv_t, layout, geom)
    n, d = hidden.shape
    v_rows = layout.vocab_rows(weight)  # the weight's vocab entries (rows of [V, D], columns of [D, V])
    # TMA views the weight as 8-row tiles: a row count that is not a multiple
    # of 8 needs a padded copy (rare: real vocabularies are multiples of 8).
    # A "dv" weight is never copied: its columns are a multiple of 64 (checked).
    v_rows8 = -(-v_rows // 8) * 8
    if v_rows8 != v_rows:
        weight = _pad_rows(weight, v_rows8)  # (bias is padded to the full width below)
    cfg = tuning.select_bucket(n, bucket)
    n_pad = tuning.padded_rows(n, cfg)
    if num_ctas is None:
        num_ctas = 2 if interpret else tuning.default_num_sms() * cfg.ctas_per_sm
    hidden_in, targets_p, inv_t_p, row_loads, h_box_rows = _row_operands(
        hidden, targets, inv_t, cfg, n_pad, unpadded, interpret
    )
    args = [hidden_in, weight]
    if bias is not None:
        width = (-(-geom.shard_cols // TILE) + geom.n_groups * geom.tiles_per_group) * TILE
        args.append(jnp.pad(bias, (0, width - bias.shape[0])))
    args += [targets_p, inv_t_p]
    want_cols = v_rows if logits_cols is None else int(logits_cols)
    if not 1 <= want_cols <= v_rows:
        raise ValueError(f"logits_cols must be in [1, {v_rows}], got {logits_cols}")
    launch = ForwardLaunch(
        cfg=cfg,
        geom=geom,
        n_pad=n_pad,
        d=d,
        # Logits rows: TMA clips rows past the array, but the array's row count must be a
        # multiple of 8 (or < 8) for the tiled store.
        lg_rows=n if (n % 8 == 0 or n < 8) else -(-n // 8) * 8,
        lg_cols=tuning.logits_width(cfg, want_cols, v_rows, return_logits),  # else sliced after
        num_ctas=tuning.persistent_ctas(n_pad, geom.n_local, cfg, int(num_ctas)),
        weight_layout=layout,
        has_bias=bias is not None,
        return_logits=return_logits,
        return_entropy=bool(return_entropy),
        row_loads=row_loads,
        h_box_rows=h_box_rows,
        interpret=interpret,
        interpret_params=interpret_params,
    )
    outs = _forward_core(*args, launch=launch)
    m_t, s_t, zt_t = outs[:3]
    a_t = outs[3] if return_entropy else None
    outs = outs[:3] + outs[4:] if return_entropy else outs  # the logits (if any) follow A
    logits = None
    if return_logits:
        logits = outs[3]
        if logits.shape != (n, want_cols):
            logits = logits[:n, :want_cols]
    z_t, owned = _owner_z_t(zt_t, targets_p, geom, v_rows, n_pad)
    return _Launched(n, m_t, s_t, a_t, z_t, owned, logits, targets_p, inv_t_p, zt_t)


class _Launched(NamedTuple):
    """What one forward launch gives, before any re-layout: the partials split-major and
    over the kernel's padded rows (m, s, a [n_local, n_pad]; z_t, owned [n_pad]; rows >= n are
    padding rows), the logits [n, want_cols] or None, the targets / inv_t the kernel read, and
    the kernel's raw target captures zt_t [n_local, n_pad] (z_t is their owner's entry; XLA
    computes z_t only where it is used)."""

    n: int
    m_t: jax.Array
    s_t: jax.Array
    a_t: jax.Array | None
    z_t: jax.Array
    owned: jax.Array
    logits: jax.Array | None
    targets_p: jax.Array
    inv_t_p: jax.Array
    zt_t: jax.Array


def partials(hidden, weight, bias, targets, inv_t, **kw):
    """Per-split LSE partials of z = hidden @ W.T (+ bias) for the local shard: see `_launch`
    for the arguments. Returns (m [N, n_local], s [N, n_local], z_t [N] f32, owned [N] bool,
    logits [N, Vl] f32 or None), and with return_entropy=True a sixth array, A [N, n_local]."""
    r = _launch(hidden, weight, bias, targets, inv_t, **kw)
    n = r.n
    out = (r.m_t[:, :n].T, r.s_t[:, :n].T, r.z_t[:n], r.owned[:n], r.logits)
    return out + (r.a_t[:, :n].T,) if r.a_t is not None else out


def forward(hidden, weight, bias, targets, inv_t, *, vocab_size: int, fold_cfg=None, unpadded: bool = True, **kw):
    """fold(partials(...)) of an unsharded head in one call: (logp [N], lse [N], logits or None,
    entropy [N] or None (with return_entropy=True)), the same bytes as
    `sm90_fold.fold(*partials(...)[:3], targets, inv_t, vocab_size, a=...)` (the same two
    kernels on the same rows), without the re-layout between them: the fold reads the
    forward's split-major partials over the forward's padded rows (the padding rows are
    folded too and dropped; every row's fold is independent of the others), so at decode
    sizes no partials are transposed, sliced or padded again; and it forms each row's z_t
    from the forward's raw split captures itself (`sm90_fold.zt_from_splits`: the same
    bytes as `_launch`'s owner select, without that XLA op).

    Arguments: `_launch`'s, and unpadded: a call whose rows fit one row block of the kernel and
    are fewer (a decode call) hands the kernels its [N] targets / inv_t and N-row hidden as they
    are and the fold writes [N]: no row pads, no output slices, the same bytes (H200: golden
    replay and the unpadded GPU test; docs/PERFORMANCE.md). False pads those rows as `partials`
    does (the same bytes; for comparisons). fold_cfg: the fold's `tuning.FoldConfig`
    (bit-neutral; default `tuning.fold_for(N)`: `DECODE_FOLD` at most `tuning.DECODE_ROWS`
    rows, `FOLD` above)."""
    r = _launch(hidden, weight, bias, targets, inv_t, vocab_size=vocab_size, unpadded=bool(unpadded), **kw)
    out = sm90_fold.fold_transposed(
        r.m_t,
        r.s_t,
        None,
        r.targets_p,
        r.inv_t_p,
        vocab_size,
        aT=r.a_t,
        ztT=r.zt_t,
        n_rows=r.targets_p.shape[0],
        interpret=kw.get("interpret", False),
        interpret_params=kw.get("interpret_params"),
        cfg=tuning.fold_for(r.n, fold_cfg),
    )
    logp, lse = out[0][: r.n], out[1][: r.n]
    entropy = out[2][: r.n] if r.a_t is not None else None
    return logp, lse, r.logits, entropy


__all__ = ["ForwardLaunch", "forward", "partials", "unsupported"]
