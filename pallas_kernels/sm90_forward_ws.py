"""The forward kernel with a dedicated epilogue warpgroup (sm90, Pallas Mosaic GPU).

Same outputs, same bits, same work items as `sm90_forward_wgmma.build`; a
different division of labour inside a CTA, so the chain of one tile group does
not stall the tensor cores:

* one producer warpgroup streams H[rows, k-slice] and W[group columns,
  k-slice] through a ring of `stages` shared-memory slots (TMA, 128B swizzle;
  `_producer`),
* `num_compute_wgs` wgmma warpgroups (block_m rows each) run the K walk of a
  tile group into their accumulator [block_m, 64*w] (k16 instructions
  ascending, one accumulator zeroed per group: the contract's GEMM), then copy
  it to their hand-off buffer in shared memory (once the epilogue has handed
  the previous group's copy back) and go on with the next group's wgmmas
  (`_wgmma`),
* one epilogue warpgroup takes each hand-off buffer and runs the chain over its
  w tiles in ascending order with `tile_math.chain_tile_sliced` (the contract
  step of `tile_math.chain_tile` read from eight 8-column slices) plus the
  target capture of `common.chain_step`, stores the serving entry's logits from
  the buffer by TMA, and hands it back (`_epilogue`, `_epilogue_item`,
  `_tile_step`).

Synchronization (mbarriers, no atomics): `full[slot]` (TMA bytes landed),
`empty[slot]` (every wgmma warpgroup is done reading the slot),
`dump_full[b]` / `dump_empty[b]` (hand-off buffer b filled / free). Every
waiter waits on every phase in order; the initial "free" phases are primed
(one arrival per arriving warpgroup) and the last ones are waited out before
exit. Arrivals are release and waits acquire for all 128 threads of a
warpgroup, which orders the buffer's writes and reads across warpgroups;
Pallas's automatic warpgroup barriers are therefore off (`build`).
Nothing here changes a bit: the accumulator a tile's chain reads is the same
wgmma sequence, and the chain is the same operations in the same order; only
which warpgroup runs it, and when, differs.

Hand-off buffers: each tile as two [bm, 32] halves in 128B-swizzled rows. The
wgmma warpgroups store 2 halves per tile, the epilogue loads each half once and
slices it in registers (all eight slices of a tile in one step of the chain's
exp loop), and the serving entry's logits leave in 2 TMA boxes of 128-byte rows
per tile (the logits' width is then a multiple of 32: `tuning.logits_width`).

Weight layouts (`build(weight_layout=...)`, static): `VD` (W [Vl, D], ring slots
[64 w, 64], wgmma reads `slot.T`) or `DV` (the Flax/Tunix kernel W.T [D, Vl]
read in place, slots [64, 64 w], wgmma reads the slot as an N-major B): the
same bytes land in a slot's operand view and the same instructions run, so both
layouts give the same bits.

Entropy (`build(return_entropy=True)`, static): the epilogue's chain also carries
the entropy statistic A (`tile_math.chain_tile_sliced(..., a=)`: u reduced from the
same slices with the tree of e) and stores it after z_t; the producer and wgmma
warpgroups are unchanged.

Shared memory: stages * (rows + 64 w) * 128 bytes for the ring plus
num_compute_wgs * w * block_m * 256 B for the hand-off buffers (Qwen3, w = 3,
2 x 64 rows: 3 stages = 120 KiB + 96 KiB).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from detlogp_jax import contract as C
from detlogp_jax.layout import as_layout
from pallas_kernels import common, interpret_utils, ptx_ops, tile_math, tuning
from pallas_kernels.common import F32, SWIZZLE, TILE, TILE_K

PRODUCER_REGISTERS = 24
MAX_REGISTERS = 232  # setmaxnreg's upper bound
MMA_REGISTERS = 128  # per wgmma-warpgroup thread: the [64, 192] accumulator alone is 96
SLICES_PER_STEP = 8  # the chain's exp loop reads a whole tile (both halves) per step


def launch_registers(n_wgs: int) -> int:
    """Registers per thread a CTA of n_wgs warpgroups launches with (64K / threads, a multiple of 8)."""
    return 65536 // (n_wgs * 128) // 8 * 8


def register_split(cfg: tuning.WsForwardConfig) -> tuple[int, int, int]:
    """(producer, wgmma, epilogue) registers per thread for `setmaxnreg`.

    The CTA launches with floor(64K / threads) registers per thread (168 for 3 warpgroups, 128
    for 4) and `setmaxnreg` only moves registers between its warpgroups, so the counts must sum
    to at most warpgroups * that (or an increase waits forever): the producer keeps 24, each
    wgmma warpgroup 128, the epilogue warpgroup the rest (at most 232). ptxas compiles the whole
    kernel within the launch count (it does not follow `setmaxnreg`), so the 64x192 wgmma needs
    a launch count of at least 122: at most 4 warpgroups for w = 3 (one epilogue warpgroup)."""
    n_wgs = cfg.num_compute_wgs + 2
    pool = n_wgs * launch_registers(n_wgs)
    epi = min(MAX_REGISTERS, (pool - PRODUCER_REGISTERS - cfg.num_compute_wgs * MMA_REGISTERS) // 8 * 8)
    if epi < 24:
        raise ValueError(f"register split does not fit: wgmma {MMA_REGISTERS}, epilogue {epi} ({tuning.describe(cfg)})")
    return PRODUCER_REGISTERS, MMA_REGISTERS, epi


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static shape of one launch: everything `build`'s pieces read besides the refs."""

    cfg: tuning.WsForwardConfig
    geom: common.ShardGeometry
    n_pad: int
    k_iters: int  # K slices of D
    stages: int  # ring slots
    num_ctas: int
    lg_cols: int
    dv: bool  # the weight is [D, Vl] (read in place)
    has_bias: bool
    return_logits: bool
    return_entropy: bool
    row_loads: int | None
    h_box_rows: int | None
    interpret: bool

    @property
    def bm(self) -> int:
        return self.cfg.block_m

    @property
    def n_mma(self) -> int:  # wgmma warpgroups (hand-off buffers)
        return self.cfg.num_compute_wgs

    @property
    def producer(self) -> int:  # the producer warpgroup's index (the last)
        return self.n_mma + 1

    @property
    def cta_rows(self) -> int:
        return self.cfg.cta_rows

    @property
    def n_rb(self) -> int:  # row blocks
        return self.n_pad // self.cta_rows

    @property
    def n_items(self) -> int:  # (split, row block) pairs
        return self.geom.n_local * self.n_rb

    @property
    def hb(self) -> int:  # rows of the producer's hidden TMA box
        return self.cta_rows if self.h_box_rows is None else self.h_box_rows


