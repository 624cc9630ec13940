"""The fused recompute + dz kernel of the backward (pallas_kernels.sm90_dz), interpret mode.

The kernel is not part of the frozen contract: these tests check the dz formula
against float64, that the chunked backward built on it gives the gradients of
the XLA-formed backward (within bf16 rounding) and that two runs give identical
bytes. The GPU run of the same checks is tests/gpu/test_grad_gpu.py.
"""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from detlogp_jax import backends, grad
from detlogp_jax.layout import VD, as_layout
from tests.helpers import assert_bitwise_equal, rel_err, row_mismatches

pk = pytest.importorskip("pallas_kernels.sm90_dz")
from pallas_kernels.interpret_utils import row_invariant_wgmma  # noqa: E402


@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("entropy", [False, True], ids=["plain", "entropy"])
def test_dz_chunk_matches_float64(entropy, layout):
    """dz = c1 p + c2 onehot (+ c3 p (u + h) with the entropy term), u = z inv_t - lse, on
    columns [lo, hi), against float64; both weight layouts ([chunk, D] and [D, chunk])."""
    rng = np.random.default_rng(0)
    n, d, chunk = 130, 128, 512
    n_pad = 256
    h = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((chunk, d)) * 0.2, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(chunk) * 0.1, jnp.float32)
    t = rng.integers(-5, chunk + 5, n).astype(np.int32)
    invt = rng.uniform(0.5, 1.5, n).astype(np.float32)
    z = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T + np.asarray(b, np.float64)
    lse = (np.log(np.exp(z * invt[:, None]).sum(1)) + 0.3).astype(np.float32)
    c1 = rng.standard_normal(n).astype(np.float32)
    c2 = rng.standard_normal(n).astype(np.float32)
    c3 = rng.standard_normal(n).astype(np.float32)
    ent = rng.uniform(0, 6, n).astype(np.float32)
    lo, hi = 64, 448
    pad = lambda x, v=0: jnp.asarray(np.pad(x, (0, n_pad - n), constant_values=v))
    kw = dict(c3=pad(c3), h=pad(ent)) if entropy else {}
    if layout == "dv":
        kw["weight_layout"] = "dv"
    with row_invariant_wgmma():
        dz = pk.dz_chunk(
            jnp.pad(h, ((0, n_pad - n), (0, 0))),
            w.T if layout == "dv" else w,
            b,
            pad(t, -1),
            pad(invt, 1),
            pad(lse),
            pad(c1),
            pad(c2),
            lo,
            hi,
            interpret=True,
            **kw,
        )
    dz = np.asarray(dz, np.float64)
    cols = np.arange(chunk)
    u = z * invt[:, None] - lse[:, None]
    p = np.exp(u)
    want = c1[:, None] * p + c2[:, None] * (cols[None, :] == t[:, None])
    if entropy:
        want += c3[:, None] * p * (u + ent[:, None])
    want[:, (cols < lo) | (cols >= hi)] = 0
    assert np.abs(dz[:n] - want).max() <= 1e-2 * np.abs(want).max()
    assert np.all(dz[:n, :lo] == 0) and np.all(dz[:n, hi:] == 0) and np.all(dz[n:] == 0)


def test_dz_chunk_refuses_half_an_entropy_term():
    with pytest.raises(ValueError, match="both c3 and h"):
        z = jnp.zeros((256,), jnp.float32)
        pk.dz_chunk(
            jnp.zeros((256, 64), jnp.bfloat16), jnp.zeros((256, 64), jnp.bfloat16), None, z, z, z, z, z, 0, 1, c3=z
        )


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("entropy", [False, True], ids=["plain", "entropy"])
def test_backward_with_fused_dz_matches_xla_backward_and_is_deterministic(entropy, layout):
    """The chunked backward on the interpret-mode dz kernel == the XLA-formed backward within
    bf16, both layouts (dW comes back in the weight's layout), with and without an entropy
    cotangent; two runs give identical bytes; padding rows get no gradient."""
    rng = np.random.default_rng(1)
    n, d, v_rows, vocab, chunk = 12, 64, 1280, 1200, 512  # 3 chunks, the last one clamped
    h = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((v_rows, d)) * 0.3, jnp.bfloat16)
    b = np.asarray(rng.standard_normal(v_rows) * 0.1, np.float32)
    b[[8, 900]] = -np.inf  # banned tokens: p = 0, and the entropy term must not make 0 * inf a NaN
    b = jnp.asarray(b)
    t = rng.integers(0, vocab, n).astype(np.int32)
    t[2], t[3], t[4] = -100, vocab - 1, 700
    inv_t = jnp.asarray(rng.uniform(0.6, 1.4, n), jnp.float32)
    z = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T + np.asarray(b, np.float64)
    y = z * np.asarray(inv_t, np.float64)[:, None]
    y[:, vocab:] = -np.inf
    lse64 = np.log(np.exp(y - y.max(1, keepdims=True)).sum(1)) + y.max(1)
    p64 = np.exp(y - lse64[:, None])
    ent = jnp.asarray(-(p64 * np.where(p64 > 0, y - lse64[:, None], 0)).sum(1), jnp.float32)
    lse = jnp.asarray(lse64, jnp.float32)
    g_logp = jnp.asarray(rng.standard_normal(n), jnp.float32)
    g_lse = jnp.asarray(rng.standard_normal(n), jnp.float32)
    wl = w.T if layout == "dv" else w
    args = (h, wl, b, jnp.asarray(t), inv_t, lse, g_logp, g_lse, None)
    kw = dict(vocab_size=vocab, chunk=chunk, weight_layout=layout)
    if entropy:
        kw.update(entropy=ent, g_entropy=jnp.asarray(rng.standard_normal(n), jnp.float32))
    want = grad.backward(*args, **kw)
    calls = []

    def kern(*a, **k):
        calls.append((a[0].shape, sorted(k)))
        return pk.dz_chunk(*a, interpret=True, **k)

    with row_invariant_wgmma():
        got = grad.backward(*args, dz=_with_fn(kern), **kw)
        again = grad.backward(*args, dz=_with_fn(kern), **kw)
    assert calls, "the fused-dz path was not taken"
    want_kw = ["c3", "h", "weight_layout"] if entropy else ["weight_layout"]
    assert calls[0][1] == want_kw
    for g, e, name in zip(got, want, ("hidden", "weight", "bias")):
        assert g.shape == e.shape, name
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        assert rel_err(g, e) < 1e-2, (name, rel_err(g, e))
    dw = np.asarray(got[1], np.float32)
    assert np.abs(dw.T[vocab:] if layout == "dv" else dw[vocab:]).max() == 0  # padding rows get nothing
    for g, g2 in zip(got, again):
        assert_bitwise_equal(np.asarray(g, np.float32), np.asarray(g2, np.float32))


