"""Chunked backward of linear_logp: gradients without an [N, V] buffer (unless the
forward kept its logits: the residual mode, below).

Given the forward's lse, each vocab chunk recomputes z = h @ W_c.T (+ b_c) (or reads
it from the forward's saved logits),
lp = z * inv_t - lse, p = exp(lp), and
    dz = inv_t * (g_lse * p + g_logp * (onehot - p) - g_H * p * (lp + H)) + g_logits,
then dh += dz @ W_c, dW_c = dz.T @ h, db_c = sum_rows dz. The entropy term: with
y = z * inv_t, H = lse - E_p[y] and dH/dy_j = -p_j (y_j - E_p[y]) = -p_j (lp_j + H),
so the forward's entropy H (a residual, one value per row) is all it needs; it is
formed only when the entropy has a cotangent. Chunks are visited in
ascending order with a fixed shape, so two runs give identical bytes; the
backward is deterministic but not part of the frozen contract. With V_rows =
q * chunk + r the q full chunks run in a scan that writes each dW / db chunk once
(no read-back, no clamping); when r > 0 one more chunk, clamped to end at the last
row, runs after it at a static offset and keeps only its r new rows. With a
backend's `dz` kernel (`backends.DzKernel`; the pallas_sm90 backend has one)
the recompute GEMM and the dz formula run in one Pallas kernel that writes dz
as bf16, so the chunk's FP32 logits never reach device memory; otherwise XLA
forms them (always when the entropy has a cotangent and the kernel does not
declare the entropy term, and for the temperature gradient). When the backend
also has an in-place walk (`backends.InPlaceWalk`; pallas_sm90 does, for
operands its kernels tile) the dz kernel and the dh GEMM read the weight at the
chunk's offset, the dW GEMM writes dW there and dh is accumulated in its own
buffer: no weight-chunk copy, no dW-chunk copy, no dh add, and a row's dh is
one fixed sum whatever batch the row is in (XLA's GEMMs choose algorithms by
shape). The default chunk is 16384 on that walk and 4096 on the slice walk
(`IN_PLACE_CHUNK`, `DEFAULT_CHUNK`: a function of the head, never of the row
count). For bf16/f16
weights the dW GEMM writes the weight dtype directly
(FP32 accumulation inside the GEMM). Rows with
target == ignore_index (or a bad target) get no logp gradient; lse and the
entropy keep their own. The clamp min(d, 0) is treated as the identity (d > 0
only by rounding), and so is the entropy's clamp at 0. For bf16/f16 models the
gradient GEMMs take dz rounded to the model dtype (f32 accumulation); f32 models
stay in f32.

Temperature (s = inv_t = 1/T per row; `row_sums=True`): dL/ds = sum_j (dL/dy_j) z_j
per row, which in terms of row statistics is
    dL/ds = (g_lse * E_p[y] + g_logp * (y_t - E_p[y]) - g_H * Var_p(y)) / s
with E_p[y] = lse - H, y_t - E_p[y] = logp + H and Var_p(y) = sum_j p_j (lp_j + H)^2
(accumulated in the same chunk pass when g_H is present). Without the entropy
output, H = -sum_j p_j lp_j is accumulated in the pass instead. `inv_t_cotangent`
combines them; dT = -s^2 ds is attached where fl(1/T) is formed
(`inputs.inv_temperature`). So dlse/dT = -E_p[y]/T, dlogp/dT = (E_p[y] - y_t)/T,
dH/dT = Var_p(y)/T.

Documented accuracy against float64 autodiff of the materialized math (tests in
tests/test_api_guards.py, tests/test_entropy.py and tests/test_residuals.py): relative
Frobenius error per tensor (hidden, weight, bias) < 1e-5 with f32 inputs (also at the
Qwen3 vocab), < 1e-2 with bf16 inputs; with the entropy in the loss, and for the
temperature, < 1e-4 with f32 inputs. Both residual modes meet these bounds.

Residual modes (`linear_logp(..., residuals=)`). "recompute" (the default): the forward
keeps hidden, the weight and per-row vectors (extra memory O(N*D + V*D)) and each chunk
recomputes z: with the forward, four GEMM passes (forward, recompute, dh, dW).
"logits": the forward also keeps its own FP32 logits (O(N*V) memory; on contract
backends from the forward's `partials(..., return_logits=True)`, whose logp/lse/entropy
bytes do not depend on return_logits, and with return_logits=True the returned array
itself), passed here as `backward(logits=)`. Having paid O(N*V) memory, the backward
forms the whole dz [N, V_rows] (model dtype) in one elementwise pass over them, by the
same formula, and runs each gradient as one GEMM over the whole vocabulary (dh = dz @ W,
dW = dz.T @ h, db = sum_rows dz): no chunk walk, so no weight-chunk copies, no dW chunk
writes and no zero-filled dW; three passes in all. The fused dz kernel is not used in
this mode (it recomputes z and has no logits input), on pallas_sm90 too.

Are the two modes' gradient bytes identical? No, not in general: the residual mode sums
dh over the whole vocabulary in one GEMM and the row statistics in one reduction, where
the recompute mode adds per-chunk GEMMs and sums in chunk order, so the last bits of dh
(and of the temperature's row sums) may differ even when the saved logits equal the
recomputed ones (the recompute is an XLA einsum on every backend, while the reference
forward walks K sequentially and pallas_sm90 accumulates in wgmma tiles, so the logits
need not agree either). What is tested (tests/test_residuals.py): with exact-arithmetic
inputs (every logit exact in f32) the modes agree to <= 1e-6 relative per tensor; run
through the chunk walk (`backward(saved_logits_chunked=True)`, the same formula on the
same chunks) the saved logits give the recompute path's bytes exactly (dh and dW; db and
the row sums to rounding when only the real vocabulary was saved); with random inputs
the modes differ by <= 1e-5 relative per tensor with f32 inputs and <= 1e-2 with bf16
inputs (dz is rounded to bf16 for the GEMMs), the order of either mode's own error
against float64. Each mode is deterministic run to run (fixed shapes, fixed GEMMs).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from detlogp_jax import vma
from detlogp_jax.layout import VD, WeightLayout, as_layout

# Bit-neutral for the forward; fixes the backward's sums. The chunk length, when the caller
# gives none, is a function of the walk (so of the head's shape and the backend), never of the
# row count: a row's dh bytes do not depend on its batch.
# The slice walk (XLA's GEMMs on weight-chunk copies): the compiled fwd+bwd program's temp memory
# at M=4096 on the Qwen3-8B head is 1.09x hidden + weight + their gradients with 4096 (1.13x with
# 8192), for ~0.8 ms more fwd+bwd on the H200 (docs/PERFORMANCE.md).
DEFAULT_CHUNK = 4096
# A backend's in-place walk (`backends.InPlaceWalk`: no chunk copies, so its temp memory is the dz
# chunk and dh): the backward alone on the Qwen3-8B head at M=4096 takes 23.04 ms / 192 MiB temp
# with 16384 (8192: 23.47 / 128; 12288: 23.16 / 160), and dh and dW have the same bytes for the
# three (dh's tiles start from the old tile and walk K in column order, so the chunk does not
# enter the sums): `benchmarks/results/h200/training_step/backward_walk.log`.
IN_PLACE_CHUNK = 16384


def _chunking(v_rows: int, chunk: int) -> int:
    """The chunk length: `chunk`, or the whole vocabulary when it is shorter."""
    return min(chunk, v_rows)


def _in_place_ok(dz, hidden, weight, chunk: int, weight_layout: WeightLayout) -> bool:
    """Whether the fused path would walk chunks of `chunk` (or the whole vocabulary) with the
    backend's in-place kernels (`backends.InPlaceWalk`): shapes only, rows padded as the fused
    path pads them (so the answer does not depend on the row count)."""
    walk = getattr(dz, "in_place", None)
    v_rows = weight_layout.vocab_rows(weight)
    chunk = _chunking(v_rows, chunk)
    if walk is None or not dz.supports(hidden, weight, chunk, weight_layout):
        return False
    return walk.supports(dz.row_multiple, hidden.shape[1], v_rows, chunk, weight_layout)


def _in_place_chunk(dz, hidden, weight, weight_layout: WeightLayout) -> int:
    """The chunk of the in-place walk where the fused path can take it, else 0: `IN_PLACE_CHUNK`,
    or for a head shorter than that which the kernels do not take whole, its rows rounded down
    to the longest chunk they take (then one chunk and a last chunk of the rest: a TP=8 shard of
    the Llama-3 head padded to 128512, 16064 rows, walks 15872 + 192 (as 256) instead of XLA's
    GEMMs on slices). Shapes only."""
    v_rows = weight_layout.vocab_rows(weight)
    if _in_place_ok(dz, hidden, weight, IN_PLACE_CHUNK, weight_layout):
        return IN_PLACE_CHUNK
    if v_rows >= IN_PLACE_CHUNK:
        return 0
    for k in range(6, v_rows.bit_length()):  # rounded down to 64, 128, ...: the longest first
        c = (v_rows >> k) << k
        if c and c < v_rows and _in_place_ok(dz, hidden, weight, c, weight_layout):
            return c
    return 0


def backward(
    hidden,
    weight,
    bias,
    targets,
    inv_t,
    lse,
    g_logp,
    g_lse,
    g_logits,
    *,
    vocab_size: int,
    chunk: int | None = None,
    dz=None,
    weight_layout: WeightLayout | str = VD,
    entropy=None,
    g_entropy=None,
    row_sums: bool = False,
    logits=None,
    saved_logits_chunked: bool = False,
):
    """Returns (d_hidden, d_weight, d_bias) for cotangents of (logp, lse, logits).

    (One function for the three walks, the fused in-place walk, the fused slice walk and the
    XLA-formed walk, because they share the chunk choice, the row masks and dz's formula;
    each walk is its own function below.)

    chunk: the vocab chunk length; None (the default) picks `IN_PLACE_CHUNK` (or for a short
    head the longest chunk they take: `_in_place_chunk`) when the fused path would walk with the
    backend's in-place kernels, else `DEFAULT_CHUNK`.
    dz: optional `backends.DzKernel`, the backend's fused recompute + dz kernel
    (used only without a logits cotangent, without `row_sums`, when it supports the
    operands and the chunk length, and, with an entropy cotangent, when it declares
    the entropy term). weight_layout: the weight's `WeightLayout` (`VD` [V, D] or `DV`
    [D, V], read in place; dW comes back in the same layout; the names "vd" / "dv" also do).
    entropy: the forward's entropy [N] (needed with `g_entropy`); g_entropy: its
    cotangent [N], or None for none (then no entropy term is traced).
    row_sums: also return the per-row sums the temperature gradient needs, as a
    fourth element (plp, var): plp = sum_j p_j lp_j (None when `entropy` is given),
    var = sum_j p_j (lp_j + H)^2 (None without `g_entropy`); see `inv_t_cotangent`.
    logits: the residual mode (`residuals="logits"`): the forward's own unscaled FP32
    logits [rows, Vs] (bias included; vocab_size <= Vs <= the weight's rows; columns at
    or beyond vocab_size are never read for a gradient). Each chunk's dz is then formed
    from them by the same formula, so no recompute GEMM runs, and `dz` is not used (it
    has no logits input). By default the whole dz [rows, V_rows] is formed in one
    elementwise pass and each gradient is one GEMM (`_whole_from_logits`: O(rows * V)
    more memory, which this mode has already accepted; no chunk walk). With
    saved_logits_chunked=True the saved logits go through the recompute mode's chunk
    walk instead (slower; the gradient bytes then equal the recompute mode's exactly
    when these logits equal the recomputed ones bit for bit, see the module docstring).
    """
    weight_layout = as_layout(weight_layout)
    v_rows = weight_layout.vocab_rows(weight)
    # Padding rows (at or beyond vocab_size) never reach a gradient, whatever values (NaN, inf)
    # the weight holds there: the XLA walks read them as zeros (`_padding_mask`), the in-place
    # walk reads its last chunk, which holds them, from a zero-masked copy of that chunk, and
    # dW's padding rows are exact zeros (their dz is 0).
    fusable = (
        dz is not None
        and logits is None
        and g_logits is None
        and not row_sums
        and (g_entropy is None or dz.entropy)
        and weight_layout in dz.layouts
    )
    if chunk is None:  # the walk picks the chunk (checked once: in_place below says the same)
        walk_chunk = _in_place_chunk(dz, hidden, weight, weight_layout) if fusable else 0
        in_place = walk_chunk > 0
        chunk = walk_chunk if in_place else DEFAULT_CHUNK
    else:
        in_place = fusable and _in_place_ok(dz, hidden, weight, chunk, weight_layout)
    chunk = _chunking(v_rows, chunk)
    if logits is not None:
        if logits.ndim != 2 or logits.shape[0] != hidden.shape[0] or not 1 <= logits.shape[1] <= v_rows:
            raise ValueError(
                f"saved logits must be [rows = {hidden.shape[0]}, <= {v_rows}] (the forward's), got {logits.shape}"
            )
        logits = logits.astype(jnp.float32)
    live = (targets >= 0) & (targets < vocab_size)
    g_logp = jnp.where(live, g_logp, 0.0).astype(jnp.float32)  # dead rows get no logp gradient
    g_lse = g_lse.astype(jnp.float32)
    inv_t = inv_t.astype(jnp.float32)
    if g_entropy is not None:
        if entropy is None:
            raise ValueError("an entropy cotangent needs the forward's entropy")
        g_entropy = g_entropy.astype(jnp.float32)
        entropy = entropy.astype(jnp.float32)
    fused_ok = fusable and dz.supports(hidden, weight, chunk, weight_layout)
    if fused_ok:
        out = _backward_fused_dz(
            hidden,
            weight,
            bias,
            targets,
            inv_t,
            lse,
            g_logp,
            g_lse,
            vocab_size=vocab_size,
            chunk=chunk,
            dz=dz,
            entropy=entropy,
            g_entropy=g_entropy,
            weight_layout=weight_layout,
            in_place=in_place,
        )
        return out
    prec = lax.Precision.HIGHEST if hidden.dtype == jnp.float32 else None
    # f32 models keep f32 GEMMs; bf16/f16 models run the two gradient GEMMs on
    # dz rounded to their dtype with f32 accumulation (the usual mixed precision).
    gemm_dtype = jnp.float32 if hidden.dtype == jnp.float32 else hidden.dtype

    g_full = None
    if g_logits is not None:  # logits were returned (already [N, vocab_size]); pad to the weight's rows
        g_full = jnp.pad(g_logits.astype(jnp.float32), ((0, 0), (0, v_rows - g_logits.shape[1])))
    want_plp = row_sums and entropy is None
    want_var = row_sums and g_entropy is not None

    def z_of(start, w_c, cols):
        """The chunk's unscaled FP32 logits: recomputed, or read from the saved ones."""
        if logits is None:
            z = jnp.einsum(
                f"nd,{weight_layout.einsum}->nv",
                hidden,
                w_c,
                preferred_element_type=jnp.float32,
                precision=prec,
            )
            if bias is not None:
                z = z + lax.dynamic_slice_in_dim(bias.astype(jnp.float32), start, chunk)[None, :]
            return z
        if logits.shape[1] == v_rows:
            return lax.dynamic_slice_in_dim(logits, start, chunk, axis=1)
        # Saved columns end at Vs < v_rows (only the real vocabulary was kept): columns at
        # or beyond Vs are padding (>= vocab_size), whose dz is 0 whatever is read there.
        return jnp.take(logits, jnp.minimum(cols, logits.shape[1] - 1), axis=1)

    def dz_from(z, cols, fresh, g_extra):
        """dz (model dtype) and the requested row sums from unscaled logits z [rows, len(cols)]."""
        lp = z * inv_t[:, None] - lse[:, None]
        p = jnp.where(fresh[None, :], jnp.exp(lp), 0.0)
        onehot = (cols[None, :] == targets[:, None]) & fresh[None, :]
        g = g_lse[:, None] * p + g_logp[:, None] * (onehot.astype(jnp.float32) - p)
        sums = ()
        if g_entropy is not None or want_plp:
            lp_safe = jnp.where(p > 0, lp, 0.0)  # p = 0 lanes (padding, -inf logits) add nothing
        if g_entropy is not None:
            c = lp_safe + entropy[:, None]  # lp + H = y - E_p[y]
            pc = p * c
            g = g - g_entropy[:, None] * pc
        if want_plp:
            sums += (jnp.sum(p * lp_safe, axis=1),)
        if want_var:
            sums += (jnp.sum(pc * c, axis=1),)
        dz = inv_t[:, None] * g
        if g_extra is not None:
            dz = dz + g_extra
        return jnp.where(fresh[None, :], dz, 0.0).astype(gemm_dtype), sums  # bf16 operands for bf16 models

    def dz_of(fresh_from, start, w_c, cols):
        fresh = cols < vocab_size  # real vocab only
        if fresh_from is not None:  # the clamped last chunk: each column once
            fresh = fresh & (cols >= fresh_from)
        g_extra = None if g_full is None else lax.dynamic_slice_in_dim(g_full, start, chunk, axis=1)
        return dz_from(z_of(start, w_c, cols), cols, fresh, g_extra)

    n_sums = int(want_plp) + int(want_var)
    if logits is not None and not saved_logits_chunked:
        dh, dw, db, sums = _whole_from_logits(
            dz_from,
            logits,
            g_full,
            hidden.astype(gemm_dtype),
            weight,
            bias,
            vocab_size,
            prec,
            weight_layout,
            hidden.dtype,
        )
        return _finish(hidden, dh, dw, db, sums, row_sums, want_plp, want_var)
    operands = (hidden, weight, bias, targets, inv_t, lse, g_logp, g_lse, g_logits, entropy, g_entropy, logits)
    dh, dw, db, sums = _chunk_walk(
        dz_of, hidden.astype(gemm_dtype), weight, bias, chunk, prec, operands, weight_layout, n_sums, vocab_size
    )
    return _finish(hidden, dh, dw, db, sums, row_sums, want_plp, want_var)


