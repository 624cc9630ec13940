"""The chain-in-wgmma forward kernel: fused lm_head + per-split LSE partials (sm90).

`build(...)` returns the kernel (hidden, weight, [bias], targets, inv_t) ->
(m, S, z_t captures [n_local, n_pad], [logits]) for a `tuning.WgmmaForwardConfig`
(the `small` bucket); `wrapper.partials` pads the operands, launches it and
selects z_t. For every row and every vocab split of
`contract.split_bounds(padded_vocab_size)` inside the local shard it computes
the chain partials (m, S) of the scaled logits, captures the raw (post-bias,
unscaled) logit of each row's target, and optionally stores the FP32 logits,
all from ONE wgmma accumulator per output element, never materializing [N, V]
logits unless asked to.

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
row block) round-robin, in the order `split_group` picks (`common.work_item`:
row blocks fastest; or groups of G splits with the split fastest inside a
group, so the CTAs running at once share both the weight slices and the
hidden rows in L2). A work item is one warp-specialized TMA pipeline over
(tile group g, K slice k): the memory warpgroup streams H[rows, k-slice] and
W[group columns, k-slice] (128B swizzle) while each consumer warpgroup (its
own block_m rows) issues wgmma into its accumulator [block_m, 64*w]; after
the last K slice of a group it runs the chain (`common.chain_step`) over the
group's w tiles in ascending order and zeroes the accumulator. The chain state
(m, S, z_t) is the pipeline carry (registers).

Weight layouts (`build(weight_layout=...)`, static): "vd" reads W [Vl, D] as
[64 w, 64] blocks that wgmma takes through a transposed view; "dv" reads the
Flax/Tunix kernel W.T [D, Vl] in place as [64, 64 w] blocks (the same K slice
of the same vocab columns) that wgmma takes as an N-major B operand. The wgmma
instructions (m64nNk16, k ascending, one FP32 accumulator per tile group), the
epilogue and every tree are the same, so both layouts give the same bytes; only
how B reaches shared memory differs (checked on the H200: tests/gpu/h200_layout.sh).

`sm90_forward_ws` (the decode and prefill buckets) is the same work items and
bits with the chain in dedicated epilogue warpgroups fed through shared memory.

Entropy (`build(return_entropy=True)`, static): the chain also carries the entropy
statistic A of `linear-logp-entropy-v1` (docs/CONTRACT.md section 9) in the pipeline
carry and stores it per (split, row) after z_t; without it the kernel is exactly the one
without the statistic (benchmarks/mosaic_ir_hashes.py keeps both apart).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from detlogp_jax.layout import as_layout
from pallas_kernels import common, interpret_utils, ptx_ops, tuning
from pallas_kernels.common import F32, SWIZZLE, TILE, TILE_K

_TRANSFORMS = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static shape of one launch: everything the kernel's pieces read besides the refs."""

    cfg: tuning.WgmmaForwardConfig
    geom: common.ShardGeometry
    n_pad: int
    k_iters: int  # K slices of D
    stages: int  # pipeline depth
    lg_cols: int
    dv: bool  # the weight is [D, Vl] (read in place)
    has_bias: bool
    return_logits: bool
    return_entropy: bool
    interpret: bool

    @property
    def bm(self) -> int:
        return self.cfg.block_m

    @property
    def cta_rows(self) -> int:
        return self.cfg.cta_rows

    @property
    def n_rb(self) -> int:
        return self.n_pad // self.cta_rows

    @property
    def w_span(self) -> int:  # weight rows ("vd") / columns ("dv") of one work item (may run past Vl)
        return self.geom.n_groups * self.geom.group_cols


