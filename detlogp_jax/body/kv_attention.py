"""The body's batch-invariant attention: causal GQA over a KV cache, one program per query row.

`attention(q, k, v, q_positions=..., kv_start=...)` computes, for every query row (sequence b,
query t, head h; KV head h // G with G = Hq / Hkv), the softmax attention of q[b, t, h] over the
keys of sequence b at positions 0 .. p (p = q_positions[b, t]), where cache slot s holds the key
at position s - kv_start[b] (kv_start: the slots a left-padded batch puts before position 0).
Contract kept by every invariant backend (`body_contract`, docs/BODY.md):

* the keys are visited in blocks of `KV_BLOCK` = 64 positions tied to absolute positions
  (block j: positions [64 j, 64 j + 64)), blocks 0 .. floor(p / 64) ascending; a block past the
  row's last one leaves the row's state untouched (a select, not arithmetic);
* per block: s = fl(dot(q, k) * scale) (the dot: the backend's one fixed f32 accumulation over
  Dh), keys at positions > p get s = -inf, then the online softmax of the operator's chain
  (`numerics.chain_step`: m' = max(m, max s); alpha = 1 if m' == m else pexp(m - m');
  e = pexp(s - m') on valid keys, +0 elsewhere; l' = fl(fl(l * alpha) + tree64(e)) with the
  contract's pinned exp and adjacent-pairwise tree), and acc' = fl(acc * alpha) + sum_k e_k v_k
  (e rounded to the model dtype for the product; the backend's fixed f32 accumulation over the
  block's keys in ascending order);
* out = fl(acc * fl(1 / l)) (`numerics.reciprocal_rn`), rounded once to the output dtype; a
  query with no key (p < 0: a padding query) gets +0.

So a row's bytes depend on its own query, position and keys only: not on the batch size, the
row's place in the batch, how many queries are computed at once (a whole-sequence prefill, a
chunk of it, one decode step), the cache's length or padding beyond the row's keys, or what the
other rows hold. Each backend is invariant on its own; backends do not share bits with each
other (the reference's sequential f32 adds are not the tensor cores' accumulation), nor across
GPU models or jax versions.

The reference formulation (`reference_attention`, any platform) writes every f32 product and
sum as a separately rounded op (`numerics.XlaOps`): dot(q, k) = the sequential chain over d
ascending from +0, sum_k e_k v_k the sequential chain over the block's keys ascending from +0,
then added to fl(acc * alpha). "xla" is the plain-JAX baseline lane (einsum + softmax), not
invariant.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from detlogp_jax import numerics
from detlogp_jax.body import backends as body_backends
from detlogp_jax.body.plain_backward import with_plain_backward

__all__ = [
    "DTYPES",
    "KV_BLOCK",
    "attention",
    "reference_attention",
    "reference_supports_attention",
    "xla_attention",
    "xla_supports_attention",
]

F32 = jnp.float32
KV_BLOCK = 64  # keys per block, tied to absolute positions (the contract's block; docs/BODY.md)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _validate(q, k, v, q_positions, kv_start, scale, out_dtype):
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    dt = jnp.dtype(q.dtype)
    if dt not in DTYPES:
        raise TypeError(f"q.dtype must be one of {[d.name for d in DTYPES]}, got {dt.name}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != dt:
            raise TypeError(f"{name}.dtype must equal q.dtype ({dt.name}), got {jnp.dtype(x.dtype).name}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q must be [B, T, Hq, Dh] and k, v [B, S, Hkv, Dh] (the cache), got {q.shape}, {k.shape}, {v.shape}"
        )
    b, t, hq, dh = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != dh:
        raise ValueError(f"k and v must both be [B={b}, S, Hkv, Dh={dh}], got {k.shape} and {v.shape}")
    hkv = k.shape[2]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"the query heads ({hq}) must be a multiple of the KV heads ({hkv}) (GQA)")
    qp = jnp.asarray(q_positions)
    if not jnp.issubdtype(qp.dtype, jnp.integer) or qp.shape != (b, t):
        raise ValueError(f"q_positions must be an integer [B={b}, T={t}] array, got {qp.dtype} {qp.shape}")
    ks = jnp.zeros((b,), jnp.int32) if kv_start is None else jnp.asarray(kv_start)
    if not jnp.issubdtype(ks.dtype, jnp.integer) or ks.shape != (b,):
        raise ValueError(f"kv_start must be an integer [B={b}] array, got {ks.dtype} {ks.shape}")
    scale = float(dh**-0.5 if scale is None else scale)
    if not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale}")
    out_dtype = dt if out_dtype is None else jnp.dtype(out_dtype)
    if out_dtype not in DTYPES:
        raise TypeError(f"out_dtype must be one of {[d.name for d in DTYPES]}, got {out_dtype.name}")
    return q, k, v, qp.astype(jnp.int32), ks.astype(jnp.int32), scale, out_dtype


def attention(q, k, v, *, q_positions, kv_start=None, scale=None, out_dtype=None, backend: str = "auto"):
    """Causal GQA attention of queries q [B, T, Hq, Dh] over the cache k, v [B, S, Hkv, Dh]
    (the sampler's layout, read in place), batch invariant (module docstring).

    q_positions [B, T] int: each query's absolute position p (it attends the keys at positions
    0 .. p, all of which must be in the cache); kv_start [B] int (default 0): the slot of
    position 0 (left padding); scale: the logit scale (default Dh ** -0.5); out_dtype: bfloat16
    or float32 (default q.dtype). backend: "auto" (the Hopper kernel where it serves, else the
    reference), "reference", "pallas_sm90", or "xla" (plain einsum + softmax, not invariant;
    refused in strict mode). Returns [B, T, Hq, Dh]. Unsupported dtypes or shapes raise
    TypeError / ValueError naming the supported set; a backend that cannot take the head size
    (the Hopper kernel's set: `pallas_kernels.body`) refuses with its reason."""
    q, k, v, qp, ks, scale, out_dtype = _validate(q, k, v, q_positions, kv_start, scale, out_dtype)
    if q.shape[1] == 0 or q.shape[0] == 0:
        return jnp.zeros(q.shape, out_dtype)
    impl = body_backends.resolve("attention", backend, q, k, v)
    static = dict(scale=scale, out_dtype=out_dtype)
    if not impl.invariant:
        return impl.attention(q, k, v, q_positions=qp, kv_start=ks, **static)

    def forward(q, k, v, qp, ks):
        return impl.attention(q, k, v, q_positions=qp, kv_start=ks, **static)

    def plain(q, k, v, qp, ks):
        return xla_attention(q, k, v, q_positions=qp, kv_start=ks, **static)

    # kernels and pinned formulations: the backward is the plain formulation's (`plain_backward`)
    return with_plain_backward(forward, plain, q, k, v, qp, ks)


# --- the reference formulation ------------------------------------------------------------


def _block_keys(x, kv_start, j, hq):
    """x's keys (or values) at positions [64 j, 64 j + 64) of each sequence, one per query
    head: [B, 64, Hq, Dh] f32 (slots past the cache read slot S - 1; they are masked)."""
    b, s = x.shape[:2]
    slots = kv_start[:, None] + j * KV_BLOCK + jnp.arange(KV_BLOCK, dtype=jnp.int32)[None, :]
    blk = jnp.take_along_axis(x, jnp.clip(slots, 0, s - 1)[:, :, None, None], axis=1)
    return jnp.repeat(blk.astype(F32), hq // x.shape[2], axis=2)


@functools.partial(jax.jit, static_argnames=("scale", "out_dtype"))
def reference_attention(q, k, v, *, q_positions, kv_start, scale: float, out_dtype):
    """The reference formulation (module docstring) of validated operands."""
    ops = numerics.XlaOps(numerics.opaque_zero(q, k, v))
    b, t, hq, dh = q.shape
    s_len = k.shape[1]
    n_blocks = -(-s_len // KV_BLOCK)  # enough for every position the cache can hold
    qf = q.astype(F32)
    c = jnp.asarray(scale, F32)
    model = q.dtype
    inf = jnp.asarray(jnp.inf, F32)

    def block(j, state):
        m, den, acc = state  # [B, T, Hq], [B, T, Hq], [B, T, Hq, Dh]
        kb, vb = _block_keys(k, kv_start, j, hq), _block_keys(v, kv_start, j, hq)  # [B, 64, Hq, Dh]

        def dot_step(d, sc):  # fl(sc + fl(q_d * k_d)), d ascending
            return ops.add(sc, ops.mul(qf[:, :, :, d, None], jnp.moveaxis(kb[:, :, :, d], 1, 2)[:, None]))

        sc = lax.fori_loop(0, dh, dot_step, jnp.zeros((b, t, hq, KV_BLOCK), F32))
        sc = ops.mul(sc, c)
        pos = j * KV_BLOCK + jnp.arange(KV_BLOCK, dtype=jnp.int32)
        valid = pos[None, None, None, :] <= q_positions[:, :, None, None]
        sc = jnp.where(valid, sc, -inf)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))  # the operator's chain step (numerics.chain_step)
        alpha = jnp.where(m == m_new, jnp.asarray(1.0, F32), numerics.pexp(ops.sub(m, m_new), ops))
        e = jnp.where(valid, numerics.pexp(ops.sub(sc, m_new[..., None]), ops), jnp.asarray(0.0, F32))
        den_new = ops.add(ops.mul(den, alpha), numerics.tree64(e, ops))
        e = e.astype(model).astype(F32)  # the product's operand in the model dtype

        def pv_step(kk, pv):  # fl(pv + fl(e_k * v_k)), keys ascending; a masked key adds +0 (never 0 * NaN)
            prod = ops.mul(e[:, :, :, kk, None], vb[:, kk][:, None])
            return ops.add(pv, jnp.where(valid[:, :, :, kk, None], prod, jnp.asarray(0.0, F32)))

        pv = lax.fori_loop(0, KV_BLOCK, pv_step, jnp.zeros((b, t, hq, dh), F32))
        acc_new = ops.add(ops.mul(acc, alpha[..., None]), pv)
        live = (j * KV_BLOCK <= q_positions)[:, :, None]  # a block past the row's last: untouched
        return (
            jnp.where(live, m_new, m),
            jnp.where(live, den_new, den),
            jnp.where(live[..., None], acc_new, acc),
        )

    init = (jnp.full((b, t, hq), -inf), jnp.zeros((b, t, hq), F32), jnp.zeros((b, t, hq, dh), F32))
    _, den, acc = lax.fori_loop(0, n_blocks, block, init)
    out = ops.mul(acc, numerics.reciprocal_rn(den)[..., None])
    return jnp.where(den[..., None] > 0, out, jnp.asarray(0.0, F32)).astype(out_dtype)  # no key (p < 0): +0


def reference_supports_attention(q, k, v) -> tuple[bool, str]:
    """The reference takes every operand `attention` validates."""
    return True, ""


# --- the XLA baseline lane ----------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("scale", "out_dtype"))
def xla_attention(q, k, v, *, q_positions, kv_start, scale: float, out_dtype):
    """Plain JAX: scores by einsum in f32, masked softmax, einsum with v (what a Flax / Tunix
    model runs today); not batch invariant."""
    b, t, hq, dh = q.shape
    g = hq // k.shape[2]
    qg = q.reshape(b, t, k.shape[2], g, dh)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=F32) * scale
    pos = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :] - kv_start[:, None]  # [B, S]
    valid = (pos[:, None, :] >= 0) & (pos[:, None, :] <= q_positions[:, :, None])  # [B, T, S]
    # masked keys at the lowest finite value, not -inf: a row with no key (a padding query)
    # gets a finite softmax, then zeroed, so its output and its gradients are +0, never NaN
    s = jnp.where(valid[:, None, None], s, jnp.finfo(F32).min)
    p = jnp.where(jnp.any(valid, axis=-1)[:, None, None, :, None], jax.nn.softmax(s, axis=-1), 0.0)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(q.dtype), v, preferred_element_type=F32)
    return o.reshape(b, t, hq, dh).astype(out_dtype)


def xla_supports_attention(q, k, v) -> tuple[bool, str]:
    return True, ""