def _finish(hidden, dh, dw, db, sums, row_sums, want_plp, want_var):
    out = (dh.astype(hidden.dtype), dw, db)
    if not row_sums:
        return out
    sums = list(sums)
    plp = sums.pop(0) if want_plp else None
    var = sums.pop(0) if want_var else None
    return out + ((plp, var),)


def _whole_from_logits(dz_from, logits, g_full, hidden, weight, bias, vocab_size, prec, layout, dh_dtype):
    """The residual mode's backward in one pass: dz [rows, V_rows] from the saved logits
    (one elementwise pass; columns at or beyond vocab_size, and the weight's rows past
    the saved columns, get 0), then dh = dz @ W, dW = dz.T @ h and db = sum_rows dz as
    one GEMM each, with no chunk walk (no weight-chunk copies, no dW chunk writes, no
    zero-filled dW). dh has nothing more to add, so its GEMM writes `dh_dtype` (the
    caller's hidden dtype: the FP32 accumulator rounded once, in the GEMM's epilogue).
    Returns (dh, dW in the weight dtype, db or None, row sums)."""
    v_rows = layout.vocab_rows(weight)
    vs = logits.shape[1]
    cols = jnp.arange(vs)
    g_extra = None if g_full is None else g_full[:, :vs]  # the logits cotangent on the saved columns
    dz, sums = dz_from(logits, cols, cols < vocab_size, g_extra)
    if vs < v_rows:  # weight rows past the saved columns are padding: dz = 0 there
        dz = jnp.pad(dz, ((0, 0), (0, v_rows - vs)))
    real = _padding_mask(layout, jnp.arange(v_rows), vocab_size, v_rows)
    w_real = weight if real is None else jnp.where(real, weight, 0)
    dh, dw, db = _gradient_gemms(dz, w_real, hidden, bias, prec, layout, dh_dtype=dh_dtype)
    dw = dw if real is None else jnp.where(real, dw, 0)
    return dh, dw, None if db is None else db.astype(bias.dtype), sums


