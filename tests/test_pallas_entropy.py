"""The entropy statistic (`linear-logp-entropy-v1`) in the pallas_sm90 kernels, on CPU.

Interpret mode (Mosaic GPU's interpreter; wgmma as a row-invariant matmul, see
`pallas_kernels/interpret_utils.py`) runs the kernels built with `return_entropy=True`
with the post-GEMM arithmetic as pinned XLA:CPU ops, so from the kernel's own logits
its (m, S, A) per split must equal `oracle.split_partials(..., return_entropy=True)` bit
for bit, and the fold's entropy `oracle.fold_entropy` / the reference fold. This checks
the logic (lanes, masks, tree, rescale, chain carry, fold order), not GPU bits: those
are for tests/gpu/test_pallas_gpu.py (-k entropy) on the H200. Turning the statistic
on must change no byte of m, S, z_t, the logits, logp or lse. Race detection where the
grid has one CTA (as tests/test_pallas_interpret.py).

The GPU-side pieces that interpret mode cannot run (the PTX blocks ENTROPY_TERM and
RCP) are checked against the oracle by their numpy simulator in
tests/test_pallas_units.py, and every entropy kernel variant lowers for CUDA there.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from detlogp_jax import contract as C
from detlogp_jax import oracle, reference
from tests.helpers import assert_bitwise_equal
from tests.pallas_cases import entropy_fold_problem

pk = pytest.importorskip("pallas_kernels")
from pallas_kernels import sm90_fold, tuning  # noqa: E402
from pallas_kernels.interpret_utils import row_invariant_wgmma  # noqa: E402


@pytest.fixture(autouse=True)
def _row_invariant_interpret_matmul():
    with row_invariant_wgmma():
        yield


def _races_found():
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    return gpu_callbacks.get_races().races_found


def _problem(n, d, vl, v, *, bias=True, seed=0):
    """bf16 hidden/weight [vl, d], per-row temperatures, edge targets (ignore, the last real
    column, past the vocabulary but owned, past the weight, negative), and a bias that makes
    lanes whose exp underflows to +0 (-1e4) and isolated -inf logits (never a whole tile)."""
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((vl, d)) * 0.25, jnp.bfloat16)
    b = None
    if bias:
        bb = rng.standard_normal(vl).astype(np.float32) * 2
        bb[3] = -np.inf
        bb[70] = -np.inf
        bb[130:150] = -1e4  # e = +0 on real lanes: u = +0 there
        bb[200] = 9.0  # a strong column (a peaked row)
        b = jnp.asarray(bb)
    t = rng.integers(0, v, n).astype(np.int32)
    t[: min(n, 5)] = [C.IGNORE_INDEX, v - 1, v + 3, vl + 5, -7][:n]
    temp = rng.uniform(0.5, 1.6, n).astype(np.float32)
    return h, w, b, t, temp, oracle.inv_temperature(temp, n)


def _partials(h, w, b, t, inv_t, v, vp, *, races=False, **kw):
    ip = plgpu.InterpretGPUParams(detect_races=races)
    out = pk.partials(
        h,
        w,
        b,
        jnp.asarray(t),
        jnp.asarray(inv_t),
        vocab_size=v,
        padded_vocab_size=vp,
        interpret=True,
        interpret_params=ip,
        **kw,
    )
    out = jax.block_until_ready(out)
    if races:
        assert not _races_found(), "race detected in the forward kernel"
    return tuple(None if x is None else np.asarray(x) for x in out)


def _same(a, b, what):
    assert_bitwise_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), what)


def _check_fold(m, s, z_t, a, t, inv_t, v, logits, temp, vp, races=False):
    """pk.fold(a=A) == the oracle's (logp, lse, entropy) of the logits and the reference fold
    of the same partials; pk.fold without A gives the same logp/lse bytes."""
    ip = plgpu.InterpretGPUParams(detect_races=races)
    logp, lse, ent = (np.asarray(x) for x in pk.fold(m, s, z_t, t, inv_t, v, a=a, interpret=True, interpret_params=ip))
    if races:
        assert not _races_found(), "race detected in the fold kernel"
    if logits is not None:
        rl, rs, rh = oracle.logp_lse_entropy(logits, t, temperature=temp, vocab_size=v, padded_vocab_size=vp)
        _same(logp, rl, "logp vs oracle")
        _same(lse, rs, "lse vs oracle")
        _same(ent, rh, "entropy vs oracle")
        _same(ent, oracle.entropy(logits, temperature=temp, vocab_size=v, padded_vocab_size=vp), "oracle.entropy")
    _same(ent, oracle.fold_entropy(m, s, a), "entropy vs oracle.fold_entropy")
    ref = reference.fold(*(jnp.asarray(x) for x in (m, s, z_t, t, inv_t)), v, a=jnp.asarray(a))
    for got, want, name in zip((logp, lse, ent), ref, ("logp", "lse", "entropy")):
        _same(got, want, f"{name} vs reference.fold")
    plain = pk.fold(m, s, z_t, t, inv_t, v, interpret=True)
    assert len(plain) == 2
    _same(plain[0], logp, "logp without A")
    _same(plain[1], lse, "lse without A")
    return ent


@pytest.mark.slow
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("bucket", ["decode", "small", "prefill"])
def test_kernel_entropy_equals_oracle_every_bucket(bucket, bias):
    """Serving entry with the statistic: (m, S, A) per split == oracle.split_partials of the
    kernel's own logits (per-row T, padding columns 328..511 of which 328..383 have weight
    rows, -inf and underflowing lanes), one CTA with race detection; the trainer entry gives
    the same m/S/z_t/A bytes; without the statistic m/S/z_t/owned/logits are unchanged; the
    fold's entropy == oracle / reference fold, its logp/lse unchanged."""
    n, d, v, vl, vp = 70, 128, 328, 384, 512
    h, w, b, t, temp, inv_t = _problem(n, d, vl, v, bias=bias, seed=3)
    srv = _partials(
        h, w, b, t, inv_t, v, vp, races=True, bucket=bucket, num_ctas=1, return_logits=True, return_entropy=True
    )
    assert len(srv) == 6
    m, s, z_t, owned, logits, a = srv
    assert a.shape == m.shape == (n, C.split_bounds(vp).n_split)
    mo, so, ao = oracle.split_partials(oracle.ftz(logits), v, vp, inv_t, return_entropy=True)
    _same(m, mo, "m")
    _same(s, so, "s")
    _same(a, ao, "A")
    assert np.all(ao[np.isfinite(ao)] <= 0) and np.isfinite(ao).any()
    trn = _partials(h, w, b, t, inv_t, v, vp, bucket=bucket, num_ctas=2, return_entropy=True)
    assert trn[4] is None
    for k, name in ((0, "m"), (1, "s"), (2, "z_t"), (3, "owned"), (5, "A")):
        _same(trn[k], srv[k], f"{name} trainer vs serving")
    plain = _partials(h, w, b, t, inv_t, v, vp, bucket=bucket, num_ctas=2, return_logits=True)
    assert len(plain) == 5
    for k, name in enumerate(("m", "s", "z_t", "owned", "logits")):
        _same(plain[k], srv[k], f"{name} without the statistic")
    _check_fold(m, s, z_t, a, t, inv_t, v, logits, temp, vp, races=bias)


