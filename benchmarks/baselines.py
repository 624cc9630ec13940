"""Non-contract baselines the fused kernel is measured against.

* `chunked_logp`: chunked XLA streaming log-sum-exp. The vocabulary is walked
  in fixed blocks of `block` weight rows with `lax.fori_loop`; each block is one
  XLA GEMM [N, D] x [D, block] followed by an online max / rescaled-sum update,
  so the [N, V] logits are never materialized (unless `return_logits`). This is
  what a JAX user writes today to avoid the logits buffer.
* `gemm`: the lm_head GEMM alone (the ceiling for any fused kernel).

Neither is batch-invariant nor part of the contract.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from detlogp_jax import xla_backend

DEFAULT_BLOCK = 2048


def chunked_logp(
    hidden, weight, targets, *, vocab_size: int, inv_t=1.0, block: int = DEFAULT_BLOCK, return_logits: bool = False
):
    """(logp [N], lse [N], logits [N, vocab_size] f32 | None), streaming over vocab blocks.

    hidden [N, D], weight [V_rows, D] (lm_head layout), targets [N] int
    (ignore_index -100 -> logp 0). Rows >= vocab_size of the weight are padding. The
    last block is shifted back to end at V_rows (no weight copy or padding);
    columns it shares with the previous block are masked out.
    """
    n = hidden.shape[0]
    v_rows = weight.shape[0]
    block = min(block, v_rows)
    n_blocks = -(-v_rows // block)
    inv_t = jnp.asarray(inv_t, jnp.float32)
    targets = targets.astype(jnp.int32)

    def body(b, carry):
        m, s, y_t, buf = carry
        lo = b * block
        start = jnp.minimum(lo, v_rows - block)
        z = xla_backend.logits(hidden, lax.dynamic_slice_in_dim(weight, start, block, axis=0))
        cols = start + jnp.arange(block, dtype=jnp.int32)
        valid = (cols >= lo) & (cols < vocab_size)
        y = jnp.where(valid[None, :], z * inv_t, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(y, axis=1))
        m_ref = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # all -inf so far: keep s = 0
        s = s * jnp.exp(m - m_ref) + jnp.sum(jnp.exp(y - m_ref[:, None]), axis=1)
        y_t = y_t + jnp.sum(
            jnp.where(cols[None, :] == targets[:, None], jnp.where(valid[None, :], y, 0.0), 0.0), axis=1
        )
        if buf is not None:
            buf = lax.dynamic_update_slice_in_dim(buf, z, start, axis=1)
        return m_new, s, y_t, buf

    init = (
        jnp.full((n,), -jnp.inf, jnp.float32),
        jnp.zeros((n,), jnp.float32),
        jnp.zeros((n,), jnp.float32),
        jnp.zeros((n, v_rows), jnp.float32) if return_logits else None,
    )
    m, s, y_t, buf = lax.fori_loop(0, n_blocks, body, init)
    lse = m + jnp.log(s)
    logp = xla_backend.clamped_logp(y_t, lse, targets, vocab_size)
    return logp, lse, (buf[:, :vocab_size] if return_logits else None)


def gemm(hidden, weight, out_dtype=jnp.bfloat16):
    """logits [N, V_rows] = hidden @ weight.T, one XLA dot with f32 accumulation."""
    prec = lax.Precision.HIGHEST if hidden.dtype == jnp.float32 else None
    return jnp.einsum("nd,vd->nv", hidden, weight, preferred_element_type=out_dtype, precision=prec)
