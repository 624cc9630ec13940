"""The body's batch-invariant GEMM: `matmul(x, w)` and the `einsum` of Tunix's projections.

Contract kept by every invariant backend: y[i] = x[i] @ W with ONE f32 accumulator per
output element, K walked in one fixed ascending order (no split-K, no algorithm chosen by
shape), rounded once to `out_dtype`; the bytes of row i depend on x[i] and W only: not on
M, on the row's position, on padding rows or on what the other rows hold. Each backend is
invariant on its own; the backends do not share bits with each other (the reference's
sequence of IEEE adds is not the tensor cores' accumulation), nor across GPU models or
jax/jaxlib versions.

Weight layouts (read in place, never copied or transposed):
* "kn": W [K, N], a Flax `nnx.Linear` kernel or a Tunix Einsum weight reshaped to 2-D;
* "nk": W [N, K], a torch `Linear` weight.

The reference formulation (`reference_matmul`, any platform): per element
acc = fl(acc + fl(x[i, k] * W[k, j])) for k = 0, 1, ..., K - 1 from acc = +0, every
product and sum a separately rounded f32 op (contraction into FMAs is blocked by
`numerics.XlaOps`), rows in independent blocks. On XLA:CPU its bytes equal numpy's
sequential f32 loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from detlogp_jax import layout, numerics
from detlogp_jax.body import backends as body_backends
from detlogp_jax.body.plain_backward import with_plain_backward

__all__ = [
    "DTYPES",
    "W_LAYOUTS",
    "einsum",
    "matmul",
    "reference_matmul",
    "reference_supports_matmul",
    "w_layout_of",
    "xla_matmul",
    "xla_supports_matmul",
]

F32 = jnp.float32
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))  # x / w / out dtypes
# A body weight's layout as the operator's typed layout: [K, N] holds N along axis 1 like a
# [D, V] lm_head kernel, [N, K] along axis 0 like [V, D]; `vocab_axis` is N's axis, `d_axis` K's.
W_LAYOUTS = {"kn": layout.DV, "nk": layout.VD}
ROW_BLOCK = 128  # reference: rows per block (bit-neutral: rows never interact)
K_UNROLL = 8  # reference: K steps per loop iteration (bit-neutral: the same ascending chain)


def w_layout_of(w_layout) -> layout.WeightLayout:
    """The `WeightLayout` of a body weight layout name ("kn" | "nk"); ValueError otherwise."""
    if isinstance(w_layout, str) and w_layout in W_LAYOUTS:
        return W_LAYOUTS[w_layout]
    raise ValueError(f"w_layout must be 'kn' (W [K, N]) or 'nk' (W [N, K]), got {w_layout!r}")


def _dtype_name(dt) -> str:
    return jnp.dtype(dt).name


def _check_dtype(what: str, dt) -> jnp.dtype:
    try:
        dt = jnp.dtype(dt)
    except TypeError as e:
        raise TypeError(f"{what} must be one of {[d.name for d in DTYPES]}, got {dt!r}") from e
    if dt not in DTYPES:
        raise TypeError(f"{what} must be one of {[d.name for d in DTYPES]}, got {_dtype_name(dt)}")
    return dt


def _validate(x, w, w_layout, out_dtype):
    """(x, w, WeightLayout, out dtype) after the checks `matmul` documents."""
    lay = w_layout_of(w_layout)
    x, w = jnp.asarray(x), jnp.asarray(w)
    xdt = _check_dtype("x.dtype", x.dtype)
    if w.dtype != xdt:
        raise TypeError(f"w.dtype must equal x.dtype ({xdt.name}), got {_dtype_name(w.dtype)}")
    out_dtype = _check_dtype("out_dtype", xdt if out_dtype is None else out_dtype)
    if x.ndim < 1:
        raise ValueError(f"x must be [..., K] (at least 1-D), got shape {x.shape}")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D ({'[K, N]' if w_layout == 'kn' else '[N, K]'}), got shape {w.shape}")
    k, n = lay.hidden_size(w), lay.vocab_rows(w)
    if x.shape[-1] != k:
        raise ValueError(f"x's last axis ({x.shape[-1]}) must equal W's K ({k}; w_layout={w_layout!r}, w {w.shape})")
    if k < 1 or n < 1:
        raise ValueError(f"K and N must be positive, got K={k}, N={n}")
    return x, w, lay, out_dtype


def matmul(x, w, *, w_layout: str = "kn", out_dtype=None, backend: str = "auto") -> jax.Array:
    """y = x @ W, batch invariant (module docstring): x [..., K], W [K, N] ("kn") or [N, K]
    ("nk") of the same dtype (bfloat16 or float32), read in place; returns [..., N] in
    `out_dtype` (bfloat16 or float32; default x.dtype), the f32 accumulator rounded once.

    backend: "auto" (the Hopper kernel where it serves, else the reference), "reference",
    "pallas_sm90", or "xla" (plain jnp.dot, not invariant; refused in strict mode); see
    `detlogp_jax.body.backends`. Bad dtypes raise TypeError, bad shapes / layouts ValueError,
    each naming the supported set; rows that do not fill a kernel tile are padded inside.
    """
    x, w, lay, out_dtype = _validate(x, w, w_layout, out_dtype)
    lead, k, n = x.shape[:-1], x.shape[-1], lay.vocab_rows(w)
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return jnp.zeros(lead + (n,), out_dtype)
    impl = body_backends.resolve("matmul", backend, x2, w, w_layout)
    if impl.invariant:  # kernels and pinned formulations: the backward is XLA's (`plain_backward`)
        forward = functools.partial(impl.matmul, w_layout=w_layout, out_dtype=out_dtype)

        def plain(x2, w):  # one XLA GEMM accumulating in f32, rounded once
            return xla_matmul(x2, w, w_layout=w_layout, out_dtype=F32).astype(out_dtype)

        y = with_plain_backward(forward, plain, x2, w)
    else:
        y = impl.matmul(x2, w, w_layout=w_layout, out_dtype=out_dtype)
    return y.reshape(lead + (n,))


# --- the reference formulation ------------------------------------------------------------


def _row_blocks(n_rows: int) -> tuple[int, int]:
    """(blocks, rows per block): balanced blocks of at most ROW_BLOCK rows."""
    n_blocks = max(1, -(-n_rows // ROW_BLOCK))
    return n_blocks, -(-n_rows // n_blocks)


def _k_walk(xt, w, lay: layout.WeightLayout, ops):
    """acc [rows, N] = the ascending K chain of fl(acc + fl(x_k * w_k)) from +0.
    xt: [K, rows] f32 (x's columns as rows); w read in place (row k of [K, N], column k of [N, K])."""
    k, rows = xt.shape

    def step(kk, acc):
        w_k = lax.dynamic_index_in_dim(w, kk, axis=lay.d_axis, keepdims=False).astype(F32)
        return ops.add(acc, ops.mul(xt[kk][:, None], w_k[None, :]))

    return lax.fori_loop(0, k, step, jnp.zeros((rows, lay.vocab_rows(w)), F32), unroll=K_UNROLL)


@functools.partial(jax.jit, static_argnames=("w_layout", "out_dtype"))
def reference_matmul(x2, w, *, w_layout: str, out_dtype):
    """The reference formulation (module docstring) of validated operands x2 [M, K], w."""
    lay = w_layout_of(w_layout)
    ops = numerics.XlaOps(numerics.opaque_zero(x2, w))
    m, k = x2.shape
    n_blocks, rb = _row_blocks(m)
    xp = jnp.pad(x2.astype(F32), ((0, n_blocks * rb - m), (0, 0)))
    xt = jnp.transpose(xp.reshape(n_blocks, rb, k), (0, 2, 1))  # [blocks, K, rb]: x's own copy, not w's
    y = lax.map(lambda xb: _k_walk(xb, w, lay, ops).astype(out_dtype), xt)
    return y.reshape(n_blocks * rb, -1)[:m]


def reference_supports_matmul(x2, w, w_layout) -> tuple[bool, str]:
    """The reference takes every operand `matmul` validates."""
    return True, ""


# --- the XLA baseline lane ----------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("w_layout", "out_dtype"))
def xla_matmul(x2, w, *, w_layout: str, out_dtype):
    """Plain XLA: one `lax.dot_general` reading w in place (what `jnp.dot(x, kernel)` runs),
    accumulating in XLA's library GEMM; not batch invariant."""
    lay = w_layout_of(w_layout)
    acc_dtype = jnp.promote_types(x2.dtype, out_dtype)
    y = lax.dot_general(x2, w, (((1,), (lay.d_axis,)), ((), ())), preferred_element_type=acc_dtype)
    return y.astype(out_dtype)


def xla_supports_matmul(x2, w, w_layout) -> tuple[bool, str]:
    return True, ""


# --- einsum -------------------------------------------------------------------------------


def _parse_spec(spec: str, x_ndim: int) -> tuple[str, str, str]:
    """(lhs, rhs, out) subscripts of a two-operand explicit einsum spec, with a leading '...'
    of lhs and out expanded to letters that the spec does not use."""
    if not isinstance(spec, str) or spec.count("->") != 1 or spec.split("->")[0].count(",") != 1:
        raise ValueError(f"einsum spec must be 'LHS,RHS->OUT' with two operands, got {spec!r}")
    ins, out = spec.replace(" ", "").split("->")
    lhs, rhs = ins.split(",")
    if "..." in rhs:
        raise ValueError(f"einsum spec {spec!r}: the weight's subscripts take no '...'")
    if "..." in lhs:
        if not lhs.startswith("...") or not out.startswith("...") or "..." in lhs[3:] + out[3:]:
            raise ValueError(f"einsum spec {spec!r}: '...' is supported only at the front of LHS and OUT")
        used = set(lhs + rhs + out)
        spare = [c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in used]
        fill = "".join(spare[: max(0, x_ndim - (len(lhs) - 3))])
        lhs, out = fill + lhs[3:], fill + out[3:]
    elif "..." in out:
        raise ValueError(f"einsum spec {spec!r}: '...' in OUT needs '...' in LHS")
    for name, s in (("LHS", lhs), ("RHS", rhs), ("OUT", out)):
        if not s.isalpha() or len(set(s)) != len(s):
            raise ValueError(f"einsum spec {spec!r}: {name} must be distinct letters, got {s!r}")
    return lhs, rhs, out


def _weight_groups(spec: str, lhs: str, rhs: str, out: str) -> tuple[str, str, str]:
    """(contracted letters in W's order, W's free letters, w_layout) of a spec that `einsum`
    takes: W = [contracted..., free...] ("kn") or [free..., contracted...] ("nk")."""
    batch = set(lhs) & set(rhs) & set(out)
    if batch:
        raise ValueError(f"einsum spec {spec!r}: batch letters {sorted(batch)} (in both operands and OUT) unsupported")
    stray = (set(lhs) ^ set(rhs)) - set(out) | set(out) - set(lhs) - set(rhs)
    if stray:
        raise ValueError(f"einsum spec {spec!r}: letters {sorted(stray)} are summed on one side or come from nowhere")
    contracted = "".join(c for c in rhs if c in lhs)
    free = "".join(c for c in rhs if c not in lhs)
    if not contracted or not free:
        raise ValueError(f"einsum spec {spec!r}: W needs contracted and output letters")
    if rhs == contracted + free:
        return contracted, free, "kn"
    if rhs == free + contracted:
        return contracted, free, "nk"
    raise ValueError(
        f"einsum spec {spec!r}: W's contracted letters {contracted!r} must come first or last in one block "
        f"(W [K..., N...] or [N..., K...]) to be read in place as a 2-D matrix, got {rhs!r}"
    )


def einsum(spec: str, x, w, *, out_dtype=None, backend: str = "auto") -> jax.Array:
    """`jnp.einsum(spec, x, w)` through `matmul`, for the projection specs of Tunix's models
    ('BTD,DNH->BTNH', 'BSD,DKH->BSKH', 'BTNH,NHD->BTD', 'BTD,DF->BTF', 'BTF,FD->BTD',
    '...TM,MD->...TD'): W's contracted letters one block at its front ("kn") or back ("nk"),
    so W is reshaped to 2-D without a copy; x is transposed if its contracted letters are not
    last in W's order (x is an activation; W is never moved). Batch letters (in x, W and the
    output) and '...' in W are refused (ValueError). Same dtypes, out_dtype and backend as
    `matmul`."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    lhs, rhs, out = _parse_spec(spec, x.ndim)
    if len(lhs) != x.ndim or len(rhs) != w.ndim:
        raise ValueError(f"einsum spec {spec!r} does not match x {x.shape} and w {w.shape}")
    contracted, w_free, w_layout = _weight_groups(spec, lhs, rhs, out)
    size = {c: d for c, d in zip(lhs, x.shape)}
    for c, d in zip(rhs, w.shape):
        if size.setdefault(c, d) != d:
            raise ValueError(f"einsum spec {spec!r}: letter {c!r} is {size[c]} in x but {d} in w")
    x_free = "".join(c for c in lhs if c not in contracted)
    x_order = x_free + contracted
    if x_order != lhs:
        x = jnp.transpose(x, [lhs.index(c) for c in x_order])
    k = int(np.prod([size[c] for c in contracted]))
    n = int(np.prod([size[c] for c in w_free]))
    w2 = w.reshape((k, n) if w_layout == "kn" else (n, k))  # merges adjacent axes: no copy
    y = matmul(x.reshape(x.shape[: len(x_free)] + (k,)), w2, w_layout=w_layout, out_dtype=out_dtype, backend=backend)
    y = y.reshape(tuple(size[c] for c in x_free + w_free))
    have = x_free + w_free
    return y if have == out else jnp.transpose(y, [have.index(c) for c in out])