def _padding_mask(layout: WeightLayout, cols, vocab_size, v_rows: int):
    """A mask (broadcasting over the weight's D axis) of the real vocabulary rows among `cols`,
    or None when the weight has no padding rows (a static vocab_size equal to its rows)."""
    if isinstance(vocab_size, int) and vocab_size >= v_rows:
        return None
    real = cols < vocab_size
    return real[:, None] if layout.vocab_axis == 0 else real[None, :]


def _gradient_gemms(dz, w, hidden, bias, prec, layout, dh_dtype=jnp.float32):
    """dz @ w (dh in dh_dtype, f32 accumulation; the chunk walk adds f32 chunks), dz.T @ h
    (dW in w's layout and dtype; bf16 out, f32 accumulation) and sum_rows dz (db, f32; None
    without a bias) for dz [rows, cols] and w of those cols."""
    wd = layout.einsum
    out_dtype = jnp.float32 if w.dtype == jnp.float32 else w.dtype
    dh = jnp.einsum(f"nv,{wd}->nd", dz, w.astype(dz.dtype), preferred_element_type=dh_dtype, precision=prec)
    dw = jnp.einsum(f"nv,nd->{wd}", dz, hidden, preferred_element_type=out_dtype, precision=prec)
    db = None if bias is None else jnp.sum(dz.astype(jnp.float32), axis=0)
    return dh, dw.astype(w.dtype), db


