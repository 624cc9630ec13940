"""Fused lm_head + per-split LSE partials: a Pallas Mosaic GPU kernel for sm90.

`partials(hidden, weight, bias, targets, inv_t, ...)` computes, for every row
and every vocab split of `contract.split_bounds(padded_vocab_size)` inside the
local shard, the chain partials (m, S) of the scaled logits, captures the raw
(post-bias, unscaled) logit of each row's target, and optionally stores the
FP32 logits, all from ONE wgmma accumulator per output element, never
materializing [N, V] logits unless asked to.

Contract kept (see `detlogp_jax/oracle.py`, the executable spec):
* z = fl(acc + b) (bias optional, FP32): acc is the wgmma FP32 accumulator
  over K = D walked ascending in 64-wide K slices (k16 instructions ascending
  inside each slice), one accumulator, no split-K, no atomics, no reduce-add.
* Per row and split, tiles of 64 columns in ascending order: y = fl(z*inv_t)
  on lanes col < vocab_size (-inf elsewhere); m' = max(m, max(y));
  alpha = 1 if m == m' else pexp(m - m'); e = pexp(y - m') (0 on padding);
  S = fl(fl(S*alpha) + tree64(e)). Every f32 op is one rounded op with FTZ
  (`ptx_ops.PtxOps`: mul/add/sub.rn.ftz.f32 inline PTX).
* The split plan, the tree and the chain order depend on the padded vocab
  size only; no split count, tree or order depends on N, the launch bucket or
  the SM count. Launch geometry (rows per warpgroup, warpgroups per CTA,
  pipeline depth, persistent CTA count) is bit-neutral (`tuning.py`).

Kernel structure: a persistent grid of CTAs walks work items (local split,
row block) round-robin, in the order `LaunchConfig.split_group` picks (row
blocks fastest; or, for the prefill bucket, groups of 4 splits with the split
fastest inside a group, so the CTAs running at once share both the weight
slices and the hidden rows in L2). A work item is one warp-specialized TMA
pipeline over (tile group g, K slice k): the memory warpgroup streams
H[rows, k-slice] and W[group columns, k-slice] (128B swizzle) while each
consumer warpgroup (its own block_m rows) issues wgmma into its accumulator
[block_m, 64*w]; after the last K slice of a group it runs the chain over the
group's w tiles in ascending order and zeroes the accumulator. The chain state
(m, S, z_t) is the pipeline carry (registers).

`LaunchConfig.epilogue_wgs > 0` (the decode and prefill buckets) builds
`sm90_forward_ws.build` instead: the same work items and bits, with the chain in
a dedicated epilogue warpgroup fed through shared memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from detlogp_jax import contract as C
from pallas_kernels import interpret_utils, ptx_ops, tile_math, tuning

F32 = jnp.float32
TILE = C.TILE_V
TILE_K = 64  # K slice per pipeline step: 64 bf16 = 128 bytes = one 128B swizzle row.
SWIZZLE = 128


@dataclasses.dataclass(frozen=True)
class ShardGeometry:
  """Static description of the local shard's splits (all Python ints)."""

  vocab_size: int
  padded_vocab_size: int
  col_offset: int
  shard_cols: int
  split_first: int  # global index of the first local split
  n_local: int  # number of local splits
  groups: int  # plan.groups
  size: int  # tiles per plan group
  parts: int  # plan.parts_per_group (q)
  max_tiles: int  # max tiles of a local split
  tiles_per_group: int  # w: wgmma N = 64 * w
  n_groups: int  # tile groups per split (static; surplus tiles are masked)
  local_starts: tuple[int, ...]  # global start tile of each local split
  local_ends: tuple[int, ...]

  @property
  def group_cols(self) -> int:
    return TILE * self.tiles_per_group


