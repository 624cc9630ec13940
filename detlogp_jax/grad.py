"""Chunked backward of linear_logp: gradients without an [N, V] buffer.

Given the forward's lse, each vocab chunk recomputes z = h @ W_c.T (+ b_c),
p = exp(z * inv_t - lse), and
    dz = inv_t * (g_lse * p + g_logp * (onehot - p)) + g_logits,
then dh += dz @ W_c, dW_c = dz.T @ h, db_c = sum_rows dz. Chunks are visited in
ascending order with a fixed shape, so two runs give identical bytes; the
backward is deterministic but not part of the frozen contract. Rows with
target == ignore_index (or a bad target) get no logp gradient; lse keeps its
own. The clamp min(d, 0) is treated as the identity (d > 0 only by rounding).
Temperature gets no gradient. For bf16/f16 models the gradient GEMMs take dz
rounded to the model dtype (f32 accumulation); f32 models stay in f32.

Documented accuracy against float64 autodiff of the materialized math (tests in
tests/test_api_guards.py): relative Frobenius error per tensor (hidden, weight,
bias) < 1e-5 with f32 inputs (also at the Qwen3 vocab), < 1e-2 with bf16 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from detlogp_jax import contract as C

DEFAULT_CHUNK = 4096  # bit-neutral for the forward; fixes the backward's sums


def _chunking(v_rows: int, chunk: int):
    chunk = min(chunk, v_rows)
    n_chunks = -(-v_rows // chunk)
    return chunk, n_chunks


def backward(hidden, weight, bias, targets, inv_t, lse, g_logp, g_lse, g_logits, *, vocab_size: int, chunk: int = DEFAULT_CHUNK):
    """Returns (d_hidden, d_weight, d_bias) for cotangents of (logp, lse, logits)."""
    n, d = hidden.shape
    v_rows = weight.shape[0]
    chunk, n_chunks = _chunking(v_rows, chunk)
    prec = lax.Precision.HIGHEST if hidden.dtype == jnp.float32 else None
    # f32 models keep f32 GEMMs; bf16/f16 models run the two gradient GEMMs on
    # dz rounded to their dtype with f32 accumulation (the usual mixed precision).
    gemm_dtype = jnp.float32 if hidden.dtype == jnp.float32 else hidden.dtype
    live = (targets >= 0) & (targets < vocab_size)
    g_logp = jnp.where(live, g_logp, 0.0).astype(jnp.float32)
    g_lse = g_lse.astype(jnp.float32)
    inv_t = inv_t.astype(jnp.float32)

    g_full = None
    if g_logits is not None:  # logits were returned (already [N, vocab_size]); pad to the weight's rows
        g_full = jnp.pad(g_logits.astype(jnp.float32), ((0, 0), (0, v_rows - g_logits.shape[1])))

    def body(carry, i):
        dh, dw, db = carry
        start = jnp.minimum(i * chunk, v_rows - chunk)
        w_c = lax.dynamic_slice_in_dim(weight, start, chunk, axis=0)
        cols = start + jnp.arange(chunk)
        fresh = (cols >= i * chunk) & (cols < vocab_size)  # each column once; real vocab only
        z = jnp.einsum("nd,vd->nv", hidden, w_c, preferred_element_type=jnp.float32, precision=prec)
        if bias is not None:
            z = z + lax.dynamic_slice_in_dim(bias.astype(jnp.float32), start, chunk)[None, :]
        p = jnp.where(fresh[None, :], jnp.exp(z * inv_t[:, None] - lse[:, None]), 0.0)
        onehot = (cols[None, :] == targets[:, None]) & fresh[None, :]
        dz = inv_t[:, None] * (g_lse[:, None] * p + g_logp[:, None] * (onehot.astype(jnp.float32) - p))
        if g_full is not None:
            dz = dz + lax.dynamic_slice_in_dim(g_full, start, chunk, axis=1)
        dz = jnp.where(fresh[None, :], dz, 0.0).astype(gemm_dtype)  # bf16 operands for bf16 models
        dh = dh + jnp.einsum("nv,vd->nd", dz, w_c.astype(gemm_dtype), preferred_element_type=jnp.float32, precision=prec)
        dw_c = jnp.einsum("nv,nd->vd", dz, hidden.astype(gemm_dtype), preferred_element_type=jnp.float32, precision=prec)
        prev = lax.dynamic_slice_in_dim(dw, start, chunk, axis=0)
        dw = lax.dynamic_update_slice_in_dim(dw, (prev.astype(jnp.float32) + dw_c).astype(dw.dtype), start, axis=0)
        if db is not None:
            prev_b = lax.dynamic_slice_in_dim(db, start, chunk)
            db = lax.dynamic_update_slice_in_dim(db, prev_b + jnp.sum(dz.astype(jnp.float32), axis=0), start, axis=0)
        return (dh, dw, db), None

    init = (
        jnp.zeros((n, d), jnp.float32),
        jnp.zeros(weight.shape, weight.dtype),
        None if bias is None else jnp.zeros(bias.shape, jnp.float32),
    )
    (dh, dw, db), _ = lax.scan(body, init, jnp.arange(n_chunks))
    return dh.astype(hidden.dtype), dw, (None if bias is None else db.astype(bias.dtype))
