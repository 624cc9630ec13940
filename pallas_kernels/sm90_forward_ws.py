"""The forward kernel with dedicated epilogue warpgroups (sm90, Pallas Mosaic GPU).

Same outputs, same bits, same work items as `sm90_forward_wgmma.build`; a
different division of labour inside a CTA, so the chain of one tile group no
longer stalls the tensor cores:

* one producer warpgroup streams H[rows, k-slice] and W[group columns,
  k-slice] through a ring of `stages` shared-memory slots (TMA, 128B swizzle),
* `num_compute_wgs` wgmma warpgroups (block_m rows each) run the K walk of a
  tile group into their accumulator [block_m, 64*w] (k16 instructions
  ascending, one accumulator zeroed per group: the contract's GEMM), then copy
  it to their hand-off buffer in shared memory (once the epilogue has handed
  the previous group's copy back) and go on with the next group's wgmmas,
* `epilogue_wgs` epilogue warpgroups take each hand-off buffer and run the
  chain over its w tiles in ascending order with
  `tile_math.chain_tile_sliced` (the contract step of `tile_math.chain_tile`
  read from eight 8-column slices, in a loop so the code stays small) plus the
  target capture of `common.chain_step`, store the serving entry's
  logits from the buffer by TMA, and hand it back.

Synchronization (mbarriers, no atomics): `full[slot]` (TMA bytes landed),
`empty[slot]` (every wgmma warpgroup is done reading the slot),
`dump_full[b]` / `dump_empty[b]` (hand-off buffer b filled / free). Every
waiter waits on every phase in order; the initial "free" phases are primed
(one arrival per arriving warpgroup) and the last ones are waited out before
exit. Arrivals are release and waits acquire for all 128 threads of a
warpgroup, which orders the buffer's writes and reads across warpgroups;
Pallas's automatic warpgroup barriers are therefore off (see `build`).
Nothing here changes a bit: the accumulator a tile's chain reads is the same
wgmma sequence, and the chain is the same operations in the same order; only
which warpgroup runs it, and when, differs.

`WsForwardConfig.cluster` = 2 (off in every bucket: slower on the H200, see tuning.py) launches
2-CTA clusters: the two CTAs take adjacent row blocks of the same split, both issue
each weight K slice's copy with `collective_axes="cluster"` (each loads half the rows
and multicasts them), and `empty` becomes a cluster barrier (a slot is free once the
wgmma warpgroups of both CTAs released it). The wgmmas read the same bytes.

Weight layouts (`build(weight_layout=...)`, static): "vd" (W [Vl, D], ring slots
[64 w, tile_k], wgmma reads `slot.T`) or "dv" (the Flax/Tunix kernel W.T [D, Vl]
read in place, slots [tile_k, 64 w], wgmma reads the slot as an N-major B): the
same bytes land in a slot's operand view, the same instructions run, so both
layouts are to give the same bits (to be confirmed on the H200).

Entropy (`build(return_entropy=True)`, static): the epilogue warpgroups' chain also
carries the entropy statistic A (`tile_math.chain_tile_sliced(..., a=)`: u reduced
from the same slices with the tree of e) and stores it after z_t; the producer and
wgmma warpgroups are unchanged.

Hand-off layout (`WsForwardConfig.handoff`, bit-neutral): "slices" keeps each tile as eight
[bm, 8] column slices; "swizzled" (both shipped ws buckets since the ninth session: ~1% faster
on the H200, `tuning.BUCKETS`) as two [bm, 32] halves in 128B-swizzled rows: the wgmma warpgroups store 2 halves
per tile instead of 8 slices, the epilogue loads a half once per 4 slices and slices it in
registers (epilogue_slices 4 or 8), and the serving entry's logits leave in 2 TMA boxes of
128-byte rows per tile instead of 8 of 32-byte rows (the logits' width then a multiple of 32).
The same values meet the same operations in the same order, so the bytes are the same.

Shared memory: stages * (rows + 64 w) * 2 * tile_k bytes for the ring plus
num_compute_wgs * w * block_m * 256 B for the hand-off buffers (Qwen3, w = 3,
2 x 64 rows, tile_k = 64: 3 stages = 120 KiB + 96 KiB).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from detlogp_jax import contract as C
from pallas_kernels import common, interpret_utils, ptx_ops, sm90_fold, tile_math, tuning
from pallas_kernels.common import F32, TILE

PRODUCER_REGISTERS = 24
MAX_REGISTERS = tuning.MAX_REGISTERS


def launch_registers(n_wgs: int) -> int:
    """Registers per thread a CTA of n_wgs warpgroups launches with (64K / threads, a multiple of 8)."""
    return 65536 // (n_wgs * 128) // 8 * 8


def register_split(cfg: tuning.WsForwardConfig) -> tuple[int, int, int]:
    """(producer, wgmma, epilogue) registers per thread for `setmaxnreg`.

    The CTA launches with floor(64K / threads) registers per thread (rounded
    down to a multiple of 8: 128 for 4 warpgroups, 96 for 5) and `setmaxnreg`
    only moves registers between its warpgroups, so the counts must sum to at
    most warpgroups * that (or an increase waits forever). `mma_registers` 0
    picks 128 (4 warpgroups) or 120 (5): the accumulator alone is 96. ptxas
    compiles the whole kernel within the launch count (it does not follow
    `setmaxnreg`), so the 64x192 wgmma needs a launch count of at least 122:
    at most 4 warpgroups for w = 3.
    """
    n_wgs = cfg.num_compute_wgs + cfg.epilogue_wgs + 1
    pool = n_wgs * launch_registers(n_wgs)
    mma = cfg.mma_registers or (128 if n_wgs <= 4 else 120)
    epi = min(MAX_REGISTERS, (pool - PRODUCER_REGISTERS - cfg.num_compute_wgs * mma) // cfg.epilogue_wgs // 8 * 8)
    if mma % 8 or not 24 <= mma <= MAX_REGISTERS or epi < 24:
        raise ValueError(f"register split does not fit: wgmma {mma}, epilogue {epi} ({tuning.describe(cfg)})")
    return PRODUCER_REGISTERS, mma, epi


def build(
    *,
    n_pad: int,
    d: int,
    lg_cols: int,
    geom: common.ShardGeometry,
    cfg: tuning.WsForwardConfig,
    has_bias: bool,
    return_logits: bool,
    num_ctas: int,
    interpret: bool,
    interpret_params=None,
    lg_rows: int | None = None,
    weight_layout: str = "vd",
    return_entropy: bool = False,
    row_tma: bool = False,
    row_loads: int | None = None,
    h_box_rows: int | None = None,
    fold: "sm90_fold.StagedPlan | None" = None,
    fold_rows: int | None = None,
):
    """Builds the kernel (hidden, weight, bias_p, targets_p, inv_t_p) -> outputs (`common.out_type`).

    row_tma (static): the epilogue warpgroups bring each work item's targets and inv_t rows
    into shared memory by TMA (one small copy each, awaited on an mbarrier) instead of
    loading them from global memory, so that hidden, targets and inv_t may have fewer rows
    than n_pad (a multiple of 8: Mosaic tiles hidden's TMA in 8-row tiles, and 1 or 3 rows
    of targets / inv_t read wrong on the H200): TMA fills the rows past an array with zeros
    (hidden rows 0, target 0, inv_t 0), which only padding rows read and whose outputs are
    dropped (every row's partials depend on its own row alone). The wrapper passes such rows
    with `wrapper._launch(unpadded=True)` (an option: at M=1 the kernel was 13% slower with
    it on the H200); interpret mode runs the same code on padded rows (its slices are
    bounded). The values reaching the chain are the same, so the bytes are. False builds
    exactly the kernel without it.

    weight_layout (static): "vd", the weight is [Vl, D] (the producer copies [64 w,
    tile_k] blocks into ring slots of that shape and wgmma reads `slot.T`); "dv", the
    weight is [D, Vl] read in place (it copies the [tile_k, 64 w] block of the same K
    slice and columns into slots of that shape, and wgmma reads the slot as B
    directly, an N-major operand; Vl a multiple of `common.DV_COL_MULTIPLE`). Same
    transforms (tile_k-element swizzle rows), same ring bytes, same barriers, same
    wgmma calls (m64nNk16, k ascending, one FP32 accumulator per group) and the same
    epilogue, so both layouts are to give the same bytes (interpret mode checks the
    indexing; the bits of the non-transposed B read are for the H200 to confirm).
    With cluster=2 the multicast splits the dv block along its K rows (each CTA
    loads tile_k / 2 rows of every column) instead of along the vocab rows. The "vd"
    module is the one built before this argument existed.

    row_loads (static; None builds exactly the kernel without it): targets and inv_t are the
    N = row_loads real rows' arrays ([N], no padding), and the epilogue warpgroup reads each
    row's entry with a scalar load (`common.gather_rows`: indices clamped inside the
    array, no TMA), giving the rows past N the padded launch's values (target IGNORE_INDEX,
    inv_t 1.0); so every row's chain sees the values the padded arrays hold. For a decode call
    (one row block, one epilogue warpgroup, no cluster), with `h_box_rows` for hidden: no pads.

    h_box_rows (static; None builds exactly the kernel without it):
    the producer's hidden TMA box covers the first h_box_rows rows of the CTA's rows (a
    multiple of 8 below cta_rows) instead of all of them; the other rows of every pipeline
    slot are zeroed once by the producer before its first copy, so the wgmma A operand holds
    the same values wherever the hidden array's rows past h_box_rows were zeros (padding
    rows). Only for a single row block whose real rows fit in the box (num rows <= h_box_rows).

    return_entropy (static): the epilogue warpgroups' chain also carries the entropy
    statistic A (`linear-logp-entropy-v1`, `tile_math.chain_tile_sliced(..., a=)`) and
    stores it [n_local, n_pad] after z_t; the producer and wgmma warpgroups, the
    barriers, m, S, z_t and the logits are the same as without it. False builds exactly
    the kernel without the statistic.

    fold (static, an experiment for decode; None builds exactly the kernel without it): a
    `sm90_fold.StagedPlan` (zt_splits=True, entropy=return_entropy, n_split the head's splits):
    the kernel also folds its own partials, as `pk.forward`'s second kernel does, and returns
    logp, lse (and with the entropy h) [n_pad] after its other outputs; the partials are still
    returned. Every CTA's epilogue warpgroup, once its partials are stored, fences and signals a
    grid semaphore (`pl.get_global`, zeroed by the launch); after the pipeline's shared memory
    is released (a second `run_scoped` scope over it, entered by every warpgroup), the last
    CTA's epilogue warpgroup waits for all `num_ctas` signals, orders the async proxy after
    them, and runs `sm90_fold.fold_row_block` on the first `fold_rows` rows (default n_pad;
    rows past them are not written), one 32- or 64-row block after another in the same scratch,
    reading the kernel's own split-major m / S / A / captures and its targets / inv_t inputs.
    The same operations on the same operands as the fold kernel, so the same bytes. Interpret
    mode has no `get_global`: it leaves the semaphore out and relies on its CTAs running one
    after another in ascending order (the last CTA folds after every other stored). Only for an
    unsharded head, one epilogue warpgroup, no cluster. Two things the GPU needs that interpret
    mode does not show: each warpgroup returns to the launch's register count after its role
    (the code after the roles is compiled for it), and the fold's barriers are reserved in a
    scope around the pipeline's (in the fold's own scope Mosaic would hand it the pipeline's
    released barriers of the same shape, their phases advanced). The first H200 run, before
    both, hung (docs/PERF_NOTES.md, seventeenth session); not yet run on the GPU since.
    """
    if not isinstance(cfg, tuning.WsForwardConfig):
        raise TypeError(f"sm90_forward_ws needs a tuning.WsForwardConfig, got {type(cfg).__name__}")
    dv = common.check_weight_layout(weight_layout)
    bm = cfg.block_m
    n_mma, n_epi = cfg.num_compute_wgs, cfg.epilogue_wgs  # (checked by WsForwardConfig)
    per_epi = n_mma // n_epi  # hand-off buffers served by one epilogue warpgroup
    reg_producer, reg_mma, reg_epi = register_split(cfg)
    cta_rows = cfg.cta_rows
    cl = cfg.cluster
    if cl > 1 and interpret:
        raise ValueError("the interpreter has no TMA multicast: run cluster=1 (the same bits) in interpret mode")
    assert n_pad % (cta_rows * cl) == 0 and num_ctas % cl == 0, (n_pad, num_ctas, cl)
    n_rb = n_pad // cta_rows
    n_clusters = num_ctas // cl
    tile_k = cfg.tile_k
    if d % tile_k:
        raise ValueError(f"hidden size D={d} must be a multiple of {tile_k}")
    k_iters = d // tile_k
    w, gcols, n_groups = geom.tiles_per_group, geom.group_cols, geom.n_groups
    c0, vocab, j0, n_local = geom.col_offset, geom.vocab_size, geom.split_first, geom.n_local
    n_items = n_local * (n_rb // cl)  # (split, cluster row block) pairs
    dump_bytes = tuning.accumulator_copy_bytes(cfg, w)
    stages = tuning.pipeline_stages(cfg, w, tile_k, dump_bytes)
    assert stages >= 2, stages  # one slot would deadlock: step k waits for the release that follows its own wgmma
    lag = cfg.mma_stagger
    if lag >= stages or lag > n_groups * k_iters:
        raise ValueError(
            f"mma_stagger ({lag}) must be below the pipeline depth ({stages} stages) and at most the K "
            f"slices of one work item ({n_groups * k_iters})"
        )
    stage_bytes = tuning.stage_bytes(cfg, w, tile_k)
    if stages * stage_bytes + dump_bytes > tuning.SMEM_LIMIT:
        raise ValueError(
            f"{stages} stages of {stage_bytes} B plus {dump_bytes} B of hand-off buffers exceed "
            f"{tuning.SMEM_LIMIT} B of shared memory"
        )
    sg = cfg.split_group
    producer = n_mma + n_epi
    if fold is not None:
        fold_rows = n_pad if fold_rows is None else fold_rows
        if not (
            fold.zt_splits
            and fold.entropy == return_entropy
            and fold.n_split == n_local
            and j0 == 0
            and geom.col_offset == 0
            and n_epi == 1
            and cl == 1
            and n_pad % fold.rows == 0
            and 1 <= fold_rows <= n_pad
        ):
            raise ValueError(
                "the in-kernel fold needs an unsharded head (its plan's n_split = the kernel's "
                f"{n_local} splits), zt_splits, the kernel's entropy setting, one epilogue warpgroup, no "
                f"cluster and 1 <= fold_rows <= n_pad = a multiple of its rows; got {fold}, "
                f"fold_rows={fold_rows}, n_pad={n_pad}, {tuning.describe(cfg)}"
            )
    n_fold_out = 0 if fold is None else (3 if return_entropy else 2)
    hb = cta_rows if h_box_rows is None else h_box_rows
    if row_loads is not None and not (
        0 < row_loads <= cta_rows and n_rb == 1 and cl == 1 and n_epi == 1 and not row_tma and fold is None
    ):
        raise ValueError(
            f"row_loads ({row_loads}) needs 1 <= N <= {cta_rows} rows in one row block, one epilogue warpgroup, "
            f"no cluster, no row_tma and no in-kernel fold (n_pad={n_pad}, {tuning.describe(cfg)})"
        )
    if h_box_rows is not None and not (h_box_rows % 8 == 0 and 0 < h_box_rows < cta_rows and n_rb == 1 and cl == 1):
        raise ValueError(
            f"h_box_rows must be a multiple of 8 below {cta_rows}, with one row block and no cluster; "
            f"got {h_box_rows} (n_pad={n_pad}, cluster={cl})"
        )
    # One K slice of tile_k bf16 = one swizzle row (64 -> 128B, 32 -> 64B). The wgmma
    # instruction sequence per accumulator (k16 ascending) does not depend on it.
    transforms = (plgpu.TilingTransform((8, tile_k)), plgpu.SwizzleTransform(2 * tile_k))
    sps = cfg.epilogue_slices
    swz = cfg.handoff == "swizzled"  # hand-off tiles as two swizzled [bm, 32] halves (else 8 slices)
    row_l = common.row_layout()
    col_l = common.col_layout()
    tile_l = plgpu.Layout.WGMMA
    load, cast = common.load, common.cast

    def kernel(*refs):
        h_gmem, w_gmem, b_gmem, tgt_gmem, invt_gmem, m_out, s_out, zt_out, lg_out, a_out = common.unpack_refs(
            refs, has_bias, return_logits, return_entropy
        )
        fold_outs = tuple(refs[len(refs) - n_fold_out :]) if fold is not None else ()
        # The grid semaphore of the in-kernel fold (zeroed for every launch; the wait leaves it at 0).
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR) if fold is not None and not interpret else None

        def _body(fold_bars):
            # (fold_bars: the in-kernel fold's barriers, reserved outside the pipeline's scope.)
            scoped = dict(
                h_smem=plgpu.SMEM((stages, cta_rows, tile_k), jnp.bfloat16, transforms=transforms),
                # A ring slot holds the weight's block in the weight's layout ("dv": [tile_k, 64 w]).
                w_smem=plgpu.SMEM(
                    (stages, tile_k, gcols) if dv else (stages, gcols, tile_k), jnp.bfloat16, transforms=transforms
                ),
                # Hand-off buffer b: tile i as eight [bm, 8] column slices (dynamic tile and
                # slice indices are leading-dimension indices; rows of 32 B, so the WGMMA
                # layout's 8-byte accesses of a warp cover 256 contiguous bytes), or with
                # handoff="swizzled" as two [bm, 32] halves in 128B-swizzled rows (the layout
                # a TMA store reads and WGMMA-layout registers reach without bank conflicts;
                # only whole halves load, the epilogue slices them in registers).
                dump=(
                    plgpu.SMEM(
                        (n_mma, w, 2, bm, 32),
                        F32,
                        transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)),
                    )
                    if swz
                    else plgpu.SMEM((n_mma, w, 8, bm, 8), F32)
                ),
                full=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                # With a cluster, a slot is free when the wgmma warpgroups of every CTA of the
                # cluster are done with it (the peer's multicast writes into it too).
                empty=(
                    plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=n_mma, num_barriers=stages)
                    if cl > 1
                    else plgpu.Barrier(num_arrivals=n_mma, num_barriers=stages)
                ),
                dump_full=plgpu.Barrier(num_arrivals=1, num_barriers=n_mma),
                dump_empty=plgpu.Barrier(num_arrivals=1, num_barriers=n_mma),
            )
            if lag:  # the first wgmma warpgroup's signal that the second may start
                scoped.update(stagger=plgpu.Barrier(num_arrivals=1, num_barriers=1))
            if row_tma:  # each hand-off buffer's targets / inv_t rows; one barrier per epilogue warpgroup
                scoped.update(
                    rows_t=plgpu.SMEM((n_mma, bm), jnp.int32),
                    rows_i=plgpu.SMEM((n_mma, bm), F32),
                    rows_bar=plgpu.Barrier(num_arrivals=2 * per_epi, num_barriers=n_epi),
                )

            @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
            def _scope(
                h_smem,
                w_smem,
                dump,
                full,
                empty,
                dump_full,
                dump_empty,
                stagger=None,
                rows_t=None,
                rows_i=None,
                rows_bar=None,
            ):
                wg = lax.axis_index("wg")
                cid = lax.axis_index("cta")  # the cluster (the CTA when cl == 1)
                n_mine = (n_items - 1 - cid) // n_clusters + 1  # work items of this cluster: cid, cid + n_clusters, ...

                def item(li):
                    js, rbc = common.work_item(cid + li * n_clusters, n_local, n_rb // cl, sg)
                    rb = rbc * cl + lax.axis_index("cluster") if cl > 1 else rbc
                    t0, t1 = common.split_tiles(geom, js + j0)
                    return js, rb, t0, t1

                launch = launch_registers(producer + 1)

                def set_registers(n):
                    # setmaxnreg.inc may only raise and .dec only lower the launch count.
                    if not interpret and n != launch:
                        plgpu.set_max_registers(n, action="increase" if n > launch else "decrease")

                def restore_registers(n):
                    # With the in-kernel fold the warpgroups meet again after their roles (the fold's
                    # scope): each first returns to the launch count, the count ptxas compiled the
                    # whole kernel for, so that no warpgroup runs the code after the roles with fewer
                    # registers than it was compiled for (a producer left at 24 would).
                    if fold is not None and not interpret and n != launch:
                        plgpu.set_max_registers(launch, action="increase" if launch > n else "decrease")

                @pl.when(wg == producer)
                def _producer():
                    set_registers(reg_producer)
                    if h_box_rows is not None:  # rows past the box: zeros in every slot, written once
                        for st in range(stages):
                            h_smem.at[st][...] = jnp.zeros((cta_rows, tile_k), jnp.bfloat16)
                        plgpu.commit_smem()  # before the async proxy (TMA, wgmma) touches the slots

                    def item_body(li, step):
                        _, rb, t0, _ = item(li)
                        row0, wrow0 = rb * cta_rows, t0 * TILE - c0  # wrow0: first weight row / column of the split

                        def load_step(sk, step):
                            g = sk // k_iters
                            k = sk - g * k_iters
                            slot = lax.rem(step, stages)
                            plgpu.barrier_wait(empty.at[slot])
                            # (The whole slot without a box: the module built before h_box_rows.)
                            h_dst = h_smem.at[slot] if h_box_rows is None else h_smem.at[slot, pl.ds(0, hb)]
                            plgpu.copy_gmem_to_smem(
                                h_gmem.at[pl.ds(row0, hb), pl.ds(k * tile_k, tile_k)], h_dst, full.at[slot]
                            )
                            # Rows ("vd") / columns ("dv") past the weight's end (the last group of the last
                            # split) read as zero (TMA fill). In a cluster both CTAs issue this same copy:
                            # each loads half the block and multicasts it to both, and each CTA's
                            # full[slot] awaits the whole block.
                            if dv:
                                w_block = w_gmem.at[pl.ds(k * tile_k, tile_k), pl.ds(wrow0 + g * gcols, gcols)]
                            else:
                                w_block = w_gmem.at[pl.ds(wrow0 + g * gcols, gcols), pl.ds(k * tile_k, tile_k)]
                            plgpu.copy_gmem_to_smem(
                                w_block,
                                w_smem.at[slot],
                                full.at[slot],
                                collective_axes="cluster" if cl > 1 else None,
                            )
                            return step + 1

                        return lax.fori_loop(0, n_groups * k_iters, load_step, step)

                    step = lax.fori_loop(0, n_mine, item_body, jnp.int32(0))
                    # Observe the releases of the last `stages` slots (no barrier phase is left unobserved).
                    for q in range(stages):
                        plgpu.barrier_wait(empty.at[lax.rem(step + q, stages)])
                    restore_registers(reg_producer)

                @pl.when(wg < n_mma)
                def _wgmma():
                    set_registers(reg_mma)
                    for st in range(stages):  # every slot starts free
                        plgpu.barrier_arrive(empty.at[st])
                    if lag:

                        @pl.when(wg == 1)
                        def _wait_for_lead():
                            plgpu.barrier_wait(stagger.at[0])

                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, gcols), F32))
                    def _acc_scope(acc_ref):
                        def k_step(k, carry):
                            acc_ref, step = carry
                            slot = lax.rem(step, stages)
                            plgpu.barrier_wait(full.at[slot])
                            # B = the [K, N] view of the slot: the slot itself ("dv") or its transpose ("vd").
                            w_tile = w_smem.at[slot] if dv else w_smem.at[slot].T
                            plgpu.wgmma(acc_ref, h_smem.at[slot, pl.ds(wg * bm, bm)], w_tile)
                            if lag:

                                @pl.when((wg == 0) & (step == lag - 1))
                                def _lead():  # its first `lag` K slices are issued: the second may start
                                    plgpu.barrier_arrive(stagger.at[0])

                            plgpu.wgmma_wait(1)  # the previous step's wgmma has finished reading its slot

                            @pl.when(k > 0)
                            def _release():
                                plgpu.barrier_arrive(empty.at[lax.rem(step + stages - 1, stages)])

                            return acc_ref, step + 1

                        def group(g, carry):
                            acc_ref, step = lax.fori_loop(0, k_iters, k_step, carry)
                            plgpu.wgmma_wait(0)
                            plgpu.barrier_arrive(empty.at[lax.rem(step + stages - 1, stages)])
                            plgpu.barrier_wait(dump_empty.at[wg])
                            z_all = acc_ref[...]
                            for i in range(w):
                                if swz:
                                    for hh in range(2):
                                        c = i * TILE + 32 * hh
                                        dump.at[wg, i, hh][...] = z_all[:, c : c + 32]
                                else:
                                    for j in range(8):
                                        dump.at[wg, i, j][...] = z_all[:, i * TILE + 8 * j : i * TILE + 8 * j + 8]
                            common.zero_acc(acc_ref, bm, gcols, interpret)
                            if return_logits and not has_bias:
                                plgpu.commit_smem()  # the epilogue's TMA stores read these writes (with bias it rewrites and commits)
                            plgpu.barrier_arrive(dump_full.at[wg])
                            return acc_ref, step

                        def item_body(li, carry):
                            return lax.fori_loop(0, n_groups, group, carry)

                        lax.fori_loop(0, n_mine, item_body, (acc_ref, jnp.int32(0)))
                        plgpu.barrier_wait(dump_empty.at[wg])  # the last hand-back (no phase left unobserved)

                    restore_registers(reg_mma)

                @pl.when((wg >= n_mma) & (wg < producer))
                def _epilogue():
                    set_registers(reg_epi)
                    ep = wg - n_mma
                    bufs = [ep * per_epi + q for q in range(per_epi)]
                    for b in bufs:  # every hand-off buffer starts free
                        plgpu.barrier_arrive(dump_empty.at[b])
                    row_cast = lambda x: cast(x, row_l, interpret)
                    tile_cast = lambda x: cast(x, tile_l, interpret)

                    def item_body(li, _):
                        js, rb, t0, t1 = item(li)
                        limit = jnp.minimum(t1 * TILE, vocab)  # first column not owned by the chain
                        rows = [rb * cta_rows + b * bm for b in bufs]
                        if row_tma:
                            # Every thread has read the previous item's rows (a warpgroup barrier)
                            # before TMA overwrites them; rows past the arrays arrive as zeros.
                            plgpu.commit_smem()
                            for b, r in zip(bufs, rows):
                                plgpu.copy_gmem_to_smem(tgt_gmem.at[pl.ds(r, bm)], rows_t.at[b], rows_bar.at[ep])
                                plgpu.copy_gmem_to_smem(invt_gmem.at[pl.ds(r, bm)], rows_i.at[b], rows_bar.at[ep])
                            plgpu.barrier_wait(rows_bar.at[ep])
                            tgts = [load(rows_t.at[b], row_l, interpret) for b in bufs]
                            invts = [load(rows_i.at[b], row_l, interpret) for b in bufs]
                        elif row_loads is not None:
                            # One row block and one epilogue warpgroup: buffer q holds rows q*bm ..
                            # q*bm + bm - 1 (static), so only the real rows are loaded.
                            def gather(ref, q, fill):
                                return common.gather_rows(ref, q * bm, row_loads, bm, fill, row_l, interpret)

                            tgts = [gather(tgt_gmem, q, C.IGNORE_INDEX) for q in range(per_epi)]
                            invts = [gather(invt_gmem, q, 1.0) for q in range(per_epi)]
                        else:
                            tgts = [load(tgt_gmem.at[pl.ds(r, bm)], row_l, interpret) for r in rows]
                            invts = [load(invt_gmem.at[pl.ds(r, bm)], row_l, interpret) for r in rows]
                        ops = ptx_ops.make_ops(interpret, common.layout_of, source=invts[0])
                        init = tuple(
                            (
                                row_cast(jnp.full((bm,), -jnp.inf, F32)),
                                row_cast(jnp.zeros((bm,), F32)),
                                row_cast(jnp.zeros((bm,), F32)),
                            )
                            + ((row_cast(jnp.zeros((bm,), F32)),) if return_entropy else ())  # A starts at +0
                            for _ in bufs
                        )

                        def tile_chain(q, b, g):
                            def body(i, st):
                                m, s, zt = st[:3]
                                a = st[3] if return_entropy else None
                                tile = t0 + g * w + i  # global tile index
                                tcol0 = tile * TILE
                                # z = fl(acc + b), written back in place: both chain passes and the logits read z.
                                # "slices": each thread reads and rewrites the same addresses (the load and the
                                # store use the same WGMMA layout), so no cross-thread hazard needs the barriers
                                # that unsafe_no_auto_barriers removes. "swizzled": the same per-lane add on
                                # [bm, 32] halves, but a swizzled half's load and store are evidently not one
                                # thread's addresses (without barriers the H200's trainer entry read halves before
                                # their bias was added; interpret mode cannot show it:
                                # benchmarks/results/h200_2026-12-01e/call3_handoff_check.log), so every thread
                                # reads both halves, a barrier, then the rewrites, a barrier (the commit also
                                # orders them before the logits' TMA stores).
                                n_parts, width = (2, 32) if swz else (8, 8)

                                def biased(j):  # fl(z + b) of part j (a slice, or a swizzled half)
                                    bias = load(b_gmem.at[pl.ds(tcol0 - c0 + width * j, width)], col_l, interpret)
                                    zj = load(dump.at[b, i, j], tile_l, interpret)
                                    return tile_cast(ops.add(zj, jnp.broadcast_to(bias[None, :], (bm, width))))

                                if has_bias and not swz:
                                    for j in range(n_parts):
                                        dump.at[b, i, j][...] = biased(j)
                                elif has_bias:
                                    parts = [biased(j) for j in range(n_parts)]
                                    plgpu.commit_smem()  # every thread has read both halves
                                    for j in range(n_parts):
                                        dump.at[b, i, j][...] = parts[j]
                                    plgpu.commit_smem()  # every half is rewritten before the chain (or a TMA store) reads it
                                if return_logits:

                                    @pl.when(
                                        (tile < t1) & (tcol0 - c0 < lg_cols)
                                    )  # padding tiles past the logits' width: none
                                    def _store():
                                        if has_bias and not swz:  # (swizzled: committed above)
                                            plgpu.commit_smem()
                                        for j in range(n_parts):

                                            @pl.when(
                                                tcol0 - c0 + width * j < lg_cols
                                            )  # slices (halves) wholly past the logits' width: none
                                            def _slice():
                                                plgpu.copy_smem_to_gmem(
                                                    dump.at[b, i, j],
                                                    lg_out.at[pl.ds(rows[q], bm), pl.ds(tcol0 - c0 + width * j, width)],
                                                )

                                def half_loaders(k):
                                    # handoff="swizzled": step k's sps slices (4: one [bm, 32] half,
                                    # 8: both) are slices k * sps + q, i.e. column block q % 4 of half
                                    # k * sps / 4 + q / 4; each half is loaded once, at its first
                                    # slice's use, and sliced in registers (k is traced in pass 2).
                                    halves = {}

                                    def slice_of(q):
                                        if q // 4 not in halves:
                                            hh = k * (sps // 4) + q // 4
                                            halves[q // 4] = load(dump.at[b, i, hh], tile_l, interpret)
                                        c = q % 4
                                        return halves[q // 4][:, 8 * c : 8 * c + 8]

                                    return [lambda q=q: slice_of(q) for q in range(sps)]

                                out = tile_math.chain_tile_sliced(
                                    m,
                                    s,
                                    lambda j: load(dump.at[b, i, j], tile_l, interpret),
                                    tcol0,
                                    tgts[q],
                                    invts[q],
                                    limit,
                                    (tile + 1) * TILE <= limit,
                                    ops,
                                    interpret=interpret,
                                    tile_cast=tile_cast,
                                    row_cast=row_cast,
                                    slices_per_step=sps,
                                    a=a,
                                    load_step=half_loaders if swz else None,
                                )
                                m2, s2, z_hit = out[:3]
                                row_hit = (tgts[q] >= tcol0) & (tgts[q] < tcol0 + TILE) & (tile < t1)
                                new = (row_cast(m2), row_cast(s2), row_cast(jnp.where(row_hit, z_hit, zt)))
                                return new + ((row_cast(out[3]),) if return_entropy else ())

                            return body

                        def group(g, state):
                            new = []
                            for q, b in enumerate(bufs):
                                plgpu.barrier_wait(dump_full.at[b])
                                st = lax.fori_loop(0, w, tile_chain(q, b, g), state[q])
                                if return_logits:
                                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stores have read the buffer
                                plgpu.barrier_arrive(dump_empty.at[b])
                                new.append(st)
                            return tuple(new)

                        state = lax.fori_loop(0, n_groups, group, init)
                        for q, r in enumerate(rows):
                            m, s, zt = state[q][:3]
                            m_out.at[js, pl.ds(r, bm)][...] = m
                            s_out.at[js, pl.ds(r, bm)][...] = s
                            zt_out.at[js, pl.ds(r, bm)][...] = zt
                            if return_entropy:
                                a_out.at[js, pl.ds(r, bm)][...] = state[q][3]
                        return 0

                    lax.fori_loop(0, n_mine, item_body, 0)
                    if return_logits:
                        plgpu.wait_smem_to_gmem(0)
                    if sem is not None:
                        # The last-block pattern: every thread's partial stores ordered at GPU scope,
                        # then (a warpgroup barrier) one thread's signal.
                        ptx_ops.fence("fence.acq_rel.gpu;")
                        plgpu.commit_smem()
                        pl.semaphore_signal(sem, 1)
                    restore_registers(reg_epi)

            if fold is not None:
                # A second scope over the pipeline's shared memory (its entry waits for every
                # warpgroup): the fold's buffers (its barriers: `fold_bars`).
                def _fold_scope(*scratch):
                    @pl.when((lax.axis_index("wg") == n_mma) & (lax.axis_index("cta") == n_clusters - 1))
                    def _fold():
                        if sem is not None:
                            pl.semaphore_wait(sem, num_ctas)  # every CTA's partials are stored
                            ptx_ops.fence("fence.proxy.async.global;")  # before TMA reads them
                        ins = (m_out, s_out, a_out, zt_out, tgt_gmem, invt_gmem)
                        outs = fold_outs if return_entropy else (*fold_outs, None)
                        for r0 in range(0, fold_rows, fold.rows):
                            sm90_fold.fold_row_block(fold, ins, outs, scratch, r0)

                pl.run_scoped(
                    lambda *smem: _fold_scope(*fold.merge_scratch(smem, fold_bars)),
                    *fold.smem_types(),
                    collective_axes="wg",
                )

        if fold is None:
            _body(None)
        else:
            # The fold's barriers live in a scope around the pipeline's: reserved in the fold's own
            # scope, Mosaic would hand it the pipeline's released barriers of the same shape (their
            # phases advanced by the pipeline, so the fold's first waits would be on the wrong parity).
            pl.run_scoped(lambda *bars: _body(bars), *fold.barrier_types(), collective_axes="wg")

    out_type = common.out_type(n_local, n_pad, return_logits, lg_rows, lg_cols, return_entropy)
    out_type += (jax.ShapeDtypeStruct((n_pad,), F32),) * n_fold_out
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(n_clusters,),
        grid_names=("cta",),
        **(dict(cluster=(cl,), cluster_names=("cluster",)) if cl > 1 else {}),
        num_threads=producer + 1,
        thread_name="wg",
        # No automatic warpgroup barriers around SMEM accesses (unless cfg.auto_barriers,
        # a timing knob): hand-off buffer writes and reads of different warpgroups are
        # ordered by the release/acquire dump_full / dump_empty mbarriers (all 128
        # threads arrive and wait); the epilogue's bias rewrite touches only the
        # addresses its own thread read; TMA and wgmma accesses of the ring are ordered
        # by full / empty; commit_smem (fence + warpgroup barrier) precedes every TMA
        # store of a buffer (H200: 7.90 vs 8.15 ms at M=4096 with the barriers).
        compiler_params=plgpu.CompilerParams(approx_math=False, unsafe_no_auto_barriers=not cfg.auto_barriers),
        **interpret_utils.kernel_kwargs(interpret, interpret_params),
    )
