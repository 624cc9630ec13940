"""The pallas_sm90 kernels in Mosaic GPU interpret mode on CPU.

Interpret mode runs the same kernel code (TMA pipeline, warpgroups, barriers,
wgmma as acc + matmul, the chain epilogue) with the post-GEMM arithmetic as
pinned XLA:CPU ops, so the kernel's partials and fold must equal the oracle
bit for bit given the kernel's own logits. Race detection is on where the
grid has one CTA (the interpreter's race detector keys per-CTA register
buffers by thread, so persistent multi-CTA runs report false races between
different CTAs' accumulators; cross-CTA output regions are disjoint by
construction: a (split, row block) work item is owned by exactly one CTA).

Interpret mode is slow (~0.1-0.2 s per pipeline step); shapes are tiny and the
larger cases are marked slow.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from detlogp_jax import contract as C
from detlogp_jax import oracle
from tests.helpers import assert_bitwise_equal
from tests.pallas_cases import fold_problem, split_captures

pk = pytest.importorskip("pallas_kernels")
from pallas_kernels import tuning  # noqa: E402
from pallas_kernels.interpret_utils import row_invariant_wgmma  # noqa: E402


@pytest.fixture(autouse=True)
def _row_invariant_interpret_matmul():
    """Interpret-mode wgmma is an OpenBLAS sgemm whose per-row result depends
    on the row's position; use a row-invariant matmul model (see
    pallas_kernels/interpret_utils.py) so batch invariance is testable."""
    with row_invariant_wgmma():
        yield


def _races_found():
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    return gpu_callbacks.get_races().races_found


def _problem(n, d, v, bias=True, seed=0, temp=0.7, per_row_t=False):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((v, d)) * 0.2, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(v), jnp.float32) if bias else None
    t = rng.integers(0, v, n).astype(np.int32)
    if n > 3:
        t[0], t[1], t[2], t[3] = C.IGNORE_INDEX, v - 1, v + 3, -7
    temp = rng.uniform(0.5, 1.5, n).astype(np.float32) if per_row_t else np.float32(temp)
    inv_t = oracle.inv_temperature(temp, n)
    return h, w, b, t, inv_t, temp


def _run(h, w, b, t, inv_t, v, vp, *, races=False, **kw):
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
    logp, lse = pk.fold(
        out[0], out[1], out[2], jnp.asarray(t), jnp.asarray(inv_t), v, interpret=True, interpret_params=ip
    )
    if races:
        assert not _races_found(), "race detected in the fold kernel"
    return out, np.asarray(logp), np.asarray(lse)


def _check_against_oracle(out, logp, lse, t, inv_t, temp, v, vp):
    m, s, z_t, owned, logits = (None if x is None else np.asarray(x) for x in out)
    mo, so = oracle.split_partials(oracle.ftz(logits), v, vp, inv_t)
    assert_bitwise_equal(m, mo, "m")
    assert_bitwise_equal(s, so, "s")
    rl, rs = oracle.logp_lse(logits, t, temperature=temp, vocab_size=v, padded_vocab_size=vp)
    assert_bitwise_equal(logp, rl, "logp")
    assert_bitwise_equal(lse, rs, "lse")
    # z_t: the raw logit of the target where the shard owns it.
    want_owned = (t >= 0) & (t < logits.shape[1])
    assert np.array_equal(owned, want_owned)
    idx = np.where(want_owned)[0]
    assert_bitwise_equal(z_t[idx], logits[idx, t[idx]], "z_t")


def test_forward_and_fold_equal_oracle_with_race_detection():
    n, d, v, vp = 64, 128, 328, 512
    h, w, b, t, inv_t, temp = _problem(n, d, v, per_row_t=True)
    out, logp, lse = _run(h, w, b, t, inv_t, v, vp, races=True, return_logits=True, bucket="decode", num_ctas=1)
    _check_against_oracle(out, logp, lse, t, inv_t, temp, v, vp)
    assert logp[0] == 0.0 and np.isnan(logp[2]) and np.isnan(logp[3])
    # Trainer entry (no logits) gives the same partials bytes.
    out2, logp2, lse2 = _run(h, w, b, t, inv_t, v, vp, races=True, return_logits=False, bucket="decode", num_ctas=1)
    assert out2[4] is None
    for a, c, name in zip(out[:4], out2[:4], ("m", "s", "z_t", "owned")):
        assert_bitwise_equal(np.asarray(a, np.float32), np.asarray(c, np.float32), name)
    assert_bitwise_equal(logp, logp2, "logp")
    assert_bitwise_equal(lse, lse2, "lse")


def test_fold_kernel_equals_oracle():
    rng = np.random.default_rng(5)
    n, ns, v = 200, 37, 1000
    m = rng.normal(0, 3, (n, ns)).astype(np.float32)
    s = rng.uniform(0.5, 40, (n, ns)).astype(np.float32)
    m[5, :] = -np.inf
    s[5, :] = 0
    m[6, 3] = np.nan
    m[7, ::2] = -np.inf
    s[7, ::2] = 0
    m[8, :] = m[8, 0]
    z_t = rng.normal(0, 5, n).astype(np.float32)
    z_t[9] = 1e-40
    t = rng.integers(0, v, n).astype(np.int32)
    t[10], t[11], t[12] = C.IGNORE_INDEX, v, -3
    inv_t = oracle.inv_temperature(rng.uniform(0.3, 2, n).astype(np.float32), n)
    logp, lse = pk.fold(m, s, z_t, t, inv_t, v, interpret=True)
    rl, rs = oracle.fold(m, s, z_t, t, inv_t, v)
    assert_bitwise_equal(np.asarray(logp), rl, "logp")
    assert_bitwise_equal(np.asarray(lse), rs, "lse")


_FOLD_VARIANTS = [
    pytest.param({}, id="default"),
    pytest.param({"chunk": 4}, id="staged-chunk4", marks=pytest.mark.slow),
    pytest.param({"rows": 64, "chunk": 6, "unroll": 5}, id="staged-rows64", marks=pytest.mark.slow),
    pytest.param({"rows": 8, "chunk": 16}, id="staged-rows8"),
    pytest.param({"rows": 16, "chunk": 24, "unroll": 7}, id="staged-rows16", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("knobs", _FOLD_VARIANTS)
@pytest.mark.parametrize("n_split", [1, 7, 9, 37, 264])
def test_fold_split_counts_equal_oracle(n_split, knobs):
    """Split counts that are not multiples of the fold's groups / chunks,
    over 3 row blocks (the last one partial), every edge row: bytes equal oracle.fold."""
    n, v = 70, 1000
    m, s, z_t, t, inv_t = fold_problem(n, n_split, v, seed=n_split)
    logp, lse = pk.fold(m, s, z_t, t, inv_t, v, interpret=True, **knobs)
    rl, rs = oracle.fold(m, s, z_t, t, inv_t, v)
    assert_bitwise_equal(np.asarray(logp), rl, "logp")
    assert_bitwise_equal(np.asarray(lse), rs, "lse")


def _capture_edge_rows(z_t):
    """fold_problem's z_t with the captures' edge values: -0 (its sign bit is the only set bit),
    NaN, +0 (no capture differs from +0), the largest finite value and a subnormal."""
    z_t = z_t.copy()
    z_t[13], z_t[14], z_t[15], z_t[16], z_t[17] = -0.0, np.nan, 0.0, np.finfo(np.float32).max, -1e-40
    return z_t


@pytest.mark.parametrize("knobs", _FOLD_VARIANTS)
@pytest.mark.parametrize("n_split", [1, 7, 264])
def test_fold_forms_z_t_from_split_captures(n_split, knobs):
    """fold_transposed(ztT=captures) (the kernel ORs each row's captures itself) == the fold given the owner's capture as z_t, byte for byte,
    over 3 row blocks, with -0 / NaN / +0 / subnormal captures and owners at the first and last
    split; and == oracle.fold."""
    from pallas_kernels import sm90_fold

    n, v = 70, 1000
    m, s, z_t, t, inv_t = fold_problem(n, n_split, v, seed=n_split)
    z_t = _capture_edge_rows(z_t)
    ztT, owner = split_captures(z_t, n_split, seed=n_split)
    assert_bitwise_equal(np.asarray(sm90_fold.zt_from_splits(ztT)), z_t, "zt_from_splits")
    args = [jnp.asarray(x) for x in (m.T, s.T)]
    got = sm90_fold.fold_transposed(
        *args, None, jnp.asarray(t), jnp.asarray(inv_t), v, ztT=jnp.asarray(ztT), interpret=True, **knobs
    )
    want = sm90_fold.fold_transposed(
        *args, jnp.asarray(z_t), jnp.asarray(t), jnp.asarray(inv_t), v, interpret=True, **knobs
    )
    rl, rs = oracle.fold(m, s, z_t, t, inv_t, v)
    for g, w, r, name in zip(got, want, (rl, rs), ("logp", "lse")):
        assert_bitwise_equal(np.asarray(g), np.asarray(w), name)
        assert_bitwise_equal(np.asarray(g), r, f"{name} oracle")
    assert np.isnan(np.asarray(got[0])[14]) and np.asarray(got[0])[15] <= 0


def test_fold_refuses_both_or_neither_z_t_and_captures():
    from pallas_kernels import sm90_fold

    m = jnp.zeros((3, 4), jnp.float32)
    t, it = jnp.zeros(4, jnp.int32), jnp.ones(4, jnp.float32)
    with pytest.raises(ValueError, match="exactly one of z_t"):
        sm90_fold.fold_transposed(m, m, jnp.zeros(4), t, it, 100, ztT=m, interpret=True)
    with pytest.raises(ValueError, match="exactly one of z_t"):
        sm90_fold.fold_transposed(m, m, None, t, it, 100, interpret=True)
    with pytest.raises(ValueError, match="target captures must be"):
        sm90_fold.fold_transposed(m, m, None, t, it, 100, ztT=m[:2], interpret=True)


@pytest.mark.slow
def test_buckets_and_batch_invariance():
    """Probe rows alone vs inside a batch at several positions, every bucket forced."""
    n, d, v, vp = 130, 128, 328, 512
    h, w, b, t, inv_t, temp = _problem(n, d, v, seed=1)
    probe = np.array([0, 64, 129])
    ref, ref_logp, ref_lse = _run(h[probe], w, b, t[probe], inv_t[probe], v, vp, bucket="decode", num_ctas=1)
    for bucket in sorted(tuning.BUCKETS):
        out, logp, lse = _run(h, w, b, t, inv_t, v, vp, bucket=bucket, num_ctas=2, return_logits=(bucket == "small"))
        if bucket == "small":
            _check_against_oracle(out, logp, lse, t, inv_t, temp, v, vp)
        assert_bitwise_equal(np.asarray(out[0])[probe], np.asarray(ref[0]), f"m {bucket}")
        assert_bitwise_equal(np.asarray(out[1])[probe], np.asarray(ref[1]), f"s {bucket}")
        assert_bitwise_equal(logp[probe], ref_logp, f"logp {bucket}")
        assert_bitwise_equal(lse[probe], ref_lse, f"lse {bucket}")


@pytest.mark.slow
def test_unpadded_weight_and_tp_shards():
    n, d, v, vp = 16, 128, 328, 512
    h, w, b, t, inv_t, temp = _problem(n, d, v, seed=2)
    full, logp, lse = _run(h, w, b, t, inv_t, v, vp, num_ctas=2)
    # Padded weight (zero rows up to V_pad) gives the same bytes.
    wp = jnp.pad(w, ((0, vp - v), (0, 0)))
    bp = jnp.pad(b, (0, vp - v))
    padded, logp_p, lse_p = _run(h, wp, bp, t, inv_t, v, vp, num_ctas=2)
    for a, c, name in zip(full[:2], padded[:2], ("m", "s")):
        assert_bitwise_equal(np.asarray(a), np.asarray(c), name)
    assert_bitwise_equal(logp, logp_p, "logp padded")
    assert_bitwise_equal(lse, lse_p, "lse padded")
    # Two TP shards of 256 columns: concatenated partials equal the full ones.
    ms, ss, zs, os_ = [], [], [], []
    for r in range(2):
        lo = 256 * r
        out = pk.partials(
            h,
            wp[lo : lo + 256],
            bp[lo : lo + 256],
            jnp.asarray(t),
            jnp.asarray(inv_t),
            vocab_size=v,
            padded_vocab_size=vp,
            col_offset=lo,
            shard_cols=256,
            interpret=True,
            num_ctas=2,
        )
        ms.append(np.asarray(out[0]))
        ss.append(np.asarray(out[1]))
        zs.append(np.asarray(out[2]))
        os_.append(np.asarray(out[3]))
    assert_bitwise_equal(np.concatenate(ms, 1), np.asarray(full[0]), "m shards")
    assert_bitwise_equal(np.concatenate(ss, 1), np.asarray(full[1]), "s shards")
    z_t = np.where(os_[0], zs[0], zs[1])
    own = np.asarray(full[3])
    assert_bitwise_equal(z_t[own], np.asarray(full[2])[own], "z_t shards")


@pytest.mark.slow
@pytest.mark.parametrize("bucket,races", [("small", True), ("decode", False)])
def test_multi_tile_splits_and_groups(monkeypatch, bucket, races):
    """264 splits of 1-2 tiles; w forced to 1 so a split spans 2 tile groups (chain across groups).

    `small` runs the chain in the wgmma warpgroups, `decode` in an epilogue warpgroup
    (sm90_forward_ws). The latter without race detection: with it this case takes more
    than 400 s in the interpreter; the ws kernel's races are checked on a smaller case
    (test_ws_kernel_bit_identical_with_race_detection)."""
    n, d, v, vp = 3, 192, 17300, 17408
    h, w, b, t, inv_t, temp = _problem(n, d, v, seed=3)
    monkeypatch.setattr(tuning, "tiles_per_group", lambda sizes: 1)
    out, logp, lse = _run(h, w, b, t, inv_t, v, vp, races=races, return_logits=True, bucket=bucket, num_ctas=1)
    _check_against_oracle(out, logp, lse, t, inv_t, temp, v, vp)


@pytest.mark.slow
def test_launch_knobs_are_bit_neutral():
    """Grouped work order, one consumer warpgroup and logits staging slots give the same bytes."""
    import dataclasses

    n, d, v, vp = 130, 128, 328, 512
    h, w, b, t, inv_t, temp = _problem(n, d, v, seed=1)
    ref, ref_logp, ref_lse = _run(h, w, b, t, inv_t, v, vp, bucket="small", num_ctas=2, return_logits=True)
    _check_against_oracle(ref, ref_logp, ref_lse, t, inv_t, temp, v, vp)
    variants = [
        # chain-in-wgmma kernel (the small bucket's): work order, staging slots
        dataclasses.replace(tuning.BUCKETS["small"], name="x1", split_group=3, logits_slots=2),
        dataclasses.replace(tuning.BUCKETS["small"], name="x3", block_m=64, num_compute_wgs=1, logits_slots=1),
        # sm90_forward_ws: work order
        dataclasses.replace(tuning.BUCKETS["prefill"], name="x2", split_group=2),
    ]
    for cfg in variants:
        out, logp, lse = _run(h, w, b, t, inv_t, v, vp, bucket=cfg, num_ctas=3, return_logits=True)
        for k, name in enumerate(("m", "s", "z_t", "owned", "logits")):
            assert_bitwise_equal(np.asarray(out[k], np.float32), np.asarray(ref[k], np.float32), f"{name} {cfg}")
        assert_bitwise_equal(logp, ref_logp, f"logp {cfg}")
        assert_bitwise_equal(lse, ref_lse, f"lse {cfg}")


# --- sm90_forward_ws: dedicated epilogue warpgroup (the prefill bucket) ---------------------


def _ws(**kw):
    import dataclasses

    return dataclasses.replace(tuning.BUCKETS["prefill"], name="ws-test", **kw)


@pytest.mark.slow
@pytest.mark.parametrize("bucket", ["prefill", "decode"])
def test_ws_kernel_bit_identical_with_race_detection(bucket):
    """sm90_forward_ws == the chain-in-wgmma kernel (small bucket), every output and the
    logits, with bias, per-row temperatures and padded vocab; no races (one CTA runs every work
    item, so the hand-off buffers and the ring carry over item switches, and the kernel ends: no
    barrier left waiting)."""
    n, d, v, vp = 130, 128, 328, 512
    h, w, b, t, inv_t, temp = _problem(n, d, v, seed=1, per_row_t=True)
    ref, ref_logp, ref_lse = _run(h, w, b, t, inv_t, v, vp, bucket="small", num_ctas=2, return_logits=True)
    _check_against_oracle(ref, ref_logp, ref_lse, t, inv_t, temp, v, vp)
    out, logp, lse = _run(h, w, b, t, inv_t, v, vp, races=True, bucket=bucket, num_ctas=1, return_logits=True)
    for k, name in enumerate(("m", "s", "z_t", "owned", "logits")):
        assert_bitwise_equal(np.asarray(out[k], np.float32), np.asarray(ref[k], np.float32), name)
    assert_bitwise_equal(logp, ref_logp, "logp")
    assert_bitwise_equal(lse, ref_lse, "lse")
    trainer, _, _ = _run(h, w, b, t, inv_t, v, vp, bucket=bucket, num_ctas=3)
    for k, name in enumerate(("m", "s", "z_t")):
        assert_bitwise_equal(np.asarray(trainer[k]), np.asarray(ref[k]), f"{name} trainer entry")


@pytest.mark.slow
@pytest.mark.parametrize("full", [True, False])
def test_chain_tile_sliced_equals_chain_tile(full):
    """The sliced chain step (two passes over eight [BM, 8] slices, exp loop) gives the bytes
    of tile_math.chain_tile for every slices_per_step, masked and unmasked (pass 1: lane-wise
    maxima and one row reduction), with a NaN logit and targets before, inside and past the
    tile."""
    from jax import lax

    from pallas_kernels import ptx_ops, tile_math

    rng = np.random.default_rng(7)
    bm = 16
    z_np = rng.standard_normal((bm, 64)) * 6
    z_np[3, 21] = np.nan
    z = jnp.asarray(z_np, jnp.float32)
    m = jnp.asarray(np.where(rng.random(bm) < 0.3, -np.inf, rng.standard_normal(bm) * 4), jnp.float32)
    s = jnp.asarray(rng.random(bm) * 3, jnp.float32)
    tcol0 = 640
    limit = tcol0 + (64 if full else 37)
    tgt = jnp.asarray(rng.integers(tcol0 - 5, tcol0 + 70, bm), jnp.int32)
    inv_t = jnp.asarray(rng.uniform(0.5, 2.0, bm), jnp.float32)
    ops = ptx_ops.make_ops(True, None, source=inv_t)
    col = jnp.asarray(np.arange(64)[None, :] + tcol0, jnp.int32) + jnp.zeros((bm, 1), jnp.int32)
    want = tile_math.chain_tile(
        m, s, z, col, tgt, jnp.broadcast_to(inv_t[:, None], (bm, 64)), limit, ops, interpret=True, masked=not full
    )
    ident = lambda x: x
    load_slice = lambda j: lax.dynamic_slice_in_dim(z, j * 8, 8, axis=1)
    for sps in (1, 2, 4, 8):
        got = tile_math.chain_tile_sliced(
            m,
            s,
            load_slice,
            tcol0,
            tgt,
            inv_t,
            limit,
            jnp.asarray(full),
            ops,
            interpret=True,
            tile_cast=ident,
            row_cast=ident,
            slices_per_step=sps,
        )
        for a, c, name in zip(got, want, ("m", "s", "z_hit")):
            assert_bitwise_equal(np.asarray(a), np.asarray(c), f"{name} sps={sps}")


def test_ws_register_split_fits_the_launch_allocation():
    """Producer 24, each wgmma warpgroup 128, the epilogue warpgroup the rest up to setmaxnreg's
    232: within the launch's registers for one and two wgmma warpgroups."""
    from pallas_kernels import sm90_forward_ws

    for cfg in (tuning.BUCKETS["prefill"], tuning.BUCKETS["decode"]):
        p, m, e = sm90_forward_ws.register_split(cfg)
        n_wgs = cfg.num_compute_wgs + 2
        assert (p, m, e) == (24, 128, 232)
        assert p + cfg.num_compute_wgs * m + e <= n_wgs * sm90_forward_ws.launch_registers(n_wgs)


def test_each_kernel_builds_only_its_own_config():
    """The config's type picks the kernel: a builder refuses the other kernel's config."""
    from pallas_kernels import sm90_forward_wgmma, sm90_forward_ws

    geom = pk.shard_geometry(328, 512)
    kw = dict(n_pad=128, d=128, lg_cols=328, geom=geom, has_bias=False, return_logits=False, num_ctas=1, interpret=True)
    with pytest.raises(TypeError, match="WsForwardConfig"):
        sm90_forward_ws.build(cfg=tuning.BUCKETS["small"], **kw)
    with pytest.raises(TypeError, match="WgmmaForwardConfig"):
        sm90_forward_wgmma.build(cfg=tuning.BUCKETS["prefill"], **kw)


@pytest.mark.slow
@pytest.mark.parametrize("bucket", ["decode", "prefill", "small"])
@pytest.mark.parametrize("v", [320, 325, 360])
def test_logits_cols_writes_only_the_real_vocabulary(bucket, v):
    """logits_cols=vocab: [N, vocab] logits, the bytes of the full-width logits' first columns
    (written directly by the kernel when vocab % 8 == 0 (% 32 with the swizzled hand-off: 360
    is not), sliced otherwise); partials unchanged."""
    n, d, vp = 9, 128, 512
    h, w, b, t, inv_t, temp = _problem(n, d, 384, seed=5)  # a weight of 384 rows > vocab
    full, _, _ = _run(h, w, b, t, inv_t, v, vp, bucket=bucket, num_ctas=2, return_logits=True)
    cut, _, _ = _run(h, w, b, t, inv_t, v, vp, bucket=bucket, num_ctas=2, return_logits=True, logits_cols=v)
    assert np.asarray(cut[4]).shape == (n, v)
    assert_bitwise_equal(np.asarray(cut[4]), np.asarray(full[4])[:, :v], "logits")
    for k, name in enumerate(("m", "s", "z_t")):
        assert_bitwise_equal(np.asarray(cut[k]), np.asarray(full[k]), name)
    with pytest.raises(ValueError, match="logits_cols"):
        pk.partials(
            h,
            w,
            b,
            jnp.asarray(t),
            jnp.asarray(inv_t),
            vocab_size=v,
            padded_vocab_size=vp,
            interpret=True,
            return_logits=True,
            logits_cols=385,
        )


# --- weight_layout="dv": a [D, V] kernel read in place ---------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("logits", [True, False], ids=["serving", "trainer"])
@pytest.mark.parametrize("bucket", ["decode", "small", "prefill"])
def test_dv_kernel_equals_vd_kernel_on_the_transposed_weight(bucket, logits, bias):
    """weight_layout="dv" on K [D, Vl] gives the bytes of the "vd" kernel on K.T [Vl, D]: m, S,
    z_t, owned and the logits, every bucket, both entries, bias on/off, per-row temperatures,
    edge targets, a vocab (328) below the weight's columns (384) below the padded vocab (512):
    the last split's tile groups read columns past Vl (TMA zero fill). One CTA with race
    detection (two CTAs for the trainer entry: the work order must not matter either)."""
    n, d, v, vl, vp = 70, 128, 328, 384, 512
    h, w, b, t, inv_t, temp = _problem(n, d, vl, bias=bias, seed=11, per_row_t=True)
    t = np.where(t >= v, v - 2, t).astype(np.int32)  # in the vocabulary, then the edge targets:
    t[1], t[2] = v - 1, vl + 3  # the last real column; a column with no weight (not owned)
    t[4] = v + 3  # past the vocabulary but owned (its weight column exists): NaN logp
    kernel = jnp.asarray(np.asarray(w).T)  # [D, Vl], its own buffer
    ctas = 1 if logits else 2
    kw = dict(bucket=bucket, num_ctas=ctas, return_logits=logits)
    ref, ref_logp, ref_lse = _run(h, w, b, t, inv_t, v, vp, **kw)
    out, logp, lse = _run(h, kernel, b, t, inv_t, v, vp, races=logits, weight_layout="dv", **kw)
    names = ("m", "s", "z_t", "owned") + (("logits",) if logits else ())
    for k, name in enumerate(names):
        assert_bitwise_equal(np.asarray(out[k], np.float32), np.asarray(ref[k], np.float32), f"{name} {bucket}")
    if not logits:
        assert out[4] is None
    assert_bitwise_equal(logp, ref_logp, "logp")
    assert_bitwise_equal(lse, ref_lse, "lse")
    if logits:  # and the dv kernel's partials are the contract of its own logits
        _check_against_oracle(out, logp, lse, t, inv_t, temp, v, vp)


@pytest.mark.slow
@pytest.mark.parametrize("bucket", ["small", "decode"])
def test_dv_kernel_multi_group_splits_and_tp_shards(monkeypatch, bucket):
    """dv == vd with w forced to 1 (a split spans 2 tile groups: the chain across groups and
    column offsets inside the split), and on a TP shard (col_offset=256) of a [D, 256] kernel."""
    n, d, v, vp = 3, 192, 17300, 17408
    h, w, b, t, inv_t, temp = _problem(n, d, v, seed=3)
    wp = jnp.pad(w, ((0, vp - v), (0, 0)))
    bp = jnp.pad(b, (0, vp - v))
    monkeypatch.setattr(tuning, "tiles_per_group", lambda sizes: 1)
    kw = dict(bucket=bucket, num_ctas=2, return_logits=True)
    ref, _, _ = _run(h, wp, bp, t, inv_t, v, vp, **kw)
    out, _, _ = _run(h, jnp.asarray(np.asarray(wp).T), bp, t, inv_t, v, vp, weight_layout="dv", **kw)
    for k, name in enumerate(("m", "s", "z_t", "owned", "logits")):
        assert_bitwise_equal(np.asarray(out[k], np.float32), np.asarray(ref[k], np.float32), name)
    monkeypatch.undo()
    n, d, v, vp = 16, 128, 328, 512
    h, w, b, t, inv_t, temp = _problem(n, d, v, seed=2)
    wp = jnp.pad(w, ((0, vp - v), (0, 0)))
    bp = jnp.pad(b, (0, vp - v))
    shard = dict(col_offset=256, shard_cols=256, bucket=bucket, num_ctas=2, return_logits=True)
    args = (jnp.asarray(t), jnp.asarray(inv_t))
    kw = dict(vocab_size=v, padded_vocab_size=vp, interpret=True, **shard)
    ref = pk.partials(h, wp[256:], bp[256:], *args, **kw)
    out = pk.partials(h, jnp.asarray(np.asarray(wp[256:]).T), bp[256:], *args, weight_layout="dv", **kw)
    for k, name in enumerate(("m", "s", "z_t", "owned", "logits")):
        assert_bitwise_equal(np.asarray(out[k], np.float32), np.asarray(ref[k], np.float32), f"{name} shard")


def test_dv_weight_columns_not_a_multiple_of_64_are_refused():
    """A [D, V] kernel is never copied: V % 64 != 0 is refused (TMA tiles the vocab columns),
    by `supports` (so auto falls back) and by `partials`; a [V, D] weight of the same V is fine."""
    h = jnp.zeros((4, 128), jnp.bfloat16)
    k = jnp.zeros((128, 328), jnp.bfloat16)
    ok, why = pk.supports(h, k, "dv")
    assert not ok and "multiple of 64" in why
    assert pk.supports(h, k.T) == (True, "ok")
    assert pk.supports(h, jnp.zeros((128, 384), jnp.bfloat16), "dv") == (True, "ok")
    assert not pk.supports(h, jnp.zeros((384, 128), jnp.bfloat16), "dv")[0]  # a [V, D] weight as "dv"
    t, it = jnp.zeros((4,), jnp.int32), jnp.ones((4,), jnp.float32)
    with pytest.raises(ValueError, match="multiple of 64"):
        pk.partials(h, k, None, t, it, vocab_size=328, padded_vocab_size=512, interpret=True, weight_layout="dv")
    with pytest.raises(ValueError, match=r"bias must be \[384\]"):
        pk.partials(
            h,
            jnp.zeros((128, 384), jnp.bfloat16),
            jnp.zeros((128,), jnp.float32),
            t,
            it,
            vocab_size=328,
            padded_vocab_size=512,
            interpret=True,
            weight_layout="dv",
        )
    with pytest.raises(ValueError, match="weight_layout"):
        pk.partials(h, k, None, t, it, vocab_size=328, padded_vocab_size=512, interpret=True, weight_layout="kv")