class _Refs(NamedTuple):
    """The kernel's operands and outputs (`common.unpack_refs`)."""

    h: object
    w: object
    b: object  # None without a bias
    tgt: object
    invt: object
    m: object
    s: object
    zt: object
    lg: object  # None for the trainer entry
    a: object  # None without the entropy


class _Smem(NamedTuple):
    """The pipeline's shared memory and barriers (one `run_scoped` scope; allocated in the
    order of their names, as `run_scoped` flattens its keyword types)."""

    h_smem: object  # [stages, cta_rows, 64] bf16 ring
    w_smem: object  # [stages, 64 w, 64] ("vd") / [stages, 64, 64 w] ("dv") bf16 ring
    dump: object  # [n_mma, w, 2, bm, 32] f32 hand-off buffers
    full: object  # per slot: its TMA bytes landed
    empty: object  # per slot: every wgmma warpgroup released it
    dump_full: object  # per hand-off buffer: filled
    dump_empty: object  # per hand-off buffer: handed back


class _Cta(NamedTuple):
    """What every warpgroup of a CTA knows about its place (traced)."""

    wg: object  # this warpgroup
    cid: object  # this CTA
    n_mine: object  # work items of this CTA: cid, cid + num_ctas, ...


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
    weight_layout="vd",
    return_entropy: bool = False,
    row_loads: int | None = None,
    h_box_rows: int | None = None,
):
    """Builds the kernel (hidden, weight, bias_p, targets_p, inv_t_p) -> outputs (`common.out_type`).

    weight_layout (static; "vd" / "dv" or a `detlogp_jax.layout.WeightLayout`): `VD`, the
    weight is [Vl, D] (the producer copies [64 w, 64] blocks into ring slots of that shape and
    wgmma reads `slot.T`); `DV`, the weight is [D, Vl] read in place (it copies the [64, 64 w]
    block of the same K slice and columns into slots of that shape, and wgmma reads the slot as
    B directly, an N-major operand; Vl a multiple of `common.DV_COL_MULTIPLE`). Same
    transforms, same ring bytes, same barriers, same wgmma calls (m64nNk16, k ascending, one
    FP32 accumulator per group) and the same epilogue, so both layouts give the same bytes.

    row_loads (static; None builds exactly the kernel without it): targets and inv_t are the
    N = row_loads real rows' arrays ([N], no padding), and the epilogue warpgroup reads each
    row's entry with a scalar load (`common.gather_rows`: indices clamped inside the array, no
    TMA), giving the rows past N the padded launch's values (target IGNORE_INDEX, inv_t 1.0);
    so every row's chain sees the values the padded arrays hold. For a decode call (one row
    block), with `h_box_rows` for hidden: no pads.

    h_box_rows (static; None builds exactly the kernel without it): the producer's hidden TMA
    box covers the first h_box_rows rows of the CTA's rows (a multiple of 8 below cta_rows)
    instead of all of them; the other rows of every pipeline slot are zeroed once by the
    producer before its first copy, so the wgmma A operand holds the same values wherever the
    hidden array's rows past h_box_rows were zeros (padding rows). Only for a single row block
    whose real rows fit in the box.

    return_entropy (static): the epilogue's chain also carries the entropy statistic A
    (`linear-logp-entropy-v1`, `tile_math.chain_tile_sliced(..., a=)`) and stores it
    [n_local, n_pad] after z_t; the producer and wgmma warpgroups, the barriers, m, S, z_t and
    the logits are the same as without it. False builds exactly the kernel without the statistic.
    """
    if not isinstance(cfg, tuning.WsForwardConfig):
        raise TypeError(f"sm90_forward_ws needs a tuning.WsForwardConfig, got {type(cfg).__name__}")
    register_split(cfg)  # (refuses a split that does not fit)
    cta_rows = cfg.cta_rows
    assert n_pad % cta_rows == 0, (n_pad, cta_rows)
    if d % TILE_K:
        raise ValueError(f"hidden size D={d} must be a multiple of {TILE_K}")
    w = geom.tiles_per_group
    dump_bytes = tuning.accumulator_copy_bytes(cfg, w)
    stages = tuning.pipeline_stages(cfg, w, TILE_K, dump_bytes)
    assert stages >= 2, stages  # one slot would deadlock: step k waits for the release that follows its own wgmma
    stage_bytes = tuning.stage_bytes(cfg, w, TILE_K)
    if stages * stage_bytes + dump_bytes > tuning.SMEM_LIMIT:
        raise ValueError(
            f"{stages} stages of {stage_bytes} B plus {dump_bytes} B of hand-off buffers exceed "
            f"{tuning.SMEM_LIMIT} B of shared memory"
        )
    n_rb = n_pad // cta_rows
    if row_loads is not None and not (0 < row_loads <= cta_rows and n_rb == 1):
        raise ValueError(
            f"row_loads ({row_loads}) needs 1 <= N <= {cta_rows} rows in one row block "
            f"(n_pad={n_pad}, {tuning.describe(cfg)})"
        )
    if h_box_rows is not None and not (h_box_rows % 8 == 0 and 0 < h_box_rows < cta_rows and n_rb == 1):
        raise ValueError(
            f"h_box_rows must be a multiple of 8 below {cta_rows}, with one row block; got {h_box_rows} (n_pad={n_pad})"
        )
    plan = _Plan(
        cfg=cfg,
        geom=geom,
        n_pad=n_pad,
        k_iters=d // TILE_K,
        stages=stages,
        num_ctas=num_ctas,
        lg_cols=lg_cols,
        dv=as_layout(weight_layout).transposed,
        has_bias=has_bias,
        return_logits=return_logits,
        return_entropy=return_entropy,
        row_loads=row_loads,
        h_box_rows=h_box_rows,
        interpret=interpret,
    )

    def kernel(*refs):
        refs = _Refs(*common.unpack_refs(refs, has_bias, return_logits, return_entropy))
        pl.run_scoped(lambda **smem: _warpgroups(plan, refs, _Smem(**smem)), collective_axes="wg", **_smem_types(plan))

    return plgpu.kernel(
        kernel,
        out_type=common.out_type(geom.n_local, n_pad, return_logits, lg_rows, lg_cols, return_entropy),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=plan.producer + 1,
        thread_name="wg",
        # No automatic warpgroup barriers around SMEM accesses: hand-off buffer writes and reads
        # of different warpgroups are ordered by the release/acquire dump_full / dump_empty
        # mbarriers (all 128 threads arrive and wait); the epilogue's bias rewrite is fenced by
        # its own commits (`_tile_step`); TMA and wgmma accesses of the ring are ordered by full /
        # empty; commit_smem (fence + warpgroup barrier) precedes every TMA store of a buffer
        # (H200: 7.90 vs 8.15 ms at M=4096 with the barriers; docs/PERFORMANCE.md).
        compiler_params=plgpu.CompilerParams(approx_math=False, unsafe_no_auto_barriers=True),
        **interpret_utils.kernel_kwargs(interpret, interpret_params),
    )