def _with_fn(fn):
    """The pallas_sm90 backend's dz entry (operand predicate, row multiple) with another kernel function."""
    return dataclasses.replace(backends.get("pallas_sm90").dz, fn=fn)


def _reference_dz_kernel(calls):
    """dz_chunk's formula in plain jnp (f32 math, bf16 out): exercises the chunked
    backward's wrapper (row padding, chunk clamping, lo/hi, target shift) fast."""

    def kern(hp, w_c, b_c, tgt, inv_t, lse, c1, c2, lo, hi, weight_layout):
        assert weight_layout is VD
        calls.append(hp.shape)
        z = jnp.einsum("nd,vd->nv", hp, w_c, preferred_element_type=jnp.float32)
        if b_c is not None:
            z = z + b_c[None, :]
        col = jnp.arange(w_c.shape[0])[None, :]
        dz = c1[:, None] * jnp.exp(z * inv_t[:, None] - lse[:, None]) + jnp.where(col == tgt[:, None], c2[:, None], 0.0)
        return jnp.where((col >= lo) & (col < hi), dz, 0.0).astype(jnp.bfloat16)

    return kern


def test_fused_path_padding_rows_get_no_gradient_with_a_large_bias():
    """A bias entry above log(FLT_MAX) overflows exp on the zero-padded rows
    unless their p is forced to 0; a NaN there would spread through the dW / db
    sums over rows. The fused-dz path must agree with the XLA-formed one."""
    rng = np.random.default_rng(2)
    n, d, v_rows, vocab, chunk = 5, 64, 1280, 1200, 512  # 3 chunks, the last one clamped; 123 padding rows
    h = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((v_rows, d)) * 0.3, jnp.bfloat16)
    b = np.asarray(rng.standard_normal(v_rows) * 0.1, np.float32)
    b[[7, 700, 1100]] = 100.0  # exp(100) = inf in f32
    b[[8, 900]] = -np.inf  # a banned token: p = 0 on every row
    t = rng.integers(0, vocab, n).astype(np.int32)
    t[1], t[2] = -100, 700
    inv_t = jnp.asarray(rng.uniform(0.6, 1.4, n), jnp.float32)
    z = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T + b.astype(np.float64)
    y = z * np.asarray(inv_t, np.float64)[:, None]
    y[:, vocab:] = -np.inf
    lse = jnp.asarray(np.log(np.exp(y - y.max(1, keepdims=True)).sum(1)) + y.max(1), jnp.float32)
    args = (
        h,
        w,
        jnp.asarray(b),
        jnp.asarray(t),
        inv_t,
        lse,
        jnp.asarray(rng.standard_normal(n), jnp.float32),
        jnp.asarray(rng.standard_normal(n), jnp.float32),
        None,
    )
    want = grad.backward(*args, vocab_size=vocab, chunk=chunk)
    calls = []
    got = grad.backward(*args, vocab_size=vocab, chunk=chunk, dz=_with_fn(_reference_dz_kernel(calls)))
    assert calls and calls[0] == (pk.ROWS_PER_CTA, d)  # the fused path ran, on padded rows
    for g, e, name in zip(got, want, ("hidden", "weight", "bias")):
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        assert rel_err(g, e) < 1e-2, (name, rel_err(g, e))
    assert np.abs(np.asarray(got[1], np.float32)[vocab:]).max() == 0


def _interpret_walk():
    """The pallas_sm90 backend's in-place walk (`backends.InPlaceWalk`) with its kernels in interpret mode."""
    import functools

    walk = backends.get("pallas_sm90").dz.in_place
    it = functools.partial
    return dataclasses.replace(
        walk,
        dz=it(walk.dz, interpret=True),
        dh=it(walk.dh, interpret=True),
        dw=it(walk.dw, interpret=True),
    )


