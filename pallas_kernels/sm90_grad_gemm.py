"""The backward's gradient GEMMs on sm90, reading the weight and writing dh / dW in place.

The chunked backward (`detlogp_jax.grad`) visits the vocabulary in chunks of `chunk`
columns starting at `start` (traced: the scan's offset). Per chunk it needs

    dh += dz @ W_c          dh [n_pad, D] FP32, dz [n_pad, chunk] bf16
    dW_c = dz.T @ h          written into dW's rows (or columns) [start, start + chunk)

where W_c is the chunk's slice of the weight. With XLA's GEMMs each chunk pays a copy of
W_c (a dynamic slice both GEMMs read) and a copy of dW_c into dW (a dynamic update
slice); these kernels read W at the offset and write dW at the offset instead
(`dh_accumulate`, `dw_write`), and dh is updated in place (the kernel's output buffer is
its input's: `_aliased_kernel`), so the walk moves no weight-sized bytes besides the
GEMMs' own operand reads.

Each element's sum: one FP32 accumulator per output element, K ascending in 64-wide
pipeline steps of m64nNk16 wgmmas (N: a consumer warpgroup's columns,
`tuning.GradGemmConfig.wg_tile`); dh's accumulator starts from the old dh value
(dh_new = ((dh + p_0) + p_1) + ..., p_j the products of K step j, no separate add;
interpret mode, whose accumulator cannot be stored to, adds the old value after the sum
instead: the same arithmetic up to rounding). No split-K, no atomics, a fixed tile walk:
two runs give identical bytes, and a row's dh does not depend on the other rows of the
batch (H200: the benchmark runner's gradient probe rows; docs/PERFORMANCE.md). The backward
is not part of the frozen contract.

Layouts. "vd" (weight [V, D]): dh's B operand is W[start + k, :] (K-major rows, read as
B directly); dW_c = dz.T @ h is [chunk, D], A read through a transposed view of dz's
[64, tile_m] blocks. "dv" (weight [D, V], a Flax/Tunix kernel): dh's B is W[:, start + k]
(read through `.T`); dW is [D, V] and dW[:, start : start + cols] = h.T @ dz, A read
through a transposed view of hidden's blocks.

Launch geometry: `tuning.DH_GEMM` / `tuning.DW_GEMM` (`tuning.GradGemmConfig`: tile shape,
pipeline depth, work order, and the 2-CTA cluster multicasting the B operand, shipped on; `_config` drops it where the output does not
tile by the cluster's two tiles, and in interpret mode). Operands must tile exactly
(`supported`: rows, D and the chunk multiples of a CTA tile's sides, offsets multiples of
`START_MULTIPLE`); `detlogp_jax.grad` keeps XLA's GEMMs on weight-chunk slices otherwise.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from detlogp_jax.layout import as_layout
from pallas_kernels import common, interpret_utils, tuning
from pallas_kernels.common import F32, SWIZZLE, TILE_K

EPI = 64  # epilogue tile: [EPI, EPI] of the output per TMA store
# Staging boxes per consumer warpgroup for the epilogue's TMA stores: they alternate, and a tile's
# stores are waited out before the next tile (a whole tile's worth, draining under the next K
# walk, was no faster on the H200: docs/PERFORMANCE.md).
OUT_SLOTS = 2
# Chunk offsets must be multiples of this (a [V, D] weight's rows and a [D, V] one's columns are
# read in 64-wide swizzle tiles; dW is written in [EPI, EPI] boxes): callers check it (`supported`).
START_MULTIPLE = 64


def _aliased_kernel(body, *, out_type, grid, cluster, num_threads, interpret, interpret_params):
    """`plgpu.kernel` whose first operand is also its output (updated in place).

    plgpu.kernel of jax 0.11.2 takes no input/output aliases; the mpmd map under it does
    (jax._src.pallas.mpmd._mpmd_map, private: pinned with the jax version, and
    tests/test_pallas_backward.py checks the aliasing in the lowered module). The body
    gets (operand refs..., out ref) where the out ref holds operand 0's values on entry."""
    from jax._src import config
    from jax._src.pallas import mpmd

    clusters = dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}
    mesh = plgpu.Mesh(grid=grid, grid_names=("cta",), num_threads=num_threads, thread_name="wg", **clusters)
    kw = interpret_utils.kernel_kwargs(interpret, interpret_params)

    def run(*operands):
        # As plgpu.kernel does: no vma typing through the call (inside shard_map with
        # check_vma=True the result is unvarying; detlogp_jax.grad gives it the operands' axes).
        with config._check_vma(False):
            return mpmd._mpmd_map([(mesh, body)], out_type, input_output_aliases={0: 0}, **kw)(*operands)

    return run


