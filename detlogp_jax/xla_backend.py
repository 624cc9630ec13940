"""The non-contract baseline: materialized XLA logits + log_softmax.

This is what JAX users run today: z = hidden @ W.T (+ b) as one XLA dot,
then logsumexp over the vocabulary and a gather. Its reduction trees and GEMM
tiling are XLA's, so its bytes can change with the batch size; it is kept as
the lane we measure drift and speed against, and it is refused in strict mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from detlogp_jax import contract as C
from detlogp_jax.layout import VD, as_layout


def logits(hidden, weight, bias=None, weight_layout=VD):
    """FP32 logits [N, V] = hidden @ W.T (+ bias) through one XLA dot (weight [V, D],
    or [D, V] with weight_layout=DV, read in place)."""
    prec = lax.Precision.HIGHEST if hidden.dtype == jnp.float32 else None
    spec = f"nd,{as_layout(weight_layout).einsum}->nv"
    z = jnp.einsum(spec, hidden, weight, preferred_element_type=jnp.float32, precision=prec)
    if bias is not None:
        z = z + bias.astype(jnp.float32)[None, : z.shape[1]]
    return z


def forward(
    hidden,
    weight,
    bias,
    targets,
    inv_t,
    *,
    vocab_size: int,
    return_logits: bool = False,
    weight_layout=VD,
    return_entropy: bool = False,
):
    """(logp, lse, logits|None) with XLA's own logsumexp; same semantics for
    ignore_index (+0) and bad targets (NaN) as the contract, other bits free.
    return_entropy: a fourth output, the entropy lse - sum(softmax(y) * y) of the
    materialized scaled logits (XLA's reductions, not the contract's statistic)."""
    z = logits(hidden, weight, bias, weight_layout)[:, :vocab_size]
    y = z * inv_t[:, None]
    lse = jax.nn.logsumexp(y, axis=1)
    safe = jnp.clip(targets, 0, vocab_size - 1)
    y_t = jnp.take_along_axis(y, safe[:, None], axis=1)[:, 0]
    out = (clamped_logp(y_t, lse, targets, vocab_size), lse, (z if return_logits else None))
    if not return_entropy:
        return out
    p = jax.nn.softmax(y, axis=1)
    mean_y = jnp.sum(p * jnp.where(p > 0, y, 0.0), axis=1)  # p = 0 lanes (y = -inf too) add nothing
    return out + (jnp.maximum(lse - mean_y, 0.0),)


def clamped_logp(y_t, lse, targets, vocab_size: int):
    """min(y_t - lse, 0) with the contract's target semantics: ignore_index -> +0,
    any other id outside [0, vocab_size) -> NaN (row-local). Unpinned arithmetic."""
    logp = jnp.minimum(y_t - lse, 0.0)
    logp = jnp.where(targets == C.IGNORE_INDEX, 0.0, logp)
    bad = C.bad_target(targets, vocab_size)
    return jnp.where(bad, jnp.nan, logp)