def _walk_case(rng, n, d, v_rows, vocab):
    h = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((v_rows, d)) * 0.2, jnp.bfloat16)
    b = np.asarray(rng.standard_normal(v_rows) * 0.1, np.float32)
    b[[8, 900]] = -np.inf
    t = rng.integers(0, vocab, n).astype(np.int32)
    t[2], t[3], t[4] = -100, vocab - 1, v_rows - 1  # ignored, the last real column, a padding column
    inv_t = jnp.asarray(rng.uniform(0.6, 1.4, n), jnp.float32)
    z = np.asarray(h, np.float64) @ np.asarray(w, np.float64).T + b.astype(np.float64)
    y = z * np.asarray(inv_t, np.float64)[:, None]
    y[:, vocab:] = -np.inf
    lse64 = np.log(np.exp(y - y.max(1, keepdims=True)).sum(1)) + y.max(1)
    p64 = np.exp(y - lse64[:, None])
    ent = jnp.asarray(-(p64 * np.where(p64 > 0, y - lse64[:, None], 0)).sum(1), jnp.float32)
    g = lambda: jnp.asarray(rng.standard_normal(n), jnp.float32)
    return h, w, jnp.asarray(b), jnp.asarray(t), inv_t, jnp.asarray(lse64, jnp.float32), g(), g(), ent, g()


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,entropy,v_rows",
    [("vd", False, 1280), ("dv", True, 1280), ("vd", True, 1344), ("dv", False, 1344), ("vd", True, 1600)],
    ids=["vd-tail256", "dv-entropy-tail256", "vd-entropy-tail320", "dv-tail320", "vd-entropy-tail64"],
)
def test_in_place_walk_matches_the_slice_walk(layout, entropy, v_rows):
    """The chunk walk without copies (dz and dh reading the weight at the chunk's offset, dW
    written at it: sm90_dz.dz_in_place + sm90_grad_gemm) gives the slice walk's gradients on
    the same dz kernel: db bitwise (the same dz, the same column sums), dh and dW within
    the rounding of another FP32 summation order; both layouts, a last chunk the kernels
    tile (256: walked as a chunk of its own) and ones whose new columns the dW kernel does not
    tile at an offset (320, 64: a longer last chunk whose whole dW block is written before
    the full chunks); two
    runs give identical bytes; the in-place kernels ran and no padding row has a gradient."""
    rng = np.random.default_rng(5)
    n, d, vocab, chunk = 12, 256, v_rows - 40, 512
    h, w, b, t, inv_t, lse, g_logp, g_lse, ent, g_ent = _walk_case(rng, n, d, v_rows, vocab)
    wl = w.T if layout == "dv" else w
    args = (h, wl, b, t, inv_t, lse, g_logp, g_lse, None)
    kw = dict(vocab_size=vocab, chunk=chunk, weight_layout=layout)
    if entropy:
        kw.update(entropy=ent, g_entropy=g_ent)
    entry = backends.get("pallas_sm90").dz
    slices = dataclasses.replace(entry, fn=lambda *a, **k: pk.dz_chunk(*a, interpret=True, **k), in_place=None)
    walk = _interpret_walk()
    calls = []
    counted = dataclasses.replace(walk, dw=lambda *a, **k: calls.append(k) or walk.dw(*a, **k))
    in_place = dataclasses.replace(slices, in_place=counted)
    with row_invariant_wgmma():
        want = grad.backward(*args, dz=slices, **kw)
        got = grad.backward(*args, dz=in_place, **kw)
        traced = list(calls)
        again = grad.backward(*args, dz=in_place, **kw)
    # traced once in the scan's body, once for the last chunk: its 256 columns walked after the
    # scan as a chunk of their own (the kernels tile them), while 320 / 64 take a longer chunk
    # (L = 512 / 256) whose whole dW block is written before the scan
    tail = v_rows % chunk
    length = grad._last_chunk_len(in_place, h, wl, chunk, as_layout(layout))
    want_calls = [(0, chunk), (0, tail)] if tail % 256 == 0 else [(0, length), (0, chunk)]
    assert [(c["col0"], c["cols"]) for c in traced] == want_calls, traced
    for name, g_, e, bound in zip(("hidden", "weight", "bias"), got, want, (1e-3, 1e-2, 0)):
        assert g_.shape == e.shape and g_.dtype == e.dtype, name
        assert np.isfinite(np.asarray(g_, np.float32)).all(), name
        if bound:
            assert rel_err(g_, e) < bound, (name, rel_err(g_, e))
        else:
            assert_bitwise_equal(np.asarray(g_), np.asarray(e))
    dw = np.asarray(got[1], np.float32)
    assert np.abs(dw.T[vocab:] if layout == "dv" else dw[vocab:]).max() == 0
    # all three compared before failing: a difference says which gradients moved
    moved = {
        name: row_mismatches(np.asarray(g_, np.float32), np.asarray(g2, np.float32))
        for name, g_, g2 in zip(("hidden", "weight", "bias"), got, again)
    }
    assert all(rows == 0 for rows, _ in moved.values()), f"two runs differ (rows, max_abs_diff): {moved}"