def _build(
    *,
    m: int,
    n: int,
    k: int,
    a_t: bool,
    b_t: bool,
    a_off: tuple,
    b_off: tuple,
    out_off: tuple,
    accumulate: bool,
    out_shape: tuple,
    out_dtype,
    num_ctas: int,
    cfg: tuning.GradGemmConfig,
    interpret: bool,
    interpret_params=None,
):
    """out[o_r + i, o_c + j] (+)= sum_k A[i, k] B[k, j] for i < m, j < n.

    A is read from a [m, k] window of its array (a_t False; block [tile_m, 64]) or a [k, m]
    one (a_t True; block [64, tile_m], read through `.T`); B from a [k, n] window (b_t False)
    or an [n, k] one (b_t True, through `.T`). a_off / b_off / out_off: the window's
    (row, column) origin in each array, each entry a Python int or "start" (the kernel's
    traced scalar operand). accumulate: the accumulator starts from the output's old value.
    Kernel operands: (out, a, b, start [1] int32) -> out (aliased to operand 0)."""
    tm, tn = cfg.tile_m, cfg.tile_n
    wm, wn = cfg.wg_tile  # one consumer warpgroup's accumulator: its rows of the tile, all columns
    cm, cn = cfg.cluster_tile
    if cfg.cluster and interpret:
        raise ValueError("the interpreter has no TMA multicast: run cluster=False in interpret mode")
    if m % cm or n % cn or k % TILE_K:
        raise ValueError(f"sm90_grad_gemm: [{m}, {n}] x K={k} does not tile by {cm} x {cn} x {TILE_K} ({cfg})")
    k_iters = k // TILE_K
    # The B operand the cluster's two row-adjacent tiles share is multicast (each CTA loads half of each block).
    share = {"a": None, "b": ("cluster",) if cfg.cluster else None}
    stages = min(cfg.max_concurrent_steps, k_iters)
    tr = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
    out_bytes = jnp.dtype(out_dtype).itemsize
    boxes = (wm // EPI) * (wn // EPI)  # output boxes of one warpgroup's tile
    slots = min(OUT_SLOTS, boxes)
    smem = stages * (tm + tn) * TILE_K * 2 + 2 * slots * EPI * EPI * out_bytes
    if smem > tuning.SMEM_LIMIT:
        raise ValueError(
            f"sm90_grad_gemm: {stages} stages and {slots} output slots need {smem} B of shared memory ({cfg})"
        )
    out_tr = (plgpu.TilingTransform((8, SWIZZLE // out_bytes)), plgpu.SwizzleTransform(SWIZZLE))
    spec = functools.partial(plgpu.BlockSpec, transforms=tr)
    a_spec = (
        spec((TILE_K, tm), lambda kk: (kk, 0), collective_axes=share["a"])
        if a_t
        else spec((tm, TILE_K), lambda kk: (0, kk), collective_axes=share["a"])
    )
    b_spec = (
        spec((tn, TILE_K), lambda kk: (0, kk), collective_axes=share["b"])
        if b_t
        else spec((TILE_K, tn), lambda kk: (kk, 0), collective_axes=share["b"])
    )
    load = functools.partial(interpret_utils.load, interpret=interpret)

    def kernel(out_in, a_gmem, b_gmem, start_gmem, out_gmem):
        del out_in  # the same buffer as out_gmem (aliased): read and written through out_gmem
        start = pl.multiple_of(start_gmem[0], START_MULTIPLE)  # TMA boxes start on whole swizzle tiles
        origin = lambda off: tuple(start if o == "start" else o for o in off)
        (ar, ac), (br, bc), (orow, ocol) = origin(a_off), origin(b_off), origin(out_off)

        def a_window(m0):
            if a_t:
                return a_gmem.at[pl.ds(ar, k), pl.ds(ac + m0, tm)]
            return a_gmem.at[pl.ds(ar + m0, tm), pl.ds(ac, k)]

        def b_window(n0):
            if b_t:
                return b_gmem.at[pl.ds(br + n0, tn), pl.ds(bc, k)]
            return b_gmem.at[pl.ds(br, k), pl.ds(bc + n0, tn)]

        def get_pipeline(body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                body,
                grid=(k_iters,),
                memory_registers=40,
                in_specs=[a_spec, b_spec],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=stages,
                compute_context=compute_context,
            )

        ignore = lambda *_, **__: None

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(a_window(0), b_window(0)),
            out_smem=plgpu.SMEM((2, slots, EPI, EPI), out_dtype, transforms=out_tr),
            collective_axes="wg",
        )
        def _scope(pipeline_allocs, out_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop(((m // cm) * (n // cn),), collective_axes="cta")
            def _work(info):
                # a work item is a cluster's tiles; the CTA takes its own of them
                nt, mt = common.work_item(info.index[0], n // cn, m // cm, cfg.col_group)
                if cfg.cluster:
                    mt = mt * 2 + lax.axis_index("cluster")
                m0, n0 = pl.multiple_of(mt * tm, tm), pl.multiple_of(nt * tn, tn)
                wg_m = pl.multiple_of(wg * wm, wm)  # this warpgroup's rows of the tile
                o_rows = pl.ds(orow + m0 + wg_m, wm)
                o_cols = pl.ds(ocol + n0 + 0, wn)  # (+ 0: the column offset of a warpgroup, all columns)

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wm, wn), F32))
                    def _acc_scope(acc_ref):
                        if accumulate and not interpret:
                            acc_ref[...] = load(out_gmem.at[o_rows, o_cols], plgpu.Layout.WGMMA)
                        eval_pipeline(acc_ref)
                        acc = acc_ref[...]
                        if accumulate and interpret:  # the interpreter's accumulator takes no store
                            acc = out_gmem.at[o_rows, o_cols][...] + acc
                        _store_tile(acc.astype(out_dtype), out_smem, wg, out_gmem.at[o_rows, o_cols], slots)

                def mma_body(idxs, a_smem, b_smem, acc_ref):
                    # this warpgroup's rows of A, all of B
                    a = a_smem.at[:, pl.ds(wg * wm, wm)].T if a_t else a_smem.at[pl.ds(wg * wm, wm)]
                    b = b_smem.T if b_t else b_smem
                    plgpu.wgmma(acc_ref, a, b)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                get_pipeline(mma_body, compute_context)(a_window(m0), b_window(n0), allocations=pipeline_allocs)

            plgpu.wait_smem_to_gmem(0)

    return _aliased_kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(num_ctas,),
        cluster=2 if cfg.cluster else 1,
        num_threads=3,
        interpret=interpret,
        interpret_params=interpret_params,
    )


def _store_tile(acc, out_smem, wg, out_tile, slots: int):
    """A warpgroup's finished [wm, wn] tile (in the output dtype) to `out_tile` by TMA in [EPI, EPI]
    boxes through `slots` staging slots, each reused once its last store has read it; a tile's
    stores are waited out before the next tile where the slots do not hold all of its boxes."""
    wm, wn = acc.shape
    boxes = (wm // EPI) * (wn // EPI)
    for i in range(wm // EPI):
        for j in range(wn // EPI):
            slot = (i * (wn // EPI) + j) % slots
            plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)  # its last store read it
            out_smem.at[wg, slot][...] = acc[i * EPI : (i + 1) * EPI, j * EPI : (j + 1) * EPI]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_tile.at[pl.ds(i * EPI, EPI), pl.ds(j * EPI, EPI)])
    if slots < boxes:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


_STATIC = ("geom", "num_ctas", "cfg", "interpret", "interpret_params")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _gemm_core(out, a, b, start, *, geom, **static):
    return _build(**dict(geom), out_shape=out.shape, out_dtype=out.dtype, **static)(out, a, b, start)


def _run(out, a, b, start, geom: dict, cfg, num_ctas, interpret, interpret_params):
    """`_build(**geom)` on (out, a, b, start) with one persistent CTA (or 2-CTA cluster) per
    output tile (cluster tile), at most the SM count's worth (`num_ctas` forces the number of
    CTAs, or of clusters with `cfg.cluster`)."""
    cm, cn = cfg.cluster_tile
    work = (geom["m"] // cm) * (geom["n"] // cn)
    if num_ctas is None:
        num_ctas = 2 if interpret else tuning.default_num_sms() // (2 if cfg.cluster else 1)
    return _gemm_core(
        out,
        a,
        b,
        jnp.reshape(jnp.asarray(start, jnp.int32), (1,)),
        geom=tuple(sorted(geom.items())),
        num_ctas=max(1, min(int(num_ctas), work)),
        cfg=cfg,
        interpret=interpret,
        interpret_params=interpret_params,
    )


def supported(n_pad: int, d: int, cols: int) -> bool:
    """Whether these kernels take a chunk walk with n_pad rows, hidden size d and chunks (and a
    last chunk's new columns) of `cols` columns in both layouts (a shape that tiles by a CTA's
    tile but not by a cluster's two runs without the cluster: `_config`)."""
    hm, hn = tuning.DH_GEMM.tile_m, tuning.DH_GEMM.tile_n
    wm, wn = tuning.DW_GEMM.tile_m, tuning.DW_GEMM.tile_n
    ok_dh = n_pad % hm == 0 and d % hn == 0 and cols % TILE_K == 0
    ok_dw = n_pad % TILE_K == 0 and cols_supported(cols) and d % wm == 0 and d % wn == 0
    return ok_dh and ok_dw


def cols_supported(cols: int) -> bool:
    """Whether `dw_write` takes `cols` columns of dz (a last chunk's new columns) in both layouts."""
    return cols % tuning.DW_GEMM.tile_m == 0 and cols % tuning.DW_GEMM.tile_n == 0


def _config(cfg, shipped: tuning.GradGemmConfig, m: int, n: int, interpret: bool) -> tuning.GradGemmConfig:
    """An explicit `cfg` as given (refused where it cannot run); else the shipped config, without
    its 2-CTA cluster where the interpreter runs (it has no TMA multicast) or the [m, n] output
    does not tile by the cluster's two tiles. Dropping the cluster changes no byte: a cluster
    changes only which CTA's TMA brings a shared block into shared memory, not the sum each
    element's accumulator forms (H200: 0 rows differing in dh and dW; docs/PERFORMANCE.md)."""
    if cfg is not None:
        return cfg
    cm, cn = shipped.cluster_tile
    if shipped.cluster and (interpret or m % cm or n % cn):
        return dataclasses.replace(shipped, cluster=False)
    return shipped


def dh_accumulate(
    dh,
    dz,
    weight,
    start,
    *,
    weight_layout="vd",
    interpret: bool = False,
    interpret_params=None,
    num_ctas: int | None = None,
    cfg: tuning.GradGemmConfig | None = None,
):
    """dh + dz @ W[start : start + chunk] (vd; "dv": dz @ W[:, start : start + chunk].T) as a new
    FP32 [n_pad, D] array whose buffer is dh's (XLA updates it in place when dh is dead after).
    dz: [n_pad, chunk] bf16; weight: the whole weight; start: traced int32 (start + chunk <= V)."""
    dv = as_layout(weight_layout).transposed
    n_pad, chunk = dz.shape
    d = dh.shape[1]
    cfg = _config(cfg, tuning.DH_GEMM, n_pad, d, interpret)
    geom = dict(
        m=n_pad,
        n=d,
        k=chunk,
        a_t=False,
        b_t=dv,
        a_off=(0, 0),
        b_off=(0, "start") if dv else ("start", 0),
        out_off=(0, 0),
        accumulate=True,
    )
    return _run(dh.astype(F32), dz, weight, start, geom, cfg, num_ctas, interpret, interpret_params)


def dw_write(
    dw,
    dz,
    hidden_p,
    start,
    *,
    col0: int = 0,
    cols: int | None = None,
    weight_layout="vd",
    interpret: bool = False,
    interpret_params=None,
    num_ctas: int | None = None,
    cfg: tuning.GradGemmConfig | None = None,
):
    """dW with its rows [start, start + cols) ("vd"; "dv": columns) set to dz[:, col0 : col0 + cols].T
    @ hidden_p (resp. hidden_p.T @ dz[:, ...]) in dW's dtype (FP32 accumulation, rounded once); the
    other entries keep dW's values (the buffer is dW's: written in place). dz: [n_pad, chunk] bf16,
    hidden_p: [n_pad, D] bf16; col0, cols: static (cols defaults to the rest of the chunk)."""
    dv = as_layout(weight_layout).transposed
    n_pad, chunk = dz.shape
    d = hidden_p.shape[1]
    cols = chunk - col0 if cols is None else int(cols)
    if dv:  # dW[:, start + j] = sum_r h[r, i] dz[r, col0 + j]: A = h (transposed view), B = dz
        geom = dict(m=d, n=cols, a_off=(0, 0), b_off=(0, col0), out_off=(0, "start"))
        a, b = hidden_p, dz
    else:  # dW[start + i, j] = sum_r dz[r, col0 + i] h[r, j]: A = dz (transposed view), B = h
        geom = dict(m=cols, n=d, a_off=(0, col0), b_off=(0, 0), out_off=("start", 0))
        a, b = dz, hidden_p
    geom.update(k=n_pad, a_t=True, b_t=False, accumulate=False)
    cfg = _config(cfg, tuning.DW_GEMM, geom["m"], geom["n"], interpret)
    return _run(dw, a, b, start, geom, cfg, num_ctas, interpret, interpret_params)