def shard_geometry(vocab_size: int, padded_vocab_size: int, col_offset: int = 0, shard_cols: int | None = None) -> ShardGeometry:
  """The local splits of `split_bounds(padded_vocab_size)` in [col_offset, col_offset + shard_cols).

  Raises `contract.ContractError` if the shard edges are not split edges.
  """
  vocab_size, padded_vocab_size = int(vocab_size), int(padded_vocab_size)
  if not 1 <= vocab_size <= padded_vocab_size:
    raise ValueError(f"need 1 <= vocab_size <= padded_vocab_size, got {vocab_size}, {padded_vocab_size}")
  plan = C.split_bounds(padded_vocab_size)
  shard_cols = padded_vocab_size - int(col_offset) if shard_cols is None else int(shard_cols)
  col_offset = int(col_offset)
  if col_offset < 0 or shard_cols <= 0 or col_offset + shard_cols > plan.n_tiles * TILE:
    raise ValueError(f"shard [{col_offset}, {col_offset + shard_cols}) outside the padded vocabulary {padded_vocab_size}")
  local = list(C.local_splits(padded_vocab_size, col_offset, shard_cols))
  starts = tuple(plan.starts[j] for j in local)
  ends = tuple(plan.ends[j] for j in local)
  sizes = tuple(e - s for s, e in zip(starts, ends))
  w = tuning.tiles_per_group(sizes)
  return ShardGeometry(
      vocab_size=vocab_size,
      padded_vocab_size=padded_vocab_size,
      col_offset=col_offset,
      shard_cols=shard_cols,
      split_first=local[0],
      n_local=len(local),
      groups=plan.groups,
      size=plan.n_tiles // plan.groups,
      parts=plan.parts_per_group,
      max_tiles=max(sizes),
      tiles_per_group=w,
      n_groups=-(-max(sizes) // w),
      local_starts=starts,
      local_ends=ends,
  )


def _work_item(i, n_local: int, n_rb: int, split_group: int):
  """(local split, row block) of work item i (bit-neutral: only the order changes).

  split_group == 0: row blocks fastest. G > 0: splits in groups of G (the last
  group may be smaller); inside a group the split index moves fastest, so a
  wave of CTAs covers a G-split x (CTAs / G)-row-block rectangle.
  """
  if split_group <= 0:
    return i // n_rb, i % n_rb
  g = min(split_group, n_local)
  span = g * n_rb
  grp = i // span
  rem = i - grp * span
  width = jnp.minimum(g, n_local - grp * g)
  rb = rem // width
  return grp * g + (rem - rb * width), rb


def _split_tiles(geom: ShardGeometry, j):
  """(start, end) tile of global split j (traced int32), per contract.split_bounds."""
  q, size = geom.parts, geom.size
  a = j // q
  p = j - a * q
  return a * size + (p * size) // q, a * size + ((p + 1) * size) // q


def _row_layout():
  return plgpu.Layout.WGMMA.reduce(1)


def _col_layout():
  return plgpu.Layout.WGMMA.reduce(0)


def _layout_of(shape):
  if len(shape) == 2:
    return plgpu.Layout.WGMMA
  if len(shape) == 1:
    return _row_layout()
  raise ValueError(f"no register layout for shape {shape}")


_cast = interpret_utils.cast
_load = interpret_utils.load


def _zero_acc(acc_ref, bm, cols, interpret):
  """acc := +0 (the next group's K walk starts from a zero accumulator)."""
  zeros = jnp.zeros((bm, cols), F32)
  if interpret:
    # Interpret mode models the accumulator as a plain buffer and has no rule
    # for the accumulator-store primitive; a plain ref store is equivalent.
    from jax._src.state import primitives as state_primitives

    state_primitives.ref_set(acc_ref, (slice(None), slice(None)), zeros)
  else:
    acc_ref[...] = plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)