def _smem_types(plan: _Plan) -> dict:
    """The `_Smem` buffers and barriers, by field name."""
    transforms = (plgpu.TilingTransform((8, TILE_K)), plgpu.SwizzleTransform(SWIZZLE))
    stages, gcols, n_mma = plan.stages, plan.geom.group_cols, plan.n_mma
    w_shape = (stages, TILE_K, gcols) if plan.dv else (stages, gcols, TILE_K)  # the weight's own layout
    return dict(
        h_smem=plgpu.SMEM((stages, plan.cta_rows, TILE_K), jnp.bfloat16, transforms=transforms),
        w_smem=plgpu.SMEM(w_shape, jnp.bfloat16, transforms=transforms),
        # Hand-off buffer b: tile i as two [bm, 32] halves in 128B-swizzled rows (the layout a TMA
        # store reads and WGMMA-layout registers reach without bank conflicts; only whole halves
        # load, the epilogue slices them in registers).
        dump=plgpu.SMEM(
            (n_mma, plan.geom.tiles_per_group, 2, plan.bm, 32),
            F32,
            transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)),
        ),
        full=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        empty=plgpu.Barrier(num_arrivals=n_mma, num_barriers=stages),
        dump_full=plgpu.Barrier(num_arrivals=1, num_barriers=n_mma),
        dump_empty=plgpu.Barrier(num_arrivals=1, num_barriers=n_mma),
    )