@pytest.mark.slow
def test_chain_tile_entropy_over_several_tiles_equals_oracle():
    """tile_math.chain_tile(a=) chained over 7 tiles (masked and unmasked steps, rows whose max
    moves, stays, or starts at -inf; rows with -inf lanes; a row of equal logits) == the oracle's
    chain of one split, and chain_tile_sliced(a=) gives the same bytes for every slices_per_step:
    the rescale of A with nonzero A and S, which one-tile splits never reach."""
    from jax import lax

    from pallas_kernels import ptx_ops, tile_math

    rng = np.random.default_rng(11)
    bm, n_tiles, tcol0, limit = 16, 7, 1024, 1024 + 6 * 64 + 23  # the last tile is masked from lane 23
    z = (rng.standard_normal((bm, n_tiles * 64)) * 4).astype(np.float32)
    z[:, 64:128] += np.linspace(0, 30, bm)[:, None].astype(np.float32)  # the max moves in tile 1 (more, lower rows)
    z[2, :] = 1.5  # equal logits: d = +0 everywhere, u = +0
    z[3, 5] = -np.inf
    z[4, 100:110] = -1e5  # underflowing lanes (e = +0)
    z[5, 300:400] = 1e-39  # subnormal logits (flushed)
    inv_t = oracle.inv_temperature(rng.uniform(0.5, 2.0, bm).astype(np.float32), bm)
    tgt = jnp.asarray(rng.integers(tcol0, tcol0 + n_tiles * 64, bm), jnp.int32)
    ident = lambda x: x  # noqa: E731

    @functools.partial(jax.jit, static_argnames=("c0", "masked"))
    def step(m, s, a, zt, inv_t, *, c0, masked):
        ops = ptx_ops.make_ops(True, None, source=inv_t)
        col = jnp.asarray(np.broadcast_to(np.arange(c0, c0 + 64), (bm, 64)), jnp.int32)
        inv_b = jnp.broadcast_to(inv_t[:, None], (bm, 64))
        got = tile_math.chain_tile(m, s, zt, col, tgt, inv_b, limit, ops, interpret=True, masked=masked, a=a)
        plain = tile_math.chain_tile(m, s, zt, col, tgt, inv_b, limit, ops, interpret=True, masked=masked)
        sliced = [
            tile_math.chain_tile_sliced(
                m,
                s,
                lambda j: lax.dynamic_slice_in_dim(zt, j * 8, 8, axis=1),
                c0,
                tgt,
                inv_t,
                limit,
                jnp.asarray(not masked),
                ops,
                interpret=True,
                tile_cast=ident,
                row_cast=ident,
                slices_per_step=sps,
                a=a,
            )
            for sps in (1, 2, 4, 8)
        ]
        return got, plain, sliced

    # The oracle: one split of n_tiles tiles at columns [tcol0, ...), vocab ending at `limit`.
    zz = np.zeros((bm, tcol0 + n_tiles * 64), np.float32)
    zz[:, tcol0:] = z
    vp = tcol0 + n_tiles * 64
    y = np.where(np.arange(vp)[None, :] < limit, oracle.f_mul(zz, inv_t[:, None]), np.float32(-np.inf))
    m_o = np.full(bm, -np.inf, np.float32)
    s_o = np.zeros(bm, np.float32)
    a_o = np.zeros(bm, np.float32)
    m = jnp.full((bm,), -jnp.inf, jnp.float32)
    s = jnp.zeros((bm,), jnp.float32)
    a = jnp.zeros((bm,), jnp.float32)
    for i in range(n_tiles):
        c0 = tcol0 + 64 * i
        yt = y[:, c0 : c0 + 64]
        valid = np.arange(c0, c0 + 64) < limit
        m_new = np.maximum(m_o, yt.max(1))
        alpha = np.where(m_o == m_new, np.float32(1), oracle.pexp(oracle.f_sub(m_o, m_new))).astype(np.float32)
        dd = oracle.f_sub(yt, m_new[:, None])
        e = np.where(valid[None, :], oracle.pexp(dd), np.float32(0)).astype(np.float32)
        u = np.where(e == 0, np.float32(0), oracle.f_mul(e, dd)).astype(np.float32)
        a_o = oracle.f_add(oracle.rescale_a(a_o, s_o, m_o, m_new, alpha), oracle.tree64(u))
        s_o = oracle.f_add(oracle.f_mul(s_o, alpha), oracle.tree64(e))
        m_o = m_new
        got, plain, sliced = step(
            m, s, a, jnp.asarray(z[:, 64 * i : 64 * i + 64]), jnp.asarray(inv_t), c0=c0, masked=c0 + 64 > limit
        )
        for sps, sl in zip((1, 2, 4, 8), sliced):
            for x, want, name in zip(sl, got, ("m", "s", "z_hit", "A")):
                _same(x, want, f"{name} sliced sps={sps} tile {i}")
        assert len(plain) == 3  # without the statistic: the old step, the same m, S, z_hit
        for x, want, name in zip(plain, got, ("m", "s", "z_hit")):
            _same(x, want, f"{name} without A, tile {i}")
        m, s, _, a = got
        _same(m, m_o, f"m tile {i}")
        _same(s, s_o, f"s tile {i}")
        _same(a, a_o, f"A tile {i}")
    assert np.any(np.asarray(a) < -1.0)  # a real statistic, not only zeros