def chain_step(m, s, zt, z, *, tile, t1, limit, tgt, invt_b, col_iota, ops, interpret, mask_always=False, diag=()):
  """One tile of a split's chain plus the target capture: (m, S, z_t) -> (m', S', z_t').

  z: [BM, 64] post-bias FP32 logits of global tile `tile`; t1: the split's end
  tile; limit: the first column not owned by the chain (min(vocab, split end)).
  The contract step is `tile_math.chain_tile`; only tiles reaching past
  `limit` take the masked variant (on all others the masks are identities, so
  both give the same bits); the branch is uniform across the CTA. Rows whose
  target lies in this tile of this split take z at the target column as z_t.
  Shared by every forward kernel, so they run the same per-tile program.
  """
  tcol0 = tile * TILE
  col = col_iota + tcol0

  def chain(m, s, z, col, masked):
    return tile_math.chain_tile(m, s, z, col, tgt, invt_b, limit, ops, interpret=interpret, masked=masked, diag=diag)

  if mask_always:
    m, s, z_hit = chain(m, s, z, col, True)
  else:
    m, s, z_hit = lax.cond(
        (tile + 1) * TILE <= limit,
        lambda m, s, z, col: chain(m, s, z, col, False),
        lambda m, s, z, col: chain(m, s, z, col, True),
        m, s, z, col,
    )
  row_hit = (tgt >= tcol0) & (tgt < tcol0 + TILE) & (tile < t1)
  return m, s, jnp.where(row_hit, z_hit, zt)


def unpack_refs(refs, has_bias: bool, return_logits: bool):
  """(h, w, bias | None, targets, inv_t, m_out, s_out, zt_out, logits_out | None) of a forward
  kernel's refs: inputs (hidden, weight, [bias], targets, inv_t), then outputs (`out_type`)."""
  refs = list(refs)
  h, w = refs[:2]
  b = refs.pop(2) if has_bias else None
  tgt, invt, m_out, s_out, zt_out = refs[2:7]
  return h, w, b, tgt, invt, m_out, s_out, zt_out, (refs[7] if return_logits else None)


def out_type(n_local: int, n_pad: int, return_logits: bool, lg_rows: int | None, lg_cols: int):
  """Outputs of a forward kernel: m, S, z_t captures [n_local, n_pad] f32, and the logits
  [lg_rows (default n_pad), lg_cols] f32 for the serving entry."""
  shapes = [jax.ShapeDtypeStruct((n_local, n_pad), F32) for _ in range(3)]
  if return_logits:
    shapes.append(jax.ShapeDtypeStruct((n_pad if lg_rows is None else lg_rows, lg_cols), F32))
  return tuple(shapes)