def _warpgroups(plan: _Plan, refs: _Refs, smem: _Smem):
    """The CTA's roles: the producer (the last warpgroup), the wgmma warpgroups (0 .. n_mma - 1)
    and the epilogue warpgroup (n_mma), each after moving its registers (`register_split`)."""
    wg = lax.axis_index("wg")
    cid = lax.axis_index("cta")
    n_mine = (plan.n_items - 1 - cid) // plan.num_ctas + 1
    cta = _Cta(wg, cid, n_mine)
    reg_producer, reg_mma, reg_epi = register_split(plan.cfg)
    launch = launch_registers(plan.producer + 1)

    def set_registers(n):
        # setmaxnreg.inc may only raise and .dec only lower the launch count.
        if not plan.interpret and n != launch:
            plgpu.set_max_registers(n, action="increase" if n > launch else "decrease")

    @pl.when(wg == plan.producer)
    def _producer_role():
        set_registers(reg_producer)
        _producer(plan, refs, smem, cta)

    @pl.when(wg < plan.n_mma)
    def _wgmma_role():
        set_registers(reg_mma)
        _wgmma(plan, smem, cta)

    @pl.when((wg >= plan.n_mma) & (wg < plan.producer))
    def _epilogue_role():
        set_registers(reg_epi)
        _epilogue(plan, refs, smem, cta)


def _item(plan: _Plan, cta: _Cta, li):
    """(local split, row block, first tile, end tile) of this CTA's li-th work item."""
    js, rb = common.work_item(cta.cid + li * plan.num_ctas, plan.geom.n_local, plan.n_rb, plan.cfg.split_group)
    t0, t1 = common.split_tiles(plan.geom, js + plan.geom.split_first)
    return js, rb, t0, t1


