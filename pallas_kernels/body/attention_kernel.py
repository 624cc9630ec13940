"""The body attention kernel for Hopper: causal GQA over a KV cache, the contract's chain per row.

Operands (host side: `attention`): q_rows [B, Hkv, R, Dh] bf16, the queries of one KV head's
group as rows r = t * G + g (query t, head g of the group; R padded to whole row tiles);
the cache k, v [B, S, Hkv, Dh] bf16, read in place; pos_rows [B, R] int32, each row's
absolute position (-1 for a row without keys: a padding query or a padding row); tile_meta
[B, R / 64, 2] int32, per row tile (n_full, last): `last` = the largest position of its rows
(at least -1), `n_full` = how many leading KV blocks every row with keys sees whole; kv_start
[B] int32. Output [B, Hkv, R, Dh] in the output dtype.

A CTA holds `cfg.wgs` consumer warpgroups (1 or 2) and one producer warpgroup; each consumer
owns one work item (row tile, KV head, sequence): a CTA's consumers take consecutive row tiles
or consecutive KV heads of one sequence (`cfg.pair`), and one past the last tile or head sits
idle. For each consumer the producer streams the K and V blocks of its sequence and KV head,
block j = the 64 slots from kv_start[b] + 64 j (positions [64 j, 64 j + 64)), j = 0 ..
last // 64, through the consumer's own `stages`-deep TMA ring (slots past the cache's end read
as TMA zero fill). A consumer keeps, per row, the chain state (m, l) and the f32 accumulator
[64, Dh] (Dh / 64 accumulators [64, 64] side by side) in registers and runs, for each block in
ascending order (`_block`):

* S = wgmma(q [64, Dh], K.T) into a fresh f32 accumulator [64, 64]: m64n64k16 instructions,
  k ascending over Dh (one wgmma call per 64 columns of Dh, chained on the accumulator):
  per row the same instruction sequence whatever the other rows are;
* s = fl(S * scale) (pinned multiply); keys at positions > p: s = -inf;
* m' = max(m, max s) (exact); alpha = 1 if m' == m else pexp(m - m'); e = pexp(s - m') on
  valid keys, +0 elsewhere (`ops.exp_diff`: one pinned program per lane);
  l' = fl(fl(l * alpha) + tree64(e)) (`tile_math.tree64`: the adjacent-pairwise tree);
* acc' = wgmma(fl(acc * alpha), e in bf16 from registers, V): per 64 columns of Dh, the
  block's 64 keys ascending (m64n64k16 instructions) accumulated onto the rescaled accumulator;
* a row whose last block is before j (64 j > p) keeps (m, l, acc) by a select.

Shared memory holds every [64, Dh] operand as Dh / 64 chunks [64, 64] (one 128-byte swizzle
row per matrix row). A cache window starts at any slot (kv_start is data), and Mosaic GPU's TMA
into a tiled buffer needs a row offset that is a multiple of 8, so the K / V rings are unions
of two views of the same bytes (`_ring`): the TMA writes through a swizzled, untiled view and
wgmma reads the tiled one; for a [64, 64] bf16 chunk both put every element at the same
address.

Consumers share nothing but the producer, so a row's work is the same whatever the CTA's
geometry. Two loops run this step: blocks [0, n_full) that every row with keys sees whole (no
key mask, no accumulator select: the mask and the select are identities there; rows without
keys keep m = -inf and l = +0 by the row selects and their output is +0 whatever their
accumulator holds) and blocks [n_full, last // 64] with the mask and the selects. A live row's operations are the
same in both, so its bytes do not depend on which loop ran a block: they depend on the row's
query, position and keys only, never on the tile's other rows, the number of queries, the
batch, the cache's length or its padding.

Before the last block's PV product the consumer zeroes the V rows at positions past `last`
(slots that may hold anything, NaN included, in a cache longer than the keys: e = +0 there,
but +0 * NaN is NaN); the V rows it keeps are keys of the tile's own rows, which every row
either uses or multiplies by e = +0.

Epilogue: out = fl(acc * rcp(l)) (pinned reciprocal and multiply), +0 where l == 0, rounded
once to the output dtype, stored by TMA.

Pinned arithmetic: on the GPU every f32 multiply, add and subtract of the chain is one inline
PTX `.rn.ftz` instruction (`ptx_ops.PtxOps`), so LLVM cannot contract or reorder them; in
interpret mode (`ptx_ops.InterpretOps`) the same programs run on XLA:CPU, pinned. Interpret
mode also differs in where two operands live, not in their values: e reaches the PV wgmma
through shared memory (the interpreter's wgmma reads A from shared memory only), and one tiled
ref serves both the TMA and wgmma (the interpreter allocates a union's views separately).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common, interpret_utils, ptx_ops, tile_math
from pallas_kernels.body import attention_config as ac

F32 = jnp.float32
BF16 = jnp.bfloat16
ROWS, KV, CHUNK = ac.ROWS, ac.KV_BLOCK, ac.CHUNK


def _tiled(swizzle_elems: int = CHUNK):
    """wgmma's shared-memory form: (8, 128-byte) tiles, 128-byte swizzle."""
    return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(ac.SWIZZLE))


