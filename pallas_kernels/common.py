"""Pieces shared by the sm90 kernels: tile constants, shard geometry, work items,
the chain step, register layouts, and the forward kernels' refs and outputs.

Every kernel module imports this one (and `tuning`); nothing here imports a
kernel module or the host wrapper.

* `TILE`, `TILE_K`, `SWIZZLE`: the 64-column contract tile
  (`contract.TILE_V`), the 64-wide K slice of a pipeline step (64 bf16 = 128
  bytes = one 128B swizzle row) and that swizzle.
* `ShardGeometry` / `shard_geometry`: the local shard's splits of
  `contract.split_bounds` (static Python ints); `split_tiles` is the same
  split arithmetic on traced split indices.
* `work_item`: the (split or column block, row block) of a persistent CTA's
  i-th work item (bit-neutral: only the order changes).
* `chain_step`: one tile of a split's chain plus the target capture, the
  per-tile program every forward kernel runs (with `a=`, also the entropy
  statistic A of `linear-logp-entropy-v1`).
* `row_layout`, `col_layout`, `layout_of`, `load`, `cast`, `zero_acc`:
  register layouts and the loads/casts that are identities in interpret mode;
  `gather_rows`: row inputs shorter than a box, read by scalar loads (no TMA).
* `unpack_refs`, `out_type`: the forward kernels' operands and outputs
  (m, S, z_t, [A], [logits]).
* `DV_COL_MULTIPLE`: what a [D, V] weight's column count must divide by (the kernels read
  either layout in place; a build's `weight_layout` is "vd" / "dv" or a
  `detlogp_jax.layout.WeightLayout`, converted once with `as_layout`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from detlogp_jax import contract as C
from pallas_kernels import interpret_utils, tile_math, tuning

F32 = jnp.float32
TILE = C.TILE_V
TILE_K = 64  # K slice per pipeline step: 64 bf16 = 128 bytes = one 128B swizzle row.
SWIZZLE = 128

# A [D, V] weight's vocab columns (`detlogp_jax.layout.DV`, read in place) are TMA's tiled minor
# dimension (one 128-byte swizzle row = 64 bf16 columns per tile): Mosaic tiles the whole
# [D, Vl] array, so Vl must be a multiple of 64 (real vocabularies and their canonical padding are).
DV_COL_MULTIPLE = SWIZZLE // 2


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


def shard_geometry(
    vocab_size: int, padded_vocab_size: int, col_offset: int = 0, shard_cols: int | None = None
) -> ShardGeometry:
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
        raise ValueError(
            f"shard [{col_offset}, {col_offset + shard_cols}) outside the padded vocabulary {padded_vocab_size}"
        )
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


def work_item(i, n_local: int, n_rb: int, split_group: int):
    """(local split, row block) of work item i (bit-neutral: only the order changes).

    split_group == 0: row blocks fastest. G > 0: splits in groups of G (the last
    group may be smaller); inside a group the split index moves fastest, so a
    wave of CTAs covers a G-split x (CTAs / G)-row-block rectangle. (The dz
    kernel passes its column blocks as the "splits".)
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


def split_tiles(geom: ShardGeometry, j):
    """(start, end) tile of global split j (traced int32), per contract.split_bounds."""
    q, size = geom.parts, geom.size
    a = j // q
    p = j - a * q
    return a * size + (p * size) // q, a * size + ((p + 1) * size) // q


def row_layout():
    """Register layout of a [block_m] row vector of a WGMMA-layout tile."""
    return plgpu.Layout.WGMMA.reduce(1)


def col_layout():
    """Register layout of a [cols] column vector of a WGMMA-layout tile (e.g. the bias)."""
    return plgpu.Layout.WGMMA.reduce(0)


def layout_of(shape):
    """The register layout of a forward kernel's arrays of this shape (for `ptx_ops.PtxOps`)."""
    if len(shape) == 2:
        return plgpu.Layout.WGMMA
    if len(shape) == 1:
        return row_layout()
    raise ValueError(f"no register layout for shape {shape}")


cast = interpret_utils.cast
load = interpret_utils.load


def gather_rows(ref, base, n_rows: int, length: int, fill, layout, interpret: bool, shape=None, axis: int = 0):
    """Row inputs shorter than a box, read without TMA: an array of `shape` (default
    (length,)) in `layout` whose entries at position i along `axis` (the same along the other
    axis) are ref[base + i] where base + i < n_rows and `fill` elsewhere.

    One scalar load per position (every thread loads the same word; the index is clamped to
    n_rows - 1, so no read leaves the n_rows-entry array), merged by selects. For targets /
    inv_t of a decode call passed unpadded: a 1-D TMA operand of 4 or 12 bytes read wrong on
    the H200 (docs/PERFORMANCE.md), and a padded copy is an XLA op per call.
    base: a Python int (positions at or past n_rows are then left out statically) or a traced
    int32 (every position is loaded, clamped, and selected by base + i < n_rows). Pure data
    movement: the values reaching the caller are the entries themselves."""
    shape = (length,) if shape is None else tuple(shape)
    dtype = ref.dtype
    out = cast(jnp.full(shape, fill, dtype), layout, interpret)
    static = isinstance(base, int)
    if static and base >= n_rows:
        return out  # no real row here (no unused iota either: Mosaic's layout inference fails on one)
    pos = cast(lax.broadcasted_iota(jnp.int32, shape, axis), layout, interpret)
    for i in range(length):
        if static and base + i >= n_rows:
            break
        if static:
            out = jnp.where(pos == i, ref[base + i], out)
        else:
            row = base + i
            value = ref[jnp.minimum(row, n_rows - 1)]
            out = jnp.where((pos == i) & (row < n_rows), value, out)
    return out


