"""The host side of the pallas_sm90 forward: `partials`, `forward` and `unsupported`.

`partials` (the per-split partials, for the fold and for tensor parallelism) and
`forward` (partials and fold of an unsharded head in one call, no re-layout
between the two kernels) share one launch (`_launch`). It checks the operands,
picks the launch config (`tuning.select_bucket`: an M bucket, or a forced
bucket / config), pads the rows (and the weight rows
of a [V, D] weight to a multiple of 8, the bias to whole tile groups; a [D, V]
weight, `weight_layout="dv"`, is read in place, never copied), launches the kernel the
config's type names (`tuning.WgmmaForwardConfig` -> `sm90_forward_wgmma`,
`tuning.WsForwardConfig` -> `sm90_forward_ws`; one jit per padded row count, so
eager callers whose N pads to the same row blocks share a compiled kernel),
and selects each row's z_t from the capture of the local split that owns its
target. None of these steps changes a bit of the partials: the padding rows
are independent of the real ones and the selection is data movement.

Only `__init__` and `backend` import this module; the kernels import `common`
and `tuning`, and this module launches the fold (`sm90_fold.fold_transposed`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from detlogp_jax import contract as C
from pallas_kernels import common, sm90_fold, sm90_forward_wgmma, sm90_forward_ws, tuning
from pallas_kernels.common import F32, TILE, TILE_K

_STATIC = (
    "n_pad",
    "d",
    "lg_cols",
    "geom",
    "cfg",
    "has_bias",
    "return_logits",
    "num_ctas",
    "interpret",
    "interpret_params",
    "lg_rows",
    "weight_layout",
    "fold",
    "fold_rows",
    "return_entropy",
    "row_tma",
    "row_loads",
    "h_box_rows",
)


# Calls of at most this many rows (the decode bucket's) fold with `tuning.DECODE_FOLD` (when set
# and no fold_cfg is given).
DECODE_ROWS = tuning.BUCKET_TABLE[0][0]


def _kernel_module(cfg: tuning.ForwardConfig):
    """The kernel module whose `build` takes this config."""
    if isinstance(cfg, tuning.WsForwardConfig):
        return sm90_forward_ws
    if isinstance(cfg, tuning.WgmmaForwardConfig):
        return sm90_forward_wgmma
    raise TypeError(f"not a forward kernel config: {cfg!r}")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _forward_core(*args, cfg, **static):
    """The kernel launch, jitted on the padded row count: eager callers with
    different N that pad to the same row blocks share one compiled kernel."""
    return _kernel_module(cfg).build(cfg=cfg, **static)(*args)


def unsupported(hidden, weight, weight_layout: str = "vd") -> str | None:
    """Why these kernels cannot take these operands (shapes/dtypes only), or None.

    weight_layout: "vd" (weight [V, D]) or "dv" (weight [D, V], read in place; its
    V must be a multiple of `common.DV_COL_MULTIPLE`, since TMA tiles the vocab
    columns in 64-column swizzle rows and a padded copy would be the very weight
    copy this layout avoids)."""
    dv = common.check_weight_layout(weight_layout)
    shape_name = "[D, V]" if dv else "[V, D]"
    if getattr(hidden, "ndim", None) != 2 or getattr(weight, "ndim", None) != 2:
        return f"hidden must be [N, D] and weight {shape_name}, got {hidden.shape}, {weight.shape}"
    if hidden.dtype != jnp.bfloat16 or weight.dtype != jnp.bfloat16:
        return (
            f"pallas_sm90 supports bf16 hidden and weight only (got {hidden.dtype}, {weight.dtype}); "
            "route other dtypes to the reference backend"
        )
    d = hidden.shape[1]
    if weight.shape[0 if dv else 1] != d:
        return f"hidden size mismatch: hidden {hidden.shape} vs weight {weight.shape} ({shape_name})"
    if d % TILE_K or d == 0:
        return f"pallas_sm90 needs the hidden size D to be a positive multiple of {TILE_K}, got {d}"
    if dv and weight.shape[1] % common.DV_COL_MULTIPLE:
        return (
            f"pallas_sm90 reads a [D, V] weight in place only when V is a multiple of {common.DV_COL_MULTIPLE} "
            f"(TMA tiles the vocab columns), got V={weight.shape[1]}; pad the kernel's columns once (e.g. to "
            "padded_vocab_size) or pass the [V, D] weight with weight_layout='vd'"
        )
    return None


def _check_inputs(hidden, weight, bias, targets, inv_t, weight_layout):
    why = unsupported(hidden, weight, weight_layout)
    if why:
        raise ValueError(why)
    n = hidden.shape[0]
    v_rows = weight.shape[1 if weight_layout == "dv" else 0]
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != v_rows):
        raise ValueError(f"bias must be [{v_rows}], got {bias.shape}")
    if targets.shape != (n,) or inv_t.shape != (n,):
        raise ValueError(f"targets and inv_t must be [{n}], got {targets.shape}, {inv_t.shape}")


def _pad_rows(x, rows, value=0):
    pad = rows - x.shape[0]
    if pad == 0:
        return x
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=value)


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
    weight_layout: str = "vd",
    return_entropy: bool = False,
    unpadded: bool = False,
    fold_in_kernel: "tuning.FoldConfig | None" = None,
):
    """One forward launch for the local shard (`partials` and `forward` present its result).

    Args:
      hidden: [N, D] bf16. weight: W [Vl, D] bf16 (weight_layout="vd"), row r
        is global column col_offset + r; or W.T [D, Vl] (weight_layout="dv",
        a Flax/Tunix kernel, read in place: no transposed copy), column r is
        global column col_offset + r, Vl a multiple of 64. Vl may be smaller
        than the shard width (vocab columns past Vl read as zero through TMA
        out-of-bounds fill and are padding lanes anyway, since they must lie at
        or past vocab_size).
      bias: [Vl] f32 or None. targets: [N] int32 global vocab ids (-100 ignore).
      inv_t: [N] f32, fl(1/T) per row.
      vocab_size / padded_vocab_size: the real and the canonical padded vocab;
        the split plan is `contract.split_bounds(padded_vocab_size)`.
      col_offset, shard_cols: the local shard [col_offset, col_offset +
        shard_cols) (defaults to the whole padded vocab); its edges must be
        split edges (`ContractError` otherwise).
      return_logits: also return the FP32 unscaled, post-bias logits [N, Vl]
        from the same accumulator (the partials are bitwise the same).
      logits_cols: return only the first logits_cols logits columns ([N,
        logits_cols]; e.g. the real vocabulary of an unsharded head). When it is
        a multiple of 8 the kernel writes that width directly (no [N, Vl] buffer
        and no slicing copy of it); otherwise the full width is sliced.
      bucket: force a launch bucket of `tuning.BUCKETS` (bit-neutral; a
        `tuning.WgmmaForwardConfig` or `tuning.WsForwardConfig` is accepted for
        experiments).
      num_ctas: force the persistent CTA count (bit-neutral).
      interpret: run under `plgpu.InterpretGPUParams` on CPU.
      weight_layout: "vd" or "dv" (a static kernel build argument). The kernel
        copies the same K slice of the same vocab columns into shared memory in
        either layout and runs the same wgmma sequence per accumulator
        (m64nNk16, k ascending, one FP32 accumulator) and the same epilogue; only
        how B reaches shared memory (and wgmma's B operand major-ness) differs, so
        the partials and logits are to be the same bytes in both layouts (the
        H200 checks it: tests/gpu/test_pallas_gpu.py, tests/gpu/h200_layout.sh).
        The dv weight is never padded or copied (`unsupported` refuses a V that
        is not a multiple of 64).
      return_entropy: a static kernel build argument: the kernels also carry
        the entropy statistic A of `linear-logp-entropy-v1` (docs/CONTRACT.md
        section 9) next to S through the same tiles, tree and chain, and it is
        returned too (`partials`' sixth array, as `detlogp_jax.reference.partials`
        gives it); m, S, z_t and the logits are the same bytes either way. False
        launches exactly the kernels without the statistic.
      unpadded: where the config is an epilogue-warpgroup kernel (`tuning.WsForwardConfig`)
        and N is not a multiple of its rows, no row copies padded to the kernel's rows. In one
        row block (a decode call: one epilogue warpgroup, no cluster) targets and inv_t go in
        as they are, read by scalar loads (`sm90_forward_ws.build(row_loads=N)`), and hidden
        with N rows (rounded up to 8 where N >= 8 is not a multiple of 8: Mosaic's tiled TMA
        takes no other row count) read with a box of N rounded up to 8 rows (`h_box_rows`; a
        64-row box mostly past the array made the kernel 5% slower, fifteenth session;
        interpret mode pads hidden to the box). In several row blocks hidden, targets and
        inv_t go in with N rounded up to a multiple of 8 rows (`row_tma=True`: TMA fills the
        rows past them with zeros; interpret mode: padded rows, the same kernel). The partials
        of the real rows are the same bytes; `targets_p` / `inv_t_p` are then those shorter
        arrays.
      fold_in_kernel: a `tuning.FoldConfig` for `forward(single_launch=True)`: where the config
        is an epilogue-warpgroup kernel with one epilogue warpgroup, the head is unsharded and
        the fold of that config is staged (`sm90_fold.kernel_plan`), the forward kernel folds its
        own partials (`sm90_forward_ws.build(fold=)`) and `folded` holds logp, lse (and the
        entropy) over its padded rows; elsewhere `folded` is None (the caller folds). Not with
        `unpadded`.

    Returns:
      a `_Launched`: m, s (and A) split-major over the padded rows, z_t (the
      raw target logit captured by the one tile owning the target; 0 where
      `owned` is False), owned, the logits [N, logits_cols or Vl] f32 or None,
      and the padded targets / inv_t the kernel read.
    """
    hidden = jnp.asarray(hidden)
    weight = jnp.asarray(weight)
    targets = jnp.asarray(targets).astype(jnp.int32)
    inv_t = jnp.asarray(inv_t, F32)
    if bias is not None:
        bias = jnp.asarray(bias, F32)
    dv = common.check_weight_layout(weight_layout)
    _check_inputs(hidden, weight, bias, targets, inv_t, weight_layout)
    geom = common.shard_geometry(vocab_size, padded_vocab_size, col_offset, shard_cols)
    n, d = hidden.shape
    v_rows = weight.shape[1 if dv else 0]  # the weight's vocab entries (rows of [V, D], columns of [D, V])
    vocab_axis = "columns" if dv else "rows"
    shard_end = geom.col_offset + geom.shard_cols
    if v_rows > geom.shard_cols:
        raise ValueError(f"weight has {v_rows} {vocab_axis} but the shard has only {geom.shard_cols} columns")
    if geom.col_offset + v_rows < min(geom.vocab_size, shard_end):
        raise ValueError(
            f"weight {vocab_axis} [{geom.col_offset}, {geom.col_offset + v_rows}) do not cover the real vocabulary "
            f"columns of the shard (vocab_size={geom.vocab_size})"
        )
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
    num_ctas = tuning.persistent_ctas(n_pad, geom.n_local, cfg, int(num_ctas))
    local_tiles = -(-geom.shard_cols // TILE)
    # Rows of hidden / targets / inv_t as passed: N rounded up to a multiple of 8 (TMA reads
    # hidden in 8-row tiles, and Mosaic refuses other counts >= 8; with 1 or 3 rows of hidden,
    # targets and inv_t (4 / 12 bytes of a 1-D TMA operand) the H200 gave other bytes and a 13%
    # slower kernel at M=1, with 8 they were right: benchmarks/results/h200_2026-12-02d/).
    ws = isinstance(cfg, tuning.WsForwardConfig)
    n8 = -(-n // 8) * 8
    # One row block (a decode call): targets / inv_t as they are, read by scalar loads
    # (`sm90_forward_ws.build(row_loads=N)`), hidden with N rows (N < 8 or a multiple of 8; else
    # rounded up to 8) read with a box of its rows rounded up to 8 (`h_box_rows`). Interpret mode:
    # hidden padded to the box (the interpreter's slices are bounded).
    row_loads = bool(unpadded) and ws and tuning.one_row_block(n, cfg) and cfg.epilogue_wgs == 1
    row_tma = bool(unpadded) and ws and not row_loads and n8 < n_pad
    kernel_kw = {}
    if row_loads:
        box = n8 if n8 < cfg.cta_rows else None
        h_rows = n_pad if box is None else (box if interpret or (n >= 8 and n % 8) else n)
        args = [_pad_rows(hidden, h_rows), weight]
        targets_p, inv_t_p = targets, inv_t
        kernel_kw = {"row_loads": n, **({"h_box_rows": box} if box is not None else {})}
    else:
        rows_in = n8 if row_tma and not interpret else n_pad
        args = [_pad_rows(hidden, rows_in), weight]
        targets_p, inv_t_p = _pad_rows(targets, rows_in, C.IGNORE_INDEX), _pad_rows(inv_t, rows_in, 1.0)
        if row_tma:
            kernel_kw = {"row_tma": True}
    if bias is not None:
        width = (local_tiles + geom.n_groups * geom.tiles_per_group) * TILE
        args.append(jnp.pad(bias, (0, width - bias.shape[0])))
    args += [targets_p, inv_t_p]
    # Logits rows: TMA clips rows past the array, but the array's row count
    # must be a multiple of 8 (or < 8) for the tiled store.
    lg_rows = n if (n % 8 == 0 or n < 8) else -(-n // 8) * 8
    want_cols = v_rows if logits_cols is None else int(logits_cols)
    if not 1 <= want_cols <= v_rows:
        raise ValueError(f"logits_cols must be in [1, {v_rows}], got {logits_cols}")
    lg_cols = tuning.logits_width(cfg, want_cols, v_rows, return_logits)  # else sliced after
    fold_kw = {}
    if fold_in_kernel is not None and not kernel_kw:
        plan = sm90_fold.kernel_plan(
            n_split=geom.n_local,
            vocab_size=vocab_size,
            interpret=interpret,
            cfg=fold_in_kernel,
            entropy=bool(return_entropy),
        )
        unsharded = geom.col_offset == 0 and geom.n_local == C.split_bounds(padded_vocab_size).n_split
        ws_one = isinstance(cfg, tuning.WsForwardConfig) and cfg.epilogue_wgs == 1 and cfg.cluster == 1
        if plan is not None and unsharded and ws_one and n_pad % plan.rows == 0:
            fold_kw = {"fold": plan, "fold_rows": -(-n // plan.rows) * plan.rows}  # (whole row blocks)
    outs = _forward_core(
        *args,
        n_pad=n_pad,
        d=d,
        lg_cols=lg_cols,
        geom=geom,
        cfg=cfg,
        has_bias=bias is not None,
        return_logits=return_logits,
        num_ctas=num_ctas,
        interpret=interpret,
        interpret_params=interpret_params,
        lg_rows=lg_rows,
        weight_layout=weight_layout,
        return_entropy=bool(return_entropy),
        **kernel_kw,
        **fold_kw,
    )
    folded = None
    if fold_kw:
        k = 3 if return_entropy else 2
        outs, folded = outs[:-k], outs[-k:]
    m_t, s_t, zt_t = outs[:3]
    a_t = outs[3] if return_entropy else None
    outs = outs[:3] + outs[4:] if return_entropy else outs  # the logits (if any) follow A
    logits = None
    if return_logits:
        logits = outs[3]
        if logits.shape != (n, want_cols):
            logits = logits[:n, :want_cols]
    # Owner of each target: the local split holding its tile (a pure function
    # of the target); z_t is selected from that split's capture (data movement).
    tile_to_split = np.zeros((local_tiles,), np.int32)
    for js, (s0, e0) in enumerate(zip(geom.local_starts, geom.local_ends)):
        tile_to_split[s0 - geom.col_offset // TILE : e0 - geom.col_offset // TILE] = js
    # As in the reference backend: a target is owned by the shard if its column
    # has a weight row here (targets >= vocab_size that do are captured too;
    # the fold turns them into NaN either way).
    # (Over the padded rows: a padding row's target is IGNORE_INDEX, never owned.)
    tg = _pad_rows(targets_p, n_pad, C.IGNORE_INDEX)
    owned = (tg >= geom.col_offset) & (tg < geom.col_offset + v_rows)
    local_tile = jnp.clip((tg - geom.col_offset) // TILE, 0, local_tiles - 1)
    owner = jnp.asarray(tile_to_split)[local_tile]
    z_t = jnp.where(owned, zt_t[owner, jnp.arange(n_pad)], jnp.asarray(0.0, F32))
    return _Launched(n, m_t, s_t, a_t, z_t, owned, logits, targets_p, inv_t_p, zt_t, folded)


class _Launched(NamedTuple):
    """What one forward launch gives, before any re-layout: the partials split-major and
    over the kernel's padded rows (m, s, a [n_local, n_pad]; z_t, owned and the padded
    targets / inv_t the kernel read [n_pad]; rows >= n are padding rows), the logits
    [n, want_cols] or None, and the kernel's raw target captures zt_t [n_local, n_pad] (z_t
    is their owner's entry; XLA computes z_t only where it is used), and with `fold_in_kernel`
    the kernel's own fold (logp, lse[, entropy]) over its padded rows, or None."""

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
    folded: tuple | None = None


