"""The contract's per-tile arithmetic on register arrays inside the kernels.

Everything here is shared by the GPU path (ops = `PtxOps`, reductions by
Mosaic GPU's warp shuffles) and the interpret path (ops = `InterpretOps`,
XLA:CPU). Each function states which contract step it implements; the
oracle (`detlogp_jax.oracle`) is the specification. The entropy statistic of
`linear-logp-entropy-v1` (`chain_tile(..., a=)`, `chain_tile_sliced(..., a=)`,
`entropy_lanes`, `rescale_a`) is traced only in kernels built with it.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from detlogp_jax import contract as C
from detlogp_jax import numerics

F32 = jnp.float32
NEG_INF = float("-inf")


def tree64(e, ops, *, interpret: bool):
    """oracle.tree64 over the 64 lanes of each row of e [BM, 64]: returns [BM].

    The adjacent-pairwise balanced tree. On the GPU the three lowest levels come
    from `jnp.sum` over static 8-column slices of the WGMMA-layout tile: a
    thread holds columns (8j + 2q, 8j + 2q + 1), so Mosaic GPU reduces
    in-thread first and then with butterfly shuffles xor 1, xor 2, which is
    exactly ((c0+c1)+(c2+c3))+((c4+c5)+(c6+c7)) (verified in IR and on H200; the
    e lanes are normal or +0, so the non-FTZ shuffle adds round identically).
    The last three levels add the eight partials pairwise with pinned ops. In
    interpret mode XLA's reduce order is unspecified, so all six levels are
    explicit pairwise adds.
    """
    assert e.shape[-1] == C.TILE_V, e.shape
    if interpret:
        return pairwise([e[:, i] for i in range(C.TILE_V)], ops)
    return pairwise([slice_sum8(e[:, 8 * j : 8 * j + 8], ops, interpret=False) for j in range(8)], ops)


def chain_tile(m, s, z, col, tgt, inv_t_b, m_limit, ops, *, interpret: bool, masked: bool = True, a=None):
    """One step of the ascending split chain for a 64-column tile.

    m, s, tgt: [BM] row vectors (running max, running sum, target column id). z: [BM, 64] FP32 logits of the tile
    (post-bias, unscaled). col: [BM, 64] int32 global column of each lane.
    inv_t_b: [BM, 64] broadcast inverse temperature. m_limit: the first global
    column NOT owned by this chain (min(vocab_size, split end)); lanes at
    col >= m_limit are padding: y = -inf, e = +0 (a tile entirely beyond the
    split end is therefore exactly neutral).

    Contract: y = fl(z * inv_t) on valid lanes; tm = max(y); m' = max(m, tm);
    alpha = 1 if m == m' else pexp(m - m'); e = pexp(y - m') on valid lanes;
    S = fl(fl(S * alpha) + tree64(e)). `ops.exp_diff(a, b)` is pexp(fl(a - b)).
    Returns (m', S', z_hit) where z_hit is
    z at the lane with col == tgt (-inf if no lane of the row holds it; the
    caller selects it only for rows whose target lies in this tile).

    masked=False: the caller guarantees every lane is valid (col < m_limit);
    the masks are then identities and are skipped (same bits).

    a: the entropy statistic A [BM] of the chain (`linear-logp-entropy-v1`), or None
    (then the step is exactly the one above, nothing of the statistic is traced).
    Given, the lanes keep d = fl(y - m') for e = pexp(d) (`entropy_lanes`: the same
    rounded ops as `exp_diff`), u = (e == 0) ? +0 : fl(e * d), and
    A' = fl(rescale_a(A, S, m, m', alpha) + tree64(u)) with the S and m before this
    tile and the same tree as e; returns (m', S', z_hit, A').
    """
    bm = z.shape[0]
    y = ops.mul(z, inv_t_b)
    if masked:
        valid = col < m_limit
        y = jnp.where(valid, y, jnp.asarray(NEG_INF, F32))
    tm = jnp.max(y, axis=1)
    m_new = jnp.maximum(m, tm)
    alpha = jnp.where(m == m_new, jnp.asarray(1.0, F32), ops.exp_diff(m, m_new))
    m_b = jnp.broadcast_to(m_new[:, None], (bm, C.TILE_V))
    if a is None:
        e = ops.exp_diff(y, m_b)
        if masked:
            e = jnp.where(valid, e, jnp.asarray(0.0, F32))
    else:
        e, u = entropy_lanes(y, m_b, valid if masked else None, ops)
    s_new = ops.add(ops.mul(s, alpha), tree64(e, ops, interpret=interpret))
    # Target capture: the lane with col == tgt (at most one lane per row). max
    # over -inf and the one hit lane is the hit lane's value exactly (NaN
    # propagates, -0 stays -0). The caller uses it only for rows whose target
    # lies in this tile of this split.
    tgt_b = jnp.broadcast_to(tgt[:, None], (bm, C.TILE_V))
    hit = col == tgt_b
    z_hit = jnp.max(jnp.where(hit, z, jnp.asarray(NEG_INF, F32)), axis=1)
    if a is None:
        return m_new, s_new, z_hit
    a_new = ops.add(rescale_a(a, s, m, m_new, alpha, ops), tree64(u, ops, interpret=interpret))
    return m_new, s_new, z_hit, a_new


def entropy_lanes(y, m_b, valid, ops):
    """(e, u) of a tile's (or slice's) lanes for the entropy statistic (CONTRACT.md section 9).

    d = fl(y - m'), e = pexp(d) (the bits of `ops.exp_diff(y, m_b)`: the same subtract,
    then the same exp instructions, with d kept), +0 where `valid` is False (None: every
    lane valid), and u = (e == 0) ? +0 : fl(e * d), so padding lanes, underflowed
    exps and -inf logits add +0.
    """
    d = ops.sub(y, m_b)
    e = ops.exp(d)
    if valid is not None:
        e = jnp.where(valid, e, jnp.asarray(0.0, F32))
    return e, ops.entropy_term(e, d)


def rescale_a(a, s, m, m_new, w, ops):
    """resc(A, S, m, m', w) of CONTRACT.md section 9 (oracle.rescale_a) on row vectors:
    A if m == m', else +0 if w == 0, else fl(w * fl(A + fl(fl(m - m') * S))), every
    product and difference flushed (`ops.flush`: the identity for `.ftz` PTX)."""
    delta = ops.flush(ops.sub(m, m_new))
    moved = ops.flush(ops.mul(w, ops.add(a, ops.flush(ops.mul(delta, s)))))
    out = jnp.where(w == 0, jnp.asarray(0.0, F32), moved)
    return jnp.where(m == m_new, a, out)


# The contract's log is shared with the XLA lane (same code, kernel ops).
plog = numerics.plog


def slice_sum8(e, ops, *, interpret: bool):
    """Levels 1-3 of tree64 over one 8-column slice e [BM, 8]: ((c0+c1)+(c2+c3))+((c4+c5)+(c6+c7)).

    On the GPU this is `jnp.sum(e, axis=1)` (in-thread pair, then butterfly
    shuffles xor 1 and xor 2: see `tree64`); in interpret mode explicit pinned
    adds (XLA's reduce order is unspecified).
    """
    if not interpret:
        return jnp.sum(e, axis=1)
    return pairwise([e[:, c] for c in range(8)], ops)


def pairwise(vals, ops):
    """The adjacent-pairwise balanced tree over a power-of-two list (pinned adds)."""
    assert len(vals) & (len(vals) - 1) == 0, len(vals)
    while len(vals) > 1:
        vals = [ops.add(vals[2 * i], vals[2 * i + 1]) for i in range(len(vals) // 2)]
    return vals[0]


def _step_loaders(load_slice, load_step, slices_per_step):
    """k -> the slices_per_step loaders (zero-argument callables) of step k's slices, in
    column order: `load_step` when given (a hand-off layout that reads a step's slices with
    one load), else one `load_slice(j)` per slice, called where the slice is used."""
    if load_step is not None:
        return load_step
    return lambda k: [lambda q=q: load_slice(k * slices_per_step + q) for q in range(slices_per_step)]


def _sliced_setup(m, load_slice, load_step, slices_per_step, tcol0, tgt, inv_t, m_limit, full, ops, tile_cast):
    """What both sliced chains (with and without the entropy) start with: the step count, the
    step loaders and pass 1. Returns (n_steps, steps, `_sliced_pass1`'s tuple)."""
    n_steps = 8 // slices_per_step
    assert n_steps * slices_per_step == 8, slices_per_step
    steps = _step_loaders(load_slice, load_step, slices_per_step)
    return n_steps, steps, _sliced_pass1(m, steps, n_steps, tcol0, tgt, inv_t, m_limit, full, ops, tile_cast)


def _sliced_pass1(m, steps, n_steps, tcol0, tgt, inv_t, m_limit, full, ops, tile_cast):
    """Pass 1 of `chain_tile_sliced`: y = fl(z * inv_t) per slice (masked), the tile max and
    the target capture; then m', alpha = pexp(m - m') (1 where the max does not move) and m'
    broadcast to a slice. Returns (iota8, inv_b, m', alpha, m'_b, z_hit).

    Both maxima are exact (`max` is an exact operation of the contract, CONTRACT.md section 2),
    so the order in which they meet the tile's 64 lanes is free: the lane-wise max over the
    eight slices is taken in registers first, then one [BM, 8] row reduction per maximum
    (two per tile; a row reduction per slice would be sixteen, each with its shuffles).
    The column mask is skipped on full tiles (an identity there), and the column tests
    compare the slice's lane index with a scalar / a row vector relative to the tile (no
    per-lane column index). The same bytes as per-slice maxima (H200: every bucket;
    docs/PERFORMANCE.md)."""
    bm = m.shape[0]
    neg_inf = jnp.asarray(NEG_INF, F32)
    iota8 = tile_cast(lax.broadcasted_iota(jnp.int32, (bm, 8), 1))
    inv_b = jnp.broadcast_to(inv_t[:, None], (bm, 8))
    rel = tgt - tcol0  # the target's column within the tile (row vector)

    def scan(masked):
        y_max = z_max = None
        loaders = [ld for k in range(n_steps) for ld in steps(k)]  # slices 0..7 in order
        for j in range(8):
            z = loaders[j]()
            y = ops.mul(z, inv_b)
            if masked:
                y = jnp.where(iota8 < m_limit - (tcol0 + 8 * j), y, neg_inf)
            h = jnp.where(iota8 == jnp.broadcast_to((rel - 8 * j)[:, None], (bm, 8)), z, neg_inf)
            y_max = y if y_max is None else jnp.maximum(y_max, y)
            z_max = h if z_max is None else jnp.maximum(z_max, h)
        return jnp.max(y_max, axis=1), jnp.max(z_max, axis=1)

    tm, z_hit = lax.cond(full, lambda: scan(False), lambda: scan(True))
    m_new = jnp.maximum(m, tm)
    alpha = jnp.where(m == m_new, jnp.asarray(1.0, F32), ops.exp_diff(m, m_new))
    m_b = jnp.broadcast_to(m_new[:, None], (bm, 8))
    return iota8, inv_b, m_new, alpha, m_b, z_hit


def chain_tile_sliced(
    m,
    s,
    load_slice,
    tcol0,
    tgt,
    inv_t,
    m_limit,
    full,
    ops,
    *,
    interpret: bool,
    tile_cast,
    row_cast,
    slices_per_step: int = 2,
    a=None,
    load_step=None,
):
    """`chain_tile` for a tile held in memory as eight [BM, 8] column slices.

    load_slice(j) returns slice j (traced j allowed): the post-bias FP32 logits
    of columns tcol0 + 8j ... + 8. load_step (optional, then load_slice is unused):
    k -> the loaders (zero-argument callables) of step k's slices_per_step slices, for a
    memory layout that reads a step's slices in one load (k is traced in pass 2).
    Same contract step, same operations on every lane, same tree: pass 1 reads the slices for y = fl(z * inv_t) (masked),
    the row max (exact: lane-wise over the slices, then one row reduction) and the
    target capture; pass 2 reads them again (y recomputed: the same rounded
    multiply of the same operands) for e = pexp(y - m') and the slice sums
    (tree levels 1-3), in a loop of 8 / slices_per_step steps so the code stays
    small; levels 4-6 are pinned pairwise adds. `full` (traced bool): every lane
    of the tile is valid, the masks are skipped in both passes (identities then).
    tile_cast / row_cast put [BM, 8] / [BM] arrays in the kernel's register
    layouts (identities in interpret mode).
    Returns (m', S', z_hit) as `chain_tile` does.

    a: the entropy statistic A [BM] (or None: exactly the step above). Given, pass 2
    also forms u from the d of each lane's exp (`entropy_lanes`) and reduces it with
    the tree of e (slice sums, then the same pairwise levels, in the same loop), and
    the result is (m', S', z_hit, A') as `chain_tile(..., a=a)` gives.
    """
    if a is not None:
        return _chain_tile_sliced_entropy(
            m,
            s,
            a,
            load_slice,
            tcol0,
            tgt,
            inv_t,
            m_limit,
            full,
            ops,
            interpret=interpret,
            tile_cast=tile_cast,
            row_cast=row_cast,
            slices_per_step=slices_per_step,
            load_step=load_step,
        )
    bm = m.shape[0]
    neg_inf = jnp.asarray(NEG_INF, F32)
    n_steps, steps, (iota8, inv_b, m_new, alpha, m_b, z_hit) = _sliced_setup(
        m, load_slice, load_step, slices_per_step, tcol0, tgt, inv_t, m_limit, full, ops, tile_cast
    )

    def slice_part(loader, j, masked):
        z = loader()
        y = ops.mul(z, inv_b)
        if masked:
            valid = (iota8 + (tcol0 + 8 * j)) < m_limit
            y = jnp.where(valid, y, neg_inf)
        e = ops.exp_diff(y, m_b)
        if masked:
            e = jnp.where(valid, e, jnp.asarray(0.0, F32))
        return slice_sum8(e, ops, interpret=interpret)

    def step_sum(k):
        def sums(masked):
            loaders = steps(k)
            return pairwise(
                [slice_part(loaders[q], k * slices_per_step + q, masked) for q in range(slices_per_step)], ops
            )

        return lax.cond(full, lambda: sums(False), lambda: sums(True))

    if n_steps == 1:
        tree = step_sum(0)
    else:

        def step(k, parts):
            v = step_sum(k)
            kk = row_cast(
                jnp.full((bm,), k, jnp.int32)
            )  # the step index as a row vector (no scalar broadcast in selects)
            return tuple(row_cast(jnp.where(kk == q, v, parts[q])) for q in range(n_steps))

        zero = jnp.zeros((bm,), F32)
        parts = lax.fori_loop(0, n_steps, step, tuple(row_cast(zero) for _ in range(n_steps)))
        tree = pairwise(list(parts), ops)
    s_new = ops.add(ops.mul(s, alpha), tree)
    return m_new, s_new, z_hit


def _chain_tile_sliced_entropy(
    m,
    s,
    a,
    load_slice,
    tcol0,
    tgt,
    inv_t,
    m_limit,
    full,
    ops,
    *,
    interpret,
    tile_cast,
    row_cast,
    slices_per_step,
    load_step=None,
):
    """`chain_tile_sliced` with the entropy statistic: the same pass 1, and in pass 2 each
    slice gives the level-3 sums of e and of u (same slices, same tree levels 1-3, then the
    same pairwise levels 4-6 for both). Returns (m', S', z_hit, A')."""
    bm = m.shape[0]
    neg_inf = jnp.asarray(NEG_INF, F32)
    n_steps, steps, (iota8, inv_b, m_new, alpha, m_b, z_hit) = _sliced_setup(
        m, load_slice, load_step, slices_per_step, tcol0, tgt, inv_t, m_limit, full, ops, tile_cast
    )

    def slice_part(loader, j, masked):
        z = loader()
        y = ops.mul(z, inv_b)
        valid = None
        if masked:
            valid = (iota8 + (tcol0 + 8 * j)) < m_limit
            y = jnp.where(valid, y, neg_inf)
        e, u = entropy_lanes(y, m_b, valid, ops)
        return slice_sum8(e, ops, interpret=interpret), slice_sum8(u, ops, interpret=interpret)

    def step_sum(k):
        def sums(masked):
            loaders = steps(k)
            parts = [slice_part(loaders[q], k * slices_per_step + q, masked) for q in range(slices_per_step)]
            return pairwise([p[0] for p in parts], ops), pairwise([p[1] for p in parts], ops)

        return lax.cond(full, lambda: sums(False), lambda: sums(True))

    if n_steps == 1:
        tree_e, tree_u = step_sum(0)
    else:

        def step(k, parts):
            ve, vu = step_sum(k)
            kk = row_cast(jnp.full((bm,), k, jnp.int32))  # the step index as a row vector
            pe = tuple(row_cast(jnp.where(kk == q, ve, parts[0][q])) for q in range(n_steps))
            pu = tuple(row_cast(jnp.where(kk == q, vu, parts[1][q])) for q in range(n_steps))
            return pe, pu

        zero = jnp.zeros((bm,), F32)
        init = tuple(row_cast(zero) for _ in range(n_steps))
        parts_e, parts_u = lax.fori_loop(0, n_steps, step, (init, init))
        tree_e, tree_u = pairwise(list(parts_e), ops), pairwise(list(parts_u), ops)
    s_new = ops.add(ops.mul(s, alpha), tree_e)
    a_new = ops.add(rescale_a(a, s, m, m_new, alpha, ops), tree_u)
    return m_new, s_new, z_hit, a_new