def _ring(wgs: int, stages: int, nd: int, interpret: bool):
    """The K or V rings of a CTA: [wgs, stages, nd, 64, 64] bf16 (one ring per consumer
    warpgroup), chunk c holding columns [64 c, 64 c + 64).

    On the GPU a union of two views of the same bytes: the TMA's (swizzled rows, no tiling:
    a cache window may start at any slot, while a tiled TMA needs its row offset to be a
    multiple of 8) and wgmma's (tiled (8, 64), swizzled). A [64, 64] bf16 chunk has one
    128-byte swizzle row per matrix row either way, so both views place every element at the
    same address. The interpreter allocates a union's views separately: there one tiled ref
    serves both (it has no alignment rule)."""
    shape = (wgs, stages, nd, KV, CHUNK)
    if interpret:
        return plgpu.SMEM(shape, BF16, transforms=_tiled())
    return plgpu.RefUnion(
        plgpu.SMEM(shape, BF16, transforms=(plgpu.SwizzleTransform(ac.SWIZZLE),)),
        plgpu.SMEM(shape, BF16, transforms=_tiled()),
    )


def build(
    *,
    batch: int,
    hkv: int,
    dh: int,
    rows: int,
    out_dtype,
    scale: float,
    cfg: ac.AttentionConfig,
    interpret: bool = False,
    interpret_params=None,
):
    """The kernel (q_rows, k, v, pos_rows, tile_meta, kv_start) -> out [batch, hkv, rows, dh].

    rows: R, a multiple of 64; scale: the logit scale (rounded to f32); cfg: bit-neutral launch
    geometry. (Long on purpose: the producer, the consumer and `_block`'s three steps, qk /
    softmax / pv, are closures over one `run_scoped` scope's refs and the launch geometry, as
    the JAX Mosaic GPU examples write a kernel; each piece is named and short.)"""
    if dh not in ac.HEAD_DIMS:
        raise ValueError(f"body attention kernel: head dim {dh} unsupported; supported: {ac.HEAD_DIMS}")
    if rows % ROWS:
        raise ValueError(f"body attention kernel: rows {rows} must be a multiple of {ROWS}")
    n_tiles, nd, wgs = rows // ROWS, dh // CHUNK, cfg.wgs
    out_dtype = jnp.dtype(out_dtype)
    stages = ac.stages_for(cfg, dh, out_dtype.itemsize)
    scale = float(np.float32(scale))
    load, cast = interpret_utils.load_and_cast(plgpu.Layout.WGMMA, interpret)
    row_load, row_cast = interpret_utils.load_and_cast(common.row_layout(), interpret)
    neg_inf = float("-inf")
    # The consumer warpgroups of a CTA take consecutive row tiles or consecutive KV heads.
    per_tile, per_head = (wgs, 1) if cfg.pair == "tile" else (1, wgs)
    grid = (-(-n_tiles // per_tile), -(-hkv // per_head), batch)

    def acc_store(acc_ref, value):
        if interpret:  # the interpreter has no rule for the accumulator store; a ref store is equivalent
            from jax._src.state import primitives as state_primitives

            state_primitives.ref_set(acc_ref, (slice(None), slice(None)), value)
        else:
            acc_ref[...] = plgpu.layout_cast(value, plgpu.Layout.WGMMA)

    def views(ring):
        """(the TMA's view, wgmma's view) of a ring (`_ring`)."""
        if interpret:
            return ring, ring
        tma_view, mma_view = ring
        return tma_view, mma_view

    def kernel(q_ref, k_ref, v_ref, pos_ref, meta_ref, ks_ref, out_ref):
        bi = lax.axis_index("batch")

        def item(w):
            """(valid, row tile, KV head, n_full, n_blocks) of consumer warpgroup w (traced or not):
            n_full = n_blocks = 0 for a warpgroup past the last tile or head."""
            t = lax.axis_index("tile") * per_tile + (w if per_tile > 1 else 0)
            h = lax.axis_index("head") * per_head + (w if per_head > 1 else 0)
            valid = (t < n_tiles) & (h < hkv)
            if cfg.heavy_first:
                t = n_tiles - 1 - t
            t, h = jnp.clip(t, 0, n_tiles - 1), jnp.minimum(h, hkv - 1)
            last = meta_ref[bi, t, 1]  # >= -1
            n_full = jnp.where(valid, meta_ref[bi, t, 0], 0)
            n_blocks = jnp.where(valid, (last + KV) // KV, 0)  # blocks 0 .. last // 64
            return valid, t, h, last, n_full, n_blocks

        def scoped(q_smem, k_ring, v_ring, o_smem, e_smem, q_bar, k_full, v_full, k_free, v_free):
            k_tma, k_smem = views(k_ring)
            v_tma, v_smem = views(v_ring)
            wg = lax.axis_index("wg")

            @pl.when(wg == wgs)
            def _producer():
                plgpu.set_max_registers(cfg.producer_regs, action="decrease")
                slot0 = ks_ref[bi]
                items = [item(w) for w in range(wgs)]
                n_max = items[0][5]
                for it in items[1:]:
                    n_max = jnp.maximum(n_max, it[5])

                @pl.loop(0, n_max)
                def _load(j):
                    slot = lax.rem(j, stages)
                    keys = pl.ds(slot0 + j * KV, KV)
                    for w, (_, _, h, _, _, n_blocks) in enumerate(items):

                        @pl.when(j < n_blocks)
                        def _():
                            for ring, full, free, src in (
                                (k_tma, k_full, k_free, k_ref),
                                (v_tma, v_full, v_free, v_ref),
                            ):

                                @pl.when(j >= stages)
                                def _():
                                    plgpu.barrier_wait(free.at[w * stages + slot])

                                for c in range(nd):
                                    window = src.at[bi, keys, h, pl.ds(c * CHUNK, CHUNK)]
                                    plgpu.copy_gmem_to_smem(window, ring.at[w, slot, c], full.at[w * stages + slot])

                # The consumers' releases of their last blocks, which no later load waits for: awaited
                # so every phase of the rings' barriers is observed (the interpreter checks it).
                for w, it in enumerate(items):
                    n_blocks = it[5]

                    @pl.loop(jnp.maximum(n_blocks - stages, 0), n_blocks)
                    def _drain(j):
                        slot = lax.rem(j, stages)
                        plgpu.barrier_wait(k_free.at[w * stages + slot])
                        plgpu.barrier_wait(v_free.at[w * stages + slot])

            @pl.when(wg < wgs)
            def _consumer():
                plgpu.set_max_registers(cfg.consumer_regs, action="increase")
                valid, tile, h, last, n_full, n_blocks = item(wg)

                @pl.when(valid)
                def _():
                    r0 = pl.multiple_of(tile * ROWS, ROWS)
                    for c in range(nd):
                        window = q_ref.at[bi, h, pl.ds(r0, ROWS), pl.ds(c * CHUNK, CHUNK)]
                        plgpu.copy_gmem_to_smem(window, q_smem.at[wg, c], q_bar.at[wg])
                    pos = row_load(pos_ref.at[bi, pl.ds(r0, ROWS)])
                    ops = ptx_ops.make_ops(interpret, common.layout_of, source=pos)
                    m = row_cast(jnp.full((ROWS,), neg_inf, F32))
                    den = row_cast(jnp.zeros((ROWS,), F32))
                    acc = tuple(cast(jnp.zeros((ROWS, CHUNK), F32)) for _ in range(nd))
                    plgpu.barrier_wait(q_bar.at[wg])
                    step = functools.partial(
                        _block,
                        q_smem=q_smem.at[wg],
                        k_smem=k_smem.at[wg],
                        v_smem=v_smem.at[wg],
                        e_smem=None if e_smem is None else e_smem.at[wg],
                        bar=lambda ref, slot: ref.at[wg * stages + slot],
                        k_full=k_full,
                        v_full=v_full,
                        k_free=k_free,
                        v_free=v_free,
                        pos=pos,
                        last=last,
                        n_blocks=n_blocks,
                        ops=ops,
                    )
                    carry = lax.fori_loop(0, n_full, functools.partial(step, partial=False), (m, den, acc))
                    m, den, acc = lax.fori_loop(n_full, n_blocks, functools.partial(step, partial=True), carry)
                    inv = jnp.broadcast_to(ops.rcp(den)[:, None], (ROWS, CHUNK))
                    has_keys = jnp.broadcast_to(den[:, None], (ROWS, CHUNK)) > 0
                    for c in range(nd):
                        out = jnp.where(has_keys, ops.mul(acc[c], inv), jnp.asarray(0.0, F32))  # no key: +0
                        o_smem.at[wg, c][...] = cast(out).astype(out_dtype)
                    plgpu.commit_smem()
                    for c in range(nd):
                        window = out_ref.at[bi, h, pl.ds(r0, ROWS), pl.ds(c * CHUNK, CHUNK)]
                        plgpu.copy_smem_to_gmem(o_smem.at[wg, c], window)
                    plgpu.wait_smem_to_gmem(0)

        out_elems = ac.SWIZZLE // out_dtype.itemsize
        pl.run_scoped(
            scoped,
            plgpu.SMEM((wgs, nd, ROWS, CHUNK), BF16, transforms=_tiled()),
            _ring(wgs, stages, nd, interpret),
            _ring(wgs, stages, nd, interpret),
            plgpu.SMEM((wgs, nd, ROWS, CHUNK), out_dtype, transforms=_tiled(out_elems)),
            plgpu.SMEM((wgs, ROWS, KV), BF16, transforms=_tiled()) if interpret else None,
            plgpu.Barrier(num_arrivals=nd, num_barriers=wgs),
            plgpu.Barrier(num_arrivals=nd, num_barriers=wgs * stages),
            plgpu.Barrier(num_arrivals=nd, num_barriers=wgs * stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=wgs * stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=wgs * stages),
            collective_axes="wg",
        )

    def _block(
        j,
        carry,
        *,
        partial,
        q_smem,
        k_smem,
        v_smem,
        e_smem,
        bar,
        k_full,
        v_full,
        k_free,
        v_free,
        pos,
        last,
        n_blocks,
        ops,
    ):
        """One KV block of the chain for the tile's 64 rows (module docstring). partial: the
        block may hold keys past a row's position (mask) and rows whose last block is
        before it (accumulator select)."""
        m, den, acc = carry
        slot = lax.rem(j, stages)
        plgpu.barrier_wait(bar(k_full, slot))

        def qk(s_ref):
            for c in range(nd):  # Dh ascending, one accumulator
                plgpu.wgmma(s_ref, q_smem.at[c], k_smem.at[slot, c].T)
            return s_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((ROWS, KV), F32))
        plgpu.barrier_arrive(bar(k_free, slot))
        s = ops.mul(s, scale)
        if partial:
            key_pos = cast(lax.broadcasted_iota(jnp.int32, (ROWS, KV), 1)) + j * KV
            valid = key_pos <= jnp.broadcast_to(pos[:, None], (ROWS, KV))
            s = jnp.where(valid, s, jnp.asarray(neg_inf, F32))
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.where(m == m_new, jnp.asarray(1.0, F32), ops.exp_diff(m, m_new))
        e = ops.exp_diff(s, jnp.broadcast_to(m_new[:, None], (ROWS, KV)))
        if partial:
            e = jnp.where(valid, e, jnp.asarray(0.0, F32))
        den_new = ops.add(ops.mul(den, alpha), tile_math.tree64(e, ops, interpret=interpret))
        alpha_b = jnp.broadcast_to(alpha[:, None], (ROWS, CHUNK))
        acc_scaled = tuple(ops.mul(a, alpha_b) for a in acc)
        e16 = cast(e).astype(BF16)
        if interpret:  # the interpreter's wgmma reads A from shared memory only: the same bf16 values
            e_smem[...] = e16
            plgpu.commit_smem()
            e16 = e_smem
        plgpu.barrier_wait(bar(v_full, slot))
        if partial:

            @pl.when(j == n_blocks - 1)
            def _clean():
                """V rows at positions past the tile's last := +0 (module docstring)."""
                v_pos = cast(lax.broadcasted_iota(jnp.int32, (KV, CHUNK), 0)) + j * KV
                for c in range(nd):
                    v_blk = load(v_smem.at[slot, c])
                    v_smem.at[slot, c][...] = jnp.where(v_pos <= last, v_blk, jnp.asarray(0.0, BF16))
                plgpu.commit_smem()

        def pv(acc_refs):  # every chunk's wgmma issued before the first result is awaited
            for c, acc_ref in enumerate(acc_refs):
                acc_store(acc_ref, acc_scaled[c])
                plgpu.wgmma(acc_ref, e16, v_smem.at[slot, c])
            return tuple(acc_ref[...] for acc_ref in acc_refs)

        acc_new = pl.run_scoped(pv, tuple(plgpu.ACC((ROWS, CHUNK), F32) for _ in range(nd)))
        plgpu.barrier_arrive(bar(v_free, slot))
        live = pos >= j * KV  # the row's last block is j or later
        m = jnp.where(live, m_new, m)
        den = jnp.where(live, den_new, den)
        if partial:
            live_b = jnp.broadcast_to(live[:, None], (ROWS, CHUNK))
            acc_new = tuple(jnp.where(live_b, a_new, a) for a_new, a in zip(acc_new, acc))
        return m, den, acc_new

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((batch, hkv, rows, dh), out_dtype),
        grid=grid,
        grid_names=("tile", "head", "batch"),
        num_threads=wgs + 1,
        thread_name="wg",
        **interpret_utils.kernel_kwargs(interpret, interpret_params),
    )