@pytest.mark.slow
@pytest.mark.parametrize("bucket,force_w1", [("small", False), ("decode", True), ("prefill", True)])
def test_kernel_entropy_multi_tile_splits(monkeypatch, bucket, force_w1):
    """264 splits of 1-2 tiles (V_pad = 17408), so A is rescaled inside a split: with the natural
    w = 2 the two tiles share a group (the epilogue's loop), with w forced to 1 they are two
    groups (the pipeline / hand-off carry). (m, S, A) == oracle; fold entropy == oracle."""
    n, d, v, vp = 3, 128, 17300, 17408
    h, w, b, t, temp, inv_t = _problem(n, d, v, v, seed=5)  # targets: ignore, v - 1, v + 3 (not owned)
    if force_w1:
        monkeypatch.setattr(tuning, "tiles_per_group", lambda sizes: 1)
    m, s, z_t, owned, logits, a = _partials(
        h, w, b, t, inv_t, v, vp, bucket=bucket, num_ctas=2, return_logits=True, return_entropy=True
    )
    mo, so, ao = oracle.split_partials(oracle.ftz(logits), v, vp, inv_t, return_entropy=True)
    _same(m, mo, "m")
    _same(s, so, "s")
    _same(a, ao, "A")
    _check_fold(m, s, z_t, a, t, inv_t, v, logits, temp, vp)