def _producer(plan: _Plan, refs: _Refs, smem: _Smem, cta: _Cta):
    """TMA of every work item's (tile group, K slice) steps into the ring, in order; each slot
    once every wgmma warpgroup has released it."""
    stages, k_iters, gcols = plan.stages, plan.k_iters, plan.geom.group_cols
    if plan.h_box_rows is not None:  # rows past the box: zeros in every slot, written once
        for st in range(stages):
            smem.h_smem.at[st][...] = jnp.zeros((plan.cta_rows, TILE_K), jnp.bfloat16)
        plgpu.commit_smem()  # before the async proxy (TMA, wgmma) touches the slots

    def item_body(li, step):
        _, rb, t0, _ = _item(plan, cta, li)
        row0, wrow0 = (
            rb * plan.cta_rows,
            t0 * TILE - plan.geom.col_offset,
        )  # wrow0: the split's first weight row / column

        def load_step(sk, step):
            g = sk // k_iters
            k = sk - g * k_iters
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(smem.empty.at[slot])
            h_dst = smem.h_smem.at[slot] if plan.h_box_rows is None else smem.h_smem.at[slot, pl.ds(0, plan.hb)]
            plgpu.copy_gmem_to_smem(
                refs.h.at[pl.ds(row0, plan.hb), pl.ds(k * TILE_K, TILE_K)], h_dst, smem.full.at[slot]
            )
            # Rows ("vd") / columns ("dv") past the weight's end (the last group of the last
            # split) read as zero (TMA fill).
            if plan.dv:
                w_block = refs.w.at[pl.ds(k * TILE_K, TILE_K), pl.ds(wrow0 + g * gcols, gcols)]
            else:
                w_block = refs.w.at[pl.ds(wrow0 + g * gcols, gcols), pl.ds(k * TILE_K, TILE_K)]
            plgpu.copy_gmem_to_smem(w_block, smem.w_smem.at[slot], smem.full.at[slot])
            return step + 1

        return lax.fori_loop(0, plan.geom.n_groups * k_iters, load_step, step)

    step = lax.fori_loop(0, cta.n_mine, item_body, jnp.int32(0))
    # Observe the releases of the last `stages` slots (no barrier phase is left unobserved).
    for q in range(stages):
        plgpu.barrier_wait(smem.empty.at[lax.rem(step + q, stages)])


def _wgmma(plan: _Plan, smem: _Smem, cta: _Cta):
    """A wgmma warpgroup: per tile group the K walk into its accumulator (k ascending, one
    accumulator), then the accumulator's copy into its hand-off buffer (once the epilogue has
    handed the previous copy back) and the accumulator zeroed for the next group."""
    stages, bm, gcols, wg = plan.stages, plan.bm, plan.geom.group_cols, cta.wg
    for st in range(stages):  # every slot starts free
        plgpu.barrier_arrive(smem.empty.at[st])

    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, gcols), F32))
    def _acc_scope(acc_ref):
        def k_step(k, carry):
            acc_ref, step = carry
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(smem.full.at[slot])
            # B = the [K, N] view of the slot: the slot itself ("dv") or its transpose ("vd").
            w_tile = smem.w_smem.at[slot] if plan.dv else smem.w_smem.at[slot].T
            plgpu.wgmma(acc_ref, smem.h_smem.at[slot, pl.ds(wg * bm, bm)], w_tile)
            plgpu.wgmma_wait(1)  # the previous step's wgmma has finished reading its slot

            @pl.when(k > 0)
            def _release():
                plgpu.barrier_arrive(smem.empty.at[lax.rem(step + stages - 1, stages)])

            return acc_ref, step + 1

        def group(g, carry):
            acc_ref, step = lax.fori_loop(0, plan.k_iters, k_step, carry)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(smem.empty.at[lax.rem(step + stages - 1, stages)])
            plgpu.barrier_wait(smem.dump_empty.at[wg])
            z_all = acc_ref[...]
            for i in range(plan.geom.tiles_per_group):
                for hh in range(2):
                    c = i * TILE + 32 * hh
                    smem.dump.at[wg, i, hh][...] = z_all[:, c : c + 32]
            common.zero_acc(acc_ref, bm, gcols, plan.interpret)
            if plan.return_logits and not plan.has_bias:
                plgpu.commit_smem()  # the epilogue's TMA stores read these writes (with bias it rewrites and commits)
            plgpu.barrier_arrive(smem.dump_full.at[wg])
            return acc_ref, step

        def item_body(li, carry):
            return lax.fori_loop(0, plan.geom.n_groups, group, carry)

        lax.fori_loop(0, cta.n_mine, item_body, (acc_ref, jnp.int32(0)))
        plgpu.barrier_wait(smem.dump_empty.at[wg])  # the last hand-back (no phase left unobserved)