def build_forward(
    *,
    n_pad: int,
    d: int,
    lg_cols: int,
    geom: ShardGeometry,
    cfg: tuning.LaunchConfig,
    has_bias: bool,
    return_logits: bool,
    num_ctas: int,
    interpret: bool,
    interpret_params=None,
    lg_rows: int | None = None,
    fused_ptx: bool = True,
    diag: tuple[str, ...] = (),
):
  """Builds the kernel callable (hidden, weight, bias_p, targets_p, inv_t_p) -> outputs.

  `diag` (timing experiments only, NOT contract-keeping): "skip_epilogue"
  drops the chain (the accumulator is still read and zeroed), to measure
  what the epilogue costs; "no_hit", "no_exp", "no_mask" drop those parts of
  the chain (`tile_math.chain_tile`); "zero_first" zeroes the accumulator
  before the chain instead of after it; "mask_always" applies the padding
  masks on every tile instead of only on tiles that reach past the limit;
  "acc_max_only" reads the accumulator and takes one row max instead of the
  chain; "wg0_only" runs the chain in consumer warpgroup 0 only; "one_tile"
  runs it on the first tile of each group only; "pad_smem96" allocates 96
  KiB of unused shared memory (does the pipeline slow down with the
  shared-memory footprint alone?).
  """
  if cfg.epilogue_wgs:
    from pallas_kernels import sm90_forward_ws  # Lazy: it imports this module.

    return sm90_forward_ws.build(
        n_pad=n_pad, d=d, lg_cols=lg_cols, geom=geom, cfg=cfg, has_bias=has_bias, return_logits=return_logits,
        num_ctas=num_ctas, interpret=interpret, interpret_params=interpret_params, lg_rows=lg_rows,
        fused_ptx=fused_ptx, diag=diag)
  bm = cfg.block_m
  n_wg = cfg.num_compute_wgs
  if n_wg not in (1, 2):
    # Three consumer warpgroups pass interpret mode but are not validated on
    # a GPU: probe1.jsonl (h200_2026-11-30b) reports "DIFFERENT" for them, but
    # that probe compared whole [n_local, n_pad] arrays and 192 rows per CTA
    # pads M=4096 to 4224 rows, so the shapes alone differed (fixed in
    # benchmarks/probe_kernel.py since); whether the bytes match is unknown.
    raise ValueError(f"num_compute_wgs must be 1 or 2, got {n_wg}")
  cta_rows = cfg.cta_rows
  assert n_pad % cta_rows == 0
  n_rb = n_pad // cta_rows
  if d % TILE_K:
    raise ValueError(f"hidden size D={d} must be a multiple of {TILE_K}")
  k_iters = d // TILE_K
  w = geom.tiles_per_group
  gcols = geom.group_cols
  n_groups = geom.n_groups
  c0 = geom.col_offset
  vocab = geom.vocab_size
  j0 = geom.split_first
  n_local = geom.n_local
  transforms = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
  row_l, col_l = _row_layout(), _col_layout()
  extra_smem = tuning.logits_staging_bytes(cfg) if return_logits else 0
  stages = min(tuning.pipeline_stages(cfg, w, TILE_K, extra_smem), n_groups * k_iters)
  delay = cfg.delay_release if stages > cfg.delay_release else 0
  slots = cfg.logits_slots
  sg = cfg.split_group
  n_items = n_local * n_rb
  skip_epilogue = "skip_epilogue" in diag
  zero_first = "zero_first" in diag
  mask_always = "mask_always" in diag
  chain_diag = tuple(x for x in diag if x in ("no_hit", "no_exp", "no_mask"))
  known = {"skip_epilogue", "zero_first", "mask_always", "no_hit", "no_exp", "no_mask",
           "acc_max_only", "wg0_only", "one_tile", "pad_smem96"}
  if set(diag) - known:
    raise ValueError(f"unknown diag {sorted(set(diag) - known)}; known: {sorted(known)}")

  def kernel(*refs):
    h_gmem, w_gmem, b_gmem, tgt_gmem, invt_gmem, m_out, s_out, zt_out, lg_out = unpack_refs(refs, has_bias,
                                                                                           return_logits)

    def get_pipeline(body, compute_context):
      return plgpu.emit_pipeline_warp_specialized(
          body,
          grid=(n_groups, k_iters),
          memory_registers=40,
          in_specs=[
              plgpu.BlockSpec((cta_rows, TILE_K), lambda g, k: (0, k), transforms=transforms,
                              delay_release=delay),
              plgpu.BlockSpec((gcols, TILE_K), lambda g, k: (g, k), transforms=transforms,
                              delay_release=delay),
          ],
          wg_axis="wg",
          num_compute_wgs=n_wg,
          max_concurrent_steps=stages,
          compute_context=compute_context,
      )

    ignore = lambda *_, **__: None
    w_span = n_groups * gcols  # weight rows touched by one work item (may run past Vl: TMA zero fill)

    scoped = dict(
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(
            h_gmem.at[pl.ds(0, cta_rows), :], w_gmem.at[pl.ds(0, w_span), :]
        ),
    )
    # TMA needs the logits row length to be a multiple of the staging tile's
    # minor tiling (swizzle bytes / 4 f32): pick the widest swizzle that
    # divides it (lg_cols is a multiple of 8, so 32B always works).
    lg_swz = next(sw for sw in (128, 64, 32) if lg_cols % (sw // 4) == 0) if return_logits else 128
    lg_transforms = (plgpu.TilingTransform((8, lg_swz // 4)), plgpu.SwizzleTransform(lg_swz))
    if return_logits:
      scoped["out_smem"] = plgpu.SMEM((n_wg, slots, bm, TILE), F32, transforms=lg_transforms)
    if "pad_smem96" in diag:  # timing only: 96 KiB of shared memory nobody touches
      scoped["pad"] = plgpu.SMEM((96 * 1024 // 4,), F32)

    @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
    def _scope(pipeline_allocs, out_smem=None, pad=None):
      del pad
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((n_items,), collective_axes="cta")
      def _work(info):
        js, rb = _work_item(info.index[0], n_local, n_rb, sg)
        j = js + j0
        t0, t1 = _split_tiles(geom, j)
        row0 = rb * cta_rows
        wrow0 = t0 * TILE - c0  # first weight row of this split
        limit = jnp.minimum(t1 * TILE, vocab)  # first column not owned by the chain

        def compute_context(eval_pipeline):
          wrow = row0 + wg * bm
          tgt = _load(tgt_gmem.at[pl.ds(wrow, bm)], row_l, interpret)
          invt = _load(invt_gmem.at[pl.ds(wrow, bm)], row_l, interpret)
          ops = ptx_ops.make_ops(interpret, _layout_of, source=invt, fused=fused_ptx)
          # mma_body (called from eval_pipeline) reads these.
          ctx_vals.update(ops=ops, tgt=tgt, invt=invt)

          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, gcols), F32))
          def _acc_scope(acc_ref):
            m0 = _cast(jnp.full((bm,), -jnp.inf, F32), row_l, interpret)
            s0 = _cast(jnp.zeros((bm,), F32), row_l, interpret)
            zt0 = _cast(jnp.zeros((bm,), F32), row_l, interpret)
            _, m, s, zt = eval_pipeline((acc_ref, m0, s0, zt0))
            m_out.at[js, pl.ds(wrow, bm)][...] = m
            s_out.at[js, pl.ds(wrow, bm)][...] = s
            zt_out.at[js, pl.ds(wrow, bm)][...] = zt

        ctx_vals = {}

        def epilogue(acc_ref, g, m, s, zt):
          if delay and not interpret:
            plgpu.wgmma_wait(0)  # the group's last wgmma is still in flight
          z_all = acc_ref[...]
          if zero_first or skip_epilogue:
            _zero_acc(acc_ref, bm, gcols, interpret)
          if skip_epilogue:
            return m, s, zt
          if "acc_max_only" in diag:  # read the accumulator, one row max, nothing else
            _zero_acc(acc_ref, bm, gcols, interpret)
            return jnp.maximum(m, jnp.max(z_all, axis=1)), s, zt
          if "wg0_only" in diag:  # only consumer warpgroup 0 runs the chain
            def skip(m, s, zt):
              _zero_acc(acc_ref, bm, gcols, interpret)
              return m, s, zt
            return lax.cond(wg == 0, lambda m, s, zt: _chain_group(z_all, acc_ref, g, m, s, zt), skip, m, s, zt)
          return _chain_group(z_all, acc_ref, g, m, s, zt)

        def _chain_group(z_all, acc_ref, g, m, s, zt):
          ops, tgt, invt = ctx_vals["ops"], ctx_vals["tgt"], ctx_vals["invt"]
          wrow = row0 + wg * bm
          invt_b = jnp.broadcast_to(invt[:, None], (bm, TILE))
          col_iota = lax.broadcasted_iota(jnp.int32, (bm, TILE), 1)
          if not interpret:
            col_iota = plgpu.layout_cast(col_iota, plgpu.Layout.WGMMA)
          for i in range(1 if "one_tile" in diag else w):
            tile = t0 + g * w + i  # global tile index
            tcol0 = tile * TILE
            z = z_all[:, i * TILE : (i + 1) * TILE]
            if has_bias:
              b = _load(b_gmem.at[pl.ds(tcol0 - c0, TILE)], col_l, interpret)
              z = ops.add(z, jnp.broadcast_to(b[None, :], (bm, TILE)))
            m, s, zt = chain_step(m, s, zt, z, tile=tile, t1=t1, limit=limit, tgt=tgt, invt_b=invt_b,
                                  col_iota=col_iota, ops=ops, interpret=interpret, mask_always=mask_always,
                                  diag=chain_diag)
            if return_logits:
              # Tile t of the work item uses staging slot t % slots; waiting
              # until at most slots - 1 stores are pending frees this slot.
              # The item's first store waits for all (the previous item's
              # last stores were issued a whole K walk ago, so this is free),
              # since the previous item may have ended on any slot.
              slot = lax.rem(g * w + i, slots)

              # Tiles wholly past the logits' width (padding columns) are not
              # stored; they come last in a work item, so no store follows a skipped one.
              @pl.when((tile < t1) & (tcol0 - c0 < lg_cols))
              def _store():
                if i == 0:
                  @pl.when(g == 0)
                  def _drain():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
                out_smem.at[wg, slot][...] = z
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    out_smem.at[wg, slot], lg_out.at[pl.ds(wrow, bm), pl.ds(tcol0 - c0, TILE)]
                )
          if not zero_first:
            _zero_acc(acc_ref, bm, gcols, interpret)
          return m, s, zt

        def mma_body(idxs, h_smem, w_smem, carry):
          g, k = idxs
          acc_ref, m, s, zt = carry
          plgpu.wgmma(acc_ref, h_smem.at[pl.ds(wg * bm, bm)], w_smem.T)
          plgpu.wgmma_wait(delay)
          m, s, zt = lax.cond(
              k == k_iters - 1,
              lambda m, s, zt: epilogue(acc_ref, g, m, s, zt),
              lambda m, s, zt: (m, s, zt),
              m, s, zt,
          )
          return acc_ref, m, s, zt

        get_pipeline(mma_body, compute_context)(
            h_gmem.at[pl.ds(row0, cta_rows), :],
            w_gmem.at[pl.ds(wrow0, w_span), :],
            allocations=pipeline_allocs,
        )

      if return_logits:
        plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      kernel,
      out_type=out_type(n_local, n_pad, return_logits, lg_rows, lg_cols),
      grid=(num_ctas,),
      grid_names=("cta",),
      num_threads=n_wg + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=False),
      **interpret_utils.kernel_kwargs(interpret, interpret_params),
  )


_STATIC = ("n_pad", "d", "lg_cols", "geom", "cfg", "has_bias", "return_logits", "num_ctas", "interpret",
           "interpret_params", "lg_rows", "fused_ptx", "diag")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _forward_core(*args, **static):
  """The kernel launch, jitted on the padded row count: eager callers with
  different N that pad to the same row blocks share one compiled kernel."""
  return build_forward(**static)(*args)


def unsupported(hidden, weight) -> str | None:
  """Why this kernel cannot take these operands (shapes/dtypes only), or None."""
  if getattr(hidden, "ndim", None) != 2 or getattr(weight, "ndim", None) != 2:
    return f"hidden must be [N, D] and weight [V, D], got {hidden.shape}, {weight.shape}"
  if hidden.dtype != jnp.bfloat16 or weight.dtype != jnp.bfloat16:
    return (f"pallas_sm90 supports bf16 hidden and weight only (got {hidden.dtype}, {weight.dtype}); "
            "route other dtypes to the reference backend")
  d = hidden.shape[1]
  if weight.shape[1] != d:
    return f"hidden size mismatch: hidden {hidden.shape} vs weight {weight.shape}"
  if d % TILE_K or d == 0:
    return f"pallas_sm90 needs the hidden size D to be a positive multiple of {TILE_K}, got {d}"
  return None


def _check_inputs(hidden, weight, bias, targets, inv_t):
  why = unsupported(hidden, weight)
  if why:
    raise ValueError(why)
  n = hidden.shape[0]
  if bias is not None and (bias.ndim != 1 or bias.shape[0] != weight.shape[0]):
    raise ValueError(f"bias must be [{weight.shape[0]}], got {bias.shape}")
  if targets.shape != (n,) or inv_t.shape != (n,):
    raise ValueError(f"targets and inv_t must be [{n}], got {targets.shape}, {inv_t.shape}")


def _pad_rows(x, rows, value=0):
  pad = rows - x.shape[0]
  if pad == 0:
    return x
  return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=value)