@pytest.mark.parametrize(
    "layout,v_rows",
    [("vd", 1024), pytest.param("dv", 1344, marks=pytest.mark.slow)],
    ids=["vd-no-tail", "dv-tail320"],
)
def test_in_place_walk_keeps_nan_padding_rows_out(layout, v_rows):
    """NaN / inf in the weight's and bias's padding rows (at or beyond vocab_size) reach no
    gradient of the in-place walk: dh, dW and db equal the walk's on clean padding rows byte
    for byte, dW's and db's padding rows are +0.0; the walk still runs in place (the padding
    rows in its last chunk: a tail of 320 walked as 512, or, where the chunk divides the rows,
    the last full chunk walked on its own) (interpret mode)."""
    rng = np.random.default_rng(11)
    n, d, chunk = 12, 256, 512
    vocab = v_rows - 40
    h, w, b, t, inv_t, lse, g_logp, g_lse, _, _ = _walk_case(rng, n, d, v_rows, vocab)
    w_bad = np.array(w, np.float32)
    w_bad[vocab:] = np.nan
    w_bad[vocab + 1] = np.inf
    b_bad = np.array(b)
    b_bad[vocab:] = np.nan
    entry = backends.get("pallas_sm90").dz
    walk = _interpret_walk()
    calls = []
    counted = dataclasses.replace(walk, dw=lambda *a, **k: calls.append((k["col0"], k["cols"])) or walk.dw(*a, **k))
    in_place = dataclasses.replace(entry, fn=lambda *a, **k: pk.dz_chunk(*a, interpret=True, **k), in_place=counted)
    lay = lambda x: x.T if layout == "dv" else x  # noqa: E731
    outs = []
    with row_invariant_wgmma():
        for ww, bb in ((w, b), (jnp.asarray(w_bad, jnp.bfloat16), jnp.asarray(b_bad))):
            args = (h, lay(ww), bb, t, inv_t, lse, g_logp, g_lse, None)
            outs.append(grad.backward(*args, vocab_size=vocab, chunk=chunk, dz=in_place, weight_layout=layout))
    assert calls, "the in-place walk did not run"
    clean, dirty = outs
    for name, g_, c in zip(("hidden", "weight", "bias"), dirty, clean):
        g_, c = np.asarray(g_, np.float32), np.asarray(c, np.float32)
        assert np.isfinite(g_).all(), name
        assert_bitwise_equal(g_, c)
    dw = np.asarray(dirty[1], np.float32)
    assert np.all(lay(dw)[vocab:].view(np.uint32) == 0) and np.all(np.asarray(dirty[2])[vocab:].view(np.uint32) == 0)