@pytest.mark.slow
def test_kernel_entropy_batch_invariance_and_knobs():
    """Probe rows alone vs inside a 130-row batch, every bucket, and bit-neutral knobs of both
    kernels (work order, one consumer warpgroup): A and the entropy bytes agree."""
    n, d, v, vp = 130, 128, 328, 512
    h, w, b, t, temp, inv_t = _problem(n, d, v, v, seed=1)
    probe = np.array([0, 64, 129])
    ref = _partials(h[probe], w, b, t[probe], inv_t[probe], v, vp, bucket="decode", num_ctas=1, return_entropy=True)
    ref_h = pk.fold(*ref[:3], t[probe], inv_t[probe], v, a=ref[5], interpret=True)[2]
    variants = list(tuning.BUCKETS.values()) + [
        dataclasses.replace(tuning.BUCKETS["small"], name="x1", split_group=3),
        dataclasses.replace(tuning.BUCKETS["prefill"], name="x2", split_group=2, num_compute_wgs=1),
    ]
    for cfg in variants:
        out = _partials(h, w, b, t, inv_t, v, vp, bucket=cfg, num_ctas=3, return_entropy=True)
        for k, name in ((0, "m"), (1, "s"), (5, "A")):
            _same(out[k][probe], ref[k], f"{name} {cfg.name}")
        ent = pk.fold(*out[:3], t, inv_t, v, a=out[5], interpret=True)[2]
        _same(np.asarray(ent)[probe], ref_h, f"entropy {cfg.name}")


@pytest.mark.slow
def test_kernel_entropy_dv_layout_and_tp_shards():
    """weight_layout="dv" (the [D, V] kernel read in place) gives the "vd" A bytes; two TP
    shards' A concatenated == the unsharded A (the statistic travels like S)."""
    n, d, v, vp = 16, 128, 328, 512
    h, w, b, t, temp, inv_t = _problem(n, d, v, v, seed=2)
    wp = jnp.pad(w, ((0, vp - v), (0, 0)))
    bp = jnp.pad(b, (0, vp - v))
    full = _partials(h, wp, bp, t, inv_t, v, vp, num_ctas=2, return_entropy=True, return_logits=True)
    dv = _partials(
        h, jnp.asarray(np.asarray(wp).T), bp, t, inv_t, v, vp, num_ctas=2, return_entropy=True, weight_layout="dv"
    )
    for k, name in ((0, "m"), (1, "s"), (2, "z_t"), (5, "A")):
        _same(dv[k], full[k], f"{name} dv")
    parts = [
        _partials(
            h,
            wp[256 * r : 256 * r + 256],
            bp[256 * r : 256 * r + 256],
            t,
            inv_t,
            v,
            vp,
            col_offset=256 * r,
            shard_cols=256,
            num_ctas=2,
            return_entropy=True,
        )
        for r in range(2)
    ]
    _same(np.concatenate([p[5] for p in parts], 1), full[5], "A shards")
    _same(np.concatenate([p[1] for p in parts], 1), full[1], "S shards")


_FOLD_VARIANTS = [
    pytest.param({}, id="default"),
    pytest.param({"chunk": 4}, id="staged-chunk4", marks=pytest.mark.slow),
    pytest.param({"rows": 64, "chunk": 6, "unroll": 5}, id="staged-rows64", marks=pytest.mark.slow),
    pytest.param({"rows": 8, "chunk": 16}, id="staged-rows8"),
]