def partials(
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
    bucket: str | None = None,
    num_ctas: int | None = None,
    interpret: bool = False,
    interpret_params=None,
    _fused_ptx: bool = True,
    _diag: tuple[str, ...] = (),
):
  """Per-split LSE partials of z = hidden @ weight.T (+ bias) for the local shard.

  Args:
    hidden: [N, D] bf16. weight: [Vl, D] bf16, row r is global column
      col_offset + r; Vl may be smaller than the shard width (rows past Vl
      read as zero through TMA out-of-bounds fill and are padding lanes
      anyway, since they must lie at or past vocab_size).
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
      `tuning.LaunchConfig` is accepted for experiments).
    num_ctas: force the persistent CTA count (bit-neutral).
    interpret: run under `plgpu.InterpretGPUParams` on CPU.
    _fused_ptx: (diagnostics) False emits exp op by op through
      `numerics.pexp` instead of the straight-line PTX program (same bits).

  Returns:
    (m [N, n_local], s [N, n_local], z_t [N] f32, owned [N] bool,
     logits [N, Vl] f32 or None). z_t is the raw target logit captured by
    the one tile owning the target (0 where `owned` is False).
  """
  hidden = jnp.asarray(hidden)
  weight = jnp.asarray(weight)
  targets = jnp.asarray(targets).astype(jnp.int32)
  inv_t = jnp.asarray(inv_t, F32)
  if bias is not None:
    bias = jnp.asarray(bias, F32)
  _check_inputs(hidden, weight, bias, targets, inv_t)
  geom = shard_geometry(vocab_size, padded_vocab_size, col_offset, shard_cols)
  n, d = hidden.shape
  v_rows = weight.shape[0]
  shard_end = geom.col_offset + geom.shard_cols
  if v_rows > geom.shard_cols:
    raise ValueError(f"weight has {v_rows} rows but the shard has only {geom.shard_cols} columns")
  if geom.col_offset + v_rows < min(geom.vocab_size, shard_end):
    raise ValueError(
        f"weight rows [{geom.col_offset}, {geom.col_offset + v_rows}) do not cover the real vocabulary "
        f"columns of the shard (vocab_size={geom.vocab_size})"
    )
  # TMA views the weight as 8-row tiles: a row count that is not a multiple
  # of 8 needs a padded copy (rare: real vocabularies are multiples of 8).
  v_rows8 = -(-v_rows // 8) * 8
  if v_rows8 != v_rows:
    weight = _pad_rows(weight, v_rows8)  # (bias is padded to the full width below)
  cfg = tuning.select_bucket(n, bucket)
  n_pad = tuning.padded_rows(n, cfg)
  if num_ctas is None:
    num_ctas = 2 if interpret else tuning.default_num_sms() * cfg.ctas_per_sm
  num_ctas = tuning.persistent_ctas(n_pad, geom.n_local, cfg, int(num_ctas))
  local_tiles = -(-geom.shard_cols // TILE)
  args = [_pad_rows(hidden, n_pad), weight]
  if bias is not None:
    width = (local_tiles + geom.n_groups * geom.tiles_per_group) * TILE
    args.append(jnp.pad(bias, (0, width - bias.shape[0])))
  args += [_pad_rows(targets, n_pad, C.IGNORE_INDEX), _pad_rows(inv_t, n_pad, 1.0)]
  # Logits rows: TMA clips rows past the array, but the array's row count
  # must be a multiple of 8 (or < 8) for the tiled store.
  lg_rows = n if (n % 8 == 0 or n < 8) else -(-n // 8) * 8
  want_cols = v_rows if logits_cols is None else int(logits_cols)
  if not 1 <= want_cols <= v_rows:
    raise ValueError(f"logits_cols must be in [1, {v_rows}], got {logits_cols}")
  # The kernel's logits width: TMA row strides and the staging swizzle need a multiple of 8.
  lg_cols = want_cols if (return_logits and want_cols % 8 == 0) else v_rows8
  outs = _forward_core(
      *args, n_pad=n_pad, d=d, lg_cols=lg_cols, geom=geom, cfg=cfg, has_bias=bias is not None,
      return_logits=return_logits, num_ctas=num_ctas, interpret=interpret,
      interpret_params=interpret_params, lg_rows=lg_rows, fused_ptx=_fused_ptx, diag=tuple(_diag),
  )
  m_t, s_t, zt_t = outs[:3]
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
  owned = (targets >= geom.col_offset) & (targets < geom.col_offset + v_rows)
  local_tile = jnp.clip((targets - geom.col_offset) // TILE, 0, local_tiles - 1)
  owner = jnp.asarray(tile_to_split)[local_tile]
  z_t = jnp.where(owned, zt_t[owner, jnp.arange(n)], jnp.asarray(0.0, F32))
  return m_t[:, :n].T, s_t[:, :n].T, z_t, owned, logits