def inv_t_cotangent(inv_t, lse, logp, targets, vocab_size, g_logp, g_lse, entropy, g_entropy, plp, var):
    """dL/d(inv_t) per row from row statistics (see the module docstring):
    (g_lse * (lse - H) + g_logp * (logp + H) - g_H * var) / inv_t, with H the forward's
    entropy or -plp, and the logp term only on live rows. g_logp / g_lse may be None (zero)."""
    live = (targets >= 0) & (targets < vocab_size)
    h = entropy.astype(jnp.float32) if entropy is not None else -plp
    acc = jnp.zeros_like(lse, jnp.float32)
    if g_lse is not None:
        acc = acc + g_lse.astype(jnp.float32) * (lse - h)
    if g_logp is not None:
        acc = acc + jnp.where(live, g_logp.astype(jnp.float32) * (logp + h), 0.0)
    if g_entropy is not None:
        acc = acc - g_entropy.astype(jnp.float32) * var
    return acc / inv_t.astype(jnp.float32)


def _chunk_walk(dz_of, hidden, weight, bias, chunk, prec, operands, layout=VD, n_sums=0, vocab_size=None):
    """The gradient GEMMs over the vocab chunks in ascending order (a fixed shape, so
    two runs give identical bytes). With v_rows = q * chunk + r: chunks i < q start at
    i * chunk (a scan, no clamping); when r > 0 one last chunk, outside the scan, starts
    at v_rows - chunk (a static offset) and its first chunk - r columns, seen already,
    get no gradient. For each chunk, dz, sums = dz_of(fresh_from, start, w_c, cols) with
    fresh_from None (every column is new) or the last chunk's first new column, dz
    [rows, chunk] in the GEMM dtype and `n_sums` per-row f32 sums over the chunk's fresh
    columns; then dh += dz @ w_c, dW[chunk] = dz.T @ h, db[chunk] = sum_rows dz, and
    each row sum is added to its accumulator in chunk order. dW and db are written once
    per row (no read-back of earlier values); only the last chunk's new rows are kept.
    Returns (dh [rows, D] f32, dW in the weight dtype, db in the bias dtype or None,
    the tuple of row sums).
    `operands`: every array dz depends on (the carries take their mesh axes under vma typing).
    `layout`: the weight's `WeightLayout` (chunks are read in place). `vocab_size` (static or
    traced; None: no padding rows): weight rows at or beyond it are read as zeros and their dW
    rows are zeros, so no value held there reaches dh or dW."""
    v_axis = layout.vocab_axis
    v_rows = weight.shape[v_axis]
    n_full, tail = divmod(v_rows, chunk)

    def step(fresh_from, start, dh, acc):
        w_c = lax.dynamic_slice_in_dim(weight, start, chunk, axis=v_axis)
        cols = start + jnp.arange(chunk)
        real = None if vocab_size is None else _padding_mask(layout, cols, vocab_size, v_rows)
        if real is not None:
            w_c = jnp.where(real, w_c, 0)
        dz, sums = dz_of(fresh_from, start, w_c, cols)
        acc = tuple(a + s for a, s in zip(acc, sums))
        dh_c, dw_c, db_c = _gradient_gemms(dz, w_c, hidden, bias, prec, layout)
        if real is not None:
            dw_c = jnp.where(real, dw_c, 0)
        return dh + dh_c, acc, dw_c, db_c

    def body(carry, i):
        dh, dw, db, acc = carry
        start = i * chunk
        dh, acc, dw_c, db_c = step(None, start, dh, acc)
        dw = lax.dynamic_update_slice_in_dim(dw, dw_c, start, axis=v_axis)
        if db is not None:
            db = lax.dynamic_update_slice_in_dim(db, db_c, start, axis=0)
        return (dh, dw, db, acc), None

    # dW and db start uninitialized (lax.empty: an AllocateBuffer on GPU, zeros elsewhere):
    # the scan writes rows [0, q * chunk) and the last chunk the rest, each row once, so
    # no zero fill of a [V, D] buffer runs (0.74 ms at the Qwen3-8B head on the H200).
    init = (
        jnp.zeros(hidden.shape, jnp.float32),
        lax.empty(weight.shape, weight.dtype),
        None if bias is None else lax.empty(bias.shape, jnp.float32),
        tuple(jnp.zeros(hidden.shape[:1], jnp.float32) for _ in range(n_sums)),
    )
    init = vma.like(init, *operands)
    (dh, dw, db, acc), _ = lax.scan(body, init, jnp.arange(n_full))
    if tail:  # the last chunk, clamped to end at the last row: its new rows only
        first = n_full * chunk
        dh, acc, dw_c, db_c = step(first, v_rows - chunk, dh, acc)
        dw_new = lax.slice_in_dim(dw_c, chunk - tail, chunk, axis=v_axis)
        dw = lax.dynamic_update_slice_in_dim(dw, dw_new, first, axis=v_axis)
        if db is not None:
            db = lax.dynamic_update_slice_in_dim(db, db_c[chunk - tail :], first, axis=0)
    return dh, dw, (None if bias is None else db.astype(bias.dtype)), acc