@pytest.mark.parametrize("knobs", _FOLD_VARIANTS)
@pytest.mark.parametrize("n_split", [1, 7, 9, 37, 264])
def test_fold_entropy_split_counts_equal_oracle(n_split, knobs):
    """The fold kernel with A, split counts that are not multiples of the fold's groups / chunks, over 3 row blocks, every edge row of fold_problem: logp/lse ==
    oracle.fold (and the fold without A), entropy == oracle.fold_entropy == reference.fold."""
    n, v = 70, 1000
    m, s, a, z_t, t, inv_t = entropy_fold_problem(n, n_split, v, seed=n_split)
    rl, rs = oracle.fold(m, s, z_t, t, inv_t, v)
    if not sm90_fold.staged_fits(n_split, knobs.get("rows", tuning.FOLD.rows), entropy=True):
        with pytest.raises(ValueError, match="does not fit.*fewer rows"):  # 264 splits x 64 rows with A
            pk.fold(m, s, z_t, t, inv_t, v, a=a, interpret=True, **knobs)
        return
    logp, lse, ent = pk.fold(m, s, z_t, t, inv_t, v, a=a, interpret=True, **knobs)
    _same(logp, rl, "logp")
    _same(lse, rs, "lse")
    _same(ent, oracle.fold_entropy(m, s, a), "entropy")
    _same(ent, reference.fold(*(jnp.asarray(x) for x in (m, s, z_t, t, inv_t)), v, a=jnp.asarray(a))[2], "ref")
    ent = np.asarray(ent)
    assert np.all(ent[np.isfinite(ent)] >= 0) and np.isnan(ent[10]) and np.isnan(ent[1])


@pytest.mark.slow
def test_fold_refuses_partials_that_do_not_fit_in_shared_memory():
    """Three SMEM arrays fit fewer splits: at n_split = 600 the 32-row fold holds m, S but not A
    too, and the fold with A says so (naming the way out: fewer rows); with 16 rows it fits and
    gives the oracle's bytes. (Every split plan of the contract, at most 264 splits, fits.)"""
    assert sm90_fold.staged_fits(600) and not sm90_fold.staged_fits(600, entropy=True)
    assert sm90_fold.staged_fits(264, entropy=True, zt_splits=True)
    assert sm90_fold.staged_fits(600, rows=16, entropy=True)
    n, v = 16, 151936
    m, s, a, z_t, t, inv_t = entropy_fold_problem(n, 600, v, seed=6)
    with pytest.raises(ValueError, match="does not fit.*fewer rows"):
        pk.fold(m, s, z_t, t, inv_t, v, a=a, interpret=True)
    logp, lse, ent = pk.fold(m, s, z_t, t, inv_t, v, a=a, interpret=True, rows=16)
    rl, rs = oracle.fold(m, s, z_t, t, inv_t, v)
    _same(logp, rl, "logp")
    _same(lse, rs, "lse")
    _same(ent, oracle.fold_entropy(m, s, a), "entropy")