def zero_acc(acc_ref, bm, cols, interpret):
    """acc := +0 (the next group's K walk starts from a zero accumulator)."""
    zeros = jnp.zeros((bm, cols), F32)
    if interpret:
        # Interpret mode models the accumulator as a plain buffer and has no rule
        # for the accumulator-store primitive; a plain ref store is equivalent.
        from jax._src.state import primitives as state_primitives

        state_primitives.ref_set(acc_ref, (slice(None), slice(None)), zeros)
    else:
        acc_ref[...] = plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)


def chain_step(m, s, zt, z, *, tile, t1, limit, tgt, invt_b, col_iota, ops, interpret, a=None):
    """One tile of a split's chain plus the target capture: (m, S, z_t) -> (m', S', z_t').

    z: [BM, 64] post-bias FP32 logits of global tile `tile`; t1: the split's end
    tile; limit: the first column not owned by the chain (min(vocab, split end)).
    The contract step is `tile_math.chain_tile`; only tiles reaching past
    `limit` take the masked variant (on all others the masks are identities, so
    both give the same bits); the branch is uniform across the CTA. Rows whose
    target lies in this tile of this split take z at the target column as z_t.

    a: the entropy statistic A [BM] of the chain (a kernel built with
    return_entropy), or None (exactly the step above). Given, the step is
    `tile_math.chain_tile(..., a=a)` and returns (m', S', z_t', A').
    """
    if a is not None:
        return _chain_step_entropy(
            m,
            s,
            zt,
            a,
            z,
            tile=tile,
            t1=t1,
            limit=limit,
            tgt=tgt,
            invt_b=invt_b,
            col_iota=col_iota,
            ops=ops,
            interpret=interpret,
        )
    tcol0 = tile * TILE
    col = col_iota + tcol0

    def chain(m, s, z, col, masked):
        return tile_math.chain_tile(m, s, z, col, tgt, invt_b, limit, ops, interpret=interpret, masked=masked)

    m, s, z_hit = lax.cond(
        (tile + 1) * TILE <= limit,
        lambda m, s, z, col: chain(m, s, z, col, False),
        lambda m, s, z, col: chain(m, s, z, col, True),
        m,
        s,
        z,
        col,
    )
    row_hit = (tgt >= tcol0) & (tgt < tcol0 + TILE) & (tile < t1)
    return m, s, jnp.where(row_hit, z_hit, zt)


def _chain_step_entropy(m, s, zt, a, z, *, tile, t1, limit, tgt, invt_b, col_iota, ops, interpret):
    """`chain_step` carrying the entropy statistic: (m, S, z_t, A) -> (m', S', z_t', A')."""
    tcol0 = tile * TILE
    col = col_iota + tcol0

    def chain(m, s, a, z, col, masked):
        return tile_math.chain_tile(m, s, z, col, tgt, invt_b, limit, ops, interpret=interpret, masked=masked, a=a)

    m, s, z_hit, a = lax.cond(
        (tile + 1) * TILE <= limit,
        lambda m, s, a, z, col: chain(m, s, a, z, col, False),
        lambda m, s, a, z, col: chain(m, s, a, z, col, True),
        m,
        s,
        a,
        z,
        col,
    )
    row_hit = (tgt >= tcol0) & (tgt < tcol0 + TILE) & (tile < t1)
    return m, s, jnp.where(row_hit, z_hit, zt), a


def unpack_refs(refs, has_bias: bool, return_logits: bool, return_entropy: bool = False):
    """(h, w, bias | None, targets, inv_t, m_out, s_out, zt_out, logits_out | None, a_out | None) of a
    forward kernel's refs: inputs (hidden, weight, [bias], targets, inv_t), then outputs (`out_type`)."""
    refs = list(refs)
    h, w = refs[:2]
    b = refs.pop(2) if has_bias else None
    tgt, invt, m_out, s_out, zt_out = refs[2:7]
    a_out = refs.pop(7) if return_entropy else None
    return h, w, b, tgt, invt, m_out, s_out, zt_out, (refs[7] if return_logits else None), a_out


def out_type(
    n_local: int, n_pad: int, return_logits: bool, lg_rows: int | None, lg_cols: int, return_entropy: bool = False
):
    """Outputs of a forward kernel: m, S, z_t captures [n_local, n_pad] f32, with return_entropy
    the entropy statistic A [n_local, n_pad] f32 next to them, and the logits
    [lg_rows (default n_pad), lg_cols] f32 for the serving entry."""
    shapes = [jax.ShapeDtypeStruct((n_local, n_pad), F32) for _ in range(4 if return_entropy else 3)]
    if return_logits:
        shapes.append(jax.ShapeDtypeStruct((n_pad if lg_rows is None else lg_rows, lg_cols), F32))
    return tuple(shapes)


__all__ = [
    "F32",
    "TILE",
    "TILE_K",
    "SWIZZLE",
    "DV_COL_MULTIPLE",
    "ShardGeometry",
    "shard_geometry",
    "work_item",
    "split_tiles",
    "row_layout",
    "col_layout",
    "layout_of",
    "cast",
    "load",
    "zero_acc",
    "gather_rows",
    "chain_step",
    "unpack_refs",
    "out_type",
]