def build(
    *,
    n_pad: int,
    d: int,
    lg_cols: int,
    geom: common.ShardGeometry,
    cfg: tuning.WgmmaForwardConfig,
    has_bias: bool,
    return_logits: bool,
    num_ctas: int,
    interpret: bool,
    interpret_params=None,
    lg_rows: int | None = None,
    weight_layout="vd",
    return_entropy: bool = False,
):
    """Builds the kernel callable (hidden, weight, bias_p, targets_p, inv_t_p) -> outputs (`common.out_type`).

    weight_layout (static; "vd" / "dv" or a `detlogp_jax.layout.WeightLayout`): "vd", the
    weight is [Vl, D] (each pipeline step copies a [64 w, 64] block, rows = vocab columns, and
    wgmma reads it through `.T`); "dv", the weight is [D, Vl] read in place (each step copies
    the [64, 64 w] block of the same K slice and columns, and wgmma reads it as B directly, an
    N-major operand; Vl a multiple of `common.DV_COL_MULTIPLE`). Same transforms, same wgmma
    calls (m64nNk16, k ascending, one FP32 accumulator per group), same epilogue: the K walk,
    the instruction shapes and the trees do not depend on where B comes from, so both layouts
    give the same bytes (interpret mode checks the indexing, the H200 the bits:
    tests/gpu/h200_layout.sh).

    return_entropy (static): the chain also carries the entropy statistic A
    (`linear-logp-entropy-v1`, `common.chain_step(..., a=)`) in the pipeline carry and
    stores it [n_local, n_pad] after z_t; m, S, z_t and the logits are the same
    operations as without it. False builds exactly the kernel without the statistic.
    """
    if not isinstance(cfg, tuning.WgmmaForwardConfig):
        raise TypeError(f"sm90_forward_wgmma needs a tuning.WgmmaForwardConfig, got {type(cfg).__name__}")
    assert n_pad % cfg.cta_rows == 0
    if d % TILE_K:
        raise ValueError(f"hidden size D={d} must be a multiple of {TILE_K}")
    k_iters = d // TILE_K
    extra_smem = tuning.logits_staging_bytes(cfg) if return_logits else 0
    stages = min(tuning.pipeline_stages(cfg, geom.tiles_per_group, TILE_K, extra_smem), geom.n_groups * k_iters)
    plan = _Plan(
        cfg=cfg,
        geom=geom,
        n_pad=n_pad,
        k_iters=k_iters,
        stages=stages,
        lg_cols=lg_cols,
        dv=as_layout(weight_layout).transposed,
        has_bias=has_bias,
        return_logits=return_logits,
        return_entropy=return_entropy,
        interpret=interpret,
    )

    def kernel(*refs):
        _kernel(plan, common.unpack_refs(refs, has_bias, return_logits, return_entropy))

    return plgpu.kernel(
        kernel,
        out_type=common.out_type(geom.n_local, n_pad, return_logits, lg_rows, lg_cols, return_entropy),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=cfg.num_compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=False),
        **interpret_utils.kernel_kwargs(interpret, interpret_params),
    )


def _pipeline(plan: _Plan, body, compute_context):
    """The warp-specialized TMA pipeline over (tile group g, K slice k) of one work item: the
    CTA's hidden rows and the weight's block of step (g, k), K slice k of tile group g's columns
    in the weight's layout ("dv": [K, N], the vocab columns minor; "vd": [N, K]). Same
    transforms either way (a 128B-swizzled 64-element minor dimension), so the SMEM tile is
    what wgmma reads."""
    gcols = plan.geom.group_cols
    if plan.dv:
        w_spec = plgpu.BlockSpec((TILE_K, gcols), lambda g, k: (k, g), transforms=_TRANSFORMS)
    else:
        w_spec = plgpu.BlockSpec((gcols, TILE_K), lambda g, k: (g, k), transforms=_TRANSFORMS)
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(plan.geom.n_groups, plan.k_iters),
        memory_registers=40,
        in_specs=[plgpu.BlockSpec((plan.cta_rows, TILE_K), lambda g, k: (0, k), transforms=_TRANSFORMS), w_spec],
        wg_axis="wg",
        num_compute_wgs=plan.cfg.num_compute_wgs,
        max_concurrent_steps=plan.stages,
        compute_context=compute_context,
    )


def _w_window(plan: _Plan, w_gmem, start):
    """The weight's vocab columns [start, start + w_span) in its own layout."""
    return w_gmem.at[:, pl.ds(start, plan.w_span)] if plan.dv else w_gmem.at[pl.ds(start, plan.w_span), :]