@pytest.mark.slow
def test_short_head_walks_in_place_with_a_rounded_down_chunk():
    """chunk=None on a head shorter than `grad.IN_PLACE_CHUNK` that the kernels do not take whole
    (1344 rows: 5.25 x 256): the in-place walk with a chunk of 1280 and a last chunk of 64
    columns walked as 256 (its dW block written before the chunk), not XLA's GEMMs on slices;
    the gradients equal the slice walk's within the rounding of another FP32 summation order,
    db bitwise; no padding row of dW has a gradient (interpret mode)."""
    rng = np.random.default_rng(14)
    n, d, v_rows = 12, 256, 1344
    vocab = v_rows - 40
    h, w, b, t, inv_t, lse, g_logp, g_lse, _, _ = _walk_case(rng, n, d, v_rows, vocab)
    args = (h, w, b, t, inv_t, lse, g_logp, g_lse, None)
    entry = backends.get("pallas_sm90").dz
    slices = dataclasses.replace(entry, fn=lambda *a, **k: pk.dz_chunk(*a, interpret=True, **k), in_place=None)
    walk = _interpret_walk()
    calls = []
    counted = dataclasses.replace(walk, dw=lambda *a, **k: calls.append((k["col0"], k["cols"])) or walk.dw(*a, **k))
    with row_invariant_wgmma():
        want = grad.backward(*args, vocab_size=vocab, dz=slices)
        got = grad.backward(*args, vocab_size=vocab, dz=dataclasses.replace(slices, in_place=counted))
    assert calls == [(0, 256), (0, 1280)], calls
    for name, g_, e, bound in zip(("hidden", "weight", "bias"), got, want, (1e-3, 1e-2, 0)):
        if bound:
            assert rel_err(g_, e) < bound, (name, rel_err(g_, e))
        else:
            assert_bitwise_equal(np.asarray(g_), np.asarray(e))
    assert np.abs(np.asarray(got[1], np.float32)[vocab:]).max() == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,v_rows,lengths",
    [("vd", 1280, (256, 512)), ("dv", 1280, (256, 512)), ("vd", 1600, (256, 512)), ("dv", 1600, (256, 512))],
    ids=["vd-tail256", "dv-tail256", "vd-tail64", "dv-tail64"],
)
def test_last_chunk_length_gives_the_clamped_chunks_bytes(layout, v_rows, lengths):
    """The last r = v_rows mod chunk columns walked as a chunk of L columns ending at the last
    row (L = r: the chunk itself; r < L < chunk: r rounded up to what the kernels tile) give
    the bytes of the chunk clamped to a whole chunk (L = chunk): the same dh, dW and db (the
    L - r recomputed columns have dz = 0, so they add zero products to dh and write no dW
    row; the r new dW rows are the dW kernel's in both: written in the last step where it tiles
    r columns at an offset, else with the chunk's whole block before the full chunks, which
    then overwrite its first L - r rows), with fewer columns recomputed; and grad picks the
    shortest L the kernels take."""
    rng = np.random.default_rng(8)
    n, d, chunk = 12, 256, 512
    vocab = v_rows - 40
    h, w, b, t, inv_t, lse, g_logp, g_lse, _, _ = _walk_case(rng, n, d, v_rows, vocab)
    walk = _interpret_walk()
    n_pad = 128
    hp = jnp.pad(h, ((0, n_pad - n), (0, 0)))
    padr = lambda x, v=0: jnp.pad(x, (0, n_pad - n), constant_values=v)  # noqa: E731
    g_logp = jnp.where((t >= 0) & (t < vocab), g_logp, 0.0)
    rows = (padr(inv_t, 1.0), padr(lse, jnp.inf), padr(inv_t * (g_lse - g_logp)), padr(inv_t * g_logp))
    wl = w.T if layout == "dv" else w
    calls = []
    counted = dataclasses.replace(walk, dz=lambda *a, **k: calls.append(k["chunk"]) or walk.dz(*a, **k))
    args = (hp, wl, b, padr(t, -1), rows, {}, vocab, chunk, as_layout(layout), (hp, wl))
    with row_invariant_wgmma():
        outs = [grad._in_place_walk(counted, *args, last_len=length) for length in lengths]
    tail = v_rows % chunk
    first = lambda length: length > tail and not walk.dw_cols_supported(tail)  # noqa: E731
    assert calls == [x for L in lengths for x in ((L, chunk) if first(L) else (chunk, L))], calls
    for got in outs[:-1]:
        for e, c in zip(got, outs[-1]):
            assert_bitwise_equal(np.asarray(e, np.float32), np.asarray(c, np.float32))
    assert np.abs(np.asarray(outs[0][0], np.float32)[:n]).max() > 0
    # grad's choice: r itself where the kernels tile it (256), else r rounded up (64 -> 256)
    dzk = dataclasses.replace(backends.get("pallas_sm90").dz, in_place=walk)
    assert grad._last_chunk_len(dzk, hp, wl, chunk, as_layout(layout)) == 256
    with pytest.raises(ValueError, match="last chunk's length"):
        grad._in_place_walk(counted, *args, last_len=v_rows % chunk - 1)


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_last_chunk_length_at_real_heads(layout):
    """The in-place walk's last chunk at the shipped chunk on real heads (shapes only): the
    Qwen3-8B head's last 4608 columns as they are, a TP=4 / TP=8 shard's (38016 / 19008 rows)
    and a 50304-row head's rounded up to 256 (5376 / 2816 / 1280: 128 / 192 / 128 columns
    recomputed, not a whole clamped chunk), none where the chunk divides the rows."""
    import jax

    S = jax.ShapeDtypeStruct
    dzk = backends.get("pallas_sm90").dz
    chunk = grad.IN_PLACE_CHUNK
    for v_rows, want in ((152064, 4608), (38016, 5376), (19008, 2816), (50304, 1280), (131072, 0)):
        w = S((v_rows, 4096) if layout == "vd" else (4096, v_rows), jnp.bfloat16)
        got = grad._last_chunk_len(dzk, S((4096, 4096), jnp.bfloat16), w, chunk, as_layout(layout))
        assert got == want, (v_rows, got)