def _backward_fused_dz(
    hidden,
    weight,
    bias,
    targets,
    inv_t,
    lse,
    g_logp,
    g_lse,
    *,
    vocab_size,
    chunk,
    dz,
    entropy=None,
    g_entropy=None,
    weight_layout=VD,
    in_place=False,
):
    """The chunked backward with dz formed by the backend's `dz` kernel (no logits cotangent).
    g_logp is already zero on dead rows; inv_t, g_logp, g_lse are f32. in_place: walk with
    the backend's `dz.in_place` kernels (`_in_place_ok` held for this chunk) when the weight's
    padding rows (static vocab_size) all sit in the walk's last chunk, else the slice walk.

    dz = inv_t * (g_lse * p + g_logp * (onehot - p)) = c1 * p + c2 * onehot
    with c1 = inv_t * (g_lse - g_logp), c2 = inv_t * g_logp per row; with an entropy
    cotangent (a kernel declaring `DzKernel.entropy`) also + c3 * p * (lp + h) with
    c3 = -inv_t * g_entropy and h the forward's entropy.
    """
    n = hidden.shape[0]
    n_pad = -(-n // dz.row_multiple) * dz.row_multiple
    pad = n_pad - n
    c1 = inv_t * (g_lse - g_logp)
    c2 = inv_t * g_logp
    padr = lambda x, v=0: jnp.pad(x, (0, pad), constant_values=v) if pad else x
    # Padding rows get dz = 0 exactly: c1 = c2 = 0 and p = exp(bias - inf) = 0
    # (lse = +inf), so no bias value (large, or -inf) can make 0 * p a NaN that
    # the dW / db sums over rows would spread. A real NaN row (NaN lse or
    # inv_t) has a NaN dz row: its own dh row, and every dW / db entry, are NaN,
    # as in the XLA-formed path.
    hp = jnp.pad(hidden, ((0, pad), (0, 0))) if pad else hidden
    tp, it, lp, c1p, c2p = (
        padr(targets.astype(jnp.int32), -1),
        padr(inv_t, 1.0),
        padr(lse.astype(jnp.float32), jnp.inf),
        padr(c1),
        padr(c2),
    )
    ent_kw = {}
    if g_entropy is not None:  # padding rows: c3 = 0, h = 0
        ent_kw = {"c3": padr(-inv_t * g_entropy), "h": padr(entropy)}

    def dz_of(fresh_from, start, w_c, cols):
        b_c = None if bias is None else lax.dynamic_slice_in_dim(bias.astype(jnp.float32), start, chunk)
        lo = 0 if fresh_from is None else fresh_from - start  # relative: the first new column
        out = dz.fn(
            hp, w_c, b_c, tp - start, it, lp, c1p, c2p, lo, vocab_size - start, weight_layout=weight_layout, **ent_kw
        )
        return out, ()

    operands = (hp, weight, bias, tp, it, lp, c1p, c2p) + tuple(ent_kw.values())
    padding = _padding_rows(vocab_size, weight_layout.vocab_rows(weight))
    last_len = _last_chunk_len(dz, hidden, weight, chunk, weight_layout) if in_place else 0
    if in_place and padding is not None and padding <= (last_len or chunk):
        dh, dw, db = _in_place_walk(
            dz.in_place,
            hp,
            weight,
            bias,
            tp,
            (it, lp, c1p, c2p),
            ent_kw,
            vocab_size,
            chunk,
            weight_layout,
            operands,
            last_len=last_len,
            padding=padding,
        )
    else:
        dh, dw, db, _ = _chunk_walk(dz_of, hp, weight, bias, chunk, None, operands, weight_layout, 0, vocab_size)
    return dh[:n].astype(hidden.dtype), dw, db


def _padding_rows(vocab_size, v_rows: int) -> int | None:
    """The weight's trailing padding rows (at or beyond a static vocab_size), or None when
    vocab_size is traced (a vocab shard's: how many of its rows are padding is not static)."""
    if not isinstance(vocab_size, int):
        return None
    return max(0, v_rows - vocab_size)


def _last_chunk_len(dz, hidden, weight, chunk: int, weight_layout: WeightLayout) -> int:
    """The length L of the in-place walk's last chunk, which covers [v_rows - L, v_rows) and
    recomputes the L - r columns before the last r = v_rows mod chunk (their dz is 0): the
    shortest L in [r, chunk] the walk's kernels take, trying r itself and then r rounded up to
    a multiple of 2, 4, ..., else the whole chunk (0 when chunk divides v_rows). A function of
    the head's shape and the backend only; bit-neutral (the recomputed columns add zero
    products to dh; dW rows written for them are overwritten by the last full chunk). At the
    Qwen3-8B head r = 4608 is taken as it is; a tensor-parallel shard of 38016 rows (TP=4)
    walks 2 x 16384 and 5376 (128 columns recomputed) instead of a clamped 16384 (11136)."""
    v_rows = weight_layout.vocab_rows(weight)
    tail = v_rows % chunk
    if not tail:
        return 0
    for k in range(chunk.bit_length()):
        length = -(-tail // (1 << k)) << k
        if length >= chunk:
            break
        if _in_place_ok(dz, hidden, weight, length, weight_layout):
            return length
    return chunk


def _in_place_walk(
    walk,
    hp,
    weight,
    bias,
    targets,
    rows,
    ent_kw,
    vocab_size,
    chunk,
    weight_layout,
    operands,
    last_len=None,
    padding: int = 0,
):
    """`_chunk_walk` of the fused dz kernel with a backend's `backends.InPlaceWalk`: the same
    chunks, dh summed in the same order (q full chunks in a scan, then the last r columns), but
    the dz kernel and the dh GEMM read the weight at the chunk's offset and the dW GEMM writes dW
    at it, and dh is accumulated in its own buffer (no weight-chunk copy, no dW-chunk copy, no dh
    add). The last r columns: one chunk of `last_len` = L columns (r <= L <= chunk; default
    chunk: as `_chunk_walk`'s clamped last chunk) ending at the last row, whose first L - r
    columns get no gradient (their dz is 0, so dh's sums are the same; L = r recomputes
    nothing, L = chunk recomputes chunk - r columns, 11776 of 16384 at the Qwen3-8B head:
    `_last_chunk_len` picks the shortest L the kernels take). Its r new dW rows: where the dW
    kernel tiles r columns it writes them in the last step; else its dz is formed first and the
    kernel writes all L rows before the scan (the first L - r as zeros, which the last full
    chunk then overwrites), and that dz is kept for the last dh step (n_pad x L bf16 more
    memory). So every dW row is a kernel's and no XLA op updates the kernels' dW buffer (XLA's
    dynamic-slice fusion of jax 0.11.2 fails to compile a dynamic_update_slice into a Mosaic
    call's output: "DUS target must be a fusion parameter", H200, a TP=8 shard's 19008 rows).
    db (with a bias) is the chunk's column sum of dz written at the offset. `padding`: the
    weight's trailing padding rows (at or beyond vocab_size), all inside the last chunk (when
    chunk divides the rows, the last full chunk is walked as that last chunk): the dz kernel
    gives them dz = 0 (a select), so their dW rows are zeros, and the last dh GEMM reads a
    zero-masked copy of the last chunk (L rows) at offset 0, so no value held there (NaN, inf)
    reaches dh; the same products, so the same bytes as the in-place read of finite padding.
    Returns (dh [n_pad, D] f32, dW in the weight's layout and dtype, db or None)."""
    v_rows = weight_layout.vocab_rows(weight)
    n_full, tail = divmod(v_rows, chunk)
    if padding and not tail:  # the padding rows sit in the last full chunk: walk it last, on its own
        n_full, tail = n_full - 1, chunk
    bias32 = None if bias is None else bias.astype(jnp.float32)

    def dz_at(bounds, length):
        return walk.dz(hp, weight, bias32, targets, *rows, bounds, chunk=length, weight_layout=weight_layout, **ent_kw)

    def db_at(db, dz, col0, new):
        if db is None:
            return None
        return lax.dynamic_update_slice_in_dim(db, jnp.sum(dz[:, col0:].astype(jnp.float32), axis=0), new, axis=0)

    def step(carry, bounds):
        dh, dw, db = carry
        start = bounds[0]
        dz = dz_at(bounds, chunk)
        dh = walk.dh(dh, dz, weight, start, weight_layout=weight_layout)
        dw = walk.dw(dw, dz, hp, start, col0=0, cols=chunk, weight_layout=weight_layout)
        return vma.like((dh, dw, db_at(db, dz, 0, start)), *operands)

    dh = jnp.zeros(hp.shape, jnp.float32)
    dw = lax.empty(weight.shape, weight.dtype)  # every row is written (see the docstring)
    db = None if bias is None else lax.empty(bias.shape, jnp.float32)
    dh, dw, db = vma.like((dh, dw, db), *operands)
    dz_first = None  # the last chunk's dz where its dW rows are written before the scan
    if tail:
        length = int(last_len) if last_len else chunk
        if not tail <= length <= chunk:
            raise ValueError(f"the last chunk's length must be in [{tail}, {chunk}], got {length}")
        col0, start = length - tail, v_rows - length
        bounds = jnp.asarray([start, n_full * chunk, vocab_size], jnp.int32)
        if col0 and not walk.dw_cols_supported(tail):
            dz_first = dz_at(bounds, length)
            dw = walk.dw(dw, dz_first, hp, start, col0=0, cols=length, weight_layout=weight_layout)
            dh, dw, db = vma.like((dh, dw, db_at(db, dz_first, col0, start + col0)), *operands)
    if n_full:
        table = jnp.asarray(
            [[i * chunk, i * chunk, vocab_size] for i in range(n_full)], jnp.int32
        )  # (start, lo, hi) per chunk: a constant of the program
        (dh, dw, db), _ = lax.scan(lambda c, b: (step(c, b), None), (dh, dw, db), table)
    if tail:
        dz = dz_at(bounds, length) if dz_first is None else dz_first
        if padding:  # the last chunk holds the padding rows: dh reads them as zeros
            real = _padding_mask(weight_layout, start + jnp.arange(length), vocab_size, v_rows)
            w_last = jnp.where(real, weight_layout.chunk(weight, start, length), 0)
            dh = walk.dh(dh, dz, w_last, 0, weight_layout=weight_layout)
        else:
            dh = walk.dh(dh, dz, weight, start, weight_layout=weight_layout)
        if dz_first is None:
            dw = walk.dw(dw, dz, hp, start + col0, col0=col0, cols=tail, weight_layout=weight_layout)
            db = db_at(db, dz, col0, start + col0)
        dh, dw, db = vma.like((dh, dw, db), *operands)
    return dh, dw, (None if bias is None else db.astype(bias.dtype))
