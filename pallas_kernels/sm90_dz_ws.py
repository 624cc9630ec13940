"""The backward's dz kernel with a dedicated epilogue warpgroup (sm90, Pallas Mosaic GPU).

The operands, outputs and per-element arithmetic of `sm90_dz.build` (see its module
docstring for dz), on `sm90_forward_ws`'s division of labour, so a work item's dz
arithmetic and stores no longer hold up the tensor cores:

* one producer warpgroup streams H[rows, k-slice] and W[item columns, k-slice] through a
  ring of `stages` shared-memory slots (TMA, 128B swizzle),
* `num_compute_wgs` wgmma warpgroups (64 rows each) run the K walk of the item into their
  accumulator [64, 64 w] (k16 instructions ascending from zero), copy it to their hand-off
  buffer in shared memory (as two [64, 32] 128B-swizzled halves per 64-column tile, once the
  epilogue has handed the previous copy back) and go on with the next item's wgmmas,
* the epilogue warpgroup forms dz from each half (bias, u = z * inv_t - lse, p = exp(u),
  dz = q * p + c2 * [col == target], 0 outside lo <= col < hi: `sm90_dz`'s operations in its
  order) and stores it as bf16 by TMA from a double-buffered [64, 32] staging tile.

Synchronization as in `sm90_forward_ws` (mbarriers `full` / `empty` for the ring,
`dump_full` / `dump_empty` for the hand-off buffers; every phase is observed; arrivals
release, waits acquire). Pallas's automatic warpgroup barriers stay on by default
(`tuning.DzWsConfig.auto_barriers`): the epilogue's staging-tile writes are then ordered
against the TMA store that reads the previous contents.

Work items are (column block of 64 w, row block of 64 * num_compute_wgs) pairs; the chunk
must be a multiple of 64 w columns (`chunk_supported`). `in_place` as in `sm90_dz`: the
weight (and bias) whole, bounds = (start, lo, hi) with absolute columns. The backward is
not part of the frozen contract; the kernel is deterministic (no atomics, no split-K, a
fixed walk per element), and a row's dz does not depend on the other rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common, interpret_utils, sm90_forward_ws, tuning
from pallas_kernels.common import F32, SWIZZLE, TILE, TILE_K

HALF = 32  # columns of a hand-off half and of a dz store box
# (sm90_dz's clamp of u with the entropy term; the same value, the same reason)
U_FLOOR = -128.0
# Staging tiles for the dz stores: two [64, HALF] bf16 (64-byte rows).
OUT_SLOTS = 2


def chunk_supported(chunk: int, cfg: tuning.DzWsConfig) -> bool:
    """Whether this kernel tiles vocab chunks of this length."""
    return chunk % cfg.block_n == 0


def build(
    *,
    n_pad: int,
    d: int,
    chunk: int,
    has_bias: bool,
    num_ctas: int,
    interpret: bool,
    interpret_params=None,
    cfg: tuning.DzWsConfig,
    has_entropy: bool = False,
    weight_layout: str = "vd",
    in_place: bool = False,
):
    """Kernel (hidden, w, [bias], tgt, inv_t, lse, c1, c2, [c3, h], bounds) -> dz [n_pad, chunk] bf16
    (`sm90_dz.build`'s operands and result)."""
    if not isinstance(cfg, tuning.DzWsConfig):
        raise TypeError(f"sm90_dz_ws needs a tuning.DzWsConfig, got {type(cfg).__name__}")
    dv = common.check_weight_layout(weight_layout)
    bm, n_mma, w = cfg.block_m, cfg.num_compute_wgs, cfg.tiles_per_group
    gcols, cta_rows = cfg.block_n, cfg.rows_per_cta
    if n_pad % cta_rows or not chunk_supported(chunk, cfg) or d % TILE_K:
        raise ValueError(
            f"sm90_dz_ws: rows {n_pad} (a multiple of {cta_rows}), chunk {chunk} (of {gcols}) and D={d} (of {TILE_K})"
        )
    n_rb, n_cb = n_pad // cta_rows, chunk // gcols
    n_items = n_rb * n_cb
    k_iters = d // TILE_K
    reg_producer, reg_mma, reg_epi = sm90_forward_ws.register_split(cfg)
    producer = n_mma + 1
    dump_bytes = n_mma * w * bm * TILE * 4
    out_bytes = OUT_SLOTS * bm * HALF * 2
    stage_bytes = (cta_rows + gcols) * TILE_K * 2
    stages = min(cfg.max_concurrent_steps, (tuning.SMEM_LIMIT - dump_bytes - out_bytes) // stage_bytes)
    if stages < 2:  # one slot would deadlock (step k waits for the release that follows its own wgmma)
        raise ValueError(f"sm90_dz_ws: {dump_bytes} B of hand-off buffers leave room for {stages} pipeline stages")
    transforms = (plgpu.TilingTransform((8, TILE_K)), plgpu.SwizzleTransform(SWIZZLE))
    half_transforms = (plgpu.TilingTransform((8, HALF)), plgpu.SwizzleTransform(128))
    out_transforms = (plgpu.TilingTransform((8, HALF)), plgpu.SwizzleTransform(64))
    row_l, col_l, tile_l = common.row_layout(), common.col_layout(), plgpu.Layout.WGMMA
    load = functools.partial(interpret_utils.load, interpret=interpret)
    cast = functools.partial(interpret_utils.cast, interpret=interpret)

    def kernel(*refs):
        refs = list(refs)
        h_gmem, w_gmem = refs[:2]
        b_gmem = refs.pop(2) if has_bias else None
        tgt_gmem, invt_gmem, lse_gmem, c1_gmem, c2_gmem = refs[2:7]
        c3_gmem, hh_gmem = refs[7:9] if has_entropy else (None, None)
        bnd_gmem, dz_out = refs[-2:]

        scoped = dict(
            h_smem=plgpu.SMEM((stages, cta_rows, TILE_K), jnp.bfloat16, transforms=transforms),
            w_smem=plgpu.SMEM(
                (stages, TILE_K, gcols) if dv else (stages, gcols, TILE_K), jnp.bfloat16, transforms=transforms
            ),
            dump=plgpu.SMEM((n_mma, w, 2, bm, HALF), F32, transforms=half_transforms),
            out_smem=plgpu.SMEM((OUT_SLOTS, bm, HALF), jnp.bfloat16, transforms=out_transforms),
            full=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            empty=plgpu.Barrier(num_arrivals=n_mma, num_barriers=stages),
            dump_full=plgpu.Barrier(num_arrivals=1, num_barriers=n_mma),
            dump_empty=plgpu.Barrier(num_arrivals=1, num_barriers=n_mma),
        )

        @functools.partial(pl.run_scoped, collective_axes="wg", **scoped)
        def _scope(h_smem, w_smem, dump, out_smem, full, empty, dump_full, dump_empty):
            wg = lax.axis_index("wg")
            cid = lax.axis_index("cta")
            n_mine = (n_items - 1 - cid) // num_ctas + 1  # work items cid, cid + num_ctas, ...
            # The chunk's first column in w_gmem / b_gmem (0: they are the chunk's slices).
            base = pl.multiple_of(bnd_gmem[0], 64) if in_place else 0
            lo = bnd_gmem[1 if in_place else 0]
            hi = bnd_gmem[2 if in_place else 1]

            def item(li):
                cb, rb = common.work_item(cid + li * num_ctas, n_cb, n_rb, cfg.col_group)
                return cb * gcols, rb * cta_rows  # (chunk column, row) of the item's corner

            launch = sm90_forward_ws.launch_registers(producer + 1)

            def set_registers(n):
                if not interpret and n != launch:
                    plgpu.set_max_registers(n, action="increase" if n > launch else "decrease")

            @pl.when(wg == producer)
            def _producer():
                set_registers(reg_producer)

                def item_body(li, step):
                    col0, row0 = item(li)
                    wcol = base + col0

                    def load_step(k, step):
                        slot = lax.rem(step, stages)
                        plgpu.barrier_wait(empty.at[slot])
                        plgpu.copy_gmem_to_smem(
                            h_gmem.at[pl.ds(row0, cta_rows), pl.ds(k * TILE_K, TILE_K)], h_smem.at[slot], full.at[slot]
                        )
                        if dv:
                            w_block = w_gmem.at[pl.ds(k * TILE_K, TILE_K), pl.ds(wcol, gcols)]
                        else:
                            w_block = w_gmem.at[pl.ds(wcol, gcols), pl.ds(k * TILE_K, TILE_K)]
                        plgpu.copy_gmem_to_smem(w_block, w_smem.at[slot], full.at[slot])
                        return step + 1

                    return lax.fori_loop(0, k_iters, load_step, step)

                step = lax.fori_loop(0, n_mine, item_body, jnp.int32(0))
                for q in range(stages):  # observe the releases of the last `stages` slots
                    plgpu.barrier_wait(empty.at[lax.rem(step + q, stages)])

            @pl.when(wg < n_mma)
            def _wgmma():
                set_registers(reg_mma)
                for st in range(stages):  # every slot starts free
                    plgpu.barrier_arrive(empty.at[st])

                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, gcols), F32))
                def _acc_scope(acc_ref):
                    def k_step(k, carry):
                        acc_ref, step = carry
                        slot = lax.rem(step, stages)
                        plgpu.barrier_wait(full.at[slot])
                        w_tile = w_smem.at[slot] if dv else w_smem.at[slot].T
                        plgpu.wgmma(acc_ref, h_smem.at[slot, pl.ds(wg * bm, bm)], w_tile)
                        plgpu.wgmma_wait(1)  # the previous step's wgmma has finished reading its slot

                        @pl.when(k > 0)
                        def _release():
                            plgpu.barrier_arrive(empty.at[lax.rem(step + stages - 1, stages)])

                        return acc_ref, step + 1

                    def item_body(li, carry):
                        acc_ref, step = lax.fori_loop(0, k_iters, k_step, carry)
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(empty.at[lax.rem(step + stages - 1, stages)])
                        plgpu.barrier_wait(dump_empty.at[wg])
                        z_all = acc_ref[...]
                        for i in range(w):
                            for hh in range(2):
                                c = i * TILE + HALF * hh
                                dump.at[wg, i, hh][...] = z_all[:, c : c + HALF]
                        common.zero_acc(acc_ref, bm, gcols, interpret)
                        plgpu.barrier_arrive(dump_full.at[wg])
                        return acc_ref, step

                    lax.fori_loop(0, n_mine, item_body, (acc_ref, jnp.int32(0)))
                    plgpu.barrier_wait(dump_empty.at[wg])  # the last hand-back

            @pl.when(wg == n_mma)
            def _epilogue():
                set_registers(reg_epi)
                for b in range(n_mma):  # every hand-off buffer starts free
                    plgpu.barrier_arrive(dump_empty.at[b])
                col_iota = cast(lax.broadcasted_iota(jnp.int32, (bm, HALF), 1), tile_l)
                bc = lambda v: jnp.broadcast_to(v[:, None], (bm, HALF))
                zeros = jnp.zeros((bm, HALF), F32)

                def item_body(li, _):
                    col0, row0 = item(li)
                    for b in range(n_mma):
                        rows = pl.ds(row0 + b * bm, bm)
                        tgt = load(tgt_gmem.at[rows], row_l)
                        invt = load(invt_gmem.at[rows], row_l)
                        lse = load(lse_gmem.at[rows], row_l)
                        c1 = load(c1_gmem.at[rows], row_l)
                        c2 = load(c2_gmem.at[rows], row_l)
                        c3 = None
                        if has_entropy:
                            c3 = load(c3_gmem.at[rows], row_l)
                            c1 = c1 + c3 * load(hh_gmem.at[rows], row_l)  # c1 + c3 * h, per row
                        plgpu.barrier_wait(dump_full.at[b])
                        for i in range(w):
                            for hh in range(2):
                                c = col0 + i * TILE + HALF * hh  # the half's first column in the chunk
                                z = load(dump.at[b, i, hh], tile_l)
                                if has_bias:
                                    bias = load(b_gmem.at[pl.ds(base + c, HALF)], col_l)
                                    z = z + jnp.broadcast_to(bias[None, :], (bm, HALF))
                                col = col_iota + (base + c)  # the column in the targets' and bounds' frame
                                u = z * bc(invt) - bc(lse)
                                if has_entropy:
                                    u = jnp.maximum(u, jnp.full((bm, HALF), U_FLOOR, F32))
                                p = jnp.exp(u)
                                q = bc(c1) + bc(c3) * u if has_entropy else bc(c1)
                                dz = q * p + jnp.where(col == bc(tgt), bc(c2), zeros)
                                dz = jnp.where((col >= lo) & (col < hi), dz, zeros)
                                slot = hh  # OUT_SLOTS = 2: the halves alternate
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store 2 halves ago has read it
                                out_smem.at[slot][...] = dz.astype(jnp.bfloat16)
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(out_smem.at[slot], dz_out.at[rows, pl.ds(c, HALF)])
                        plgpu.barrier_arrive(dump_empty.at[b])
                    return 0

                lax.fori_loop(0, n_mine, item_body, 0)
                plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((n_pad, chunk), jnp.bfloat16),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=producer + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=False, unsafe_no_auto_barriers=not cfg.auto_barriers),
        **interpret_utils.kernel_kwargs(interpret, interpret_params),
    )
