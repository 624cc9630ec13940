"""The body's RMSNorm with a pinned reduction: `rms_norm(x, scale, eps)`.

    ss   = sum_i fl(x_i * x_i) over the last axis (D), in f32: the features zero-padded to a
           multiple of 64, each group of 64 summed by the contract's adjacent-pairwise tree
           (`numerics.tree64`), the group sums added in ascending order from +0
    mean = fl(ss * fl(1 / D))
    y    = fl(x * fl(rsqrt(fl(mean + eps)) * scale)), rounded once to the output dtype

Every product and sum is a separately rounded f32 op (`numerics.XlaOps`: no contraction into
FMAs) and the order is fixed by D alone, so a row's bytes never depend on the other rows, on M
or on the row's position, on any backend (XLA builds only element-wise ops from it). The
structure of `flax.nnx.RMSNorm` (statistics in f32, the scale folded into the rsqrt factor);
its bytes are not flax's (flax's mean of squares is XLA's reduction, whose order XLA picks).
Differentiable: the backward is the plain formulation's (not batch invariant; a trainer needs
the forward's bytes only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from detlogp_jax import contract as C
from detlogp_jax import numerics
from detlogp_jax.body.plain_backward import with_plain_backward

__all__ = ["rms_norm"]

F32 = jnp.float32


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype"))
def _rms_norm(x, scale, *, eps: float, out_dtype):
    ops = numerics.XlaOps(numerics.opaque_zero(x, scale))
    d = x.shape[-1]
    xf = x.astype(F32)
    sq = ops.mul(xf, xf)
    groups = -(-d // C.TILE_V)
    sq = jnp.pad(sq, [(0, 0)] * (x.ndim - 1) + [(0, groups * C.TILE_V - d)])
    part = numerics.tree64(sq.reshape(x.shape[:-1] + (groups, C.TILE_V)), ops)  # [..., groups]
    ss = jnp.zeros(x.shape[:-1], F32)
    for g in range(groups):  # ascending, from +0
        ss = ops.add(ss, part[..., g])
    mean = ops.mul(ss, jnp.asarray(np.float32(1.0) / np.float32(d), F32))
    factor = ops.mul(lax.rsqrt(ops.add(mean, jnp.asarray(eps, F32)))[..., None], scale.astype(F32))
    return ops.mul(xf, factor).astype(out_dtype)


def _plain(x, scale, *, eps: float, out_dtype):
    """The backward's formulation: jnp RMSNorm in f32."""
    xf = x.astype(F32)
    inv = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (inv * scale.astype(F32))).astype(out_dtype)


def rms_norm(x, scale, eps: float = 1e-6, *, out_dtype=None) -> jax.Array:
    """RMSNorm over the last axis of x [..., D] with scale [D] (module docstring); bfloat16 or
    float32 x, output in `out_dtype` (default x.dtype). Bad shapes / dtypes raise."""
    x, scale = jnp.asarray(x), jnp.asarray(scale)
    for name, a in (("x", x), ("scale", scale)):
        if jnp.dtype(a.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
            raise TypeError(f"{name}.dtype must be bfloat16 or float32, got {jnp.dtype(a.dtype).name}")
    if x.ndim < 1 or scale.shape != (x.shape[-1],):
        raise ValueError(f"scale must be [D] for x [..., D], got x {x.shape}, scale {scale.shape}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    static = dict(eps=float(eps), out_dtype=jnp.dtype(x.dtype if out_dtype is None else out_dtype))
    forward, plain = functools.partial(_rms_norm, **static), functools.partial(_plain, **static)
    return with_plain_backward(forward, plain, x, scale)
