"""The reference backend: the contract in plain JAX, on any platform.

Logits: every output element is an ascending sequential sum over d of
fl(h_d * w_d) in f32 (one accumulator, separately rounded, no library GEMM or
reduction whose order could depend on N), then fl(acc + b). Post-GEMM: the
contract's programs from `detlogp_jax.numerics`, with contraction blocked.
Rows never interact, and the vocabulary is streamed tile by tile across all
splits at once, so the trainer path holds O(rows_per_block * n_split * 64)
floats, never [N, V].

With `return_entropy=True` the chain also carries the entropy statistic A
(`numerics.chain_step_entropy`) and the fold returns the entropy
(`linear-logp-entropy-v1`); without it the program is the one it always was.

Its logits need not equal a GPU kernel's (tensor cores do not accumulate as a
sequence of IEEE adds); given its own logits, logp/lse (and the entropy) equal the oracle's.
On XLA:CPU (FTZ/DAZ arithmetic) the logits equal `oracle.reference_logits`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from detlogp_jax import contract as C
from detlogp_jax import numerics, vma
from detlogp_jax.layout import VD, as_layout

BACKEND_NAME = "reference"
ROW_BLOCK = 128  # bit-neutral: rows are independent


def _local_plan(padded_vocab_size: int, col_offset: int, shard_cols: int):
    """Split tile ranges inside [col_offset, col_offset + shard_cols), as tile indices."""
    plan = C.split_bounds(padded_vocab_size)
    idx = C.local_splits(padded_vocab_size, col_offset, shard_cols)
    starts = np.array([plan.starts[j] for j in idx], np.int64)
    ends = np.array([plan.ends[j] for j in idx], np.int64)
    return starts, ends


def _block_partials(
    h, weight, bias, gather, col_steps, t, inv_t, vocab_size, zero, return_logits, d_axis, return_entropy=False
):
    """Partials for one block of rows; the chain walks `col_steps` [steps, n_loc*64].
    `d_axis`: the weight's D axis (1 for [V, D], 0 for [D, V]: read in place).
    return_entropy: the carry also holds the entropy statistic A (returned last)."""
    ops = numerics.XlaOps(zero)
    rows = h.shape[0]
    n_loc = col_steps.shape[1] // C.TILE_V

    def logits_of(g, cols):
        # Ascending sequential K walk, one f32 accumulator, separately rounded.
        present = cols >= 0

        def kstep(d, acc):
            w_d = lax.dynamic_index_in_dim(weight, d, axis=d_axis, keepdims=False)[g]
            w_d = numerics.ftz(jnp.where(present, w_d.astype(jnp.float32), 0.0))
            return ops.add(acc, ops.mul(h[:, d][:, None], w_d[None, :]))

        acc0 = vma.like(jnp.zeros((rows, cols.shape[0]), jnp.float32), h, weight, cols)
        acc = lax.fori_loop(0, h.shape[1], kstep, acc0)
        if bias is not None:
            acc = ops.add(acc, jnp.where(present, bias.astype(jnp.float32)[g], 0.0)[None, :])
        return numerics.ftz(acc)

    def step(carry, xs):
        m, s, z_t, owned = carry[:4]
        g, cols = xs
        z = logits_of(g, cols)  # [rows, n_loc*64]
        valid = (cols >= 0) & (cols < vocab_size)
        y = numerics.ftz(ops.mul(z, inv_t[:, None]))
        y = jnp.where(valid[None, :], y, -jnp.inf).reshape(rows, n_loc, C.TILE_V)
        valid = valid.reshape(1, n_loc, C.TILE_V)
        if return_entropy:
            m, s, a = numerics.chain_step_entropy(m, s, carry[4], y, valid, ops)
        else:
            m, s = numerics.chain_step(m, s, y, valid, ops)
        hit = (cols[None, :] == t[:, None]) & (cols[None, :] >= 0)
        z_sel = jnp.max(jnp.where(hit, z, -jnp.inf), axis=1)
        found = jnp.any(hit, axis=1)
        carry = (m, s, jnp.where(found, z_sel, z_t), owned | found) + ((a,) if return_entropy else ())
        return carry, (z if return_logits else None)

    init = (
        jnp.full((rows, n_loc), -jnp.inf, jnp.float32),
        jnp.zeros((rows, n_loc), jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows,), bool),
    )
    if return_entropy:
        init += (jnp.zeros((rows, n_loc), jnp.float32),)
    init = vma.like(init, h, weight, bias, t, inv_t, zero)
    carry, zs = lax.scan(step, init, (gather, col_steps))
    return carry, zs


def partials(
    hidden,
    weight,
    bias,
    targets,
    inv_t,
    *,
    vocab_size: int,
    padded_vocab_size: int,
    col_offset: int = 0,
    shard_cols: int | None = None,
    return_logits: bool = False,
    logits_cols: int | None = None,
    row_block: int | None = None,
    weight_layout=VD,
    return_entropy: bool = False,
):
    """Split partials of the contract for rows of `hidden` against `weight`.

    weight [Vl, D] (or [D, Vl] with weight_layout=DV, read in place: the K walk
    and every sum are the same, so are the bytes) holds the rows of global
    columns [col_offset, col_offset+Vl);
    columns of the shard beyond Vl (an unpadded weight) and columns >= vocab_size
    are padding. Returns (m, s) [N, n_local], the owner's raw z_t [N] (valid
    where `owned`), and, with `return_logits`, logits [N, Vl] f32 (only the
    first `logits_cols` columns if given). With `return_entropy` a sixth array
    follows: the entropy statistic A [N, n_local] of the same splits (CONTRACT.md
    section 9); without it the statistic is not traced at all.
    """
    shard_cols = padded_vocab_size - col_offset if shard_cols is None else shard_cols
    starts, ends = _local_plan(padded_vocab_size, col_offset, shard_cols)
    n_loc, steps = len(starts), int((ends - starts).max())
    n_rows, d = hidden.shape
    d_axis = as_layout(weight_layout).d_axis
    v_local = weight.shape[1 - d_axis]

    # Static column map: step i of split j reads tile starts[j] + i (or nothing).
    lane = np.arange(C.TILE_V)
    tile = starts[None, :] + np.arange(steps)[:, None]  # [steps, n_loc]
    in_split = tile < ends[None, :]
    cols = tile[..., None] * C.TILE_V + lane  # global columns [steps, n_loc, 64]
    local = cols - col_offset
    present = in_split[..., None] & (local < v_local)
    cols = np.where(present, cols, -1).reshape(steps, n_loc * C.TILE_V)
    gather = np.where(present, local, 0).reshape(steps, n_loc * C.TILE_V)

    col_steps = jnp.asarray(cols, jnp.int32)
    gather = jnp.asarray(gather, jnp.int32)
    h32 = numerics.ftz(hidden.astype(jnp.float32))
    zero = numerics.opaque_zero(hidden, weight, bias, targets, inv_t)

    if isinstance(n_rows, int):  # balanced blocks of at most row_block rows
        n_blocks = max(1, -(-n_rows // (row_block or ROW_BLOCK)))
        rb = max(1, -(-n_rows // n_blocks))
    else:  # a symbolic row count (jax.export): blocks of exactly row_block rows
        rb = row_block or ROW_BLOCK
        n_blocks = -(-n_rows // rb)
    pad = n_blocks * rb - n_rows
    hp = jnp.pad(h32, ((0, pad), (0, 0)))
    tp = jnp.pad(targets.astype(jnp.int32), (0, pad), constant_values=-1)
    ip = jnp.pad(inv_t.astype(jnp.float32), (0, pad), constant_values=1.0)

    def run_block(args):
        h, t, it = args
        return _block_partials(
            h, weight, bias, gather, col_steps, t, it, vocab_size, zero, return_logits, d_axis, return_entropy
        )

    carry, zs = lax.map(run_block, (hp.reshape(n_blocks, rb, d), tp.reshape(n_blocks, rb), ip.reshape(n_blocks, rb)))
    m, s, z_t, owned = carry[:4]
    unblock = lambda a: a.reshape((n_blocks * rb,) + a.shape[2:])[:n_rows]
    logits = None
    if return_logits:
        # zs [n_blocks, steps, rb, n_loc*64] -> [N, Vl] in column order.
        zs = jnp.transpose(zs, (0, 2, 1, 3)).reshape(n_blocks * rb, steps * n_loc * C.TILE_V)[:n_rows]
        order = np.full(v_local, 0, np.int64)
        flat_cols = np.asarray(cols).reshape(-1)
        pos = np.nonzero(flat_cols >= 0)[0]
        order[flat_cols[pos] - col_offset] = pos
        if logits_cols is not None:
            if not 1 <= logits_cols <= v_local:
                raise ValueError(f"logits_cols must be in [1, {v_local}], got {logits_cols}")
            order = order[:logits_cols]
        logits = zs[:, order]
    out = (unblock(m), unblock(s), unblock(z_t), unblock(owned), logits)
    return out + (unblock(carry[4]),) if return_entropy else out


def fold(m, s, z_t, targets, inv_t, vocab_size: int, a=None):
    """The contract's fold of split partials (see `numerics.fold`); with the entropy
    statistic `a` it returns (logp, lse, entropy)."""
    return numerics.fold(m, s, z_t, targets, inv_t, vocab_size, a=a)