def test_fold_refuses_a_statistic_of_another_shape():
    m = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match="entropy statistic"):
        pk.fold(m, m, np.zeros(4), np.zeros(4, np.int32), np.ones(4, np.float32), 100, a=m[:, :2], interpret=True)


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 70], ids=["M1", "M70"])
def test_fused_forward_equals_partials_and_fold(n):
    """pk.forward (the fold reads the forward's split-major partials over its padded rows, no
    re-layout) == pk.fold(*pk.partials(...)) byte for byte: logp, lse, entropy and the logits,
    with and without the statistic and the logits, bias and per-row T, a one-row decode call and
    rows that pad to a second row block, the 8-row fold too."""
    d, v, vl, vp = 128, 328, 384, 512
    h, w, b, t, temp, inv_t = _problem(n, d, vl, v, seed=5)
    tj, ij = jnp.asarray(t), jnp.asarray(inv_t)
    kw = dict(vocab_size=v, padded_vocab_size=vp, interpret=True, num_ctas=2)
    for ent, lg, fold_cfg in ((True, True, None), (False, False, None), (True, False, tuning.FoldConfig(rows=8))):
        parts = pk.partials(h, w, b, tj, ij, return_entropy=ent, return_logits=lg, logits_cols=v if lg else None, **kw)
        want = pk.fold(*parts[:3], tj, ij, v, a=parts[5] if ent else None, interpret=True, cfg=fold_cfg)
        got = pk.forward(
            h,
            w,
            b,
            tj,
            ij,
            return_entropy=ent,
            return_logits=lg,
            logits_cols=v if lg else None,
            fold_cfg=fold_cfg,
            **kw,
        )
        assert len(got) == 4 and (got[3] is None) == (not ent) and (got[2] is None) == (not lg)
        what = f"entropy={ent} logits={lg} fold={fold_cfg}"
        _same(got[0], want[0], f"logp {what}")
        _same(got[1], want[1], f"lse {what}")
        if ent:
            _same(got[3], want[2], f"entropy {what}")
        if lg:
            assert got[2].shape == (n, v)
            _same(got[2], parts[4], f"logits {what}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "n,bucket,layout",
    [(1, "decode", "vd"), (3, "decode", "dv"), (13, "decode", "vd"), (40, "decode", "vd"), (63, "decode", "vd")]
    + [(70, "mid", "vd")],
    ids=lambda x: str(x),
)
def test_unpadded_forward_equals_padded_forward(n, bucket, layout):
    """pk.forward (unpadded=True, its default) == the padded launch (unpadded=False) byte for
    byte: logp, lse, entropy, logits, with bias, per-row T and the edge targets of _problem (past
    the vocabulary but owned, past the weight, negative, ignored). In one row block (M <= 64
    decode, M = 70 in the mid bucket's 128 rows) the forward kernel reads the [N] targets /
    inv_t by scalar loads (`row_loads`) and hidden with a box of N rounded up to 8 rows (none at
    63: 64 rows), and the fold reads and writes [N] by scalar loads and stores (`scalar_rows`;
    at 40 rows two 32-row fold blocks, the second partly past N; the 8-row decode fold here
    too, as the default at N <= 64)."""
    from pallas_kernels import sm90_forward_ws, wrapper

    d, v, vl, vp = 128, 328, 384, 512
    h, w, b, t, temp, inv_t = _problem(n, d, vl, v, seed=8 + n)
    if layout == "dv":
        w = jnp.asarray(w).T
    tj, ij = jnp.asarray(t), jnp.asarray(inv_t)
    kw = dict(vocab_size=v, padded_vocab_size=vp, interpret=True, num_ctas=2, bucket=bucket, weight_layout=layout)
    kw.update(return_entropy=True, return_logits=True, logits_cols=v)
    built = []
    real_build = sm90_forward_ws.build

    def spy(**static):
        built.append({k: static.get(k) for k in ("row_loads", "h_box_rows")})
        return real_build(**static)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sm90_forward_ws, "build", spy)
        wrapper._forward_core.clear_cache()  # (a cached trace would not call build)
        got = pk.forward(h, w, b, tj, ij, **kw)
        assert n < tuning.select_bucket(n, bucket).cta_rows  # (one row block: unpadded)
        n8 = -(-n // 8) * 8
        box = n8 if n8 < tuning.select_bucket(n, bucket).cta_rows else None
        assert built == [{"row_loads": n, "h_box_rows": box}], built
        wrapper._forward_core.clear_cache()
        want = pk.forward(h, w, b, tj, ij, unpadded=False, fold_cfg=tuning.FOLD, **kw)
        assert built[1:] == [{"row_loads": None, "h_box_rows": None}], built
    for i, name in ((0, "logp"), (1, "lse"), (3, "entropy"), (2, "logits")):
        assert got[i].shape == want[i].shape
        _same(got[i], want[i], f"{name} n={n} {bucket}")


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 13])
def test_decode_fold_config_gives_the_same_bytes(n, monkeypatch):
    """tuning.DECODE_FOLD (the fold pk.forward runs at N <= 64 rows): FoldConfig(rows=8), 16 threads per row's splits, gives the bytes of the 32-row fold:
    logp, lse, entropy, with bias, per-row T and _problem's edge targets (interpret mode; the
    row inputs by scalar loads at 1 and 13 rows, 13 rows over two 8-row fold blocks)."""
    d, v, vl, vp = 128, 328, 384, 512
    h, w, b, t, temp, inv_t = _problem(n, d, vl, v, seed=30 + n)
    tj, ij = jnp.asarray(t), jnp.asarray(inv_t)
    kw = dict(vocab_size=v, padded_vocab_size=vp, interpret=True, num_ctas=2, return_entropy=True)
    assert tuning.DECODE_FOLD == tuning.FoldConfig(rows=8)
    assert tuning.FOLD.rows == 32
    want = pk.forward(h, w, b, tj, ij, fold_cfg=tuning.FOLD, **kw)
    used, real = [], sm90_fold.fold_transposed
    monkeypatch.setattr(sm90_fold, "fold_transposed", lambda *a, **k: used.append(k["cfg"]) or real(*a, **k))
    got = pk.forward(h, w, b, tj, ij, **kw)
    assert used == [tuning.FoldConfig(rows=8)], used
    for i, name in ((0, "logp"), (1, "lse"), (3, "entropy")):
        _same(got[i], want[i], f"{name} n={n}")