def _kernel(plan: _Plan, refs):
    """The CTA: the pipeline's buffers (and the serving entry's logits staging tiles), then the
    persistent loop over work items (`_work_item`)."""
    h_gmem, w_gmem = refs[0], refs[1]
    ignore = lambda *_, **__: None
    scoped = dict(
        pipeline_allocs=_pipeline(plan, ignore, ignore).get_allocations(
            h_gmem.at[pl.ds(0, plan.cta_rows), :], _w_window(plan, w_gmem, 0)
        ),
    )
    if plan.return_logits:
        # TMA needs the logits row length to be a multiple of the staging tile's minor tiling
        # (swizzle bytes / 4 f32): the widest swizzle that divides it (lg_cols is a multiple of
        # 8, so 32B always works).
        lg_swz = next(sw for sw in (128, 64, 32) if plan.lg_cols % (sw // 4) == 0)
        lg_transforms = (plgpu.TilingTransform((8, lg_swz // 4)), plgpu.SwizzleTransform(lg_swz))
        shape = (plan.cfg.num_compute_wgs, plan.cfg.logits_slots, plan.bm, TILE)
        scoped["out_smem"] = plgpu.SMEM(shape, F32, transforms=lg_transforms)

    @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
    def _scope(pipeline_allocs, out_smem=None):
        wg = lax.axis_index("wg")
        n_items = plan.geom.n_local * plan.n_rb

        @plgpu.nd_loop((n_items,), collective_axes="cta")
        def _work(info):
            _work_item(plan, refs, wg, pipeline_allocs, out_smem, info.index[0])

        if plan.return_logits:
            plgpu.wait_smem_to_gmem(0)


def _work_item(plan: _Plan, refs, wg, pipeline_allocs, out_smem, index):
    """One work item (local split, row block): the pipeline's K walk per tile group, each group's
    chain after its last K slice (`_group_epilogue`), the partials stored."""
    h_gmem, w_gmem, _, tgt_gmem, invt_gmem, m_out, s_out, zt_out, _, a_out = refs
    geom, bm, interpret = plan.geom, plan.bm, plan.interpret
    row_l = common.row_layout()
    js, rb = common.work_item(index, geom.n_local, plan.n_rb, plan.cfg.split_group)
    j = js + geom.split_first
    t0, t1 = common.split_tiles(geom, j)
    row0 = rb * plan.cta_rows
    wrow0 = t0 * TILE - geom.col_offset  # first weight row ("vd") / column ("dv") of this split
    limit = jnp.minimum(t1 * TILE, geom.vocab_size)  # first column not owned by the chain
    ctx = {}  # the rows' inputs and ops, set by compute_context, read by the epilogue

    def compute_context(eval_pipeline):
        wrow = row0 + wg * bm
        tgt = common.load(tgt_gmem.at[pl.ds(wrow, bm)], row_l, interpret)
        invt = common.load(invt_gmem.at[pl.ds(wrow, bm)], row_l, interpret)
        ops = ptx_ops.make_ops(interpret, common.layout_of, source=invt)
        ctx.update(ops=ops, tgt=tgt, invt=invt)

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, geom.group_cols), F32))
        def _acc_scope(acc_ref):
            m0 = common.cast(jnp.full((bm,), -jnp.inf, F32), row_l, interpret)
            s0 = common.cast(jnp.zeros((bm,), F32), row_l, interpret)
            zt0 = common.cast(jnp.zeros((bm,), F32), row_l, interpret)
            init = (acc_ref, m0, s0, zt0)
            if plan.return_entropy:  # A starts at +0
                init += (common.cast(jnp.zeros((bm,), F32), row_l, interpret),)
            out = eval_pipeline(init)
            m, s, zt = out[1:4]
            m_out.at[js, pl.ds(wrow, bm)][...] = m
            s_out.at[js, pl.ds(wrow, bm)][...] = s
            zt_out.at[js, pl.ds(wrow, bm)][...] = zt
            if plan.return_entropy:
                a_out.at[js, pl.ds(wrow, bm)][...] = out[4]

    item = _Item(t0, t1, limit, row0)

    def mma_body(idxs, h_smem, w_smem, carry):
        g, k = idxs
        acc_ref, *st = carry  # st: (m, S, z_t[, A])
        # B = the [K, N] view of the tile: the tile itself ("dv") or its transpose ("vd").
        plgpu.wgmma(acc_ref, h_smem.at[pl.ds(wg * bm, bm)], w_smem if plan.dv else w_smem.T)
        plgpu.wgmma_wait(0)
        st = lax.cond(
            k == plan.k_iters - 1,
            lambda *st: _group_epilogue(plan, refs, out_smem, item, ctx, wg, acc_ref, g, *st),
            lambda *st: st,
            *st,
        )
        return (acc_ref, *st)

    _pipeline(plan, mma_body, compute_context)(
        h_gmem.at[pl.ds(row0, plan.cta_rows), :],
        _w_window(plan, w_gmem, wrow0),
        allocations=pipeline_allocs,
    )


class _Item(NamedTuple):
    """One work item's tiles [t0, t1), the chain's column limit and the CTA's first row (traced)."""

    t0: object
    t1: object
    limit: object
    row0: object


def _group_epilogue(plan: _Plan, refs, out_smem, item: _Item, ctx, wg, acc_ref, g, m, s, zt, *a):
    """After tile group g's last K slice: the chain over its w tiles in ascending order
    (`common.chain_step`, z = fl(acc + b)), the serving entry's logits staged and stored by TMA,
    the accumulator zeroed. (m, S, z_t[, A]) -> the next."""
    b_gmem, lg_out = refs[2], refs[8]
    geom, bm, interpret = plan.geom, plan.bm, plan.interpret
    w, c0, slots = geom.tiles_per_group, geom.col_offset, plan.cfg.logits_slots
    z_all = acc_ref[...]
    ops, tgt, invt = ctx["ops"], ctx["tgt"], ctx["invt"]
    wrow = item.row0 + wg * bm
    invt_b = jnp.broadcast_to(invt[:, None], (bm, TILE))
    col_iota = lax.broadcasted_iota(jnp.int32, (bm, TILE), 1)
    if not interpret:
        col_iota = plgpu.layout_cast(col_iota, plgpu.Layout.WGMMA)
    for i in range(w):
        tile = item.t0 + g * w + i  # global tile index
        tcol0 = tile * TILE
        z = z_all[:, i * TILE : (i + 1) * TILE]
        if plan.has_bias:
            b = common.load(b_gmem.at[pl.ds(tcol0 - c0, TILE)], common.col_layout(), interpret)
            z = ops.add(z, jnp.broadcast_to(b[None, :], (bm, TILE)))
        st = common.chain_step(
            m,
            s,
            zt,
            z,
            tile=tile,
            t1=item.t1,
            limit=item.limit,
            tgt=tgt,
            invt_b=invt_b,
            col_iota=col_iota,
            ops=ops,
            interpret=interpret,
            a=a[0] if a else None,
        )
        m, s, zt = st[:3]
        a = st[3:]  # (A,) with the entropy statistic, else ()
        if plan.return_logits:
            # Tile t of the work item uses staging slot t % slots; waiting until at most
            # slots - 1 stores are pending frees this slot. The item's first store waits for all
            # (the previous item's last stores were issued a whole K walk ago, so this is free),
            # since the previous item may have ended on any slot.
            slot = lax.rem(g * w + i, slots)

            # Tiles wholly past the logits' width (padding columns) are not stored; they come
            # last in a work item, so no store follows a skipped one.
            @pl.when((tile < item.t1) & (tcol0 - c0 < plan.lg_cols))
            def _store(i=i, slot=slot, z=z, tcol0=tcol0):
                if i == 0:

                    @pl.when(g == 0)
                    def _drain():
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
                out_smem.at[wg, slot][...] = z
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], lg_out.at[pl.ds(wrow, bm), pl.ds(tcol0 - c0, TILE)])

    common.zero_acc(acc_ref, bm, geom.group_cols, interpret)
    return (m, s, zt) + tuple(a)