def _epilogue(plan: _Plan, refs: _Refs, smem: _Smem, cta: _Cta):
    """The epilogue warpgroup: every work item's chain over the hand-off buffers of all wgmma
    warpgroups (`_epilogue_item`), then the logits stores drained."""
    # The hand-off buffers this warpgroup serves: all of them (one epilogue warpgroup; ep is 0
    # at run time, the indices are traced from wg: the shipped modules are built that way).
    ep = cta.wg - plan.n_mma
    bufs = [ep * plan.n_mma + q for q in range(plan.n_mma)]
    for b in bufs:  # every hand-off buffer starts free
        plgpu.barrier_arrive(smem.dump_empty.at[b])

    def item_body(li, _):
        _epilogue_item(plan, refs, smem, cta, bufs, li)
        return 0

    lax.fori_loop(0, cta.n_mine, item_body, 0)
    if plan.return_logits:
        plgpu.wait_smem_to_gmem(0)


def _epilogue_item(plan: _Plan, refs: _Refs, smem: _Smem, cta: _Cta, bufs, li):
    """One work item in the epilogue: the rows' targets / inv_t, the chain state from (-inf, +0,
    +0[, +0]), each tile group's tiles in ascending order from its hand-off buffers, the partials
    stored."""
    bm, interpret, load = plan.bm, plan.interpret, common.load
    row_l = common.row_layout()
    row_cast = lambda x: common.cast(x, row_l, interpret)
    js, rb, t0, t1 = _item(plan, cta, li)
    limit = jnp.minimum(t1 * TILE, plan.geom.vocab_size)  # first column not owned by the chain
    rows = [rb * plan.cta_rows + b * bm for b in bufs]
    if plan.row_loads is not None:
        # One row block: buffer q holds rows q*bm .. q*bm + bm - 1 (static), so only the real
        # rows are loaded.
        def gather(ref, q, fill):
            return common.gather_rows(ref, q * bm, plan.row_loads, bm, fill, row_l, interpret)

        tgts = [gather(refs.tgt, q, C.IGNORE_INDEX) for q in range(len(bufs))]
        invts = [gather(refs.invt, q, 1.0) for q in range(len(bufs))]
    else:
        tgts = [load(refs.tgt.at[pl.ds(r, bm)], row_l, interpret) for r in rows]
        invts = [load(refs.invt.at[pl.ds(r, bm)], row_l, interpret) for r in rows]
    ops = ptx_ops.make_ops(interpret, common.layout_of, source=invts[0])
    init = tuple(
        (
            row_cast(jnp.full((bm,), -jnp.inf, F32)),
            row_cast(jnp.zeros((bm,), F32)),
            row_cast(jnp.zeros((bm,), F32)),
        )
        + ((row_cast(jnp.zeros((bm,), F32)),) if plan.return_entropy else ())  # A starts at +0
        for _ in bufs
    )
    item = _EpilogueItem(t0, t1, limit, rows, tgts, invts, ops)

    def group(g, state):
        new = []
        for q, b in enumerate(bufs):
            plgpu.barrier_wait(smem.dump_full.at[b])
            st = lax.fori_loop(
                0, plan.geom.tiles_per_group, functools.partial(_tile_step, plan, refs, smem, item, q, b, g), state[q]
            )
            if plan.return_logits:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stores have read the buffer
            plgpu.barrier_arrive(smem.dump_empty.at[b])
            new.append(st)
        return tuple(new)

    state = lax.fori_loop(0, plan.geom.n_groups, group, init)
    for q, r in enumerate(rows):
        m, s, zt = state[q][:3]
        refs.m.at[js, pl.ds(r, bm)][...] = m
        refs.s.at[js, pl.ds(r, bm)][...] = s
        refs.zt.at[js, pl.ds(r, bm)][...] = zt
        if plan.return_entropy:
            refs.a.at[js, pl.ds(r, bm)][...] = state[q][3]


