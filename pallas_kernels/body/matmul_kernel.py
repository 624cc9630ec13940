"""The body GEMM kernel for Hopper: out = x @ W, bf16 operands, ONE f32 accumulator per element.

Per CTA (persistent over output tiles): a producer warpgroup streams [cta_rows, 64] blocks of x
and the matching 64-deep K slice of the CTA's weight columns through a TMA + mbarrier ring
(`plgpu.emit_pipeline_warp_specialized`); `wgs` consumer warpgroups each own `wg_rows` rows of
the tile in `accs` f32 accumulators [wg_rows, n_instr] and advance them with
`plgpu.wgmma` (m64 n_instr k16 instructions, k ascending) on every pipeline step, K walked
from 0 to K - 1 once: no split-K, no partial sums combined afterwards. The epilogue rounds each
accumulator once to the output dtype and stores it through [64, 64] shared-memory boxes by TMA.

The weight is read in place: "kn" (W [K, N]) blocks are [64, cols] and wgmma reads them as the
B operand directly (N-major); "nk" (W [N, K]) blocks are [cols, 64] read through `.T`
(K-major; transposed 16-bit operands are allowed). Rows of x past its end read as zeros (TMA
fill) and output rows past its end are not written (TMA clips), so no row of x, real or
padding, reaches another row's accumulator.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common, interpret_utils
from pallas_kernels.body import matmul_config as mc

F32 = jnp.float32
OUT_SLOTS = 2  # staging boxes per consumer warpgroup, alternating


def _operand_transforms():
    return (plgpu.TilingTransform((8, mc.SWIZZLE // 2)), plgpu.SwizzleTransform(mc.SWIZZLE))


def _out_transforms(out_dtype):
    width = mc.SWIZZLE // jnp.dtype(out_dtype).itemsize
    return (plgpu.TilingTransform((8, width)), plgpu.SwizzleTransform(mc.SWIZZLE))


def build(
    *,
    rows: int,
    n: int,
    k: int,
    nk: bool,
    out_dtype,
    cfg: mc.TuningConfig,
    n_instr: int,
    num_ctas: int,
    interpret: bool = False,
    interpret_params=None,
):
    """The kernel (x [rows, k] bf16, w) -> out [rows, n] out_dtype for one launch geometry.

    nk: W is [n, k] (else [k, n]); n_instr: the wgmma instruction's N (bit-relevant: a function
    of the weight's N, `matmul_config.instruction_n`); cfg, num_ctas: bit-neutral geometry."""
    accs = mc.accs_for(cfg, n, n_instr)
    tm, tn = cfg.cta_rows, accs * n_instr
    if cfg.wg_rows * tn > 128 * 128:
        raise ValueError(f"body GEMM: a warpgroup's accumulators [{cfg.wg_rows}, {tn}] exceed its registers")
    if k % mc.TILE_K or n % tn or n_instr % mc.EPI:
        raise ValueError(f"body GEMM: [{rows}, {n}] x K={k} does not tile by {tm} x {tn} x {mc.TILE_K}")
    m_tiles, n_tiles, k_iters = -(-rows // tm), n // tn, k // mc.TILE_K
    out_bytes = jnp.dtype(out_dtype).itemsize
    stages = min(k_iters, mc.stages_for(cfg, n_instr, accs, out_bytes, OUT_SLOTS))
    spec = functools.partial(plgpu.BlockSpec, transforms=_operand_transforms())
    a_spec = spec((tm, mc.TILE_K), lambda kk: (0, kk))
    b_spec = spec((tn, mc.TILE_K), lambda kk: (0, kk)) if nk else spec((mc.TILE_K, tn), lambda kk: (kk, 0))

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[a_spec, b_spec],
            wg_axis="wg",
            num_compute_wgs=cfg.wgs,
            max_concurrent_steps=stages,
            compute_context=context,
        )

    def b_columns(b_smem, j):
        """The B operand of accumulator j: columns [j * n_instr, (j + 1) * n_instr) of the block."""
        if nk:
            return b_smem.at[pl.ds(j * n_instr, n_instr)].T
        return b_smem.at[:, pl.ds(j * n_instr, n_instr)]

    def mma_body(idxs, a_smem, b_smem, acc_refs):
        a = a_smem.at[pl.ds(lax.axis_index("wg") * cfg.wg_rows, cfg.wg_rows)]
        for j, acc in enumerate(acc_refs):
            plgpu.wgmma(acc, a, b_columns(b_smem, j))
        plgpu.wgmma_wait(0)  # the slot is released after this step: its reads must be done
        return acc_refs

    def kernel(x_gmem, w_gmem, out_gmem):
        ignore = lambda *_, **__: None
        x_window = lambda m0: x_gmem.at[pl.ds(m0, tm), :]
        w_window = lambda n0: w_gmem.at[pl.ds(n0, tn), :] if nk else w_gmem.at[:, pl.ds(n0, tn)]

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(ignore, ignore).get_allocations(x_window(0), w_window(0)),
            out_smem=plgpu.SMEM((cfg.wgs, OUT_SLOTS, mc.EPI, mc.EPI), out_dtype, transforms=_out_transforms(out_dtype)),
            collective_axes="wg",
        )
        def _scope(allocs, out_smem):
            @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="cta")
            def _tile(info):
                nt, mt = common.work_item(info.index[0], n_tiles, m_tiles, cfg.col_group)
                m0, n0 = pl.multiple_of(mt * tm, tm), pl.multiple_of(nt * tn, tn)

                def context(eval_pipeline):
                    @functools.partial(
                        pl.run_scoped, acc_refs=tuple(plgpu.ACC((cfg.wg_rows, n_instr), F32) for _ in range(accs))
                    )
                    def _accs(acc_refs):
                        eval_pipeline(acc_refs)
                        _epilogue(acc_refs, out_smem, out_gmem, m0, n0)

                pipeline(mma_body, context)(x_window(m0), w_window(n0), allocations=allocs)

            plgpu.wait_smem_to_gmem(0)

    def _epilogue(acc_refs, out_smem, out_gmem, m0, n0):
        """Each accumulator rounded once to out_dtype and stored in [64, 64] boxes; boxes wholly
        past the output's rows are skipped (TMA would clip them)."""
        wg = lax.axis_index("wg")
        row0 = m0 + wg * cfg.wg_rows
        box = 0
        for j, acc_ref in enumerate(acc_refs):
            y = acc_ref[...].astype(out_dtype)
            for i in range(cfg.wg_rows // mc.EPI):
                for jj in range(n_instr // mc.EPI):
                    slot = box % OUT_SLOTS
                    box += 1
                    rows0 = row0 + i * mc.EPI
                    cols0 = n0 + j * n_instr + jj * mc.EPI

                    @pl.when(rows0 < rows)
                    def _store():
                        plgpu.wait_smem_to_gmem(OUT_SLOTS - 1, wait_read_only=True)  # the slot's last store read it
                        out_smem.at[wg, slot][...] = y[i * mc.EPI : (i + 1) * mc.EPI, jj * mc.EPI : (jj + 1) * mc.EPI]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[wg, slot], out_gmem.at[pl.ds(rows0, mc.EPI), pl.ds(cols0, mc.EPI)]
                        )

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging boxes are free for the next tile

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((rows, n), out_dtype),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=cfg.wgs + 1,
        thread_name="wg",
        **interpret_utils.kernel_kwargs(interpret, interpret_params),
    )
