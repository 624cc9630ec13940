"""The split fold as a Pallas Mosaic GPU kernel: (m, S, z_t) -> (logp, lse).

Contract kept (`detlogp_jax.oracle.fold` is the spec), per row:
  M = max_j m_j (exact, computed first over all splits);
  S = +0; for j ascending: S = fl(S + fl(S_j * w_j)),
      w_j = 1 if m_j == M else pexp(m_j - M);
  lse = fl(M + plog(S)); y_t = fl(z_t * inv_t); d = fl(y_t - lse);
  logp = +0 if d > 0 else d; target == -100 -> +0; target < 0 (other) or
  target >= vocab_size -> NaN.
Every f32 op is one rounded op with FTZ (`ptx_ops.PtxOps` on the GPU,
`ptx_ops.InterpretOps` in interpret mode); the sequential order over splits
is fixed and independent of N, the row block and the grid. Rows are
independent: a CTA folds `FOLD_ROWS` rows held one per thread (WG_STRIDED
layout), so no cross-thread arithmetic exists at all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from detlogp_jax import contract as C
from pallas_kernels import ptx_ops, tile_math

F32 = jnp.float32
FOLD_ROWS = 128  # rows per CTA: one row per thread of one warpgroup (bit-neutral)
UNROLL = 8  # default splits per loop trip (bit-neutral: the order of the sum is unchanged)


def build_fold(*, n_split: int, n_pad: int, vocab_size: int, interpret: bool, interpret_params=None, unroll: int = UNROLL):
  """Kernel (mT [n_split, n_pad], sT, z_t [n_pad], targets [n_pad] i32, inv_t [n_pad]) -> (logp, lse)."""
  br = FOLD_ROWS
  assert n_pad % br == 0
  layout = plgpu.Layout.WG_STRIDED((br,), vec_size=1)

  def load(ref):
    if interpret:
      return ref[...]
    return plgpu.load(ref, layout=layout, optimized=False)

  def cast(x):
    return x if interpret else plgpu.layout_cast(x, layout)

  def kernel(m_ref, s_ref, zt_ref, tgt_ref, invt_ref, logp_ref, lse_ref):
    r0 = lax.axis_index("rows") * br
    rows = pl.ds(r0, br)
    ops = ptx_ops.make_ops(interpret, lambda shape: layout, source=load(invt_ref.at[rows]))

    # Both passes walk the splits in ascending order. They are unrolled by
    # UNROLL splits per loop trip: the loads and exps of a trip are
    # independent of the running value, so their latency overlaps; the
    # running max / sum still consumes splits strictly one after another.
    def blocks(first, body, init):
      n_full = (n_split - first) // unroll
      val = lax.fori_loop(0, n_full, lambda i, v: body(first + i * unroll, unroll, v), init)
      rest = (n_split - first) - n_full * unroll
      return body(first + n_full * unroll, rest, val) if rest else val

    def max_body(j0, count, big_m):
      ms = [load(m_ref.at[j0 + u, rows]) for u in range(count)]
      for m_j in ms:
        big_m = jnp.maximum(big_m, m_j)
      return big_m

    big_m = blocks(1, max_body, load(m_ref.at[0, rows]))

    def sum_body(j0, count, acc):
      terms = []
      for u in range(count):
        m_j = load(m_ref.at[j0 + u, rows])
        s_j = load(s_ref.at[j0 + u, rows])
        w = jnp.where(m_j == big_m, jnp.asarray(1.0, F32), ops.exp_diff(m_j, big_m))
        terms.append(ops.mul(s_j, w))
      for term in terms:
        acc = ops.add(acc, term)
      return acc

    acc = blocks(0, sum_body, cast(jnp.zeros((br,), F32)))
    lse = ops.add(big_m, tile_math.plog(acc, ops))
    tgt = load(tgt_ref.at[rows])
    y_t = ops.mul(load(zt_ref.at[rows]), load(invt_ref.at[rows]))
    d = ops.sub(y_t, lse)
    logp = jnp.where(d > 0, jnp.asarray(0.0, F32), d)
    logp = jnp.where(tgt == C.IGNORE_INDEX, jnp.asarray(0.0, F32), logp)
    bad = ((tgt < 0) & (tgt != C.IGNORE_INDEX)) | (tgt >= vocab_size)
    logp = jnp.where(bad, jnp.asarray(jnp.nan, F32), logp)
    logp_ref.at[rows][...] = logp
    lse_ref.at[rows][...] = lse

  kw = {}
  if interpret:
    kw["interpret"] = interpret_params if interpret_params is not None else plgpu.InterpretGPUParams()
  return plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((n_pad,), F32), jax.ShapeDtypeStruct((n_pad,), F32)),
      grid=(n_pad // br,),
      grid_names=("rows",),
      compiler_params=plgpu.CompilerParams(approx_math=False),
      **kw,
  )


@functools.partial(jax.jit, static_argnames=("n_split", "n_pad", "vocab_size", "interpret", "interpret_params", "unroll"))
def _fold_core(*args, **static):
  """The fold launch, jitted on the padded row count (shared across N)."""
  return build_fold(**static)(*args)


def fold_transposed(mT, sT, z_t, targets, inv_t, vocab_size: int, *, interpret: bool = False, interpret_params=None):
  """fold() on split-major partials mT, sT [n_split, N]; returns (logp [N], lse [N])."""
  n_split, n = mT.shape
  n_pad = -(-max(n, 1) // FOLD_ROWS) * FOLD_ROWS
  pad = n_pad - n

  def p(x, val):
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=val) if pad else x

  logp, lse = _fold_core(
      p(mT.astype(F32), -jnp.inf),
      p(sT.astype(F32), 0.0),
      p(z_t.astype(F32), 0.0),
      p(targets.astype(jnp.int32), C.IGNORE_INDEX),
      p(inv_t.astype(F32), 1.0),
      n_split=n_split, n_pad=n_pad, vocab_size=int(vocab_size), interpret=interpret, interpret_params=interpret_params,
      unroll=UNROLL,
  )
  return logp[:n], lse[:n]


def fold(m, s, z_t, targets, inv_t, vocab_size: int, *, interpret: bool = False, interpret_params=None):
  """Merges split partials m, s [N, n_split] in ascending split order -> (logp [N], lse [N]).

  Same contract as `detlogp_jax.oracle.fold`. `z_t` is the raw (unscaled,
  post-bias) target logit; `inv_t` = fl(1/T) per row.
  """
  m = jnp.asarray(m, F32)
  if m.ndim != 2:
    raise ValueError(f"m must be [N, n_split], got {m.shape}")
  return fold_transposed(m.T, jnp.asarray(s, F32).T, jnp.asarray(z_t), jnp.asarray(targets), jnp.asarray(inv_t), vocab_size,
                         interpret=interpret, interpret_params=interpret_params)