class _EpilogueItem(NamedTuple):
    """One work item's values in the epilogue (traced): its tiles [t0, t1), the chain's column
    limit, each hand-off buffer's first row and its rows' targets / inv_t, the rounded ops."""

    t0: object
    t1: object
    limit: object
    rows: list
    tgts: list
    invts: list
    ops: object


def _tile_step(plan: _Plan, refs: _Refs, smem: _Smem, item: _EpilogueItem, q, b, g, i, st):
    """Tile i of tile group g from hand-off buffer b (rows of buffer q): z = fl(acc + b) written
    back in place, the serving entry's logits stored, one contract step of the chain and the
    target capture: st = (m, S, z_t[, A]) -> the next."""
    bm, interpret, load = plan.bm, plan.interpret, common.load
    row_cast = lambda x: common.cast(x, common.row_layout(), interpret)
    tile_cast = lambda x: common.cast(x, plgpu.Layout.WGMMA, interpret)
    c0, lg_cols, ops = plan.geom.col_offset, plan.lg_cols, item.ops
    m, s, zt = st[:3]
    a = st[3] if plan.return_entropy else None
    tile = item.t0 + g * plan.geom.tiles_per_group + i  # global tile index
    tcol0 = tile * TILE
    # z = fl(acc + b), written back in place: both chain passes and the logits read z. A
    # swizzled half's load and store are not one thread's addresses (without barriers the H200's
    # trainer entry read halves before their bias was added; interpret mode cannot show it:
    # docs/PERFORMANCE.md), so every thread reads both halves, a barrier, then the rewrites, a
    # barrier (the commit also orders them before the logits' TMA stores).
    if plan.has_bias:

        def biased(j):  # fl(z + b) of half j
            bias = load(refs.b.at[pl.ds(tcol0 - c0 + 32 * j, 32)], common.col_layout(), interpret)
            zj = load(smem.dump.at[b, i, j], plgpu.Layout.WGMMA, interpret)
            return tile_cast(ops.add(zj, jnp.broadcast_to(bias[None, :], (bm, 32))))

        parts = [biased(j) for j in range(2)]
        plgpu.commit_smem()  # every thread has read both halves
        for j in range(2):
            smem.dump.at[b, i, j][...] = parts[j]
        plgpu.commit_smem()  # every half is rewritten before the chain (or a TMA store) reads it
    if plan.return_logits:

        @pl.when((tile < item.t1) & (tcol0 - c0 < lg_cols))  # padding tiles past the logits' width: none
        def _store():
            for j in range(2):

                @pl.when(tcol0 - c0 + 32 * j < lg_cols)  # halves wholly past the logits' width: none
                def _half():
                    plgpu.copy_smem_to_gmem(
                        smem.dump.at[b, i, j],
                        refs.lg.at[pl.ds(item.rows[q], bm), pl.ds(tcol0 - c0 + 32 * j, 32)],
                    )

    def half_loaders(k):
        # Step k's 8 slices are slices 8k + q, i.e. column block q % 4 of half 2k + q / 4; each
        # half is loaded once, at its first slice's use, and sliced in registers.
        halves = {}

        def slice_of(q):
            if q // 4 not in halves:
                hh = k * (SLICES_PER_STEP // 4) + q // 4
                halves[q // 4] = load(smem.dump.at[b, i, hh], plgpu.Layout.WGMMA, interpret)
            c = q % 4
            return halves[q // 4][:, 8 * c : 8 * c + 8]

        return [lambda q=q: slice_of(q) for q in range(SLICES_PER_STEP)]

    tgt = item.tgts[q]
    out = tile_math.chain_tile_sliced(
        m,
        s,
        lambda j: load(smem.dump.at[b, i, j], plgpu.Layout.WGMMA, interpret),
        tcol0,
        tgt,
        item.invts[q],
        item.limit,
        (tile + 1) * TILE <= item.limit,
        ops,
        interpret=interpret,
        tile_cast=tile_cast,
        row_cast=row_cast,
        slices_per_step=SLICES_PER_STEP,
        a=a,
        load_step=half_loaders,
    )
    m2, s2, z_hit = out[:3]
    row_hit = (tgt >= tcol0) & (tgt < tcol0 + TILE) & (tile < item.t1)
    new = (row_cast(m2), row_cast(s2), row_cast(jnp.where(row_hit, z_hit, zt)))
    return new + ((row_cast(out[3]),) if plan.return_entropy else ())