def test_dz_in_place_equals_dz_chunk():
    """dz of the chunk [start, start + chunk) read in place from the whole weight and bias, with
    absolute targets and bounds, is dz_chunk's of the sliced chunk, bit for bit (interpret)."""
    rng = np.random.default_rng(6)
    n_pad, d, v_rows, chunk, start = 128, 64, 1024, 256, 512
    h = jnp.asarray(rng.standard_normal((n_pad, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((v_rows, d)) * 0.3, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(v_rows) * 0.1, jnp.float32)
    t = jnp.asarray(rng.integers(start - 50, start + chunk + 50, n_pad), jnp.int32)
    rows = [jnp.asarray(x, jnp.float32) for x in (rng.uniform(0.6, 1.4, n_pad), rng.uniform(3, 5, n_pad))]
    c1, c2 = (jnp.asarray(rng.standard_normal(n_pad), jnp.float32) for _ in range(2))
    lo, hi = start + 64, start + 200
    with row_invariant_wgmma():
        want = pk.dz_chunk(
            h,
            w[start : start + chunk],
            b[start : start + chunk],
            t - start,
            *rows,
            c1,
            c2,
            lo - start,
            hi - start,
            interpret=True,
        )
        got = pk.dz_in_place(
            h, w, b, t, *rows, c1, c2, jnp.asarray([start, lo, hi], jnp.int32), chunk=chunk, interpret=True
        )
    assert_bitwise_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert np.abs(np.asarray(got, np.float32)).max() > 0


@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_gradient_gemms_in_place(layout):
    """sm90_grad_gemm against float64: dh + dz @ W[start : start + chunk] (FP32), and dW's rows
    ([D, V]: columns) [start + ..) set from a column range of dz, every other entry kept;
    interpret mode."""
    from pallas_kernels import sm90_grad_gemm as gg

    rng = np.random.default_rng(7)
    n_pad, d, chunk, v_rows, start = 128, 256, 512, 1536, 512
    bf = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
    dz, h = bf(n_pad, chunk), bf(n_pad, d)
    w = bf(v_rows, d) if layout == "vd" else bf(d, v_rows)
    dh0 = jnp.asarray(rng.standard_normal((n_pad, d)), jnp.float32)
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    w_c = f64(w)[start : start + chunk] if layout == "vd" else f64(w)[:, start : start + chunk].T
    dh = gg.dh_accumulate(dh0, dz, w, start, weight_layout=layout, interpret=True)
    want = f64(dh0) + f64(dz) @ w_c
    assert dh.dtype == jnp.float32 and np.abs(np.asarray(dh) - want).max() < 1e-5 * np.abs(want).max()
    col0, cols = 256, 256
    dw0 = jnp.full(w.shape, 3.0, jnp.bfloat16)
    dw = np.asarray(
        gg.dw_write(dw0, dz, h, start, col0=col0, cols=cols, weight_layout=layout, interpret=True), np.float64
    )
    blk = f64(dz)[:, col0 : col0 + cols].T @ f64(h)  # [cols, D]
    if layout == "dv":
        dw = dw.T
    assert np.abs(dw[start : start + cols] - blk).max() <= 1e-2 * np.abs(blk).max()
    rest = np.delete(dw, np.s_[start : start + cols], axis=0)
    assert np.all(rest == 3.0)


def test_gradient_gemms_alias_their_output_to_operand_0():
    """The lowered dh / dW kernels (CUDA, on any machine) update operand 0's buffer in place:
    the custom call declares the alias, so XLA writes no copy of dh or dW per chunk."""
    import jax

    from pallas_kernels import sm90_grad_gemm as gg

    S = jax.ShapeDtypeStruct
    dz, h, w = S((128, 512), jnp.bfloat16), S((128, 256), jnp.bfloat16), S((1024, 256), jnp.bfloat16)
    for f, args in (
        (lambda dh, dz, w, s: gg.dh_accumulate(dh, dz, w, s), (S((128, 256), jnp.float32), dz, w, S((), jnp.int32))),
        (lambda dw, dz, h, s: gg.dw_write(dw, dz, h, s), (w, dz, h, S((), jnp.int32))),
    ):
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        calls = [ln for ln in txt.splitlines() if "mosaic_gpu" in ln and "custom_call" in ln]
        assert calls and all("output_operand_aliases" in ln for ln in calls), calls


def test_default_chunk_follows_the_walk_not_the_rows():
    """chunk=None: 16384 (`grad.IN_PLACE_CHUNK`) where the fused path walks with the in-place
    kernels (a shorter head: itself where the kernels take it whole, else its rows rounded down
    to a chunk they take), 4096 (`grad.DEFAULT_CHUNK`) on the slice walk, at any row count
    (traced with stand-in kernels that record what they were given)."""
    import jax

    entry = backends.get("pallas_sm90").dz
    seen = []

    def fake_dz(hp, w, b, t, it, lse, c1, c2, bounds, *, chunk, weight_layout, **k):
        seen.append(("in_place", chunk))
        return jnp.zeros((hp.shape[0], chunk), jnp.bfloat16)

    def fake_fn(hp, w_c, *a, weight_layout, **k):
        seen.append(("slices", weight_layout.vocab_rows(w_c)))
        return jnp.zeros((hp.shape[0], weight_layout.vocab_rows(w_c)), jnp.bfloat16)

    walk = dataclasses.replace(entry.in_place, dz=fake_dz, dh=lambda dh, *a, **k: dh, dw=lambda dw, *a, **k: dw)
    S = jax.ShapeDtypeStruct
    for d, n, v_rows, want in (
        (4096, 4096, 152064, ("in_place", 16384)),
        (4096, 7, 152064, ("in_place", 16384)),
        (192, 4096, 152064, ("slices", 4096)),
        (4096, 64, 8192, ("in_place", 8192)),  # a short head the kernels take whole
        # a TP=8 shard of the Llama-3 head padded to 128512: 16064 rows, not a whole chunk of the
        # kernels: 15872 (rounded down to 256) and a last chunk of 192 columns walked as 256
        (4096, 64, 16064, ("in_place", 15872)),
        (4096, 64, 16032, ("slices", 4096)),  # 128256 / 8: rows not a multiple of 64
    ):
        seen.clear()
        dzk = dataclasses.replace(entry, fn=fake_fn, in_place=walk)
        vec = S((n,), jnp.float32)
        args = (S((n, d), jnp.bfloat16), S((v_rows, d), jnp.bfloat16), None, S((n,), jnp.int32), vec, vec, vec, vec)
        jax.eval_shape(lambda *a: grad.backward(*a, None, vocab_size=v_rows - 40, dz=dzk), *args)
        assert seen and want in seen and {k for k, _ in seen} == {want[0]}, (d, n, v_rows, seen)


@pytest.mark.slow
@pytest.mark.parametrize("v_rows", [1280, 1600], ids=["tail256", "tail64-rounded"])
def test_in_place_walk_inside_shard_map_with_vma_checks(v_rows):
    """Inside `jax.shard_map(..., check_vma=True)` (a one-device mesh: the vocab axis is manual)
    the in-place walk traces (its kernels' results take the operands' mesh axes) and gives the
    same bytes as outside (interpret mode); also with a last chunk rounded up (64 columns walked
    as 256, whose whole dW block is written before the full chunks). With the shard's vocab size
    traced from the rank (how many of its rows are padding is then not static) the walk is the
    slice walk, whose masks keep any padding row out, within the rounding of another FP32
    summation order."""
    import jax
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(8)
    n, d, vocab, chunk = 12, 256, v_rows - 40, 512
    h, w, b, t, inv_t, lse, g_logp, g_lse, _, _ = _walk_case(rng, n, d, v_rows, vocab)
    entry = backends.get("pallas_sm90").dz
    dzk = dataclasses.replace(
        entry, fn=lambda *a, **k: pk.dz_chunk(*a, interpret=True, **k), in_place=_interpret_walk()
    )

    walked = []
    walk = dzk.in_place
    dzk = dataclasses.replace(
        dzk, in_place=dataclasses.replace(walk, dz=lambda *a, **k: walked.append(1) or walk.dz(*a, **k))
    )

    def local(h, w, b, t, traced=False):
        # traced: the shard's real columns from the rank (as `sharding.tp` forms them)
        v_loc = jnp.clip(vocab - jax.lax.axis_index("tp") * v_rows, 0, v_rows) if traced else vocab
        dh, dw, db = grad.backward(h, w, b, t, inv_t, lse, g_logp, g_lse, None, vocab_size=v_loc, chunk=chunk, dz=dzk)
        return dh[None], dw, db

    mesh = jax.make_mesh((1,), ("tp",))
    put = lambda x, spec: jax.device_put(x, jax.NamedSharding(mesh, spec))
    specs = dict(in_specs=(P(), P("tp"), P("tp"), P()), out_specs=(P("tp"), P("tp"), P("tp")), check_vma=True)
    ops = (put(h, P()), put(w, P("tp")), put(b, P("tp")), put(t, P()))
    with row_invariant_wgmma():
        got = jax.jit(jax.shard_map(local, mesh=mesh, **specs))(*ops)
        assert walked, "the in-place walk did not run"
        walked.clear()
        traced = jax.jit(jax.shard_map(functools.partial(local, traced=True), mesh=mesh, **specs))(*ops)
        assert not walked, "a traced vocab size took the in-place walk"
        want = grad.backward(h, w, b, t, inv_t, lse, g_logp, g_lse, None, vocab_size=vocab, chunk=chunk, dz=dzk)
    for g_, e in zip((got[0][0], got[1], got[2]), want):
        assert_bitwise_equal(np.asarray(g_, np.float32), np.asarray(e, np.float32))
    for name, g_, e, bound in zip(
        ("hidden", "weight", "bias"), (traced[0][0], traced[1], traced[2]), want, (1e-3, 1e-2, 0)
    ):
        if bound:
            assert rel_err(g_, e) < bound, (name, rel_err(g_, e))
        else:
            assert_bitwise_equal(np.asarray(g_), np.asarray(e))


def test_gradient_gemms_with_clusters_lower_and_interpret_mode_refuses_them():
    """`GradGemmConfig.cluster` (2-CTA clusters on row-adjacent tiles multicasting B; shipped):
    both GEMMs in both layouts lower for CUDA on any machine; the interpreter, which has no TMA
    multicast, refuses an explicit cluster config; shapes that do not tile by the cluster's two
    tiles are refused when the config is explicit; a cluster that is not a bool is refused."""
    import jax

    from pallas_kernels import sm90_grad_gemm as gg
    from pallas_kernels import tuning

    S = jax.ShapeDtypeStruct
    dh_cfg, dw_cfg = tuning.DH_GEMM, tuning.DW_GEMM
    n_pad, d, chunk, v = 256, 512, 512, 2048
    dz, h, start = S((n_pad, chunk), jnp.bfloat16), S((n_pad, d), jnp.bfloat16), S((), jnp.int32)
    for layout in ("vd", "dv"):
        w = S((v, d) if layout == "vd" else (d, v), jnp.bfloat16)
        fh = lambda dh, dz, w, s: gg.dh_accumulate(dh, dz, w, s, weight_layout=layout, cfg=dh_cfg)  # noqa: E731
        fw = lambda dw, dz, h, s: gg.dw_write(dw, dz, h, s, weight_layout=layout, cfg=dw_cfg)  # noqa: E731
        jax.jit(fh).trace(S((n_pad, d), jnp.float32), dz, w, start).lower(lowering_platforms=("cuda",))
        jax.jit(fw).trace(w, dz, h, start).lower(lowering_platforms=("cuda",))
    rng = np.random.default_rng(9)
    dzv = jnp.asarray(rng.standard_normal((n_pad, chunk)), jnp.bfloat16)
    wv = jnp.asarray(rng.standard_normal((v, d)), jnp.bfloat16)
    with pytest.raises(ValueError, match="no TMA multicast"):
        gg.dh_accumulate(jnp.zeros((n_pad, d), jnp.float32), dzv, wv, 0, cfg=dh_cfg, interpret=True)
    with pytest.raises(ValueError, match="does not tile"):  # 128 rows: one tile, no pair of them
        jax.jit(lambda dh, dz, w: gg.dh_accumulate(dh, dz, w, 0, cfg=dh_cfg)).trace(
            S((128, 512), jnp.float32), S((128, chunk), jnp.bfloat16), S((v, 512), jnp.bfloat16)
        )
    with pytest.raises(ValueError, match="cluster must be a bool"):
        tuning.GradGemmConfig(cluster="m")


def test_shipped_gradient_gemms_drop_their_cluster_only_where_it_cannot_run():
    """The shipped DH_GEMM / DW_GEMM run in 2-CTA clusters; `_config` keeps the cluster where
    the output tiles by the cluster's two tiles on a GPU, and drops it (the same bytes) where
    it does not (128 rows for dh: one row tile) and in interpret mode; an explicit config is
    kept as given. `supported` asks only for a CTA tile, so a walk of 128 rows still takes the
    kernels, and such a call lowers for CUDA."""
    import jax

    from pallas_kernels import sm90_grad_gemm as gg
    from pallas_kernels import tuning

    assert tuning.DH_GEMM.cluster and tuning.DW_GEMM.cluster
    assert gg._config(None, tuning.DH_GEMM, 256, 512, False).cluster
    assert not gg._config(None, tuning.DH_GEMM, 128, 512, False).cluster
    assert not gg._config(None, tuning.DH_GEMM, 256, 512, True).cluster
    assert gg._config(None, tuning.DW_GEMM, 4608, 4096, False).cluster
    explicit = dataclasses.replace(tuning.DH_GEMM, tile_m=256)
    assert gg._config(explicit, tuning.DH_GEMM, 128, 512, True) is explicit
    assert gg.supported(128, 512, 512) and not gg.supported(64, 512, 512)
    assert gg.cols_supported(256) and not gg.cols_supported(192)

    S = jax.ShapeDtypeStruct
    dz, w = S((128, 512), jnp.bfloat16), S((2048, 512), jnp.bfloat16)
    fh = lambda dh, dz, w, s: gg.dh_accumulate(dh, dz, w, s)  # noqa: E731
    jax.jit(fh).trace(S((128, 512), jnp.float32), dz, w, S((), jnp.int32)).lower(lowering_platforms=("cuda",))


def test_gradient_gemm_refuses_a_config_beyond_shared_memory():
    """A config whose pipeline stages and staging boxes exceed shared memory is refused when the
    kernel is built (a [256, 256] CTA tile in 8 stages)."""
    import jax

    from pallas_kernels import sm90_grad_gemm as gg
    from pallas_kernels import tuning

    S = jax.ShapeDtypeStruct
    too_big = tuning.GradGemmConfig(tile_m=256, tile_n=256, max_concurrent_steps=8)
    args = (S((1024, 512), jnp.bfloat16), S((512, 512), jnp.bfloat16), S((512, 512), jnp.bfloat16), S((), jnp.int32))
    with pytest.raises(ValueError, match="shared memory"):
        jax.jit(lambda dw, dz, h, s: gg.dw_write(dw, dz, h, s, cfg=too_big)).trace(*args)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["vd", "dv"])
def test_no_xla_update_of_the_kernels_dw(layout):
    """Lowered for CUDA (shapes only), the fused backward's in-place walk leaves every dW row to
    the kernels: no dynamic_update_slice writes into a weight-shaped buffer, also where the
    last chunk's new columns are not tiled by the dW kernel at an offset (64 columns after one
    and after three full chunks). XLA's dynamic-slice fusion in jax 0.11.2 cannot compile an
    update whose target is a Mosaic call's output ("DUS target must be a fusion parameter" on
    the H200 at a TP=8 shard of the Qwen3-8B head, 19008 rows = one chunk of 16384 + 2624, when
    XLA formed those rows), and a loop of one chunk leaves the dW kernel's output as the target."""
    import re

    import jax

    S = jax.ShapeDtypeStruct
    dzk = backends.get("pallas_sm90").dz
    n, d, chunk = 12, 256, 512
    for v_rows in (576, 1600, 1280, 1024):  # 1024: the chunk divides the rows, padding in the last one
        shape = (v_rows, d) if layout == "vd" else (d, v_rows)
        vec = S((n,), jnp.float32)
        args = (S((n, d), jnp.bfloat16), S(shape, jnp.bfloat16), S((v_rows,), jnp.bfloat16), S((n,), jnp.int32))
        args += (vec, vec, vec, vec)
        assert grad._in_place_ok(dzk, args[0], args[1], chunk, as_layout(layout)), v_rows

        def f(*a):
            return grad.backward(*a, None, vocab_size=v_rows - 40, chunk=chunk, dz=dzk, weight_layout=layout)

        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("mosaic_gpu") >= 3, v_rows
        w_type = "tensor<{}x{}xbf16>".format(*shape)
        updates = re.findall(r"stablehlo\.dynamic_update_slice .*-> (tensor<[^>]*>)", text)
        assert w_type not in updates, (v_rows, updates)
        assert f"tensor<{v_rows}xf32>" in updates, (v_rows, updates)  # db's: the search sees updates