def partials(hidden, weight, bias, targets, inv_t, **kw):
    """Per-split LSE partials of z = hidden @ W.T (+ bias) for the local shard: see `_launch`
    for the arguments. Returns (m [N, n_local], s [N, n_local], z_t [N] f32, owned [N] bool,
    logits [N, Vl] f32 or None), and with return_entropy=True a sixth array, A [N, n_local]."""
    r = _launch(hidden, weight, bias, targets, inv_t, **kw)
    n = r.n
    out = (r.m_t[:, :n].T, r.s_t[:, :n].T, r.z_t[:n], r.owned[:n], r.logits)
    return out + (r.a_t[:, :n].T,) if r.a_t is not None else out


def forward(
    hidden, weight, bias, targets, inv_t, *, vocab_size: int, fold_cfg=None, single_launch=None, unpadded=None, **kw
):
    """fold(partials(...)) of an unsharded head in one call: (logp [N], lse [N], logits or None,
    entropy [N] or None (with return_entropy=True)), the same bytes as
    `sm90_fold.fold(*partials(...)[:3], targets, inv_t, vocab_size, a=...)` (the same two
    kernels on the same rows), without the re-layout between them: the fold reads the
    forward's split-major partials over the forward's padded rows (the padding rows are
    folded too and dropped; every row's fold is independent of the others), so at decode
    sizes no partials are transposed, sliced or padded again; and it forms each row's z_t
    from the forward's raw split captures itself (`sm90_fold.zt_from_splits`: the same
    bytes as `_launch`'s owner select, without that XLA op). Arguments: `_launch`'s
    (`unpadded`: None takes `tuning.UNPADDED_ROWS` (on) for a call whose rows fit one row block
    of the kernel and are fewer (a decode call): the kernels get its [N] targets / inv_t and
    N-row hidden as they are and the fold writes [N] (`_launch(unpadded=)`): no row pads, no
    output slices; the same bytes (H200, twenty-first session: golden replay, the unpadded and
    fused-forward GPU tests); calls of several row blocks stay padded unless `unpadded=True`
    (hidden / targets / inv_t rounded up to 8 rows, TMA's zero fill; not timed);
    fold_cfg: the fold's `tuning.FoldConfig` (bit-neutral; default `tuning.FOLD`, or
    `tuning.DECODE_FOLD` where that is set and N <= DECODE_ROWS);
    single_launch (an experiment for decode; None: `tuning.SINGLE_LAUNCH`, off): where
    `_launch(fold_in_kernel=)` can, the forward kernel folds its own partials (its last CTA, after
    a grid semaphore: one launch instead of two), the same fold program on the same operands, so
    the same bytes; elsewhere the two kernels as without it."""
    explicit_single = single_launch is not None
    single_launch = single_launch if explicit_single else tuning.SINGLE_LAUNCH
    if unpadded is None:  # by default only a call in one row block (several: padded, as before)
        n = int(np.shape(hidden)[0])
        one_block = tuning.one_row_block(n, tuning.select_bucket(n, kw.get("bucket")))
        unpadded = tuning.UNPADDED_ROWS and one_block and not single_launch
    elif not explicit_single:
        single_launch = single_launch and not unpadded
    if single_launch and unpadded:
        raise ValueError("single_launch folds the padded rows: it does not take unpadded=True")
    kw["unpadded"] = bool(unpadded)
    fold_in_kernel = sm90_fold.config(fold_cfg) if single_launch else None
    r = _launch(hidden, weight, bias, targets, inv_t, vocab_size=vocab_size, fold_in_kernel=fold_in_kernel, **kw)
    if fold_cfg is None and tuning.DECODE_FOLD is not None and r.n <= DECODE_ROWS:
        fold_cfg = tuning.DECODE_FOLD  # (read at trace time; bit-neutral)
    if r.folded is not None:
        logp, lse = r.folded[0][: r.n], r.folded[1][: r.n]
        return logp, lse, r.logits, (r.folded[2][: r.n] if r.a_t is not None else None)
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
        cfg=fold_cfg,
    )
    logp, lse = out[0][: r.n], out[1][: r.n]
    entropy = out[2][: r.n] if r.a_t is not None else None
    return logp, lse, r.logits, entropy


__all__ = ["forward", "partials", "unsupported"]
