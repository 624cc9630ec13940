"""The backward's logits-gradient tile on sm90: dz = d(loss)/dz for one vocab chunk.

`dz_chunk(hidden, w_c, bias_c, targets_c, inv_t, lse, c1, c2, lo, hi)` recomputes
z = hidden @ w_c.T (+ bias) with the forward kernel's TMA + wgmma pipeline (one
FP32 accumulator per element, K ascending) and, in the same kernel, forms

    u  = z * inv_t - lse,   p = exp(u)
    dz = c1 * p + c2 * [col == target]      on columns lo <= col < hi, else 0

(c1 = inv_t * (g_lse - g_logp), c2 = inv_t * g_logp per row); with the entropy
term (static `has_entropy`; per-row c3 = -inv_t * g_H and the forward's entropy h)

    dz = p * (c1 + c3 * (u + h)) + c2 * [col == target]

(dH/dy = -p * (y - E_p[y]) = -p * (u + h)), formed as p * ((c1 + c3 * h) + c3 * u)
with u clamped below at `U_FLOOR` (p unchanged): one max and one FMA more per element. Written once as
bf16 [N, chunk]; the [N, chunk] FP32 logits never reach device memory. The
backward is not part of the frozen contract: exp is the GPU's `expf` and
XLA-style arithmetic is used, but every element is computed by one fixed
instruction sequence (no split-K, no atomics, fixed tile walk), so two runs give
identical bytes. `dz_in_place` is the same kernel reading the chunk from the whole
weight (and bias) at a traced offset, for the chunk walk without copies
(`backends.InPlaceWalk`; H200: its walk's dW bytes equal the slice walk's,
docs/PERFORMANCE.md). `detlogp_jax.grad` calls it per chunk when the backend is
pallas_sm90 (bf16 operands, D a multiple of 64, `chunk_supported`; the registry
entry in `backend.py` says so) and feeds dz to the two gradient GEMMs. Launch
geometry: `tuning.DzConfig` (shipped: `tuning.DZ`; bit-neutral).

Weight layout (static `weight_layout`, as in the forward kernels): "vd", w_c is a
[chunk, D] slice of a [V, D] weight, TMA copies [block_n, 64] blocks and wgmma reads
them through `.T`; "dv", w_c is a [D, chunk] slice of a Flax/Tunix [D, V] kernel,
TMA copies [64, block_n] blocks that wgmma reads as B directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from detlogp_jax.layout import as_layout
from pallas_kernels import common, interpret_utils, tuning
from pallas_kernels.common import F32, SWIZZLE, TILE, TILE_K

# With the entropy term u = z * inv_t - lse is clamped below at U_FLOOR before exp: p is
# unchanged (exp underflows to 0 in f32 below about -104), but c3 * u stays finite where
# u = -inf (a -inf bias entry, a padding row's lse = +inf), so p * q is 0 there, not NaN.
# A NaN u (a NaN row) stays NaN (max propagates it).
U_FLOOR = -128.0
ROWS_PER_CTA = tuning.DZ.rows_per_cta  # callers pad rows to a multiple of this (the registry's row_multiple)


def build(
    *,
    n_pad: int,
    d: int,
    chunk: int,
    has_bias: bool,
    num_ctas: int,
    interpret: bool,
    interpret_params=None,
    cfg: tuning.DzConfig = tuning.DZ,
    has_entropy: bool = False,
    weight_layout="vd",
    in_place: bool = False,
):
    """Kernel (hidden, w_c, [bias_c], tgt, inv_t, lse, c1, c2, [c3, h], bounds) -> dz [n_pad, chunk] bf16.

    in_place: w_c is the whole weight, bias_c the whole bias, bounds = (start, lo, hi) with
    the chunk's first column `start` (a multiple of 64) and lo, hi and the targets absolute
    columns (`dz_in_place`); else w_c / bias_c are the chunk's slices and bounds = (lo, hi),
    targets and bounds relative to the chunk."""
    if not isinstance(cfg, tuning.DzConfig):
        raise TypeError(f"sm90_dz needs a tuning.DzConfig, got {type(cfg).__name__}")
    dv = as_layout(weight_layout).transposed
    bm, n_wg, cta_rows, block_n = cfg.block_m, cfg.num_compute_wgs, cfg.rows_per_cta, cfg.block_n
    assert n_pad % cta_rows == 0 and chunk % block_n == 0 and d % TILE_K == 0
    n_rb, n_cb = n_pad // cta_rows, chunk // block_n
    k_iters = d // TILE_K
    transforms = (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))
    out_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    row_l = common.row_layout()
    stages = min(cfg.max_concurrent_steps, k_iters)
    if dv:  # [K, N] blocks of the [D, chunk] slice, read by wgmma as B directly
        w_spec = plgpu.BlockSpec((TILE_K, block_n), lambda k: (k, 0), transforms=transforms)
    else:  # [N, K] blocks of the [chunk, D] slice, read through .T
        w_spec = plgpu.BlockSpec((block_n, TILE_K), lambda k: (0, k), transforms=transforms)

    load = functools.partial(interpret_utils.load, interpret=interpret)

    def kernel(*refs):
        refs = list(refs)
        h_gmem, w_gmem = refs[:2]
        b_gmem = refs.pop(2) if has_bias else None
        tgt_gmem, invt_gmem, lse_gmem, c1_gmem, c2_gmem = refs[2:7]
        c3_gmem, hh_gmem = refs[7:9] if has_entropy else (None, None)
        bnd_gmem, dz_out = refs[-2:]

        # The chunk's first column in w_gmem / b_gmem (0: they are the chunk's slices).
        if in_place:
            base = pl.multiple_of(bnd_gmem[0], 64)
            shift = lambda x: base + x
        else:
            shift = lambda x: x  # (no add traced: the module is the slices' kernel as before)

        def w_block(col0):
            """The chunk's columns [col0, col0 + block_n) in the weight's own layout."""
            return w_gmem.at[:, pl.ds(shift(col0), block_n)] if dv else w_gmem.at[pl.ds(shift(col0), block_n), :]

        def get_pipeline(body, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                body,
                grid=(k_iters,),
                memory_registers=40,
                in_specs=[
                    plgpu.BlockSpec((cta_rows, TILE_K), lambda k: (0, k), transforms=transforms),
                    w_spec,
                ],
                wg_axis="wg",
                num_compute_wgs=n_wg,
                max_concurrent_steps=stages,
                compute_context=compute_context,
            )

        ignore = lambda *_, **__: None

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(h_gmem.at[pl.ds(0, cta_rows), :], w_block(0)),
            out_smem=plgpu.SMEM((n_wg, 2, bm, TILE), jnp.bfloat16, transforms=out_transforms),
            collective_axes="wg",
        )
        def _scope(pipeline_allocs, out_smem):
            wg = lax.axis_index("wg")
            lo = bnd_gmem[1 if in_place else 0]
            hi = bnd_gmem[2 if in_place else 1]

            @plgpu.nd_loop((n_rb * n_cb,), collective_axes="cta")
            def _work(info):
                cb, rb = common.work_item(info.index[0], n_cb, n_rb, cfg.col_group)
                row0 = rb * cta_rows
                col0 = cb * block_n

                def compute_context(eval_pipeline):
                    wrow = row0 + wg * bm
                    rows = pl.ds(wrow, bm)
                    tgt = load(tgt_gmem.at[rows], row_l)
                    invt = load(invt_gmem.at[rows], row_l)
                    lse = load(lse_gmem.at[rows], row_l)
                    c1 = load(c1_gmem.at[rows], row_l)
                    c2 = load(c2_gmem.at[rows], row_l)
                    if has_entropy:
                        c3 = load(c3_gmem.at[rows], row_l)
                        c1 = c1 + c3 * load(hh_gmem.at[rows], row_l)  # c1 + c3 * h, per row

                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, block_n), F32))
                    def _acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        coeffs = (tgt, invt, lse, c1, c2, c3 if has_entropy else None)
                        out = (out_smem, wg, dz_out, rows)
                        _store_dz(acc_ref[...], coeffs, (lo, hi), col0, shift, b_gmem, out, interpret=interpret)

                def mma_body(idxs, h_smem, w_smem, acc_ref):
                    plgpu.wgmma(acc_ref, h_smem.at[pl.ds(wg * bm, bm)], w_smem if dv else w_smem.T)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                get_pipeline(mma_body, compute_context)(
                    h_gmem.at[pl.ds(row0, cta_rows), :],
                    w_block(col0),
                    allocations=pipeline_allocs,
                )

            plgpu.wait_smem_to_gmem(0)

    kw = interpret_utils.kernel_kwargs(interpret, interpret_params)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((n_pad, chunk), jnp.bfloat16),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=n_wg + 1,
        thread_name="wg",
        **kw,
    )


def _store_dz(z_all, coeffs, bounds, col0, shift, b_gmem, out, *, interpret: bool):
    """The epilogue of one [bm, block_n] work item: per 64-column tile, z = acc (+ bias), u = z *
    inv_t - lse (clamped at U_FLOOR with the entropy term), p = exp(u), dz = q * p + c2 *
    [col == target] on lo <= col < hi (else 0), stored as bf16 by TMA through two staging slots
    (the item's stores waited out at its end)."""
    tgt, invt, lse, c1, c2, c3 = coeffs
    lo, hi = bounds
    out_smem, wg, dz_out, rows = out  # this warpgroup's staging slots and output rows
    bm, block_n = z_all.shape
    cast = functools.partial(interpret_utils.cast, interpret=interpret)
    load = functools.partial(interpret_utils.load, interpret=interpret)
    col_iota = cast(lax.broadcasted_iota(jnp.int32, (bm, TILE), 1), plgpu.Layout.WGMMA)
    bc = lambda v: jnp.broadcast_to(v[:, None], (bm, TILE))
    for i in range(block_n // TILE):
        c = col0 + i * TILE
        z = z_all[:, i * TILE : (i + 1) * TILE]
        if b_gmem is not None:
            b = load(b_gmem.at[pl.ds(shift(c), TILE)], common.col_layout())
            z = z + jnp.broadcast_to(b[None, :], (bm, TILE))
        col = col_iota + shift(c)  # the column in the targets' and bounds' frame
        u = z * bc(invt) - bc(lse)
        if c3 is not None:  # keep c3 * u finite where p = 0 (see U_FLOOR)
            u = jnp.maximum(u, jnp.full((bm, TILE), U_FLOOR, F32))
        p = jnp.exp(u)
        q = bc(c1) + bc(c3) * u if c3 is not None else bc(c1)
        dz = q * p + jnp.where(col == bc(tgt), bc(c2), jnp.zeros((bm, TILE), F32))
        dz = jnp.where((col >= lo) & (col < hi), dz, jnp.zeros((bm, TILE), F32))
        slot = i % 2
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        out_smem.at[wg, slot][...] = dz.astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], dz_out.at[rows, pl.ds(c, TILE)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(
    jax.jit,
    static_argnames=(
        "n_pad",
        "d",
        "chunk",
        "has_bias",
        "num_ctas",
        "interpret",
        "interpret_params",
        "has_entropy",
        "weight_layout",
        "in_place",
    ),
)
def _dz_core(*args, **static):
    return build(**static)(*args)


def chunk_supported(chunk: int) -> bool:
    """True if this kernel can form dz for vocab chunks of this length (the operands: `wrapper.unsupported`)."""
    return chunk % tuning.DZ.block_n == 0


def dz_chunk(hidden_p, w_c, bias_c, targets_c, inv_t, lse, c1, c2, lo, hi, **options):
    """dz [n_pad, chunk] bf16 for one vocab chunk (see the module docstring).

    hidden_p: [n_pad, D] bf16 with n_pad a multiple of `ROWS_PER_CTA`;
    w_c: [chunk, D] bf16 ("vd") or [D, chunk] ("dv"); bias_c: [chunk] f32 or None; targets_c: [n_pad] int32
    target column relative to the chunk (anything outside [0, chunk) never
    matches); inv_t, lse, c1, c2: [n_pad] f32 (c1 = c2 = 0 on padding rows;
    `detlogp_jax.grad` pads lse with +inf there: p = 0 for any bias < +inf);
    lo, hi: traced int32 column bounds (relative) of the columns that get a
    gradient. options (keywords, all optional): c3, h: [n_pad] f32, both or neither: the
    entropy term (c3 = -inv_t * g_H, h the forward's entropy; 0 on padding rows);
    weight_layout ("vd" or "dv"), interpret, interpret_params, num_ctas.
    """
    chunk = as_layout(options.get("weight_layout", "vd")).vocab_rows(w_c)
    bounds = jnp.stack([jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)])
    return _launch(hidden_p, w_c, bias_c, targets_c, (inv_t, lse, c1, c2), bounds, chunk, False, **options)


def dz_in_place(hidden_p, weight, bias, targets, inv_t, lse, c1, c2, bounds, *, chunk: int, **options):
    """`dz_chunk` of the chunk [start, start + chunk) read in place from the whole weight (and bias):
    no slice of either is copied. bounds: int32 [3] = (start, lo, hi), start a multiple of 64 with
    start + chunk <= the weight's vocab entries; lo, hi and `targets` are absolute columns (dz = 0
    outside lo <= col < hi); options: `dz_chunk`'s. The bytes are `dz_chunk`'s for the same chunk
    (the same wgmma sequence on the same K slices, the same per-element arithmetic)."""
    return _launch(hidden_p, weight, bias, targets, (inv_t, lse, c1, c2), bounds, chunk, True, **options)


def _launch(
    hidden_p,
    w,
    bias,
    targets,
    rows,
    bounds,
    chunk,
    in_place,
    *,
    c3=None,
    h=None,
    weight_layout="vd",
    interpret: bool = False,
    interpret_params=None,
    num_ctas: int | None = None,
):
    if (c3 is None) != (h is None):
        raise ValueError("the entropy term needs both c3 and h")
    n_pad, d = hidden_p.shape
    work = (n_pad // ROWS_PER_CTA) * (chunk // tuning.DZ.block_n)
    if num_ctas is None:
        num_ctas = 2 if interpret else tuning.default_num_sms()
    num_ctas = max(1, min(int(num_ctas), work))
    args = [hidden_p, w] + ([bias.astype(F32)] if bias is not None else [])
    args += [targets.astype(jnp.int32)] + [r.astype(F32) for r in rows]
    args += ([c3.astype(F32), h.astype(F32)] if c3 is not None else []) + [bounds.astype(jnp.int32)]
    return _dz_core(
        *args,
        n_pad=n_pad,
        d=d,
        chunk=chunk,
        has_bias=bias is not None,
        num_ctas=num_ctas,
        interpret=interpret,
        interpret_params=interpret_params,
        has_entropy=c3 is not None,
        weight_layout=as_layout(weight_layout),  # (one jit entry per layout, named or typed)
        in_place=in_place,
    )
